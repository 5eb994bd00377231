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

from datapipe.errors import InputError
from datapipe.formats.base import (
    SPAN_DTYPE,
    TOKENS,
    TRAINED,
    OwnShardWriter,
    RowReader,
    read_ranges,
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

    def _read_shard_masked(self, shard: int, local_rows: np.ndarray):
        """Each row's two members read as one range (the spans member follows the tokens')."""
        fd, offs, sizes = self._open(shard)
        s_offs, s_sizes = self._spans[shard]
        begin = offs[local_rows]
        span_at = s_offs[local_rows]
        if (span_at < begin + sizes[local_rows]).any():
            raise ValueError(f"a .{SPANS_MEMBER} member does not follow its row's .{MEMBER}")
        end = span_at + s_sizes[local_rows]
        raw = read_ranges(fd, begin, end, self.stats)
        out = []
        for d, n, at in zip(raw, sizes[local_rows], span_at - begin):
            toks = np.load(io.BytesIO(d[:n]), allow_pickle=False)
            spans = np.load(io.BytesIO(d[at:]), allow_pickle=False)
            out.append((toks, np.asarray(spans, SPAN_DTYPE)))
        return out

    def close(self) -> None:
        for fd, _, _ in self._shards.values():
            os.close(fd)
        self._shards.clear()


def open_reader(
    local: str, remote: str | None, manifest: dict, cache_dir: str | None, mds_access: str
) -> RowReader:
    """The webdataset row reader."""
    return Reader(local, remote, manifest)
