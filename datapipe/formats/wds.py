"""webdataset tar shards: one `<key>.tokens.npy` member per storage row (mtime 0, no PAX
headers), written with webdataset's `TarWriter`; with a loss mask, one more member closes each
shard: `__mixlen_trained__.trained_spans.npy`, all its rows' trained spans behind their offsets
(docs/FORMAT.md). webdataset has no random-access index, so the reader builds one by a single tar
header scan per shard on first use (512 B per member), reading and checking the spans member
then, and `pread`s the rows' `.npy` members.
"""

from __future__ import annotations

import contextlib
import io
import os
import tarfile

import numpy as np

from datapipe.errors import VERIFY_ADVICE, InputError
from datapipe.formats.base import (
    SPAN_DTYPE,
    TOKENS,
    TRAINED,
    OwnShardWriter,
    RowReader,
    read_ranges,
    read_ranges_into,
    willneed,
)
from datapipe.jit import njit

MEMBER = f"{TOKENS}.npy"  # member extension of a row: `s0000000012_c000003.tokens.npy`
SPANS_MEMBER = f"{TRAINED}.npy"  # the spans' member extension
# the key of a masked shard's last member (a sample of its own to webdataset's readers): a 1-D
# uint32 `.npy` of the shard's R rows: R + 1 offsets, then the rows' spans back to back (row r's
# are values[offsets[r]:offsets[r + 1]], values = the array from R + 1 on)
SPANS_KEY = "__mixlen_trained__"
SPANS_NAME = f"{SPANS_KEY}.{SPANS_MEMBER}"


class Writer(OwnShardWriter):
    """webdataset tar shards: one `.tokens.npy` member per row, mtime 0 (no PAX headers); with
    `masks` the shard's spans member last."""

    suffix = ".tar"

    def _open(self, name: str) -> None:
        from webdataset import TarWriter

        self._f = open(os.path.join(self.root, name), "wb")
        self._tar = TarWriter(self._f, encoder=False, mtime=0)
        self._spans: list[np.ndarray] = []

    def _close(self) -> None:
        if self.masks:
            self._tar.write({"__key__": SPANS_KEY, SPANS_MEMBER: _npy(shard_spans(self._spans))})
        self._tar.close()
        self._f.close()

    def _abort(self) -> None:
        ts = self._tar.tarstream
        ts.closed = True  # neither the TarFile nor its stream may flush into the failed file
        with contextlib.suppress(AttributeError):
            ts.fileobj.closed = True
        self._f.close()

    def _estimate(self, rows: list[np.ndarray]) -> int:
        return sum(512 + _blocks(NPY_HEADER + int(r.nbytes)) for r in rows)

    def _write_rows(
        self, sample_id: int, rows: list[np.ndarray], spans: list[np.ndarray] | None
    ) -> int:
        total = 0
        for j, row in enumerate(rows):
            data = _npy(row)
            self._tar.write({"__key__": f"s{sample_id:010d}_c{j:06d}", MEMBER: data})
            total += 512 + _blocks(len(data))
        if spans is not None:  # kept for the shard's spans member (4 bytes a value and a row)
            if not self._spans:  # the member's own header, .npy header, last offset, padding
                total += 512 + NPY_HEADER + 4 + 511
            self._spans.extend(spans)
            total += sum(4 * len(s) + 4 for s in spans)
        return total


NPY_HEADER = 128  # bytes before a 1-D array's data in a `.npy`


def _blocks(n: int) -> int:
    """`n` bytes padded to tar's 512-byte blocks."""
    return -(-n // 512) * 512


def _npy(arr: np.ndarray) -> bytes:
    """An array as `.npy` bytes (no pickle)."""
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


def shard_spans(row_spans: list[np.ndarray]) -> np.ndarray:
    """The spans member's array of a shard's rows (SPANS_KEY): row offsets, then the values."""
    offsets = np.zeros(len(row_spans) + 1, np.int64)
    np.cumsum([len(s) for s in row_spans], out=offsets[1:])
    if offsets[-1] + len(offsets) > np.iinfo(SPAN_DTYPE).max:
        raise ValueError(f"{offsets[-1]:,} span values in one shard: lower --shard-size")
    return np.concatenate([offsets.astype(SPAN_DTYPE), *row_spans]).astype(SPAN_DTYPE)


def spans_problem(arr: np.ndarray, rows: int) -> str | None:
    """What is wrong with a spans member's array for a shard of `rows` rows (None: nothing)."""
    if arr.dtype != SPAN_DTYPE or arr.ndim != 1:
        return f"expected a 1-D {SPAN_DTYPE} array, got {arr.dtype} of shape {arr.shape}"
    if len(arr) < rows + 1:
        return f"{len(arr)} values, fewer than the {rows + 1} offsets of the shard's {rows} rows"
    off = arr[: rows + 1].astype(np.int64)
    n = len(arr) - rows - 1
    if off[0] != 0 or off[-1] != n:
        return f"row offsets from {off[0]} to {off[-1]}, expected 0 to {n} (the values after them)"
    counts = np.diff(off)
    bad = np.flatnonzero((counts < 0) | (counts % 2 == 1))
    if bad.size:
        r = int(bad[0])
        return f"row {r}'s offsets {off[r]}..{off[r + 1]} do not hold whole [start, end) pairs"
    pairs = arr[rows + 1 :].reshape(-1, 2)
    bad = np.flatnonzero(pairs[:, 0] > pairs[:, 1])
    if bad.size:
        r = int(np.searchsorted(off, 2 * bad[0], side="right") - 1)
        return f"row {r} has a span that ends before it starts ({pairs[bad[0]].tolist()})"
    return None


class Reader(RowReader):
    """webdataset tar rows: member offsets from one header scan per shard (and with a loss mask
    the shard's spans member, read and checked then), then pread."""

    def __init__(self, local: str, remote: str | None, manifest: dict) -> None:
        super().__init__(local, remote, manifest)
        self._shards: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}
        self._spans: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # row offsets, span values
        self._npy_ok: dict[int, bool] = {}  # the direct cut checked, per shard

    def _open(self, shard: int) -> tuple[int, np.ndarray, np.ndarray]:
        if shard not in self._shards:
            path = self.shard_path(shard)
            offs, sizes, spans_at = _scan(path)
            want = int(self.shard_starts[shard + 1] - self.shard_starts[shard])
            if len(offs) != want:
                raise InputError(f"{path}: {len(offs)} .{MEMBER} members, manifest says {want}")
            self.stats.index_bytes += 512 * (len(offs) + len(spans_at))
            fd = os.open(path, os.O_RDONLY)
            try:
                if self.masked:
                    self._spans[shard] = self._read_spans(fd, path, offs, spans_at, want)
            except BaseException:
                os.close(fd)
                raise
            self._shards[shard] = (fd, np.asarray(offs, np.int64), np.asarray(sizes, np.int64))
        return self._shards[shard]

    def _read_spans(
        self, fd: int, path: str, offs: list[int], spans_at: list[tuple[str, int, int]], rows: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """A masked shard's (row offsets, span values) from its spans member, checked."""
        if any(name != SPANS_NAME for name, _, _ in spans_at):
            raise InputError(
                f"{path}: one .{SPANS_MEMBER} member per row, the layout mixlen wrote before it "
                f"kept a shard's spans in one {SPANS_NAME} member; re-run `mixlen preprocess` "
                "to rewrite this dataset"
            )
        if len(spans_at) != 1 or (offs and spans_at[0][1] < offs[-1]):
            raise InputError(
                f"{path}: {len(spans_at)} {SPANS_NAME} members, manifest.json says the dataset "
                "has a loss mask: expected one, after the shard's rows",
                VERIFY_ADVICE,
            )
        _, at, size = spans_at[0]
        raw = os.pread(fd, size, at)
        self.stats.index_bytes += len(raw)
        try:
            arr = np.load(io.BytesIO(raw), allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise InputError(f"{path}: {SPANS_NAME} is not an .npy array ({exc})") from None
        problem = spans_problem(arr, rows)
        if problem:
            raise InputError(f"{path}: {SPANS_NAME}: {problem}; re-run `mixlen preprocess`")
        return arr[: rows + 1].astype(np.int64), arr[rows + 1 :]

    def _announce(self, shard: int, local_rows: np.ndarray) -> None:
        fd, offs, sizes = self._open(shard)
        willneed(fd, offs[local_rows], offs[local_rows] + sizes[local_rows])

    def _read_shard(self, shard: int, local_rows: np.ndarray) -> list[np.ndarray]:
        fd, offs, sizes = self._open(shard)
        begin = offs[local_rows]
        raw = read_ranges(fd, begin, begin + sizes[local_rows], self.stats)
        return [np.load(io.BytesIO(d), allow_pickle=False) for d in raw]

    def _read_shard_flat(
        self, shard: int, local_rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The rows' tokens back to back and their counts (`_cut`); None: np.load row by row."""
        got = self._cut(shard, local_rows, False)
        return None if got is None else got[:2]

    def _read_shard_masked(self, shard: int, local_rows: np.ndarray):
        """The rows' tokens as `_read_shard_flat` reads them (one member each) with their spans
        gathered from the shard's spans member (read on the shard's first use) in the same
        pass; else np.load row by row."""
        got = self._cut(shard, local_rows, True)
        if got is not None:
            return got
        off, values = self._spans[shard]
        arrays = self._read_shard(shard, local_rows)
        return [(t, values[off[r] : off[r + 1]]) for t, r in zip(arrays, local_rows.tolist())]

    def _cut(self, shard: int, local_rows: np.ndarray, masked: bool) -> tuple | None:
        """(tokens, count per row, spans, span values per row) of the rows, their `.npy`
        members read into one buffer and cut out by one numba pass which, `masked`, also
        gathers their spans (else none); None where a member's header is not the one checked
        (the first of a shard is checked against np.load)."""
        fd, offs, sizes = self._open(shard)
        begin = offs[local_rows]
        end = begin + sizes[local_rows]
        buf, starts = read_ranges_into(fd, begin, end, self.stats)
        ends = starts + (end - begin)
        off, values = self._spans[shard] if masked else _NO_SPANS
        rows = np.ascontiguousarray(local_rows, np.int64) if masked else _NO_ROWS
        data, counts, ok, spans, span_counts = _npy_cut(
            buf, starts, ends, self.dtype.itemsize, off, values, rows
        )
        if not ok:
            return None
        data = data.view(self.dtype)
        if len(starts) and shard not in self._npy_ok:
            first = np.load(io.BytesIO(buf[starts[0] : ends[0]].tobytes()), allow_pickle=False)
            mine = data[: counts[0]]
            same = first.dtype == mine.dtype and np.array_equal(first, mine)
            self._npy_ok[shard] = bool(same and first.ndim == 1)
        if len(starts) and not self._npy_ok[shard]:
            return None
        return data, counts, spans, span_counts

    def close(self) -> None:
        for fd, _, _ in self._shards.values():
            os.close(fd)
        self._shards.clear()
        self._spans.clear()


def _scan(path: str) -> tuple[list[int], list[int], list[tuple[str, int, int]]]:
    """One header scan of a shard: its rows' token members (data offsets, sizes) in tar order
    and every spans member (name, data offset, size)."""
    offs: list[int] = []
    sizes: list[int] = []
    spans: list[tuple[str, int, int]] = []
    try:
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                name = m.name.rpartition("/")[2]
                kind = name.partition(".")[2]
                if m.isfile() and kind == MEMBER:
                    offs.append(m.offset_data)
                    sizes.append(m.size)
                elif m.isfile() and kind == SPANS_MEMBER:
                    spans.append((name, m.offset_data, m.size))
    except tarfile.TarError as exc:
        raise InputError(f"{path}: not a readable tar shard ({exc})") from None
    return offs, sizes, spans


_NO_SPANS = (np.zeros(1, np.int64), np.zeros(0, SPAN_DTYPE))  # an unmasked read's (no rows)
_NO_ROWS = np.zeros(0, np.int64)


@njit(cache=True, nogil=True)
def _npy_cut(buf, starts, ends, item, offsets, values, rows):  # noqa: ANN001, ANN202 (numba)
    """(data bytes back to back, items per file, all well formed) of `.npy` files in `buf`
    (format 1.0 or 2.0 as np.save writes a 1-D array: magic, version, header length, header,
    data; not well formed: one is not, or its data is not whole items), and rows' spans
    values[offsets[r]:offsets[r + 1]] back to back with their counts."""
    n = starts.shape[0]
    first = np.empty(n, np.int64)
    total = 0
    for k in range(n):
        s = starts[k]
        if ends[k] - s < 12 or buf[s] != 0x93 or buf[s + 6] < 1 or buf[s + 6] > 2:
            total = -1
            break
        hl = np.int64(buf[s + 8]) | np.int64(buf[s + 9]) << 8
        if buf[s + 6] == 1:
            first[k] = s + 10 + hl
        else:
            hl |= np.int64(buf[s + 10]) << 16 | np.int64(buf[s + 11]) << 24
            first[k] = s + 12 + hl
        size = ends[k] - first[k]
        if size < 0 or size % item:
            total = -1
            break
        total += size
    m = rows.shape[0]
    span_counts = np.empty(m, np.int64)
    if total < 0:
        return np.empty(0, np.uint8), np.empty(0, np.int64), False, values[:0], span_counts[:0]
    out = np.empty(total, np.uint8)
    counts = np.empty(n, np.int64)
    pos = 0
    for k in range(n):
        size = ends[k] - first[k]
        out[pos : pos + size] = buf[first[k] : ends[k]]
        pos += size
        counts[k] = size // item
    n_spans = 0
    for k in range(m):
        span_counts[k] = offsets[rows[k] + 1] - offsets[rows[k]]
        n_spans += span_counts[k]
    spans = np.empty(n_spans, values.dtype)
    pos = 0
    for k in range(m):
        lo = offsets[rows[k]]
        spans[pos : pos + span_counts[k]] = values[lo : lo + span_counts[k]]
        pos += span_counts[k]
    return out, counts, True, spans, span_counts


def open_reader(
    local: str, remote: str | None, manifest: dict, cache_dir: str | None, mds_access: str
) -> RowReader:
    """The webdataset row reader."""
    return Reader(local, remote, manifest)
