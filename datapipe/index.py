"""The length index of a dataset: `index.parquet` + `manifest.json` (see docs/FORMAT.md), with a
dataset's loss mask where it has one (each sample's `loss_tokens` and `trained_spans`, the
datapipe.plan.loss.LossMask that planning and the loss read), and where a dataset lives (a local
directory, or a remote URI whose two metadata files are downloaded with mosaicml-streaming's
downloader into a cache directory).

Imports numpy and pyarrow only (the streaming library lazily, for remote datasets), so planning
and profiling start fast.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from datapipe.errors import VERIFY_ADVICE, ConfigError, InputError, StoreError
from datapipe.files import (
    CONFIG_FILE_LIMIT,
    not_regular_reason,
    open_lock_file,
    read_bounded_bytes,
)
from datapipe.integrity import (
    FINGERPRINT_KEY,
    INDEX_CHECKSUM_KEY,
    check_index,
    check_manifest,
    checksum_file,
)
from datapipe.integrity import dataset_fingerprint as _fingerprint
from datapipe.plan.loss import LossMask

INDEX_FILE = "index.parquet"
MANIFEST_FILE = "manifest.json"
INDEX_COLUMNS = ("sample_id", "num_tokens", "shard", "first_row", "num_rows", "source")
METADATA_FILES = (MANIFEST_FILE, INDEX_FILE)
LOSS_MASK_KEY = "loss_mask"  # manifest.json: "trained_spans" when the dataset has a loss mask
LOSS_COLUMNS = ("loss_tokens", "trained_spans")  # index.parquet's columns of a masked dataset
_SCHEMA = pa.schema(
    [
        ("sample_id", pa.int64()),
        ("num_tokens", pa.int64()),
        ("shard", pa.int32()),
        ("first_row", pa.int64()),
        ("num_rows", pa.int32()),
        ("source", pa.string()),
    ]
)


@dataclass(frozen=True)
class LossColumns:
    """A masked dataset's index columns: each sample's labelled positions and its trained spans
    (flat [start, end) pairs, sample i's at values[offsets[i]:offsets[i+1]])."""

    loss_tokens: np.ndarray  # int64 [N]
    offsets: np.ndarray  # int64 [N + 1]
    values: np.ndarray  # int64

    @classmethod
    def of(cls, spans: list, num_tokens: np.ndarray) -> LossColumns:
        """From each sample's spans (None: the whole sample is trained)."""
        parts = [
            np.array([0, n] if n else [], np.int64) if sp is None else np.asarray(sp, np.int64)
            for sp, n in zip(spans, np.asarray(num_tokens).tolist())
        ]
        offsets = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([len(p) for p in parts], out=offsets[1:])
        values = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        mask = LossMask(offsets, values)
        ids = np.arange(len(parts), dtype=np.int64)
        loss = mask.unit_tokens(ids, np.zeros_like(ids), np.asarray(num_tokens, np.int64))
        return cls(loss, offsets, values)

    @property
    def mask(self) -> LossMask:
        return LossMask(self.offsets, self.values)


@dataclass(frozen=True)
class DatasetIndex:
    """Per-sample columns of index.parquet (numpy) and the manifest; `loss` for a dataset with
    a loss mask (else None: every token is trained)."""

    root: str
    manifest: dict
    sample_id: np.ndarray
    num_tokens: np.ndarray
    shard: np.ndarray
    first_row: np.ndarray
    num_rows: np.ndarray
    source: list[str] | None = None
    loss: LossColumns | None = None

    def __len__(self) -> int:
        return len(self.num_tokens)

    @property
    def loss_mask(self) -> LossMask:
        """The trained tokens (LossMask() for a dataset without a mask: every token)."""
        return self.loss.mask if self.loss is not None else LossMask()

    @property
    def loss_tokens(self) -> np.ndarray:
        """Each sample's labelled positions (L - 1 without a mask)."""
        if self.loss is not None:
            return self.loss.loss_tokens
        return np.maximum(np.asarray(self.num_tokens, np.int64) - 1, 0)

    @property
    def shard_row_offsets(self) -> np.ndarray:
        """Global row of each shard's first row (int64, one more entry than shards)."""
        rows = np.array([s["rows"] for s in self.manifest["shards"]], dtype=np.int64)
        return np.concatenate([[0], np.cumsum(rows)])

    @property
    def global_first_row(self) -> np.ndarray:
        """Each sample's first row counted over the concatenation of all shards."""
        return self.shard_row_offsets[self.shard] + self.first_row


def write_index(
    path: str,
    num_tokens: np.ndarray,
    shard: np.ndarray,
    first_row: np.ndarray,
    num_rows: np.ndarray,
    source: list[str],
    loss: LossColumns | None = None,
) -> None:
    """Write index.parquet (one row per sample, sample_id = row position; with `loss`, the
    mask's columns after them)."""
    n = len(num_tokens)
    arrays = [
        pa.array(np.arange(n, dtype=np.int64)),
        pa.array(np.asarray(num_tokens, dtype=np.int64)),
        pa.array(np.asarray(shard, dtype=np.int32)),
        pa.array(np.asarray(first_row, dtype=np.int64)),
        pa.array(np.asarray(num_rows, dtype=np.int32)),
        pa.array(source, pa.string()),
    ]
    schema = _SCHEMA
    if loss is not None:
        spans = pa.LargeListArray.from_arrays(pa.array(loss.offsets), pa.array(loss.values))
        arrays += [pa.array(loss.loss_tokens), spans]
        schema = _SCHEMA.append(pa.field(LOSS_COLUMNS[0], pa.int64()))
        schema = schema.append(pa.field(LOSS_COLUMNS[1], pa.large_list(pa.int64())))
    table = pa.Table.from_arrays(arrays, schema=schema)
    pq.write_table(table, path, compression="zstd")


def read_manifest(path: str | os.PathLike) -> dict:
    """manifest.json of a dataset directory; InputError naming the file and field if it is
    missing, not a regular file, over 16 MiB (refused unread) or malformed
    (datapipe.integrity.check_manifest)."""
    mpath = os.path.join(os.fspath(path), MANIFEST_FILE)
    try:
        raw = read_bounded_bytes(mpath, CONFIG_FILE_LIMIT, MANIFEST_FILE)
    except FileNotFoundError:
        raise InputError(
            f"{mpath}: not found; is {path} a dataset written by 'mixlen preprocess' "
            "(or indexed with 'mixlen index')?"
        ) from None
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise InputError(f"{mpath}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    except (UnicodeDecodeError, RecursionError, ValueError) as exc:
        raise InputError(f"{mpath}: not a JSON manifest ({type(exc).__name__})") from None
    check_manifest(manifest, mpath)
    return manifest


def dataset_fingerprint(path_or_manifest: str | os.PathLike | dict) -> str:
    """A dataset's identity (32 hex digits over the checksums of its index and shards, see
    datapipe.integrity.dataset_fingerprint), from a dataset directory or a manifest dict. The
    manifest's recorded `dataset_fingerprint` when it has one (read_manifest checked that it
    matches the checksums), else computed: datasets written before the field have one too."""
    if isinstance(path_or_manifest, dict):
        manifest = path_or_manifest
        check_manifest(manifest, MANIFEST_FILE)
    else:
        manifest = read_manifest(path_or_manifest)
    return manifest.get(FINGERPRINT_KEY) or _fingerprint(manifest)


def _read_table(path: str | os.PathLike, columns: list[str]) -> pa.Table:
    ipath = os.path.join(os.fspath(path), INDEX_FILE)
    try:
        problem = not_regular_reason(ipath)  # pyarrow would block on a FIFO
        if problem:
            raise InputError(f"{ipath}: {problem}")
        table = pq.read_table(ipath, columns=columns)
    except FileNotFoundError:
        raise InputError(f"{ipath}: not found; build it with 'mixlen index {path}'") from None
    except (pa.ArrowException, KeyError, OSError) as exc:
        raise InputError(f"{ipath}: not a valid index ({exc})") from None
    for name in columns:
        want = _SCHEMA.field(name).type
        if name in table.column_names and not _compatible(table.schema.field(name).type, want):
            raise InputError(
                f"{ipath}: column {name!r} has type {table.schema.field(name).type}, expected {want}"
            )
        if name in table.column_names and name != "source" and table.column(name).null_count:
            raise InputError(f"{ipath}: column {name!r} has null values")
    return table


def _compatible(got: pa.DataType, want: pa.DataType) -> bool:
    if pa.types.is_string(want):
        return pa.types.is_string(got) or pa.types.is_large_string(got)
    return pa.types.is_integer(got)


def read_lengths(path: str | os.PathLike) -> np.ndarray:
    """Sample lengths (int64, in sample_id order), reading only that column."""
    col = _read_table(path, ["num_tokens"]).column(0)
    return col.to_numpy().astype(np.int64, copy=False)


def read_index(path: str | os.PathLike, with_source: bool = False) -> DatasetIndex:
    """manifest.json and the numeric columns of index.parquet (add `source` on request). The
    index must match the manifest's checksum of it (when recorded) and agree with its shards
    (datapipe.integrity.check_index); else InputError naming the file and row."""
    manifest = read_manifest(path)
    ipath = os.path.join(os.fspath(path), INDEX_FILE)
    digest = manifest.get(INDEX_CHECKSUM_KEY)
    if digest and os.path.isfile(ipath) and checksum_file(ipath) != digest:
        raise InputError(
            f"{ipath}: XXH3-64 checksum differs from manifest.json's {INDEX_CHECKSUM_KEY} "
            "(the index was edited or is corrupt)",
            VERIFY_ADVICE,
        )
    cols = [c for c in INDEX_COLUMNS if c != "source" or with_source]
    table = _read_table(path, cols)
    arrays = {c: table.column(c).to_numpy().astype(np.int64) for c in cols if c != "source"}
    problems = check_index(arrays, manifest, ipath)
    if problems:
        raise InputError(problems[0])
    loss = (
        read_loss_columns(path, manifest, arrays["num_tokens"])
        if manifest.get(LOSS_MASK_KEY)
        else None
    )
    return DatasetIndex(
        root=os.fspath(path),
        manifest=manifest,
        sample_id=arrays["sample_id"],
        num_tokens=arrays["num_tokens"],
        shard=arrays["shard"].astype(np.int32),
        first_row=arrays["first_row"],
        num_rows=arrays["num_rows"].astype(np.int32),
        source=table.column("source").to_pylist() if with_source else None,
        loss=loss,
    )


def read_loss_columns(
    path: str | os.PathLike, manifest: dict, num_tokens: np.ndarray
) -> LossColumns:
    """A masked dataset's `loss_tokens` and `trained_spans` (manifest `loss_mask`), checked:
    spans sorted, disjoint and inside their sample, and `loss_tokens` what they imply."""
    ipath = os.path.join(os.fspath(path), INDEX_FILE)
    try:
        table = pq.read_table(ipath, columns=list(LOSS_COLUMNS))
    except (pa.ArrowException, KeyError, OSError) as exc:
        raise InputError(
            f"{ipath}: manifest.json has {LOSS_MASK_KEY}, but the index has no valid "
            f"{' and '.join(LOSS_COLUMNS)} columns ({exc})"
        ) from None
    col = table.column(LOSS_COLUMNS[1]).combine_chunks()
    if not pa.types.is_list(col.type) and not pa.types.is_large_list(col.type):
        raise InputError(f"{ipath}: column {LOSS_COLUMNS[1]!r} has type {col.type}, expected lists")
    if col.null_count or table.column(LOSS_COLUMNS[0]).null_count:
        raise InputError(f"{ipath}: the loss mask columns have null values")
    offsets = np.asarray(col.offsets, np.int64)
    values = np.asarray(col.values.to_numpy(zero_copy_only=False), np.int64)
    loss = table.column(LOSS_COLUMNS[0]).to_numpy().astype(np.int64)
    problem = _mask_problem(offsets, values, np.asarray(num_tokens, np.int64), loss)
    if problem:
        raise InputError(f"{ipath}: {problem}")
    return LossColumns(loss, offsets, values)


def _mask_problem(
    offsets: np.ndarray, values: np.ndarray, num_tokens: np.ndarray, loss: np.ndarray
) -> str | None:
    """The first inconsistency of a loss mask's columns (None: consistent)."""
    n = len(num_tokens)
    if len(offsets) != n + 1 or len(loss) != n:
        return f"the loss mask columns have {len(loss)} rows, the index {n}"
    odd = np.flatnonzero(np.diff(offsets) % 2)
    if odd.size:
        return f"row {int(odd[0])}: trained_spans holds an odd number of values (pairs expected)"
    pair_row = np.repeat(np.arange(n), np.diff(offsets) // 2)
    s, e = values[0::2], values[1::2]
    bad = (s < 0) | (e <= s) | (e > num_tokens[pair_row])
    later = (pair_row[1:] == pair_row[:-1]) & (s[1:] < e[:-1])
    bad[1:] |= later
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        return (
            f"row {int(pair_row[k])}: trained span [{int(s[k])}, {int(e[k])}) is empty, outside "
            f"its {int(num_tokens[pair_row[k]])} tokens or overlaps the one before"
        )
    # each sample's trained tokens after its first (numpy: reading an index never loads numba)
    want = np.bincount(pair_row, weights=np.clip(e - np.maximum(s, 1), 0, None), minlength=n)
    want = want.astype(np.int64)
    wrong = np.flatnonzero(want != loss)
    if wrong.size:
        i = int(wrong[0])
        return f"row {i}: loss_tokens is {int(loss[i])}, its trained_spans give {int(want[i])}"
    return None


def read_loss_tokens(
    path: str | os.PathLike, manifest: dict | None = None, lengths: np.ndarray | None = None
) -> np.ndarray | None:
    """Each sample's labelled positions of a masked dataset (None: it has no mask); `manifest`
    and `lengths`, where the caller has read them already, are not read again."""
    manifest = read_manifest(path) if manifest is None else manifest
    if not manifest.get(LOSS_MASK_KEY):
        return None
    lengths = read_lengths(path) if lengths is None else lengths
    return read_loss_columns(path, manifest, lengths).loss_tokens


# --- dataset location: local directory or remote URI ----------------------------------------------


def is_remote(path: str) -> bool:
    """True for a URI with a scheme (s3://, gs://, oci://, hf://, ...); False for a local path."""
    scheme = urllib.parse.urlparse(str(path)).scheme
    return scheme not in ("", "file") and len(scheme) > 1  # len>1: not a Windows drive letter


def uri_key(remote: str) -> str:
    """A remote dataset's folder name in a cache: stable per URI."""
    return hashlib.sha1(remote.rstrip("/").encode()).hexdigest()[:16]


def default_cache_dir(remote: str) -> str:
    """Local cache directory for a remote dataset: stable per URI, under the temp directory."""
    return os.path.join(tempfile.gettempdir(), "mixlen-cache", uri_key(remote))


def download(remote_file: str, local_file: str, replace: bool = False) -> None:
    """Fetch one file with mosaicml-streaming's downloader (no-op when already cached, unless
    `replace`); errors and retries as in datapipe.store."""
    from datapipe.store import download as store_download

    store_download(remote_file, local_file, replace=replace)


@contextlib.contextmanager
def _folder_lock(path: str) -> Iterator[None]:
    """An exclusive flock on `path` for the block; none (the block runs unguarded) where the
    lock file cannot be opened (files.open_lock_file) or the file system has no locks."""
    fd = open_lock_file(path)
    if fd is None:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # ENOLCK, ENOSYS, EOPNOTSUPP: some network file systems
            pass
        yield
    finally:
        os.close(fd)


def resolve_dataset(
    path: str, cache_dir: str | None = None, key: str = "path"
) -> tuple[str, str | None]:
    """(local directory holding manifest.json + index.parquet, remote root or None).

    A remote dataset's two metadata files are downloaded into its folder under ``cache_dir``, one
    per URI (default: under the temp directory), so datasets that share a cache never read each
    other's files; its shards are fetched later, on demand, by the fetch. manifest.json is
    fetched on every open: a dataset written anew at the URI empties the folder first. `key`
    names the setting in errors.
    """
    path = str(path)
    if not is_remote(path):
        if path.startswith("file://"):
            path = urllib.parse.urlparse(path).path
        if not os.path.isdir(path):
            raise ConfigError(f"{key}: dataset directory {path!r} not found")
        return path, None
    from datapipe.store import import_downloader, refresh_cache, remove_dead_parts

    import_downloader()  # its seconds of imports before the lock, not one rank after another

    local = os.path.join(cache_dir, uri_key(path)) if cache_dir else default_cache_dir(path)
    os.makedirs(local, exist_ok=True)
    lock = os.path.join(os.path.dirname(local), f".{os.path.basename(local)}.lock")
    try:
        # manifest.json anew every time (a dataset deleted and written again at this URI must
        # not be read from an old copy); index.parquet and shards while they are current
        refresh_cache(
            path.rstrip("/") + "/" + MANIFEST_FILE,
            os.path.join(local, MANIFEST_FILE),
            lambda: _folder_lock(lock),
        )
        with _folder_lock(lock):  # the host's ranks and workers, one at a time
            remove_dead_parts(local)  # what downloads of killed readers left
            for name in METADATA_FILES:
                download(path.rstrip("/") + "/" + name, os.path.join(local, name))
    except StoreError as exc:
        raise StoreError(f"{key}: {exc}", exc.kind) from None
    except OSError as exc:  # a full disk, a read-only cache: the store is not at fault
        raise InputError(
            f"{key}: cannot write the dataset's cache in {local} ({exc.strerror or exc}); "
            "free space there or set data.cache_dir to another disk"
        ) from None
    return local, path
