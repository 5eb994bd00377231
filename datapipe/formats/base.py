"""What every storage format shares (docs/FORMAT.md): shard checksums, the manifest's shard
entry, the writer and row-reader interfaces, and positional reads (`pread` of byte ranges, with the
kernel told of a step's reads first).

A writer stores a sample as consecutive rows of at most ``chunk_tokens`` tokens and reports, for
each sample, the shard and row where its first chunk went. A reader returns the token arrays of
global rows (rows counted over all shards in manifest order).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from datapipe.errors import VERIFY_ADVICE, InputError, MixlenError
from datapipe.index import LOSS_MASK_KEY, download
from datapipe.integrity import check_shard_file, checksum_file
from datapipe.jit import njit

TOKENS = "tokens"  # the token column (MDS, parquet) and member name (webdataset `tokens.npy`)
# the loss mask of a row (docs/FORMAT.md): its trained tokens as flat [start, end) pairs relative
# to the row, uint32; the name sorts after `tokens`, so MDS keeps the token column's offset fixed
TRAINED = "trained_spans"
SPAN_DTYPE = np.dtype(np.uint32)

__all__ = [
    "SPAN_DTYPE",
    "TOKENS",
    "TRAINED",
    "RowReader",
    "ShardInfo",
    "ShardWriter",
    "checksum_file",
]


@dataclass
class ShardInfo:
    """One written shard, as the manifest lists it."""

    name: str
    rows: int
    samples: int = 0
    first_sample: int = 0
    bytes: int = 0
    xxh3_64: str = ""

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "rows": self.rows,
            "samples": self.samples,
            "first_sample": self.first_sample,
            "bytes": self.bytes,
            "xxh3_64": self.xxh3_64,
        }


@dataclass
class ShardWriter:
    """Base writer: rows out, per-sample (shard, first_row) in. With `masks` every row also
    stores its trained spans (TRAINED)."""

    root: str
    dtype: np.dtype
    chunk_tokens: int
    shard_bytes: int
    masks: bool = False
    shards: list[ShardInfo] = field(default_factory=list)
    sample_shard: list[int] = field(default_factory=list)
    sample_first_row: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Subclass hook (the dataclass __init__ calls it)."""

    def write(self, sample_id: int, tokens: np.ndarray, spans: np.ndarray | None = None) -> None:
        """Store one sample as its chunk rows; `spans`: its trained tokens as flat [start, end)
        pairs (None: every token; stored only by a writer with `masks`)."""
        raise NotImplementedError

    def _row_spans(self, spans: np.ndarray | None, n: int) -> list[np.ndarray]:
        """Each chunk row's trained spans, relative to the row (SPAN_DTYPE); [0, 0] for a row
        without any."""
        c = self.chunk_tokens
        pairs = (
            np.array([[0, n]], np.int64)
            if spans is None
            else np.asarray(spans, np.int64).reshape(-1, 2)
        )
        out = []
        for lo in range(0, max(n, 1), c):
            hi = min(lo + c, n)
            s = np.clip(pairs, lo, hi) - lo
            s = s[s[:, 1] > s[:, 0]]
            if not len(s):  # no trained token: the empty span (MDS stores no empty array)
                s = np.zeros((1, 2), np.int64)
            out.append(np.ascontiguousarray(s.reshape(-1), dtype=SPAN_DTYPE))
        return out

    def finish(self) -> list[ShardInfo]:
        """Close the last shard; return all shards with sizes and checksums."""
        raise NotImplementedError

    def abort(self) -> None:
        """After a failure (disk full, interrupt): release open files without finishing them
        (the caller deletes the directory)."""

    @property
    def shards_completed(self) -> int:
        """Shards fully written so far (for progress and the test pause hook)."""
        return len(self.shards)

    def _rows(self, tokens: np.ndarray) -> list[np.ndarray]:
        c = self.chunk_tokens
        return [tokens[i : i + c] for i in range(0, max(len(tokens), 1), c)]

    def _seal(self) -> None:
        for s in self.shards:
            path = os.path.join(self.root, s.name)
            s.bytes = os.path.getsize(path)
            s.xxh3_64 = checksum_file(path)


class OwnShardWriter(ShardWriter):
    """Writers whose shard boundaries mixlen chooses: a sample never straddles two shards."""

    suffix = ""

    def __post_init__(self) -> None:
        self._open_bytes = 0
        self._open_rows = 0
        self._open_samples = 0
        self._open_first = 0
        self._is_open = False

    def _open(self, name: str) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    def _write_rows(
        self, sample_id: int, rows: list[np.ndarray], spans: list[np.ndarray] | None
    ) -> int:
        """Write a sample's rows (and, with `masks`, each row's spans); the bytes written."""
        raise NotImplementedError

    def _abort(self) -> None:
        """Drop the open shard's file objects without flushing them."""

    def abort(self) -> None:
        if self._is_open:
            self._is_open = False
            self._abort()

    def _name(self, i: int) -> str:
        return f"shard-{i:05d}{self.suffix}"

    def _estimate(self, rows: list[np.ndarray]) -> int:
        """About the bytes a sample's rows add to the open shard (before they are written)."""
        return sum(int(r.nbytes) for r in rows) + 512 * len(rows)

    def write(self, sample_id: int, tokens: np.ndarray, spans: np.ndarray | None = None) -> None:
        rows = self._rows(tokens)
        row_spans = self._row_spans(spans, len(tokens)) if self.masks else None
        est = self._estimate(rows)
        if row_spans is not None:
            est += sum(4 * len(s) + 4 for s in row_spans)
        if self._is_open and self._open_bytes and self._open_bytes + est > self.shard_bytes:
            self._roll()
        if not self._is_open:
            self._open(self._name(len(self.shards)))
            self._is_open = True
            self._open_first = sample_id
        self.sample_shard.append(len(self.shards))
        self.sample_first_row.append(self._open_rows)
        self._open_bytes += self._write_rows(sample_id, rows, row_spans)
        self._open_rows += len(rows)
        self._open_samples += 1

    def _roll(self) -> None:
        self._close()
        self.shards.append(
            ShardInfo(
                self._name(len(self.shards)), self._open_rows, self._open_samples, self._open_first
            )
        )
        self._is_open = False
        self._open_bytes = self._open_rows = self._open_samples = 0

    def finish(self) -> list[ShardInfo]:
        if self._is_open:
            self._roll()
        self._seal()
        return self.shards


@dataclass
class ReadStats:
    """What a reader took from storage."""

    rows: int = 0  # storage rows decoded
    token_bytes: int = 0  # token payload of those rows
    bytes: int = 0  # bytes read from shard files (payload + per-row/row-group overhead)
    index_bytes: int = 0  # one-off bytes to locate rows (MDS offset tables, tar header scans)
    seconds: float = 0.0  # time spent in read_rows
    verify_seconds: float = 0.0  # of which checking shards against the manifest (first opens)


# what a format's decoder raises on a damaged shard (mixlen's own errors are named already)
READ_ERRORS = (OSError, EOFError, ValueError, KeyError, IndexError)


def unreadable(path: str, exc: Exception) -> InputError:
    """The error for a shard `path` whose rows cannot be decoded."""
    return InputError(f"{path}: cannot read its rows ({type(exc).__name__}: {exc})", VERIFY_ADVICE)


class RowReader:
    """Random access to storage rows by global row; subclasses implement `_read_shard`.

    With `verify` (the default) a shard's size and XXH3-64 are checked against the manifest the
    first time this reader opens it (`shard_path`), before any of its bytes are decoded; a
    mismatch is an InputError naming the shard."""

    def __init__(self, local: str, remote: str | None, manifest: dict) -> None:
        self.local, self.remote, self.manifest = local, remote, manifest
        self.dtype = np.dtype(manifest.get("dtype", "uint16"))
        self.shard_names = [s["name"] for s in manifest["shards"]]
        rows = np.array([s["rows"] for s in manifest["shards"]], dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(rows)])
        self.stats = ReadStats()
        self.verify = True
        self._verified: set[int] = set()

    @property
    def masked(self) -> bool:
        """Does the dataset have a loss mask (manifest.json's loss_mask)?"""
        return bool(self.manifest.get(LOSS_MASK_KEY))

    def check_present(self) -> None:
        """A local dataset's shards all exist with the manifest's sizes (a stat each, no read)."""
        if self.remote is None:
            for i, name in enumerate(self.shard_names):
                check_shard_file(os.path.join(self.local, name), self.manifest["shards"][i], False)

    def shard_path(self, shard: int) -> str:
        """Local path of a shard, downloading it first for a remote dataset; verified against
        the manifest the first time (see the class docstring)."""
        name = self.shard_names[shard]
        path = os.path.join(self.local, name)
        if self.remote is None:
            self.verify_shard(shard, path)
            return path
        url = self.remote.rstrip("/") + "/" + name
        cached = os.path.exists(path)
        if not cached:
            download(url, path)
        try:
            self.verify_shard(shard, path)
        except InputError:
            if not cached:
                raise
            # a damaged copy in the cache (the store's may be sound): fetched once more, put in
            # its place in one step (other processes reading the same cache never find it missing)
            download(url, path, replace=True)
            self.verify_shard(shard, path)
        return path

    def verify_shard(self, shard: int, path: str) -> None:
        """Check `path` (shard `shard`'s local file) once per reader; see the class docstring."""
        if shard in self._verified:
            return
        t0 = time.perf_counter()
        check_shard_file(path, self.manifest["shards"][shard], hash_bytes=self.verify)
        self.stats.verify_seconds += time.perf_counter() - t0
        self._verified.add(shard)

    def shard_of_row(self, row: int) -> int:
        """The shard holding global row `row`."""
        return int(np.searchsorted(self.shard_starts, row, side="right") - 1)

    def read_rows(self, rows: np.ndarray) -> list[np.ndarray]:
        """Token arrays of the given global rows (sorted, unique), in that order."""
        return self._read(rows, "list")

    def read_rows_flat(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tokens of the given global rows (sorted, unique) back to back, and each row's token
        count (what the fetch packs from; a reader with `_read_shard_flat` builds it without
        per-row arrays)."""
        if type(self)._read_shard_flat is RowReader._read_shard_flat:
            return _concat(self.read_rows(rows), self.dtype)
        return self._read(rows, "flat")

    def read_rows_masked(
        self, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`read_rows_flat` of a dataset with a loss mask, plus each row's trained spans: (tokens,
        token count per row, the rows' TRAINED values back to back, value count per row)."""
        return self._read(rows, "masked")

    def _shard_parts(self, rows: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(shard, its local rows) of sorted global rows, in order."""
        shard_of = np.searchsorted(self.shard_starts, rows, side="right") - 1
        cuts = np.flatnonzero(np.diff(shard_of)) + 1
        return [
            (int(shard_of[g[0]]), rows[g] - self.shard_starts[shard_of[g[0]]])
            for g in np.split(np.arange(len(rows)), cuts)
            if len(g)
        ]

    def _read_part(self, shard: int, local_rows: np.ndarray, mode: str) -> tuple:
        """One shard's rows: ("list",) arrays, or flat (tokens, counts[, spans, span counts])."""
        if mode == "masked":
            got = self._read_shard_masked(shard, local_rows)
            if isinstance(got, tuple):
                return got
            toks, counts = _concat([t for t, _ in got], self.dtype)
            spans, span_counts = _concat([m for _, m in got], SPAN_DTYPE)
            return toks, counts, spans, span_counts
        got = self._read_shard_flat(shard, local_rows) if mode == "flat" else None
        if got is None:
            arrays = self._read_shard(shard, local_rows)
            return (arrays,) if mode == "list" else _concat(arrays, self.dtype)
        return got

    def _read(self, rows: np.ndarray, mode: str):
        t0 = time.perf_counter()
        rows = np.asarray(rows, np.int64)
        parts = self._shard_parts(rows)
        got: list[tuple] = []
        shard = parts[0][0] if parts else 0
        try:
            for shard, local_rows in parts:  # announce every read of the step first
                self._announce(shard, local_rows)
            for shard, local_rows in parts:
                got.append(self._read_part(shard, local_rows, mode))
        except MixlenError:  # named already (a bad shard, an object store that refused)
            raise
        except READ_ERRORS as exc:
            raise unreadable(os.path.join(self.local, self.shard_names[shard]), exc) from None
        self.stats.rows += len(rows)
        self.stats.seconds += time.perf_counter() - t0
        if mode == "list":
            out = [a for g in got for a in g[0]]
            self.stats.token_bytes += sum(int(t.nbytes) for t in out)
            return out
        width = 4 if mode == "masked" else 2
        dtypes = (self.dtype, np.int64, SPAN_DTYPE, np.int64)[:width]
        cols = tuple(
            np.concatenate([g[k] for g in got]).astype(dtypes[k], copy=False)
            if got
            else np.zeros(0, dtypes[k])
            for k in range(width)
        )
        self.stats.token_bytes += int(cols[0].nbytes)
        return cols

    def _read_shard_masked(
        self, shard: int, local_rows: np.ndarray
    ) -> list[tuple[np.ndarray, np.ndarray]] | tuple:
        """A masked dataset's rows of a shard: (tokens, TRAINED values) per row, or the flat
        4-tuple of `read_rows_masked`."""
        raise NotImplementedError

    def _read_shard_flat(
        self, shard: int, local_rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(tokens back to back, count per row) of a shard's rows, or None: use _read_shard."""
        return None

    def _announce(self, shard: int, local_rows: np.ndarray) -> None:
        """Tell the OS which rows will be read next (optional)."""

    def _read_shard(self, shard: int, local_rows: np.ndarray) -> list[np.ndarray]:
        raise NotImplementedError

    def close(self) -> None:
        """Release files (and shared memory for the StreamingDataset access)."""


def _concat(arrays: list[np.ndarray], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(arrays back to back, their lengths)."""
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype)
    return flat, np.fromiter(map(len, arrays), np.int64, len(arrays))


def take_ranges(values: np.ndarray, begin: np.ndarray, end: np.ndarray) -> np.ndarray:
    """values[begin[k]:end[k]] for every k, back to back (one numba pass)."""
    begin = np.ascontiguousarray(begin, np.int64)
    end = np.ascontiguousarray(end, np.int64)
    out = np.empty(int((end - begin).sum()), values.dtype)
    _take_ranges(np.ascontiguousarray(values), begin, end, out)
    return out


@njit(cache=True, nogil=True)
def _take_ranges(values: np.ndarray, begin: np.ndarray, end: np.ndarray, out: np.ndarray) -> None:
    pos = 0
    for k in range(begin.shape[0]):
        n = end[k] - begin[k]
        out[pos : pos + n] = values[begin[k] : end[k]]
        pos += n


def run_groups(begin: np.ndarray, end: np.ndarray) -> list[tuple[int, int]]:
    """Index ranges [i, j) of runs of back-to-back byte ranges (ascending)."""
    cut = (np.flatnonzero(begin[1:] != end[:-1]) + 1).tolist()
    return list(zip([0, *cut], [*cut, len(begin)], strict=True))


def willneed(fd: int, begin: np.ndarray, end: np.ndarray) -> None:
    """POSIX_FADV_WILLNEED for each run: the kernel starts all reads at once, in parallel (a
    no-op for cached pages). Measured: 2.7x on cold files; merging reads across gaps instead was
    worse and would break the one-chunk-per-piece-end bound (benchmarks/RESULTS.md, stream section)."""
    if hasattr(os, "posix_fadvise") and len(begin) > 1:
        b, e = begin.tolist(), end.tolist()
        for i, j in run_groups(begin, end):
            os.posix_fadvise(fd, b[i], e[j - 1] - b[i], os.POSIX_FADV_WILLNEED)


def read_ranges_into(
    fd: int, begin: np.ndarray, end: np.ndarray, stats: ReadStats
) -> tuple[np.ndarray, np.ndarray]:
    """Bytes [begin[k], end[k]) of each row (ascending) back to back in one uint8 array, read
    with one preadv per run of back-to-back rows; returns (buffer, each row's start in it). A
    short read (the file shrank) raises EOFError."""
    sizes = end - begin
    starts = np.zeros(len(begin), np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    buf = np.empty(int(sizes.sum()), np.uint8)
    view = memoryview(buf)
    b, e, s = begin.tolist(), end.tolist(), starts.tolist()
    for i, j in run_groups(begin, end):
        n = e[j - 1] - b[i]
        got = os.preadv(fd, [view[s[i] : s[i] + n]], b[i])
        if got != n:
            raise EOFError(f"bytes {b[i]}..{e[j - 1]} requested, the file ends at {b[i] + got}")
        stats.bytes += n
    return buf, starts


def read_ranges(fd: int, begin: np.ndarray, end: np.ndarray, stats: ReadStats) -> list:
    """Bytes [begin[k], end[k]) of each row (ascending), one pread per run of back-to-back rows.
    Returns memoryviews; a short read (the file shrank) raises EOFError."""
    b, e = begin.tolist(), end.tolist()
    out = []
    for i, j in run_groups(begin, end):
        base = b[i]
        data = memoryview(os.pread(fd, e[j - 1] - base, base))
        if len(data) != e[j - 1] - base:
            raise EOFError(
                f"bytes {base}..{e[j - 1]} requested, the file ends at {base + len(data)}"
            )
        stats.bytes += len(data)
        out.extend(data[b[k] - base : e[k] - base] for k in range(i, j))
    return out
