"""`mixlen preprocess --engine local` (the default): this machine's processes.

The main process reads the inputs in blocks, in input order; `--workers` processes tokenize them
(inline for 1), results come back in block order and one shard writer writes them, so the dataset
never depends on the number of workers.

The writer is opened at the first tokenized block, with a loss-mask column when that block holds a
conversation or prompt-completion sample. A masked sample that comes after samples were written
without one (text rows first, then conversations) restarts the run with the column: the written
dataset is the same as if it had been there from the start.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from datapipe.errors import MixlenError
from datapipe.formats import build_writer
from datapipe.formats.base import ShardWriter
from datapipe.ingest.engines.base import EngineResult, EngineRun, Written, write_metadata
from datapipe.ingest.sources import BLOCK_BYTES, Block, TokenizeSettings, iter_blocks
from datapipe.ingest.worker import BlockResult, init_worker, process_block
from datapipe.progress import InputProgress, input_sizes, progress


def _init_pool_worker(settings: TokenizeSettings) -> None:
    """A pool process leaves the main process's process group. Ctrl-C, `kill -- -PGID` or a
    scheduler's stop signal a whole group: workers killed while one holds the pool's task-queue
    lock would leave the pool's shutdown waiting for it forever. Now only the main process gets
    them, and it ends the pool as after any error; a worker whose main process is killed
    outright ends within a second (`_exit_with`)."""
    os.setpgrp()
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    init_worker(settings)


def _exit_with(parent: int) -> None:
    """End this process once `parent` is gone (it was re-parented)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


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
    pool = ProcessPoolExecutor(
        workers, mp.get_context("spawn"), initializer=_init_pool_worker, initargs=(settings,)
    )
    window: deque[tuple[Future, Block]] = deque()
    try:
        inflight = 0
        for block in blocks:
            window.append((_submit(pool, block, window), block))
            inflight += block.nbytes
            while window and (len(window) >= 2 * workers + 2 or inflight >= budget):
                inflight -= window[0][1].nbytes
                yield _result(window)
        while window:
            yield _result(window)
    except BaseException:
        _stop(pool)
        raise
    pool.shutdown()


def _died(window: deque) -> MixlenError:
    """The error for a worker process that ended without a result (killed: by the out-of-memory
    killer, say), naming the blocks it may have been tokenizing."""
    where = "; ".join(block.where() for _, block in window) or "no block"
    return MixlenError(
        f"a preprocess worker process died (killed by a signal, for example when out of "
        f"memory) while these inputs were being tokenized: {where}; nothing was written"
    )


def _submit(pool: ProcessPoolExecutor, block: Block, window: deque) -> Future:
    try:
        return pool.submit(process_block, block)
    except BrokenProcessPool:
        raise _died(window) from None


def _result(window: deque) -> BlockResult:
    """The oldest block's result, taken off the window."""
    try:
        return window[0][0].result()
    except BrokenProcessPool:
        raise _died(window) from None
    finally:
        window.popleft()


def _stop(pool: ProcessPoolExecutor) -> None:
    """End the pool now (an error or Ctrl-C ends the run; nothing the workers return is used):
    queued blocks cancelled, the workers terminated rather than awaited."""
    procs = list((getattr(pool, "_processes", None) or {}).values())  # public only from 3.14
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        p.terminate()
    for p in procs:
        p.join(5)


def _pause_for_test(marker: str) -> None:
    """Test hook: write `marker`, then wait until it is removed (at most 600 s)."""
    Path(marker).write_text(str(os.getpid()))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and os.path.exists(marker):
        time.sleep(0.05)


class _NeedMasks(Exception):
    """A masked sample after samples written without a mask column: start again with one."""


def _write_samples(
    writer: ShardWriter,
    res: BlockResult,
    lengths: list[int],
    sources: list[str],
    spans: list,
) -> int:
    """Write a block's samples with the next sample ids; their tokens in all."""
    n = 0
    for src, toks, sp in zip(res.sources, res.tokens, res.spans):
        if sp is not None and not writer.masks:
            raise _NeedMasks
        writer.write(len(lengths), toks, sp)
        lengths.append(len(toks))
        sources.append(src)
        spans.append(sp)
        n += len(toks)
    return n


def write_dataset(run: EngineRun) -> EngineResult:
    """Tokenize `run.files` and write shards, index.parquet and manifest.json into `run.root`."""
    saved = run.tally.snapshot()
    try:
        return _write_dataset(run, None)
    except _NeedMasks:
        for name in os.listdir(run.root):  # what the first pass wrote; the directory is ours
            path = os.path.join(run.root, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        run.tally.restore(saved)
        return _write_dataset(run, True)


def _open_writer(run: EngineRun, masks: bool) -> ShardWriter:
    cfg = run.cfg
    return build_writer(
        cfg.format, run.root, run.tokenizer.dtype, cfg.chunk_tokens, cfg.shard_bytes, masks
    )


def _write_dataset(run: EngineRun, masks: bool | None) -> EngineResult:
    """One pass; `masks` None: decided by the first block (module docstring)."""
    cfg, tally = run.cfg, run.tally
    writer: ShardWriter | None = None if masks is None else _open_writer(run, masks)
    lengths: list[int] = []
    sources: list[str] = []
    spans: list = []
    nbytes = total_tokens = 0
    track = InputProgress(input_sizes(run.files))
    bar = progress(track.total, "preprocess", "B", cfg.progress, unit_scale=True)
    paused = False
    try:
        blocks = (track.advance(b) or b for b in iter_blocks(run.files, run.settings))
        for res in _results(blocks, run.settings, cfg.workers):
            tally.add(res)
            if writer is None and res.tokens:
                writer = _open_writer(run, any(sp is not None for sp in res.spans))
            if writer is not None:
                total_tokens += _write_samples(writer, res, lengths, sources, spans)
            nbytes += res.nbytes
            bar.update(track.pop())
            bar.set_postfix_str(
                f"docs={tally.counts['documents']:,} tokens={total_tokens:,}", refresh=False
            )
            if run.pause_marker and not paused and writer and writer.shards_completed >= 1:
                paused = True
                _pause_for_test(run.pause_marker)
            del res  # its tokens are written: free them before the next block is tokenized
        bar.update(track.rest())
        if writer is None:
            writer = _open_writer(run, False)
        shards = writer.finish()
    except BaseException:
        if writer is not None:
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
        spans if writer.masks else None,
    )
    return EngineResult(write_metadata(run, written), nbytes)
