"""`mixlen verify DIR`: check a whole local dataset against its manifest and index.

In order: manifest.json's fields and shard names (and its dataset fingerprint against the
checksums it lists); index.parquet's checksum (as recorded in the
manifest) and its agreement with the shards (datapipe.integrity.check_index); every shard's
presence, size and XXH3-64; every shard's row count as its format stores it; and every storage
row, read through the format's reader: its token count against the index and its token ids
against the vocabulary. Problems are collected (one per shard at most for the row checks), not
raised, so one run lists everything that is wrong. The report carries the dataset's fingerprint
(datapipe.index.dataset_fingerprint): equal fingerprints, both verified, mean the same bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from datapipe.errors import InputError
from datapipe.index import INDEX_FILE, MANIFEST_FILE, dataset_fingerprint, read_index, read_manifest
from datapipe.integrity import FINGERPRINT_KEY, check_shard_file, expected_row_lengths
from datapipe.inuse import ReadersLock

__all__ = ["VerifyReport", "verify_dataset"]

ROWS_PER_READ = 4096


@dataclass
class VerifyReport:
    """What `verify_dataset` checked and the problems it found (empty: the dataset is sound)."""

    root: str
    problems: list[str] = field(default_factory=list)
    shards: int = 0
    samples: int = 0
    rows: int = 0
    tokens: int = 0
    bytes: int = 0
    fingerprint: str = ""  # the dataset's identity (empty: the manifest could not be read)
    fingerprint_recorded: bool = False  # False: computed (a manifest from before the field)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_dataset(root: str, progress: bool | None = None) -> VerifyReport:
    """Check the dataset in directory `root`; see the module docstring. `progress`: bars over
    shard bytes and rows (None: only on a terminal). Holds the dataset's readers lock
    (datapipe.inuse) meanwhile: `preprocess --overwrite` of it is refused."""
    rep = VerifyReport(root)
    if not os.path.isdir(root):
        raise InputError(f"{root}: not a directory (mixlen verify checks a local dataset)")
    lock = ReadersLock(root)  # `preprocess --overwrite` waits: the files checked are one dataset
    try:
        _verify(rep, progress)
    finally:
        lock.close()
    return rep


def _verify(rep: VerifyReport, progress: bool | None) -> None:
    """Fill `rep` with what the checks of the module docstring find."""
    from datapipe.progress import progress as progress_bar

    root = rep.root
    try:
        manifest = read_manifest(root)
    except InputError as exc:
        rep.problems.append(exc.message)
        return
    rep.fingerprint = dataset_fingerprint(manifest)
    rep.fingerprint_recorded = FINGERPRINT_KEY in manifest
    entries = manifest["shards"]
    rep.shards = len(entries)
    try:
        index = read_index(root)
    except InputError as exc:
        rep.problems.append(exc.message)
        index = None
    # every shard's bytes against the manifest
    sound: list[int] = []
    total = sum(int(e.get("bytes", 0)) for e in entries if isinstance(e, dict))
    with progress_bar(total, "verify checksums", "B", progress, unit_scale=True) as bar:
        for i, entry in enumerate(entries):
            path = os.path.join(root, entry["name"])
            bar.update(int(entry.get("bytes", 0)))
            try:
                check_shard_file(path, entry)
            except InputError as exc:
                rep.problems.append(exc.message)
                continue
            if not entry.get("xxh3_64"):
                rep.problems.append(f"{path}: manifest.json records no xxh3_64 checksum for it")
            rep.bytes += os.path.getsize(path)
            sound.append(i)
    if index is None:
        return
    rep.samples = len(index)
    rep.tokens = int(index.num_tokens.sum())
    rows = int(index.num_rows.sum())
    with progress_bar(rows, "verify rows", "row", progress) as bar:
        _check_rows(rep, index, sound, bar)


def _check_rows(rep: VerifyReport, index, sound: list[int], bar) -> None:
    """Read every row of the sound shards through the format's reader; compare token counts with
    the index and ids with the vocabulary."""
    from datapipe.formats import open_reader

    manifest = index.manifest
    try:
        reader = open_reader(rep.root, None, manifest)
    except InputError as exc:
        rep.problems.append(exc.message)
        return
    reader.verify = False  # the checksums were checked above (sizes are checked again)
    want = expected_row_lengths(index.num_tokens, index.num_rows, int(manifest["chunk_tokens"]))
    vocab = manifest.get("vocab_size")
    starts = reader.shard_starts
    try:
        for i in sound:
            path = os.path.join(rep.root, manifest["shards"][i]["name"])
            try:
                problem = _check_shard_rows(reader, int(starts[i]), int(starts[i + 1]), want, vocab)
            except InputError as exc:  # names the shard already (a reader's error)
                problem = exc.message.removeprefix(f"{path}: ")
            if problem:
                rep.problems.append(f"{path}: {problem}")
            else:
                rep.rows += int(starts[i + 1] - starts[i])
            bar.update(int(starts[i + 1] - starts[i]))
    finally:
        reader.close()


def _check_shard_rows(reader, lo: int, hi: int, want: np.ndarray, vocab: int | None) -> str | None:
    """The first problem among global rows [lo, hi), or None."""
    for a in range(lo, hi, ROWS_PER_READ):
        rows = np.arange(a, min(hi, a + ROWS_PER_READ), dtype=np.int64)
        got = reader.read_rows(rows)
        lens = np.fromiter((len(t) for t in got), np.int64, len(got))
        bad = np.flatnonzero(lens != want[rows])
        if bad.size:
            k = int(bad[0])
            return (
                f"row {int(rows[k]) - lo} holds {int(lens[k])} tokens, {INDEX_FILE} implies "
                f"{int(want[rows[k]])}"
            )
        flat = np.concatenate(got) if got else np.zeros(0, np.int64)
        bad = flat < 0 if flat.dtype.kind == "i" else np.zeros(flat.shape, bool)
        if vocab is not None:
            bad |= flat >= vocab
        if bad.any():
            k = int(np.argmax(bad))
            r = int(np.searchsorted(np.cumsum(lens), k, side="right"))
            return (
                f"row {int(rows[r]) - lo} holds token id {int(flat[k])}, outside the vocabulary "
                f"({MANIFEST_FILE} vocab_size = {vocab}, ids from 0)"
            )
    return None
