"""What every ingest engine shares: its input from the driver (`EngineRun`) and its result
(`EngineResult`), the note of a bad input, the error of a run without samples, and the tail of a
run: index.parquet, then manifest.json (docs/FORMAT.md), written into the run's directory."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from datapipe import __version__
from datapipe.errors import InputError
from datapipe.formats.base import ShardInfo
from datapipe.index import INDEX_FILE, MANIFEST_FILE, write_index
from datapipe.ingest.config import PreprocessConfig
from datapipe.ingest.sources import TokenizeSettings
from datapipe.ingest.tokenizer import Tokenizer
from datapipe.integrity import INDEX_CHECKSUM_KEY, checksum_file

COUNT_KEYS = ("documents", "empty", "bad", "split", "truncated", "dropped")  # manifest `counts`
BLOCK_COUNT_KEYS = tuple(k for k in COUNT_KEYS if k != "bad")  # what a BlockResult counts


@dataclass
class EngineRun:
    """What the driver hands an engine."""

    cfg: PreprocessConfig
    files: list[Path]  # the inputs, in their fixed order
    tokenizer: Tokenizer
    settings: TokenizeSettings  # what a tokenizer process needs
    root: str  # the run's temporary output directory
    warn: Callable[[str], None]
    pause_marker: str | None = None  # test hook: pause after the first shard (local engine)


@dataclass
class EngineResult:
    """What an engine wrote: the manifest, the bad inputs it reported, the input bytes read."""

    manifest: dict
    bad_examples: list[tuple[str, str]]
    nbytes: int


Engine = Callable[[EngineRun], EngineResult]


def new_counts() -> dict[str, int]:
    """The run's outcome counts (manifest `counts`), all zero."""
    return dict.fromkeys(COUNT_KEYS, 0)


def note_bad(
    cfg: PreprocessConfig,
    where: str,
    reason: str,
    counts: dict[str, int],
    bad_examples: list[tuple[str, str]],
    warn: Callable[[str], None],
) -> None:
    """Count a bad input (InputError with --strict); the first `max_reported` are warned about."""
    if cfg.strict:
        raise InputError(f"{where}: {reason}")
    counts["bad"] += 1
    if len(bad_examples) < cfg.max_reported:
        bad_examples.append((where, reason))
        warn(f"skipped {where}: {reason}")


def no_samples(counts: dict[str, int], bad_examples: list[tuple[str, str]]) -> InputError:
    """The error of a run whose inputs gave no sample at all."""
    first = f" (first: {bad_examples[0][0]}: {bad_examples[0][1]})" if bad_examples else ""
    return InputError(
        f"no samples: {counts['documents']:,} documents read ({counts['empty']:,} empty, "
        f"{counts['dropped']:,} dropped), {counts['bad']:,} bad inputs{first}; "
        "nothing was written"
    )


@dataclass
class Written:
    """What an engine wrote: the index columns in sample_id order, outcome counts, shards."""

    num_tokens: np.ndarray  # int64 per sample
    shard: np.ndarray  # int32: position in `shards`
    first_row: np.ndarray  # int64: first storage row within that shard
    sources: list[str]
    counts: dict[str, int]
    shards: list[ShardInfo]
    engine: dict  # how it was written (manifest `engine`)


def write_metadata(cfg: PreprocessConfig, root: str, tokenizer: Tokenizer, w: Written) -> dict:
    """Write index.parquet, then manifest.json (docs/FORMAT.md) into `root`; return the manifest."""
    num_tokens = w.num_tokens
    num_rows = np.maximum(1, -(-num_tokens // cfg.chunk_tokens))
    write_index(
        os.path.join(root, INDEX_FILE),
        num_tokens,
        w.shard,
        w.first_row,
        num_rows,
        w.sources,
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
        "num_samples": len(num_tokens),
        "num_tokens": int(num_tokens.sum()),
        "num_rows": int(num_rows.sum()),
        "counts": w.counts,
        "shards": [s.to_dict() for s in w.shards],
        INDEX_CHECKSUM_KEY: checksum_file(os.path.join(root, INDEX_FILE)),
        "engine": w.engine,
        "args": asdict(cfg),
    }
    tmp_manifest = os.path.join(root, MANIFEST_FILE + ".tmp")
    with open(tmp_manifest, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp_manifest, os.path.join(root, MANIFEST_FILE))
    return manifest
