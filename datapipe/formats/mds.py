"""MDS (mosaicml-streaming's format, the default): written through `MDSWriter`, read through the
library's own `MDSReader` (offset table + `pread`, `decode_sample`), or, with
``mds_access="dataset"``, through `StreamingDataset` indexing.

MDS picks shard boundaries itself, so a long sample's rows may continue into the next shard (readers
use the global row). The `StreamingDataset` access coordinates the processes of a node through
shared memory and /tmp filelocks; `release_streaming_prefix` removes what one dataset object left
(the library's issues #781, #893).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable

import numpy as np

from datapipe.errors import InputError
from datapipe.formats.base import (
    TOKENS,
    RowReader,
    ShardInfo,
    ShardWriter,
    read_ranges,
    willneed,
)
from datapipe.formats.mds_direct import token_decoder, verified
from datapipe.index import download

SUFFIX = ".mds"


class Writer(ShardWriter):
    """mosaicml-streaming MDS shards through `MDSWriter`; MDS picks shard boundaries itself, so a
    long sample's rows may continue into the next shard (readers use the global row)."""

    def __init__(self, root: str, dtype: np.dtype, chunk_tokens: int, shard_bytes: int) -> None:
        super().__init__(root, dtype, chunk_tokens, shard_bytes)
        from streaming import MDSWriter

        columns = {"sample_id": "int64", "chunk": "int32", TOKENS: f"ndarray:{self.dtype.name}"}
        self._w = MDSWriter(
            out=root, columns=columns, compression=None, size_limit=shard_bytes, hashes=["xxh3_64"]
        )
        self._row = 0
        self._global_first_row: list[int] = []

    @property
    def shards_completed(self) -> int:
        return len(self._w.shards)

    def write(self, sample_id: int, tokens: np.ndarray) -> None:
        self._global_first_row.append(self._row)
        for j, row in enumerate(self._rows(tokens)):
            self._w.write({"sample_id": sample_id, "chunk": j, TOKENS: row})
            self._row += 1

    def finish(self) -> list[ShardInfo]:
        self._w.finish()
        with open(os.path.join(self.root, "index.json")) as f:
            mds = json.load(f)
        rows = np.array([s["samples"] for s in mds["shards"]], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(rows)])
        first = np.asarray(self._global_first_row, dtype=np.int64)
        shard = np.searchsorted(starts, first, side="right") - 1
        self.sample_shard = shard.tolist()
        self.sample_first_row = (first - starts[shard]).tolist()
        counts = np.bincount(shard, minlength=len(rows)) if len(first) else np.zeros(len(rows), int)
        first_sample = np.concatenate([[0], np.cumsum(counts)])
        self.shards = [
            ShardInfo(
                s["raw_data"]["basename"],
                int(rows[i]),
                int(counts[i]),
                int(first_sample[i]),
                int(s["raw_data"]["bytes"]),
                s["raw_data"]["hashes"]["xxh3_64"],  # computed by MDSWriter from the bytes it wrote
            )
            for i, s in enumerate(mds["shards"])
        ]
        return self.shards


class Reader(RowReader):
    """MDS rows through the library's MDSReader: offset table + pread; the token column decoded
    directly where the shard's layout allows and a first row checked it (datapipe.formats.
    mds_direct), else by `decode_sample`. `direct = False` forces the library's decode."""

    direct = True

    def __init__(self, local: str, remote: str | None, manifest: dict) -> None:
        super().__init__(local, remote, manifest)
        from streaming.base.format import reader_from_json

        index_json = os.path.join(local, "index.json")
        if remote is not None:
            download(remote.rstrip("/") + "/index.json", index_json)
        with open(index_json) as f:
            obj = json.load(f)
        self.readers = [reader_from_json(local, None, s) for s in obj["shards"]]
        names = [r.raw_data.basename for r in self.readers]
        if names != self.shard_names:
            raise InputError(f"{index_json}: shard order differs from manifest.json")
        if any(r.compression for r in self.readers):
            raise InputError(f"{index_json}: compressed MDS shards are not supported")
        self._fds: dict[int, tuple[int, np.ndarray]] = {}
        self._decoders: dict[int, Callable] = {}

    def _open(self, shard: int) -> tuple[int, np.ndarray]:
        if shard not in self._fds:
            fd = os.open(self.shard_path(shard), os.O_RDONLY)
            n = self.readers[shard].samples
            head = os.pread(fd, 4 * (n + 2), 0)
            offsets = np.frombuffer(head, dtype="<u4")[1:].astype(np.int64)
            self.stats.index_bytes += len(head)
            self._fds[shard] = (fd, offsets)
        return self._fds[shard]

    def _announce(self, shard: int, local_rows: np.ndarray) -> None:
        fd, offs = self._open(shard)
        willneed(fd, offs[local_rows], offs[local_rows + 1])

    def _decoder(self, shard: int, row: memoryview) -> Callable:
        """The token decoder of a shard, chosen at its first read (mds_direct.verified)."""
        if shard not in self._decoders:
            rd = self.readers[shard]

            def library(data, _decode=rd.decode_sample):
                return _decode(data)[TOKENS]

            direct = None
            if self.direct:
                direct = token_decoder(
                    rd.column_names, rd.column_encodings, rd.column_sizes, self.dtype, library
                )
            self._decoders[shard] = verified(direct, library, row)
        return self._decoders[shard]

    def _read_shard(self, shard: int, local_rows: np.ndarray) -> list[np.ndarray]:
        fd, offs = self._open(shard)
        raw = read_ranges(fd, offs[local_rows], offs[local_rows + 1], self.stats)
        if not raw:
            return []
        decode = self._decoder(shard, raw[0])
        return [decode(d) for d in raw]

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()


class DatasetReader(RowReader):
    """MDS rows through ``StreamingDataset`` indexing (``get_item(global_row)``)."""

    def __init__(
        self, local: str, remote: str | None, manifest: dict, cache_dir: str | None
    ) -> None:
        super().__init__(local, remote, manifest)
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()  # leftovers of killed runs (streaming issues #781, #893)
        if remote is None:
            ds_local, ds_remote = local, None
        else:  # a unique local directory per dataset object: no sharing of cache state
            base = cache_dir or tempfile.gettempdir()
            ds_local = os.path.join(base, f"mds-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            ds_remote = remote
        self._own_local = ds_local if remote is not None else None
        self.ds = StreamingDataset(remote=ds_remote, local=ds_local, batch_size=1, shuffle=False)
        self._prefix = int(self.ds._shm_prefix_int)
        if int(self.ds.num_samples) != int(self.shard_starts[-1]):
            raise InputError(
                f"{local}: StreamingDataset has {self.ds.num_samples} rows, "
                f"manifest.json {int(self.shard_starts[-1])}"
            )

    def read_rows(self, rows: np.ndarray) -> list[np.ndarray]:
        t0 = time.perf_counter()
        out = [self.ds.get_item(int(r))[TOKENS] for r in np.asarray(rows, np.int64)]
        nbytes = sum(int(t.nbytes) for t in out)
        self.stats.rows += len(out)
        self.stats.token_bytes += nbytes
        self.stats.bytes += nbytes  # the dataset hides file reads; payload only
        self.stats.seconds += time.perf_counter() - t0
        return out

    def close(self) -> None:
        """Drop the dataset and unlink its own shared memory and filelocks (not other jobs')."""
        if getattr(self, "ds", None) is None:
            return
        self.ds = None
        release_streaming_prefix(self._prefix)
        if self._own_local is not None:
            import shutil

            shutil.rmtree(self._own_local, ignore_errors=True)


def release_streaming_prefix(prefix: int) -> None:
    """Unlink the shared memory segments and /tmp filelocks of one StreamingDataset prefix
    (``ds._shm_prefix_int``); the library leaves the filelocks behind (its issues #781, #893).
    Call only once that dataset is no longer used."""
    from multiprocessing import shared_memory

    from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK, SHM_TO_CLEAN

    for name in SHM_TO_CLEAN:
        try:
            shm = shared_memory.SharedMemory(name=f"{prefix:06}_{name}")
        except FileNotFoundError:
            continue
        shm.close()
        shm.unlink()  # also unregisters it from the resource tracker (no warning at exit)
    for name in (BARRIER_FILELOCK, CACHE_FILELOCK):
        path = os.path.join(tempfile.gettempdir(), f"{prefix:06}_{name}")
        if os.path.exists(path):
            os.unlink(path)


def open_reader(
    local: str, remote: str | None, manifest: dict, cache_dir: str | None, mds_access: str
) -> RowReader:
    """The MDS row reader: MDSReader + pread (``mds_access="reader"``) or StreamingDataset."""
    if mds_access == "dataset":
        return DatasetReader(local, remote, manifest, cache_dir)
    return Reader(local, remote, manifest)
