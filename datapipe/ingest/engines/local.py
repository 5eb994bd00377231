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
from datapipe.ingest.engines.base import (
    BLOCK_COUNT_KEYS,
    EngineResult,
    EngineRun,
    Written,
    new_counts,
    no_samples,
    note_bad,
    write_metadata,
)
from datapipe.ingest.sources import (
    BlockResult,
    TokenizeSettings,
    init_worker,
    iter_blocks,
    process_block,
)
from datapipe.progress import InputProgress, input_sizes, progress


def _results(blocks: Iterator, settings: TokenizeSettings, workers: int) -> Iterator[BlockResult]:
    """Tokenized blocks in input order, from `workers` processes (inline for 1)."""
    if workers == 1:
        init_worker(settings)
        for block in blocks:
            yield process_block(block)
        return
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers, initializer=init_worker, initargs=(settings,)) as pool:
        window: deque = deque()
        for block in blocks:
            window.append(pool.apply_async(process_block, (block,)))
            if len(window) >= 2 * workers + 2:
                yield window.popleft().get()
        while window:
            yield window.popleft().get()


def _pause_for_test(marker: str) -> None:
    """Test hook: write `marker`, then wait until it is removed (at most 600 s)."""
    Path(marker).write_text(str(os.getpid()))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and os.path.exists(marker):
        time.sleep(0.05)


def write_dataset(run: EngineRun) -> EngineResult:
    """Tokenize `run.files` and write shards, index.parquet and manifest.json into `run.root`."""
    cfg, tokenizer = run.cfg, run.tokenizer
    writer = build_writer(cfg.format, run.root, tokenizer.dtype, cfg.chunk_tokens, cfg.shard_bytes)
    counts = new_counts()
    lengths: list[int] = []
    sources: list[str] = []
    bad_examples: list[tuple[str, str]] = []
    nbytes = total_tokens = 0
    track = InputProgress(input_sizes(run.files))
    bar = progress(track.total, "preprocess", "B", cfg.progress, unit_scale=True)
    paused = False
    try:
        blocks = (track.advance(b) or b for b in iter_blocks(run.files, cfg.text_field))
        for res in _results(blocks, run.settings, cfg.workers):
            for where, reason in res.bad:
                note_bad(cfg, where, reason, counts, bad_examples, run.warn)
            for key in BLOCK_COUNT_KEYS:
                counts[key] += getattr(res, key)
            for src, toks in zip(res.sources, res.tokens):
                writer.write(len(lengths), toks)
                lengths.append(len(toks))
                sources.append(src)
                total_tokens += len(toks)
            nbytes += res.nbytes
            bar.update(track.pop())
            bar.set_postfix_str(
                f"docs={counts['documents']:,} tokens={total_tokens:,}", refresh=False
            )
            if run.pause_marker and not paused and writer.shards_completed >= 1:
                paused = True
                _pause_for_test(run.pause_marker)
        bar.update(track.rest())
        shards = writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    if not lengths:
        raise no_samples(counts, bad_examples)
    written = Written(
        np.asarray(lengths, np.int64),
        np.asarray(writer.sample_shard, np.int32),
        np.asarray(writer.sample_first_row, np.int64),
        sources,
        counts,
        shards,
        {"name": "local"},
    )
    return EngineResult(write_metadata(cfg, run.root, tokenizer, written), bad_examples, nbytes)
