"""`mixlen preprocess`: corpora -> length-indexed shards, written atomically.

Everything goes to a hidden temporary directory next to the output and is renamed into place at
the end, so an interrupted run leaves no output directory a reader could take for complete.
"""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from datapipe import __version__
from datapipe.errors import InputError, MixlenError
from datapipe.formats import FORMATS, build_writer
from datapipe.index import INDEX_FILE, MANIFEST_FILE, write_index
from datapipe.ingest.output import OutputLock, check_out_path, clean_stale, commit, partial_dir
from datapipe.ingest.sources import (
    BlockResult,
    TokenizeSettings,
    find_inputs,
    init_worker,
    iter_blocks,
    process_block,
)
from datapipe.ingest.tokenizer import TokenizerSpec
from datapipe.integrity import INDEX_CHECKSUM_KEY, checksum_file

PAUSE_HOOK_ENV = "MIXLEN_TEST_PAUSE_AFTER_FIRST_SHARD"  # test-only: marker path, then sleep
LONG_DOC_POLICIES = ("split", "truncate", "drop")
_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


@dataclass
class PreprocessConfig:
    """Arguments of `mixlen preprocess`."""

    inputs: list[str]
    out: str
    format: str = "mds"
    tokenizer: str | None = None  # None or "bytes": UTF-8 bytes; else a tokenizer.json path
    text_field: str = "text"
    globs: list[str] = field(default_factory=lambda: ["**/*"])
    excludes: list[str] = field(default_factory=list)
    chunk_tokens: int = 65536
    max_len: int | None = None
    long_docs: str = "split"
    workers: int = 1
    strict: bool = False
    overwrite: bool = False
    shard_bytes: int = 1 << 26
    progress: bool | None = None  # None: only on a terminal
    max_reported: int = 5

    def validate(self) -> None:
        """Reject bad settings with a message naming the option."""
        if not self.inputs:
            raise InputError("no inputs given")
        if self.format not in FORMATS:
            raise InputError(f"--format {self.format!r}: expected one of {', '.join(FORMATS)}")
        if self.long_docs not in LONG_DOC_POLICIES:
            raise InputError(
                f"--long-docs {self.long_docs!r}: expected one of {', '.join(LONG_DOC_POLICIES)}"
            )
        if self.chunk_tokens < 1:
            raise InputError(f"--chunk-tokens must be >= 1, got {self.chunk_tokens}")
        if self.max_len is not None and self.max_len < 1:
            raise InputError(f"--max-len must be >= 1, got {self.max_len}")
        if self.workers < 1:
            raise InputError(f"--workers must be >= 1, got {self.workers}")
        if not 1 <= self.shard_bytes < 1 << 32:
            raise InputError(
                f"--shard-size must be between 1 byte and 4 GiB, got {self.shard_bytes}"
            )


@dataclass
class PreprocessResult:
    """What a run wrote and what it skipped."""

    out: str
    manifest: dict
    bad_examples: list[tuple[str, str]]
    seconds: float
    input_bytes: int


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


class _SigtermAsInterrupt:
    """Turn SIGTERM into KeyboardInterrupt so the temporary directory is cleaned up."""

    def __enter__(self) -> None:
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._raise)

    @staticmethod
    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def preprocess(
    cfg: PreprocessConfig, warn: Callable[[str], None] | None = None
) -> PreprocessResult:
    """Tokenize `cfg.inputs` into shards + index.parquet + manifest.json under `cfg.out`."""
    cfg.validate()
    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    out = Path(cfg.out).absolute()
    check_out_path(out, cfg.out, cfg.inputs)
    if out.exists() and not cfg.overwrite:
        raise InputError(f"{cfg.out}: already exists; pass --overwrite to replace it")
    files = find_inputs(cfg.inputs, cfg.globs, tuple(cfg.excludes))
    if not files:
        raise InputError(
            f"no input files found in {', '.join(cfg.inputs)} (globs: {', '.join(cfg.globs)})"
        )
    tok_spec = TokenizerSpec.parse(cfg.tokenizer)
    tokenizer = tok_spec.build()
    settings = TokenizeSettings(tok_spec, cfg.text_field, cfg.max_len, cfg.long_docs)

    out.parent.mkdir(parents=True, exist_ok=True)
    with OutputLock(out, cfg.out):
        clean_stale(out, warn)
        if out.exists() and not cfg.overwrite:  # restored, or made while we waited
            raise InputError(f"{cfg.out}: already exists; pass --overwrite to replace it")
        tmp = partial_dir(out)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        t0 = time.perf_counter()
        pause_marker = os.environ.get(PAUSE_HOOK_ENV)
        try:
            with _SigtermAsInterrupt():
                manifest, bad_examples, nbytes = _write_dataset(
                    cfg, files, tokenizer, settings, str(tmp), warn, pause_marker
                )
            commit(tmp, out, cfg.out, cfg.overwrite)
        except OSError as exc:  # disk full, file size limit, permissions, ... while writing
            shutil.rmtree(tmp, ignore_errors=True)
            full = " (disk full or file size limit)" if exc.errno in _FULL_ERRNOS else ""
            raise MixlenError(
                f"--out {cfg.out}: writing failed{full}: {exc.strerror or exc}"
                + (f" ({exc.filename})" if exc.filename else "")
                + "; nothing was written there, and what was there before is untouched"
            ) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return PreprocessResult(str(out), manifest, bad_examples, time.perf_counter() - t0, nbytes)


def _write_dataset(
    cfg: PreprocessConfig,
    files: list[Path],
    tokenizer,
    settings: TokenizeSettings,
    root: str,
    warn: Callable[[str], None],
    pause_marker: str | None,
) -> tuple[dict, list[tuple[str, str]], int]:
    writer = build_writer(cfg.format, root, tokenizer.dtype, cfg.chunk_tokens, cfg.shard_bytes)
    counts = dict(documents=0, empty=0, bad=0, split=0, truncated=0, dropped=0)
    lengths: list[int] = []
    sources: list[str] = []
    bad_examples: list[tuple[str, str]] = []
    nbytes = total_tokens = 0
    show = sys.stderr.isatty() if cfg.progress is None else cfg.progress
    from tqdm import tqdm

    bar = tqdm(disable=not show, unit="B", unit_scale=True, desc="preprocess", file=sys.stderr)
    paused = False
    try:
        for res in _results(iter_blocks(files, cfg.text_field), settings, cfg.workers):
            for where, reason in res.bad:
                if cfg.strict:
                    raise InputError(f"{where}: {reason}")
                counts["bad"] += 1
                if len(bad_examples) < cfg.max_reported:
                    bad_examples.append((where, reason))
                    warn(f"skipped {where}: {reason}")
            for key in ("documents", "empty", "split", "truncated", "dropped"):
                counts[key] += getattr(res, key)
            for src, toks in zip(res.sources, res.tokens):
                writer.write(len(lengths), toks)
                lengths.append(len(toks))
                sources.append(src)
                total_tokens += len(toks)
            nbytes += res.nbytes
            bar.update(res.nbytes)
            bar.set_postfix_str(
                f"docs={counts['documents']:,} tokens={total_tokens:,}", refresh=False
            )
            if pause_marker and not paused and writer.shards_completed >= 1:
                paused = True
                _pause_for_test(pause_marker)
        shards = writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    if not lengths:
        first = f" (first: {bad_examples[0][0]}: {bad_examples[0][1]})" if bad_examples else ""
        raise InputError(
            f"no samples: {counts['documents']:,} documents read ({counts['empty']:,} empty, "
            f"{counts['dropped']:,} dropped), {counts['bad']:,} bad inputs{first}; "
            "nothing was written"
        )
    num_tokens = np.asarray(lengths, dtype=np.int64)
    num_rows = np.maximum(1, -(-num_tokens // cfg.chunk_tokens))
    write_index(
        os.path.join(root, INDEX_FILE),
        num_tokens,
        np.asarray(writer.sample_shard, dtype=np.int32),
        np.asarray(writer.sample_first_row, dtype=np.int64),
        num_rows,
        sources,
    )
    manifest = {
        "mixlen_version": __version__,
        "format": cfg.format,
        "tokenizer": tokenizer.describe(),
        "vocab_size": int(tokenizer.vocab_size),
        "dtype": tokenizer.dtype.name,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "tokens_field": "tokens",
        "chunk_tokens": cfg.chunk_tokens,
        "max_len": cfg.max_len,
        "long_docs": cfg.long_docs,
        "num_samples": len(lengths),
        "num_tokens": int(num_tokens.sum()),
        "num_rows": int(num_rows.sum()),
        "counts": counts,
        "shards": [s.to_dict() for s in shards],
        INDEX_CHECKSUM_KEY: checksum_file(os.path.join(root, INDEX_FILE)),
        "args": asdict(cfg),
    }
    tmp_manifest = os.path.join(root, MANIFEST_FILE + ".tmp")
    with open(tmp_manifest, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp_manifest, os.path.join(root, MANIFEST_FILE))
    return manifest, bad_examples, nbytes
