"""webdataset tar shards: one `<key>.tokens.npy` member per storage row (mtime 0, no PAX
headers), written with webdataset's `TarWriter`. webdataset has no random-access index, so the
reader builds one by a single tar header scan per shard on first use (512 B per member), then
`pread`s the `.npy` members.
"""

from __future__ import annotations

import contextlib
import io
import os
import tarfile

import numpy as np
from numba import njit

from datapipe.errors import InputError
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

MEMBER = f"{TOKENS}.npy"  # member extension of a row: `s0000000012_c000003.tokens.npy`
SPANS_MEMBER = f"{TRAINED}.npy"  # with a loss mask: the row's spans, the member after its tokens


class Writer(OwnShardWriter):
    """webdataset tar shards: one `.tokens.npy` member per row, mtime 0 (no PAX headers)."""

    suffix = ".tar"

    def _open(self, name: str) -> None:
        from webdataset import TarWriter

        self._f = open(os.path.join(self.root, name), "wb")
        self._tar = TarWriter(self._f, encoder=False, mtime=0)

    def _close(self) -> None:
        self._tar.close()
        self._f.close()

    def _abort(self) -> None:
        ts = self._tar.tarstream
        ts.closed = True  # neither the TarFile nor its stream may flush into the failed file
        with contextlib.suppress(AttributeError):
            ts.fileobj.closed = True
        self._f.close()

    def _write_rows(
        self, sample_id: int, rows: list[np.ndarray], spans: list[np.ndarray] | None
    ) -> int:
        total = 0
        for j, row in enumerate(rows):
            sample = {"__key__": f"s{sample_id:010d}_c{j:06d}", MEMBER: _npy(row)}
            if spans is not None:  # webdataset writes a key's members in sorted order
                sample[SPANS_MEMBER] = _npy(spans[j])
            self._tar.write(sample)
            total += sum(512 + -(-len(d) // 512) * 512 for k, d in sample.items() if k != "__key__")
        return total


def _npy(arr: np.ndarray) -> bytes:
    """An array as `.npy` bytes (no pickle)."""
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


class Reader(RowReader):
    """webdataset tar rows: member offsets from one header scan per shard, then pread."""

    def __init__(self, local: str, remote: str | None, manifest: dict) -> None:
        super().__init__(local, remote, manifest)
        self._shards: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}
        self._spans: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # offsets, sizes per row
        self._npy_ok: dict[tuple[int, str], bool] = {}  # direct cut checked, per shard and member

    def _open(self, shard: int) -> tuple[int, np.ndarray, np.ndarray]:
        if shard not in self._shards:
            path = self.shard_path(shard)
            found: dict[str, tuple[list[int], list[int]]] = {
                MEMBER: ([], []),
                SPANS_MEMBER: ([], []),
            }
            try:
                with tarfile.open(path, "r:") as tf:
                    for m in tf:
                        kind = m.name.rpartition("/")[2].partition(".")[2]
                        if m.isfile() and kind in found:
                            found[kind][0].append(m.offset_data)
                            found[kind][1].append(m.size)
            except tarfile.TarError as exc:
                raise InputError(f"{path}: not a readable tar shard ({exc})") from None
            want = int(self.shard_starts[shard + 1] - self.shard_starts[shard])
            offs, sizes = found[MEMBER]
            if len(offs) != want:
                raise InputError(f"{path}: {len(offs)} .{MEMBER} members, manifest says {want}")
            if self.manifest.get("loss_mask") and len(found[SPANS_MEMBER][0]) != want:
                got = len(found[SPANS_MEMBER][0])
                raise InputError(
                    f"{path}: {got} .{SPANS_MEMBER} members, manifest says {want} rows (one each)"
                )
            self.stats.index_bytes += 512 * len(offs)
            fd = os.open(path, os.O_RDONLY)
            self._shards[shard] = (fd, np.asarray(offs, np.int64), np.asarray(sizes, np.int64))
            self._spans[shard] = tuple(np.asarray(x, np.int64) for x in found[SPANS_MEMBER])
        return self._shards[shard]

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
        """All rows' `.npy` members read into one buffer and their arrays cut out together
        (npy_rows); None (np.load row by row) where a header is not the one checked."""
        fd, offs, sizes = self._open(shard)
        begin = offs[local_rows]
        end = begin + sizes[local_rows]
        buf, starts = read_ranges_into(fd, begin, end, self.stats)
        return self._npy(shard, MEMBER, buf, starts, starts + (end - begin), self.dtype)

    def _read_shard_masked(self, shard: int, local_rows: np.ndarray):
        """Each row's two members read as one range (the spans member follows the tokens'), both
        cut out as `_read_shard_flat` does (else np.load row by row)."""
        fd, offs, sizes = self._open(shard)
        s_offs, s_sizes = self._spans[shard]
        begin = offs[local_rows]
        span_at = s_offs[local_rows]
        if (span_at < begin + sizes[local_rows]).any():
            raise ValueError(f"a .{SPANS_MEMBER} member does not follow its row's .{MEMBER}")
        end = span_at + s_sizes[local_rows]
        buf, starts = read_ranges_into(fd, begin, end, self.stats)
        toks = self._npy(shard, MEMBER, buf, starts, starts + sizes[local_rows], self.dtype)
        spans = self._npy(
            shard, SPANS_MEMBER, buf, starts + (span_at - begin), starts + (end - begin), SPAN_DTYPE
        )
        if toks is not None and spans is not None:
            return (*toks, *spans)
        out = []
        for s, n, at, e in zip(starts, sizes[local_rows], span_at - begin, end - begin):
            t = np.load(io.BytesIO(buf[s : s + n].tobytes()), allow_pickle=False)
            m = np.load(io.BytesIO(buf[s + at : s + e].tobytes()), allow_pickle=False)
            out.append((t, np.asarray(m, SPAN_DTYPE)))
        return out

    def _npy(
        self, shard: int, member: str, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, dtype
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The 1-D arrays of `.npy` members buf[starts[k]:ends[k]] back to back, and their
        lengths, cut out together; the first member of a shard is checked against np.load."""
        got = npy_rows(buf, starts, ends, np.dtype(dtype))
        if got is None or not len(starts):
            return got
        key = (shard, member)
        if key not in self._npy_ok:
            first = np.load(io.BytesIO(buf[starts[0] : ends[0]].tobytes()), allow_pickle=False)
            mine = got[0][: got[1][0]]
            same = first.dtype == mine.dtype and np.array_equal(first, mine)
            self._npy_ok[key] = bool(same and first.ndim == 1)
        return got if self._npy_ok[key] else None

    def close(self) -> None:
        for fd, _, _ in self._shards.values():
            os.close(fd)
        self._shards.clear()


def npy_rows(
    buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray] | None:
    """The data of `.npy` files buf[starts[k]:ends[k]] (format 1.0 or 2.0, as np.save writes a
    1-D array: magic, version, header length, header, data) back to back as `dtype`, and each
    one's length; None if one is not an `.npy` file or its data is not whole items."""
    starts = np.ascontiguousarray(starts, np.int64)
    ends = np.ascontiguousarray(ends, np.int64)
    data, counts, ok = _npy_data(buf, starts, ends, np.dtype(dtype).itemsize)
    return (data.view(dtype), counts) if ok else None


@njit(cache=True, nogil=True)
def _npy_data(buf, starts, ends, item):  # noqa: ANN001, ANN202 (numba)
    """(data bytes back to back, items per file, all well formed) of `.npy` files in `buf`."""
    n = starts.shape[0]
    first = np.empty(n, np.int64)
    total = 0
    for k in range(n):
        s = starts[k]
        if ends[k] - s < 12 or buf[s] != 0x93 or buf[s + 6] < 1 or buf[s + 6] > 2:
            return np.empty(0, np.uint8), np.empty(0, np.int64), False
        hl = np.int64(buf[s + 8]) | np.int64(buf[s + 9]) << 8
        if buf[s + 6] == 1:
            first[k] = s + 10 + hl
        else:
            hl |= np.int64(buf[s + 10]) << 16 | np.int64(buf[s + 11]) << 24
            first[k] = s + 12 + hl
        size = ends[k] - first[k]
        if size < 0 or size % item:
            return np.empty(0, np.uint8), np.empty(0, np.int64), False
        total += size
    out = np.empty(total, np.uint8)
    counts = np.empty(n, np.int64)
    pos = 0
    for k in range(n):
        size = ends[k] - first[k]
        out[pos : pos + size] = buf[first[k] : ends[k]]
        pos += size
        counts[k] = size // item
    return out, counts, True


def open_reader(
    local: str, remote: str | None, manifest: dict, cache_dir: str | None, mds_access: str
) -> RowReader:
    """The webdataset row reader."""
    return Reader(local, remote, manifest)
