"""`mixlen preprocess`: corpora -> length-indexed shards, written atomically.

The driver: it checks the settings and `--out`, finds the inputs, builds the tokenizer, and runs
the chosen engine (datapipe.ingest.engines) into a hidden temporary directory next to the output,
renamed into place at the end, so an interrupted run leaves no output directory a reader could take
for complete.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from datapipe.errors import InputError, MixlenError
from datapipe.files import FULL_ERRNOS
from datapipe.index import is_remote
from datapipe.ingest.chat import find_template
from datapipe.ingest.config import PreprocessConfig
from datapipe.ingest.engines import ENGINES
from datapipe.ingest.engines.base import EngineRun, Tally
from datapipe.ingest.inputs import scan_inputs
from datapipe.ingest.output import (
    OutputLock,
    SigtermAsInterrupt,
    check_out_path,
    clean_stale,
    commit,
    partial_dir,
)
from datapipe.ingest.sources import TokenizeSettings
from datapipe.ingest.tokenizer import TokenizerSpec
from datapipe.inuse import DatasetInUse, no_readers

__all__ = ["PAUSE_HOOK_ENV", "PreprocessConfig", "PreprocessResult", "preprocess"]

PAUSE_HOOK_ENV = "MIXLEN_TEST_PAUSE_AFTER_FIRST_SHARD"  # test-only: marker path, then sleep


@dataclass
class PreprocessResult:
    """What a run wrote and what it skipped."""

    out: str
    manifest: dict
    reported: dict[str, list[tuple[str, str]]]  # the first inputs named, per note kind
    seconds: float
    input_bytes: int

    @property
    def bad_examples(self) -> list[tuple[str, str]]:
        """The first bad inputs named (at most --max-reported)."""
        return self.reported["bad"]


def _prepare(cfg: PreprocessConfig, warn: Callable[[str], None]) -> EngineRun:
    """The inputs (special ones noted: --strict stops at the first), the tokenizer (a warning
    if it can drop characters) and the settings, before anything is written; the run's
    directory is set later. A run with no regular input fails here."""
    inputs = scan_inputs(cfg.inputs, cfg.globs, tuple(cfg.excludes))
    if not inputs.files and not inputs.special:
        raise InputError(
            f"no input files found in {', '.join(cfg.inputs)} (globs: {', '.join(cfg.globs)})"
        )
    tally = Tally(cfg, warn)
    for where, reason in inputs.special:
        tally.note("special", where, reason)
    if not inputs.files:
        raise tally.no_samples()
    tok_spec = TokenizerSpec.parse(cfg.tokenizer, cfg.tokenizer_from)
    tokenizer = tok_spec.build()
    if tokenizer.lossy:
        warn(
            f"warning: {tok_spec.path}: the tokenizer has no unk token and no byte fallback: "
            "characters outside its vocabulary are dropped; they are counted as unknown_chars"
            " and the first documents losing any are named (--strict stops at the first)"
        )
    # conversations' template; with a tokenizer file, its own BOS/EOS names as the template's
    chat = find_template(cfg.chat_template, cfg.tokenizer_from, tokenizer.special_names())
    settings = TokenizeSettings(
        tok_spec,
        cfg.text_field,
        cfg.max_len,
        cfg.long_docs,
        cfg.max_doc_bytes,
        cfg.min_tokens,
        chat,
    )
    return EngineRun(cfg, inputs.files, tokenizer, settings, "", tally)


def preprocess(
    cfg: PreprocessConfig, warn: Callable[[str], None] | None = None
) -> PreprocessResult:
    """Tokenize `cfg.inputs` into shards + index.parquet + manifest.json under `cfg.out`."""
    cfg.validate(ENGINES)
    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    if is_remote(cfg.out):  # write locally, then upload (manifest last)
        from datapipe.ingest.upload import preprocess_to_store

        return preprocess_to_store(cfg, preprocess, warn)
    out = Path(cfg.out).absolute()
    check_out_path(out, cfg.out, cfg.inputs)
    if out.exists() and not cfg.overwrite:
        raise InputError(f"{cfg.out}: already exists; pass --overwrite to replace it")
    with no_readers(str(out), cfg.out, make=False):  # a dataset being read: refused before
        pass  # any work
    run = _prepare(cfg, warn)

    out.parent.mkdir(parents=True, exist_ok=True)
    with OutputLock(out, cfg.out):
        clean_stale(out, warn)
        if out.exists() and not cfg.overwrite:  # restored, or made while we waited
            raise InputError(f"{cfg.out}: already exists; pass --overwrite to replace it")
        tmp = partial_dir(out)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        t0 = time.perf_counter()
        run.root, run.pause_marker = str(tmp), os.environ.get(PAUSE_HOOK_ENV)
        try:
            with SigtermAsInterrupt():
                result = ENGINES[cfg.engine](run)
            try:
                # and again for the swap itself (a folder it will not replace stays untouched)
                with no_readers(str(out), cfg.out, make=cfg.overwrite):
                    commit(tmp, out, cfg.out, cfg.overwrite)
            except DatasetInUse as exc:  # a reader came meanwhile: keep the finished work
                kept = out.parent / f"{out.name}.new-{os.getpid()}"
                if kept.exists():  # (a pid reused since an earlier such run)
                    kept = kept.with_name(f"{kept.name}-{uuid.uuid4().hex[:8]}")
                os.rename(tmp, kept)
                raise DatasetInUse(
                    f"{exc}. This run's dataset is complete in {kept}: put it in place "
                    f"of {cfg.out} once the readers are done"
                ) from None
        except OSError as exc:  # disk full, file size limit, permissions, ... while writing
            shutil.rmtree(tmp, ignore_errors=True)
            full = " (disk full or file size limit)" if exc.errno in FULL_ERRNOS else ""
            raise MixlenError(
                f"--out {cfg.out}: writing failed{full}: {exc.strerror or exc}"
                + (f" ({exc.filename})" if exc.filename else "")
                + "; nothing was written there, and what was there before is untouched"
            ) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    seconds = time.perf_counter() - t0
    reported = run.tally.reported
    return PreprocessResult(str(out), result.manifest, reported, seconds, result.nbytes)
