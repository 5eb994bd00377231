"""`mixlen preprocess --engine local` (the default): this machine's processes.

The main process reads the inputs in blocks, in input order; `--workers` processes tokenize them
(inline for 1), results come back in block order and one shard writer writes them, so the dataset
never depends on the number of workers.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from datapipe.formats import build_writer
from datapipe.formats.base import ShardWriter
from datapipe.ingest.engines.base import EngineResult, EngineRun, Written, write_metadata
from datapipe.ingest.sources import BLOCK_BYTES, Block, TokenizeSettings, iter_blocks
from datapipe.ingest.worker import BlockResult, init_worker, process_block
from datapipe.progress import InputProgress, input_sizes, progress


def _results(
    blocks: Iterator[Block], settings: TokenizeSettings, workers: int
) -> Iterator[BlockResult]:
    """Tokenized blocks in input order, from `workers` processes (inline for 1). At most
    2 x workers + 2 blocks are in flight, and at most about `workers` x max(--max-doc-bytes,
    BLOCK_BYTES) of their input bytes, so finished results waiting in this process stay within
    the memory bound docs/preprocess.md states."""
    if workers == 1:
        init_worker(settings)
        for block in blocks:
            yield process_block(block)
        return
    budget = workers * max(settings.max_doc_bytes, BLOCK_BYTES)
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers, initializer=init_worker, initargs=(settings,)) as pool:
        window: deque = deque()
        inflight = 0
        for block in blocks:
            window.append((pool.apply_async(process_block, (block,)), block.nbytes))
            inflight += block.nbytes
            while window and (len(window) >= 2 * workers + 2 or inflight >= budget):
                res, nbytes = window.popleft()
                inflight -= nbytes
                yield res.get()
        while window:
            yield window.popleft()[0].get()


def _pause_for_test(marker: str) -> None:
    """Test hook: write `marker`, then wait until it is removed (at most 600 s)."""
    Path(marker).write_text(str(os.getpid()))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and os.path.exists(marker):
        time.sleep(0.05)


def _write_samples(
    writer: ShardWriter, res: BlockResult, lengths: list[int], sources: list[str]
) -> int:
    """Write a block's samples with the next sample ids; their tokens in all."""
    n = 0
    for src, toks in zip(res.sources, res.tokens):
        writer.write(len(lengths), toks)
        lengths.append(len(toks))
        sources.append(src)
        n += len(toks)
    return n


def write_dataset(run: EngineRun) -> EngineResult:
    """Tokenize `run.files` and write shards, index.parquet and manifest.json into `run.root`."""
    cfg, tokenizer, tally = run.cfg, run.tokenizer, run.tally
    writer = build_writer(cfg.format, run.root, tokenizer.dtype, cfg.chunk_tokens, cfg.shard_bytes)
    lengths: list[int] = []
    sources: list[str] = []
    nbytes = total_tokens = 0
    track = InputProgress(input_sizes(run.files))
    bar = progress(track.total, "preprocess", "B", cfg.progress, unit_scale=True)
    paused = False
    try:
        blocks = (track.advance(b) or b for b in iter_blocks(run.files, run.settings))
        for res in _results(blocks, run.settings, cfg.workers):
            tally.add(res)
            total_tokens += _write_samples(writer, res, lengths, sources)
            nbytes += res.nbytes
            bar.update(track.pop())
            bar.set_postfix_str(
                f"docs={tally.counts['documents']:,} tokens={total_tokens:,}", refresh=False
            )
            if run.pause_marker and not paused and writer.shards_completed >= 1:
                paused = True
                _pause_for_test(run.pause_marker)
            del res  # its tokens are written: free them before the next block is tokenized
        bar.update(track.rest())
        shards = writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    if not lengths:
        raise tally.no_samples()
    written = Written(
        np.asarray(lengths, np.int64),
        np.asarray(writer.sample_shard, np.int32),
        np.asarray(writer.sample_first_row, np.int64),
        sources,
        shards,
        {"name": "local"},
    )
    return EngineResult(write_metadata(run, written), nbytes)
