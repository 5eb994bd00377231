"""What every ingest engine shares: its input from the driver (`EngineRun`) and its result
(`EngineResult`), the run's counts and its notes of bad, special and lossy inputs (`Tally`), the
error of a run without samples, and the tail of a run: index.parquet, then manifest.json
(docs/FORMAT.md), written into the run's directory."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from datapipe import __version__
from datapipe.errors import InputError
from datapipe.formats.base import TRAINED, ShardInfo
from datapipe.index import INDEX_FILE, LOSS_MASK_KEY, MANIFEST_FILE, LossColumns, write_index
from datapipe.ingest.config import PreprocessConfig
from datapipe.ingest.sources import TokenizeSettings
from datapipe.ingest.tokenizer import Tokenizer
from datapipe.ingest.worker import BLOCK_COUNT_KEYS, BlockResult
from datapipe.integrity import (
    FINGERPRINT_KEY,
    INDEX_CHECKSUM_KEY,
    checksum_file,
    dataset_fingerprint,
)

# manifest `counts`: what blocks count (datapipe.ingest.worker) and what notes count
COUNT_KEYS = (
    "documents",
    "empty",
    "blank",
    "bad",
    "special",
    "split",
    "truncated",
    "dropped",
    "short",
    "no_target",
    "unknown_docs",
    "unknown_chars",
)
NOTE_COUNTS = {"bad": "bad", "special": "special", "unknown": "unknown_docs"}  # kind -> count
assert set(BLOCK_COUNT_KEYS) | set(NOTE_COUNTS.values()) == set(COUNT_KEYS)


class Tally:
    """A run's outcome counts and the inputs it names. Of each note kind ("bad": skipped,
    "special": not a regular file, "unknown": characters the tokenizer dropped) the first
    `max_reported` are warned about and kept; with --strict the first note stops the run."""

    def __init__(self, cfg: PreprocessConfig, warn: Callable[[str], None]) -> None:
        self.cfg, self.warn = cfg, warn
        self.counts = dict.fromkeys(COUNT_KEYS, 0)
        self.reported: dict[str, list[tuple[str, str]]] = {k: [] for k in NOTE_COUNTS}

    def note(self, kind: str, where: str, reason: str) -> None:
        """Count one note (InputError with --strict); warn about it if among the first."""
        if self.cfg.strict:
            raise InputError(f"{where}: {reason}")
        self.counts[NOTE_COUNTS[kind]] += 1
        if len(self.reported[kind]) < self.cfg.max_reported:
            self.reported[kind].append((where, reason))
            self.warn(f"{where}: {reason}" if kind == "unknown" else f"skipped {where}: {reason}")

    def snapshot(self) -> tuple:
        """The counts and notes so far (`restore` goes back to them)."""
        return dict(self.counts), {k: list(v) for k, v in self.reported.items()}

    def restore(self, saved: tuple) -> None:
        """Back to a snapshot, for a run that starts again (datapipe.ingest.engines.local):
        the notes it warned about already are not warned about again."""
        seen = {(w, r) for v in self.reported.values() for w, r in v}
        warn = self.warn
        self.counts, self.reported = dict(saved[0]), {k: list(v) for k, v in saved[1].items()}
        self.warn = lambda msg: (
            None if any(msg.endswith(f"{w}: {r}") for w, r in seen) else warn(msg)
        )

    def add(self, res: BlockResult) -> None:
        """A tokenized block's notes (in input order) and counts."""
        for kind, where, reason in res.notes:
            self.note(kind, where, reason)
        for key, n in res.counts.items():
            self.counts[key] += n

    def no_samples(self) -> InputError:
        """The error of a run whose inputs gave no sample at all."""
        c = self.counts

        def first(kind: str) -> str:
            x = self.reported[kind]
            return f" (first: {x[0][0]}: {x[0][1]})" if x else ""

        special = f", {c['special']:,} special files skipped{first('special')}"
        return InputError(
            f"no samples: {c['documents']:,} documents read ({c['empty']:,} empty, "
            f"{c['blank']:,} blank, {c['dropped']:,} dropped, {c['short']:,} under --min-tokens), "
            f"{c['bad']:,} bad inputs{first('bad')}{special if c['special'] else ''}; "
            "nothing was written"
        )


@dataclass
class EngineRun:
    """What the driver hands an engine."""

    cfg: PreprocessConfig
    files: list[Path]  # the regular inputs, in their fixed order
    tokenizer: Tokenizer
    settings: TokenizeSettings  # what reading and tokenizing need
    root: str  # the run's temporary output directory
    tally: Tally  # already holds the special inputs the driver skipped
    pause_marker: str | None = None  # test hook: pause after the first shard (local engine)


@dataclass
class EngineResult:
    """What an engine wrote: the manifest, and the input bytes it read."""

    manifest: dict
    nbytes: int


Engine = Callable[[EngineRun], EngineResult]


@dataclass
class Written:
    """What an engine wrote: the index columns in sample_id order, outcome counts, shards."""

    num_tokens: np.ndarray  # int64 per sample
    shard: np.ndarray  # int32: position in `shards`
    first_row: np.ndarray  # int64: first storage row within that shard
    sources: list[str]
    shards: list[ShardInfo]
    engine: dict  # how it was written (manifest `engine`)
    # with a loss mask: each sample's trained spans (None: every token trained); None: no mask
    spans: list | None = None


def write_metadata(run: EngineRun, w: Written) -> dict:
    """Write index.parquet, then manifest.json (docs/FORMAT.md) into the run's directory;
    return the manifest."""
    cfg, root, tokenizer, tally = run.cfg, run.root, run.tokenizer, run.tally
    num_tokens = w.num_tokens
    num_rows = np.maximum(1, -(-num_tokens // cfg.chunk_tokens))
    mask = None if w.spans is None else LossColumns.of(w.spans, num_tokens)
    write_index(
        os.path.join(root, INDEX_FILE),
        num_tokens,
        w.shard,
        w.first_row,
        num_rows,
        w.sources,
        mask,
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
        "max_doc_bytes": cfg.max_doc_bytes,
        "min_tokens": cfg.min_tokens,
        "num_samples": len(num_tokens),
        "num_tokens": int(num_tokens.sum()),
        "num_rows": int(num_rows.sum()),
        "num_loss_tokens": int(
            mask.loss_tokens.sum() if mask is not None else np.maximum(num_tokens - 1, 0).sum()
        ),
        "counts": tally.counts,
        "reported": {k: [list(x) for x in v] for k, v in tally.reported.items()},
        "shards": [s.to_dict() for s in w.shards],
        INDEX_CHECKSUM_KEY: checksum_file(os.path.join(root, INDEX_FILE)),
        "engine": w.engine,
        "args": asdict(cfg),
    }
    if mask is not None:
        manifest[LOSS_MASK_KEY] = TRAINED
        chat = run.settings.chat
        if chat is not None and chat.text is not None:  # which template rendered them
            digest = hashlib.sha256(chat.text.encode("utf-8")).hexdigest()
            manifest["chat_template"] = {"source": chat.where, "sha256": digest}
    manifest[FINGERPRINT_KEY] = dataset_fingerprint(manifest)
    tmp_manifest = os.path.join(root, MANIFEST_FILE + ".tmp")
    with open(tmp_manifest, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp_manifest, os.path.join(root, MANIFEST_FILE))
    return manifest
