"""Data-aware fetch: read exactly one rank's token ranges and pack them into micro-batches.

A plan piece ``(s, a, b)`` means "compute positions a..b-1 of sample s". Its inputs are tokens
[a, b); its labels are tokens [a+1, b+1) of the same sample, so the fetch reads tokens
[a, min(b+1, L)); the last position of a sample has label -100. Every sample thus contributes
L-1 labelled positions however it is split. Tokens are read through the storage rows
(``chunk_tokens`` each, FORMAT.md) that overlap that range, so a rank reads at most its tokens plus
one storage chunk at each end of each piece.

Readers (one per format, random access by global row):

- ``mds``: mosaicml-streaming's own ``MDSReader`` (``reader_from_json`` on the dataset's
  ``index.json``) decodes rows; with ``mds_access="reader"`` (default) the row bytes are located
  through the shard's offset table and read with ``os.pread`` on a kept-open file, one read per run
  of back-to-back rows, all of a step's reads announced first with ``POSIX_FADV_WILLNEED``; no
  shared memory, no filelocks, no torch.distributed, so every rank can open its own. With
  ``mds_access="dataset"`` rows come from ``StreamingDataset`` indexing
  (``ds.get_item(global_row)``): it calls ``clean_stale_shared_memory()`` first, gives a remote
  dataset a unique local directory, and on ``close()`` unlinks its own shared memory and /tmp
  filelocks (streaming issues #781, #893). The library coordinates the processes of a node
  through shared memory and, with RANK/WORLD_SIZE set, torch.distributed: in a multi-rank job build
  it on all ranks together, or use the default. ``StreamingDataLoader`` is not used (its resume
  bug with list-returning ``collate_fn`` does not apply).
- ``wds``: webdataset 1.0.2 has no random-access index (``wids`` is not part of it), so the
  documented fallback is an in-memory member index built by one tar header scan per shard on first
  use (512 B read per member), then ``os.pread`` of the ``.npy`` member.
- ``parquet``: ``ParquetFile.read_row_group`` of the row groups holding the rows (the writer closes
  a row group at ``chunk_tokens`` tokens, so the bound above holds).

Remote datasets: ``manifest.json``/``index.parquet`` come through ``datapipe.stream.resolve_dataset``
and shards are downloaded on first use into ``cache_dir`` with mosaicml-streaming's downloader.
Use one ``cache_dir`` per process (or per node with one downloading process).

Micro-batches are numpy; ``MicroBatch.to_torch()`` converts. Torch and the streaming library are
imported lazily.
"""

from __future__ import annotations

import io
import json
import os
import queue
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from datapipe.errors import ConfigError, InputError
from datapipe.stream import download, load_index, resolve_dataset

IGNORE_INDEX = -100
VECTORIZE_BELOW_MEAN_PIECE = 32  # pack with index arithmetic when pieces average fewer tokens
MDS_ACCESS = ("reader", "dataset")


# ----------------------------------------------------------------------------- micro-batches


@dataclass
class MicroBatch:
    """One packed micro-batch of one rank; every array is 1-D over its T positions."""

    input_ids: np.ndarray  # int64 [T]
    labels: np.ndarray  # int64 [T], IGNORE_INDEX at a sample's last position
    position_ids: np.ndarray  # int64 [T], absolute position within the sample
    cu_seqlens: np.ndarray  # int32 [P+1], piece boundaries for document-masked attention
    pieces: np.ndarray  # int64 [P, 3] (sample_id, token_start, token_end)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_labels(self) -> int:
        """Labelled positions (the loss denominator's share of this micro-batch)."""
        return int(np.count_nonzero(self.labels != IGNORE_INDEX))

    def to_torch(self) -> dict[str, Any]:
        """The arrays as torch tensors (int64; cu_seqlens int32), sharing memory where possible."""
        import torch

        return {
            "input_ids": torch.from_numpy(self.input_ids),
            "labels": torch.from_numpy(self.labels),
            "position_ids": torch.from_numpy(self.position_ids),
            "cu_seqlens": torch.from_numpy(self.cu_seqlens),
        }


def as_pieces(pieces: Any) -> np.ndarray:
    """Pieces as a contiguous int64 [P, 3] array."""
    arr = np.asarray(pieces, dtype=np.int64)
    if arr.size == 0:
        return np.zeros((0, 3), np.int64)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"pieces must have shape [P, 3], got {arr.shape}")
    return np.ascontiguousarray(arr)


def pack_microbatch(
    pieces: np.ndarray,
    lengths: np.ndarray,
    flat: np.ndarray,
    span_start: np.ndarray,
    vectorized: bool | None = None,
) -> MicroBatch:
    """Pack pieces whose tokens [a, min(b+1, L)) sit at ``flat[span_start[i]:]``.

    Two equivalent paths: one slice copy per piece (3 passes over the output; best for pieces of
    more than a few dozen tokens) or index arithmetic over all tokens (no per-piece Python; best
    for many tiny pieces). ``vectorized=None`` picks by mean piece size.
    """
    pieces = as_pieces(pieces)
    s, a, b = pieces[:, 0], pieces[:, 1], pieces[:, 2]
    sizes = b - a
    cu = np.zeros(len(pieces) + 1, np.int64)
    np.cumsum(sizes, out=cu[1:])
    total = int(cu[-1])
    starts = np.asarray(span_start, np.int64)
    if vectorized is None:
        vectorized = total < VECTORIZE_BELOW_MEAN_PIECE * len(pieces)
    labels = np.full(total, IGNORE_INDEX, np.int64)
    if vectorized:
        position_ids = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - a, sizes)
        src = position_ids + np.repeat(starts - a, sizes)  # index into flat of each input token
        input_ids = flat.take(src).astype(np.int64, copy=False)
        has_label = position_ids + 1 < np.repeat(lengths[s], sizes)
        labels[has_label] = flat.take(src[has_label] + 1)
    else:
        input_ids = np.empty(total, np.int64)
        position_ids = np.empty(total, np.int64)
        ramp = np.arange(int(b.max()) if len(b) else 0, dtype=np.int64)
        nlab = np.minimum(b + 1, lengths[s]) - a - 1  # labelled positions of each piece
        for lo, hi, st, ai, bi, nl in zip(
            cu[:-1].tolist(),
            cu[1:].tolist(),
            starts.tolist(),
            a.tolist(),
            b.tolist(),
            nlab.tolist(),
            strict=True,
        ):
            input_ids[lo:hi] = flat[st : st + hi - lo]
            labels[lo : lo + nl] = flat[st + 1 : st + 1 + nl]
            position_ids[lo:hi] = ramp[ai:bi]
    return MicroBatch(input_ids, labels, position_ids, cu.astype(np.int32), pieces)


def rows_of_pieces(
    pieces: np.ndarray, lengths: np.ndarray, global_first_row: np.ndarray, chunk: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(global rows, first chunk j0, row count) of each piece's read range [a, min(b+1, L))."""
    s, a, b = pieces[:, 0], pieces[:, 1], pieces[:, 2]
    end = np.minimum(b + 1, lengths[s])
    j0 = a // chunk
    count = (end - 1) // chunk - j0 + 1
    start = global_first_row[s] + j0
    offs = np.zeros(len(pieces) + 1, np.int64)
    np.cumsum(count, out=offs[1:])
    rows = np.repeat(start - offs[:-1], count) + np.arange(int(offs[-1]), dtype=np.int64)
    return rows, j0, count


# ----------------------------------------------------------------------------- readers


@dataclass
class ReadStats:
    """What a reader took from storage."""

    rows: int = 0  # storage rows decoded
    token_bytes: int = 0  # token payload of those rows
    bytes: int = 0  # bytes read from shard files (payload + per-row/row-group overhead)
    index_bytes: int = 0  # one-off bytes to locate rows (MDS offset tables, tar header scans)
    seconds: float = 0.0  # time spent in read_rows


class RowReader:
    """Random access to storage rows by global row; subclasses implement `_read_shard`."""

    def __init__(self, local: str, remote: str | None, manifest: dict) -> None:
        self.local, self.remote, self.manifest = local, remote, manifest
        self.dtype = np.dtype(manifest.get("dtype", "uint16"))
        self.shard_names = [s["name"] for s in manifest["shards"]]
        rows = np.array([s["rows"] for s in manifest["shards"]], dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(rows)])
        self.stats = ReadStats()

    def shard_path(self, shard: int) -> str:
        """Local path of a shard, downloading it first for a remote dataset."""
        name = self.shard_names[shard]
        path = os.path.join(self.local, name)
        if self.remote is not None and not os.path.exists(path):
            download(self.remote.rstrip("/") + "/" + name, path)
        elif not os.path.exists(path):
            raise InputError(f"{path}: shard listed in manifest.json is missing")
        return path

    def read_rows(self, rows: np.ndarray) -> list[np.ndarray]:
        """Token arrays of the given global rows (sorted, unique), in that order."""
        t0 = time.perf_counter()
        rows = np.asarray(rows, np.int64)
        out: list[np.ndarray] = []
        shard_of = np.searchsorted(self.shard_starts, rows, side="right") - 1
        cuts = np.flatnonzero(np.diff(shard_of)) + 1
        parts = [
            (int(shard_of[g[0]]), rows[g] - self.shard_starts[shard_of[g[0]]])
            for g in np.split(np.arange(len(rows)), cuts)
            if len(g)
        ]
        for shard, local_rows in parts:  # announce every read of the step first
            self._announce(shard, local_rows)
        for shard, local_rows in parts:
            out.extend(self._read_shard(shard, local_rows))
        self.stats.rows += len(rows)
        self.stats.token_bytes += sum(int(t.nbytes) for t in out)
        self.stats.seconds += time.perf_counter() - t0
        return out

    def _announce(self, shard: int, local_rows: np.ndarray) -> None:
        """Tell the OS which rows will be read next (optional)."""

    def _read_shard(self, shard: int, local_rows: np.ndarray) -> list[np.ndarray]:
        raise NotImplementedError

    def close(self) -> None:
        """Release files (and shared memory for the StreamingDataset access)."""


def _groups(begin: np.ndarray, end: np.ndarray) -> list[tuple[int, int]]:
    """Index ranges [i, j) of runs of back-to-back byte ranges (ascending)."""
    cut = (np.flatnonzero(begin[1:] != end[:-1]) + 1).tolist()
    return list(zip([0, *cut], [*cut, len(begin)], strict=True))


def _willneed(fd: int, begin: np.ndarray, end: np.ndarray) -> None:
    """POSIX_FADV_WILLNEED for each run: the kernel starts all reads at once, in parallel (a
    no-op for cached pages). Measured: 2.7x on cold files; merging reads across gaps instead was
    worse and would break the one-chunk-per-piece-end bound (benchmarks/RESULTS.md, stream section)."""
    if hasattr(os, "posix_fadvise") and len(begin) > 1:
        b, e = begin.tolist(), end.tolist()
        for i, j in _groups(begin, end):
            os.posix_fadvise(fd, b[i], e[j - 1] - b[i], os.POSIX_FADV_WILLNEED)


def _read_ranges(fd: int, begin: np.ndarray, end: np.ndarray, stats: ReadStats) -> list:
    """Bytes [begin[k], end[k]) of each row (ascending), one pread per run of back-to-back rows.
    Returns memoryviews."""
    b, e = begin.tolist(), end.tolist()
    out = []
    for i, j in _groups(begin, end):
        base = b[i]
        data = memoryview(os.pread(fd, e[j - 1] - base, base))
        stats.bytes += len(data)
        out.extend(data[b[k] - base : e[k] - base] for k in range(i, j))
    return out


class MDSRowReader(RowReader):
    """MDS rows through the library's MDSReader: offset table + pread, decode_sample."""

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
        _willneed(fd, offs[local_rows], offs[local_rows + 1])

    def _read_shard(self, shard: int, local_rows: np.ndarray) -> list[np.ndarray]:
        fd, offs = self._open(shard)
        decode = self.readers[shard].decode_sample
        raw = _read_ranges(fd, offs[local_rows], offs[local_rows + 1], self.stats)
        return [decode(d)["tokens"] for d in raw]

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()


class MDSDatasetRowReader(RowReader):
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
        out = [self.ds.get_item(int(r))["tokens"] for r in np.asarray(rows, np.int64)]
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


class WDSRowReader(RowReader):
    """webdataset tar rows: member offsets from one header scan per shard, then pread."""

    def __init__(self, local: str, remote: str | None, manifest: dict) -> None:
        super().__init__(local, remote, manifest)
        self._shards: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}

    def _open(self, shard: int) -> tuple[int, np.ndarray, np.ndarray]:
        if shard not in self._shards:
            path = self.shard_path(shard)
            offs, sizes = [], []
            with tarfile.open(path, "r:") as tf:
                for m in tf:
                    if m.isfile() and m.name.endswith(".tokens.npy"):
                        offs.append(m.offset_data)
                        sizes.append(m.size)
            want = int(self.shard_starts[shard + 1] - self.shard_starts[shard])
            if len(offs) != want:
                raise InputError(f"{path}: {len(offs)} .tokens.npy members, manifest says {want}")
            self.stats.index_bytes += 512 * len(offs)
            fd = os.open(path, os.O_RDONLY)
            self._shards[shard] = (fd, np.asarray(offs, np.int64), np.asarray(sizes, np.int64))
        return self._shards[shard]

    def _announce(self, shard: int, local_rows: np.ndarray) -> None:
        fd, offs, sizes = self._open(shard)
        _willneed(fd, offs[local_rows], offs[local_rows] + sizes[local_rows])

    def _read_shard(self, shard: int, local_rows: np.ndarray) -> list[np.ndarray]:
        fd, offs, sizes = self._open(shard)
        begin = offs[local_rows]
        raw = _read_ranges(fd, begin, begin + sizes[local_rows], self.stats)
        return [np.load(io.BytesIO(d), allow_pickle=False) for d in raw]

    def close(self) -> None:
        for fd, _, _ in self._shards.values():
            os.close(fd)
        self._shards.clear()


class ParquetRowReader(RowReader):
    """Parquet rows: read the row groups that hold them."""

    def __init__(self, local: str, remote: str | None, manifest: dict) -> None:
        super().__init__(local, remote, manifest)
        self._files: dict[int, tuple[Any, np.ndarray]] = {}

    def _open(self, shard: int) -> tuple[Any, np.ndarray]:
        if shard not in self._files:
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(self.shard_path(shard))
            md = pf.metadata
            starts = np.zeros(md.num_row_groups + 1, np.int64)
            np.cumsum([md.row_group(g).num_rows for g in range(md.num_row_groups)], out=starts[1:])
            self._files[shard] = (pf, starts)
        return self._files[shard]

    def _read_shard(self, shard: int, local_rows: np.ndarray) -> list[np.ndarray]:
        pf, starts = self._open(shard)
        group_of = np.searchsorted(starts, local_rows, side="right") - 1
        out = []
        for g in np.unique(group_of):
            table = pf.read_row_group(int(g), columns=["tokens"])
            rg = pf.metadata.row_group(int(g))
            self.stats.bytes += sum(
                rg.column(c).total_compressed_size
                for c in range(rg.num_columns)
                if rg.column(c).path_in_schema.startswith("tokens")
            )
            lists = table.column("tokens").combine_chunks()
            values = lists.values.to_numpy(zero_copy_only=False)
            offsets = lists.offsets.to_numpy()
            for r in local_rows[group_of == g] - starts[g]:
                out.append(values[offsets[r] : offsets[r + 1]])
        return out


# ----------------------------------------------------------------------------- fetcher


@dataclass
class FetchConfig:
    """Configuration of a :class:`Fetcher`."""

    path: str  # dataset directory or remote URI (as StreamConfig.path)
    cache_dir: str | None = None  # local copy of a remote dataset (one per process)
    mds_access: str = "reader"  # "reader" (MDSReader + pread) | "dataset" (StreamingDataset[i])
    prefetch_depth: int = 1  # steps fetched ahead by Prefetcher

    def build(self) -> Fetcher:
        """Read the index and open the format's reader."""
        if self.mds_access not in MDS_ACCESS:
            raise ConfigError(
                f"fetch.mds_access must be one of {MDS_ACCESS}, got {self.mds_access!r}"
            )
        if self.prefetch_depth < 1:
            raise ConfigError(f"fetch.prefetch_depth must be >= 1, got {self.prefetch_depth}")
        local, remote = resolve_dataset(self.path, self.cache_dir)
        index = load_index(local)
        fmt = index.manifest["format"]
        if fmt == "mds" and self.mds_access == "dataset":
            reader: RowReader = MDSDatasetRowReader(local, remote, index.manifest, self.cache_dir)
        elif fmt == "mds":
            reader = MDSRowReader(local, remote, index.manifest)
        elif fmt == "wds":
            reader = WDSRowReader(local, remote, index.manifest)
        elif fmt == "parquet":
            reader = ParquetRowReader(local, remote, index.manifest)
        else:
            raise InputError(f"{local}/manifest.json: unknown format {fmt!r}")
        return Fetcher(self, index, reader)


@dataclass
class Fetcher:
    """Reads pieces' tokens and packs micro-batches; `fetch_step` does one read per step."""

    config: FetchConfig
    index: Any  # datapipe.index.DatasetIndex
    reader: RowReader
    lengths: np.ndarray = field(init=False)
    global_first_row: np.ndarray = field(init=False)
    chunk: int = field(init=False)

    def __post_init__(self) -> None:
        self.lengths = np.asarray(self.index.num_tokens, np.int64)
        self.global_first_row = np.asarray(self.index.global_first_row, np.int64)
        self.chunk = int(self.index.manifest["chunk_tokens"])

    def _check(self, pieces: np.ndarray) -> None:
        s, a, b = pieces[:, 0], pieces[:, 1], pieces[:, 2]
        bad = (s < 0) | (s >= len(self.lengths))
        if bad.any():
            raise ValueError(f"piece {pieces[bad][0].tolist()}: sample id outside the dataset")
        bad = (a < 0) | (b <= a) | (b > self.lengths[s])
        if bad.any():
            p = pieces[bad][0]
            raise ValueError(f"piece {p.tolist()}: needs 0 <= start < end <= {self.lengths[p[0]]}")

    def _check_rows(self, pieces, j0, count, rows, uniq, row_len) -> None:
        """Storage rows must hold min(C, L - j*C) tokens (FORMAT.md); else the data is corrupt."""
        piece_of = np.repeat(np.arange(len(pieces)), count)
        offs = np.zeros(len(pieces) + 1, np.int64)
        np.cumsum(count, out=offs[1:])
        j = np.arange(len(rows), dtype=np.int64) - offs[piece_of] + j0[piece_of]
        want = np.minimum(self.chunk, self.lengths[pieces[piece_of, 0]] - j * self.chunk)
        got = row_len[np.searchsorted(uniq, rows)]
        bad = np.flatnonzero(got != want)
        if bad.size:
            k = int(bad[0])
            raise InputError(
                f"{self.index.root}: global row {int(rows[k])} (sample {int(pieces[piece_of[k], 0])}, "
                f"chunk {int(j[k])}) holds {int(got[k])} tokens, the index implies {int(want[k])}"
            )

    def fetch_step(self, microbatches: Sequence[Any]) -> list[MicroBatch]:
        """Micro-batches for a list of piece arrays ([P, 3] each); rows shared are read once."""
        plist = [as_pieces(p) for p in microbatches]
        allp = np.concatenate(plist) if plist else np.zeros((0, 3), np.int64)
        self._check(allp)
        rows, j0, count = rows_of_pieces(allp, self.lengths, self.global_first_row, self.chunk)
        uniq = np.unique(rows)
        tokens = self.reader.read_rows(uniq)
        flat = np.concatenate(tokens) if tokens else np.zeros(0, self.reader.dtype)
        row_len = np.fromiter((len(t) for t in tokens), np.int64, len(tokens))
        self._check_rows(allp, j0, count, rows, uniq, row_len)
        row_off = np.zeros(len(tokens) + 1, np.int64)
        np.cumsum(row_len, out=row_off[1:])
        # a piece's rows are consecutive global rows, hence adjacent in `uniq`: its span is
        # contiguous in `flat`, starting inside its first row
        first = np.searchsorted(uniq, self.global_first_row[allp[:, 0]] + j0)
        span_start = row_off[first] + allp[:, 1] - j0 * self.chunk
        out, p0 = [], 0
        for p in plist:
            p1 = p0 + len(p)
            out.append(pack_microbatch(p, self.lengths, flat, span_start[p0:p1]))
            p0 = p1
        return out

    def fetch(self, pieces: Any) -> MicroBatch:
        """One micro-batch."""
        return self.fetch_step([pieces])[0]

    def prefetch(self, steps: Iterable[tuple[Any, Sequence[Any]]]) -> Prefetcher:
        """Background fetch of `(key, microbatch pieces)` steps; see :class:`Prefetcher`."""
        return Prefetcher(self, steps, self.config.prefetch_depth)

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> Fetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_END = object()


class Prefetcher:
    """Fetches step t+1 (up to `depth` steps ahead) in a thread while step t computes.

    Iterating yields ``(key, list[MicroBatch])``; ``key`` is passed through untouched (e.g. the
    stream state to checkpoint with the step, since the producer runs ahead of the consumer).
    ``last_wait_s``/``total_wait_s`` is the time the consumer spent waiting for data.
    """

    def __init__(
        self, fetcher: Fetcher, steps: Iterable[tuple[Any, Sequence[Any]]], depth: int = 1
    ):
        self.fetcher = fetcher
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self.last_wait_s = 0.0
        self.total_wait_s = 0.0
        self.steps = 0
        self._thread = threading.Thread(target=self._work, args=(iter(steps),), daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, steps: Iterator[tuple[Any, Sequence[Any]]]) -> None:
        try:
            for key, mbs in steps:
                if self._stop.is_set() or not self._put((key, self.fetcher.fetch_step(mbs))):
                    return
            self._put(_END)
        except BaseException as exc:  # handed to the consumer
            self._put(exc)

    def __iter__(self) -> Iterator[tuple[Any, list[MicroBatch]]]:
        return self

    def __next__(self) -> tuple[Any, list[MicroBatch]]:
        t0 = time.perf_counter()
        item = self._q.get()
        self.last_wait_s = time.perf_counter() - t0
        self.total_wait_s += self.last_wait_s
        if item is _END:
            self._q.put(_END)
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        self.steps += 1
        return item

    def close(self) -> None:
        """Stop the worker (it finishes the step it is fetching) and wait for it."""
        self._stop.set()
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=30)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
