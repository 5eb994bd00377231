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
from datapipe.formats.base import TOKENS, OwnShardWriter, RowReader, read_ranges, willneed

MEMBER = f"{TOKENS}.npy"  # member extension of a row: `s0000000012_c000003.tokens.npy`


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

    def _write_rows(self, sample_id: int, rows: list[np.ndarray]) -> int:
        total = 0
        for j, row in enumerate(rows):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(row), allow_pickle=False)
            data = buf.getvalue()
            self._tar.write({"__key__": f"s{sample_id:010d}_c{j:06d}", MEMBER: data})
            total += 512 + -(-len(data) // 512) * 512
        return total


class Reader(RowReader):
    """webdataset tar rows: member offsets from one header scan per shard, then pread."""

    def __init__(self, local: str, remote: str | None, manifest: dict) -> None:
        super().__init__(local, remote, manifest)
        self._shards: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}

    def _open(self, shard: int) -> tuple[int, np.ndarray, np.ndarray]:
        if shard not in self._shards:
            path = self.shard_path(shard)
            offs, sizes = [], []
            try:
                with tarfile.open(path, "r:") as tf:
                    for m in tf:
                        if m.isfile() and m.name.endswith("." + MEMBER):
                            offs.append(m.offset_data)
                            sizes.append(m.size)
            except tarfile.TarError as exc:
                raise InputError(f"{path}: not a readable tar shard ({exc})") from None
            want = int(self.shard_starts[shard + 1] - self.shard_starts[shard])
            if len(offs) != want:
                raise InputError(f"{path}: {len(offs)} .{MEMBER} members, manifest says {want}")
            self.stats.index_bytes += 512 * len(offs)
            fd = os.open(path, os.O_RDONLY)
            self._shards[shard] = (fd, np.asarray(offs, np.int64), np.asarray(sizes, np.int64))
        return self._shards[shard]

    def _announce(self, shard: int, local_rows: np.ndarray) -> None:
        fd, offs, sizes = self._open(shard)
        willneed(fd, offs[local_rows], offs[local_rows] + sizes[local_rows])

    def _read_shard(self, shard: int, local_rows: np.ndarray) -> list[np.ndarray]:
        fd, offs, sizes = self._open(shard)
        begin = offs[local_rows]
        raw = read_ranges(fd, begin, begin + sizes[local_rows], self.stats)
        return [np.load(io.BytesIO(d), allow_pickle=False) for d in raw]

    def close(self) -> None:
        for fd, _, _ in self._shards.values():
            os.close(fd)
        self._shards.clear()


def open_reader(
    local: str, remote: str | None, manifest: dict, cache_dir: str | None, mds_access: str
) -> RowReader:
    """The webdataset row reader."""
    return Reader(local, remote, manifest)
