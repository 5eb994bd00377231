"""MDS (mosaicml-streaming's format, the default): written through `MDSWriter`, read through the
library's own `MDSReader` (offset table + `pread`, `decode_sample`), or, with
``mds_access="dataset"``, through `StreamingDataset` indexing.

MDS picks shard boundaries itself, so a long sample's rows may continue into the next shard (readers
use the global row). The `StreamingDataset` access coordinates the processes of a node through
shared memory and /tmp filelocks; `release_streaming_prefix` removes what one dataset object left
(the library's issues #781, #893).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
import uuid
from collections.abc import Callable

import numpy as np

from datapipe.errors import InputError, MixlenError
from datapipe.files import (
    METADATA_FILE_LIMIT,
    host_tag,
    read_bounded_bytes,
    remove_dead_pid_dirs,
)
from datapipe.formats.base import (
    READ_ERRORS,
    SPAN_DTYPE,
    TOKENS,
    TRAINED,
    RowReader,
    ShardInfo,
    ShardWriter,
    read_ranges,
    read_ranges_into,
    unreadable,
    willneed,
)
from datapipe.formats.mds_direct import decode_rows, decode_rows_masked, token_decoder, verified
from datapipe.index import download

SUFFIX = ".mds"


class Writer(ShardWriter):
    """mosaicml-streaming MDS shards through `MDSWriter`; MDS picks shard boundaries itself, so a
    long sample's rows may continue into the next shard (readers use the global row)."""

    def __init__(
        self, root: str, dtype: np.dtype, chunk_tokens: int, shard_bytes: int, masks: bool = False
    ) -> None:
        super().__init__(root, dtype, chunk_tokens, shard_bytes, masks)
        from streaming import MDSWriter

        columns = {"sample_id": "int64", "chunk": "int32", TOKENS: f"ndarray:{self.dtype.name}"}
        if masks:
            columns[TRAINED] = f"ndarray:{SPAN_DTYPE.name}"
        self._w = MDSWriter(
            out=root, columns=columns, compression=None, size_limit=shard_bytes, hashes=["xxh3_64"]
        )
        self._row = 0
        self._global_first_row: list[int] = []

    @property
    def shards_completed(self) -> int:
        return len(self._w.shards)

    def write(self, sample_id: int, tokens: np.ndarray, spans: np.ndarray | None = None) -> None:
        self._global_first_row.append(self._row)
        rows = self._rows(tokens)
        row_spans = self._row_spans(spans, len(tokens)) if self.masks else [None] * len(rows)
        for j, (row, sp) in enumerate(zip(rows, row_spans)):
            record = {"sample_id": sample_id, "chunk": j, TOKENS: row}
            if sp is not None:
                record[TRAINED] = sp
            self._w.write(record)
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


UNSAFE_ENCODINGS = ("pkl",)  # MDS column encodings that unpickle on decode: never read


def read_mds_index(local: str, remote: str | None, manifest: dict) -> dict:
    """MDS's own index.json (downloaded first for a remote dataset), checked against the
    manifest: the same shards in the same order with the same row counts, no compression, no
    column that would be unpickled when decoded, and the token column (`tokens_field`) an
    ndarray of the manifest's dtype in every shard."""
    path = os.path.join(local, "index.json")
    if remote is not None and not os.path.exists(path):
        download(remote.rstrip("/") + "/index.json", path)
    try:
        raw = read_bounded_bytes(path, METADATA_FILE_LIMIT, "MDS index.json")
    except FileNotFoundError:
        raise InputError(f"{path}: not found (an MDS dataset needs MDS's index.json)") from None
    try:
        obj = json.loads(raw.decode("utf-8"))
        shards = obj["shards"]
        names = [s["raw_data"]["basename"] for s in shards]
        rows = [s["samples"] for s in shards]
        encodings = [e for s in shards for e in s.get("column_encodings", [])]
        columns = [dict(zip(s["column_names"], s["column_encodings"])) for s in shards]
        compressed = any(s.get("compression") for s in shards)
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise InputError(f"{path}: not a valid MDS index ({type(exc).__name__}: {exc})") from None
    if names != [s["name"] for s in manifest["shards"]]:
        raise InputError(f"{path}: shard names or order differ from manifest.json")
    want = [s["rows"] for s in manifest["shards"]]
    if rows != want:
        i = next(k for k, (a, b) in enumerate(zip(rows, want)) if a != b)
        raise InputError(
            f"{path}: shard {names[i]} has {rows[i]} rows, manifest.json says {want[i]}"
        )
    if compressed:
        raise InputError(f"{path}: compressed MDS shards are not supported")
    unsafe = [e for e in encodings if str(e).split(":")[0] in UNSAFE_ENCODINGS]
    if unsafe:
        raise InputError(
            f"{path}: column encoding {unsafe[0]!r} would unpickle data; mixlen never reads "
            "pickled columns"
        )
    field, dtype = tokens_field(manifest), manifest.get("dtype", "uint16")
    for name, cols in zip(names, columns):
        enc = cols.get(field)
        if not (isinstance(enc, str) and enc.split(":")[:2] in (["ndarray"], ["ndarray", dtype])):
            raise InputError(
                f"{path}: shard {name} column {field!r} has encoding {enc!r}; expected "
                f"'ndarray:{dtype}' (manifest.json dtype)"
            )
    return obj


def tokens_field(manifest: dict) -> str:
    """The MDS column holding the token ids (`mixlen index --tokens-field`; mixlen's own:
    tokens)."""
    return manifest.get("tokens_field") or TOKENS


class Reader(RowReader):
    """MDS rows through the library's MDSReader: offset table + pread; the token column decoded
    directly where the shard's layout allows and a first row checked it (datapipe.formats.
    mds_direct), else by `decode_sample`. `direct = False` forces the library's decode."""

    direct = True

    def __init__(self, local: str, remote: str | None, manifest: dict) -> None:
        super().__init__(local, remote, manifest)
        from streaming.base.format import reader_from_json

        obj = read_mds_index(local, remote, manifest)
        self.field = tokens_field(manifest)
        self.readers = [reader_from_json(local, None, s) for s in obj["shards"]]
        self._fds: dict[int, tuple[int, np.ndarray]] = {}
        self._decoders: dict[int, Callable] = {}
        self._spans_ok: dict[int, bool] = {}

    def _open(self, shard: int) -> tuple[int, np.ndarray]:
        if shard not in self._fds:
            fd = os.open(self.shard_path(shard), os.O_RDONLY)
            n = self.readers[shard].samples
            head = os.pread(fd, 4 * (n + 2), 0)
            offsets = np.frombuffer(head, dtype="<u4")[1:].astype(np.int64)
            if len(offsets) != n + 1 or np.any(np.diff(offsets) < 0):
                os.close(fd)
                raise EOFError("the shard's offset table is truncated or corrupt")
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

            def library(data, _decode=rd.decode_sample, _field=self.field):
                # bytes: the library's str/json decoders cannot take a memoryview
                return _decode(bytes(data) if isinstance(data, memoryview) else data)[_field]

            direct = None
            if self.direct and self.field == TOKENS:
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

    def _read_shard_flat(
        self, shard: int, local_rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """A shard whose direct decoder is chosen: all rows read into one buffer and their token
        columns cut out with array operations (mds_direct.decode_rows); else None."""
        layout = getattr(self._decoders.get(shard), "layout", None)
        if layout is None or not len(local_rows):
            return None  # not yet chosen (the first read chooses it) or the library decodes
        fd, offs = self._open(shard)
        begin, end = offs[local_rows], offs[local_rows + 1]
        buf, starts = read_ranges_into(fd, begin, end, self.stats)
        got = decode_rows(layout, buf, starts, starts + (end - begin))
        if got is None:  # a row that is not 1-D: the per-row path decides
            sizes = (end - begin).tolist()
            rows = [memoryview(buf)[a : a + n] for a, n in zip(starts.tolist(), sizes)]
            arrays = [self._decoders[shard](r) for r in rows]
            return np.concatenate(arrays), np.fromiter(map(len, arrays), np.int64, len(arrays))
        return got

    def _read_shard_masked(self, shard: int, local_rows: np.ndarray):
        """(tokens, TRAINED) per row through the library, or all rows flat where the direct
        layout with spans is chosen (mds_direct.decode_rows_masked)."""
        fd, offs = self._open(shard)
        begin, end = offs[local_rows], offs[local_rows + 1]
        if not len(local_rows):
            return []
        if shard not in self._decoders:  # the first read chooses the token decoder
            self._decoder(shard, read_ranges(fd, begin[:1], end[:1], self.stats)[0])
        layout = getattr(self._decoders[shard], "layout", None)
        decode = self.readers[shard].decode_sample
        if layout is not None and layout.spans and self._spans_direct(shard, layout, fd, offs):
            buf, starts = read_ranges_into(fd, begin, end, self.stats)
            got = decode_rows_masked(layout, buf, starts, starts + (end - begin))
            if got is not None:
                return got
        out = []
        for d in read_ranges(fd, begin, end, self.stats):
            row = decode(d)
            out.append((row[self.field], np.asarray(row[TRAINED], SPAN_DTYPE)))
        return out

    def _spans_direct(self, shard: int, layout, fd: int, offs: np.ndarray) -> bool:
        """Whether the direct decode of the shard's first row's spans equals the library's
        (checked once per shard, as `verified` checks the tokens)."""
        if shard not in self._spans_ok:
            raw = read_ranges(fd, offs[:1], offs[1:2], self.stats)[0]
            buf = np.frombuffer(raw, np.uint8)
            got = decode_rows_masked(layout, buf, np.zeros(1, np.int64), np.array([len(buf)]))
            want = np.asarray(self.readers[shard].decode_sample(raw)[TRAINED], SPAN_DTYPE)
            self._spans_ok[shard] = got is not None and np.array_equal(got[2], want)
        return self._spans_ok[shard]

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

        read_mds_index(local, remote, manifest)
        self.field = tokens_field(manifest)
        clean_stale_streaming()  # leftovers of killed runs (streaming issues #781, #893)
        if remote is None:
            ds_local, ds_remote = local, None
        else:  # a unique local directory per dataset object: no sharing of cache state
            base = cache_dir or tempfile.gettempdir()
            mine = f"mds-{host_tag()}-"
            remove_dead_pid_dirs(base, mine)  # a killed reader's: close() never ran
            ds_local = os.path.join(base, f"{mine}{os.getpid()}-{uuid.uuid4().hex[:8]}")
            ds_remote = remote
        self._own_local = ds_local if remote is not None else None
        self.ds = StreamingDataset(remote=ds_remote, local=ds_local, batch_size=1, shuffle=False)
        self._prefix = int(self.ds._shm_prefix_int)
        if int(self.ds.num_samples) != int(self.shard_starts[-1]):
            raise InputError(
                f"{local}: StreamingDataset has {self.ds.num_samples} rows, "
                f"manifest.json {int(self.shard_starts[-1])}"
            )

    def _item(self, row: int) -> dict:
        """The library's sample `row`; a shard it cannot decode is named (`verify = false`)."""
        try:
            return self.ds.get_item(row)
        except MixlenError:
            raise
        except READ_ERRORS as exc:
            name = self.shard_names[self.shard_of_row(row)]
            raise unreadable(os.path.join(self._own_local or self.local, name), exc) from None

    def read_rows(self, rows: np.ndarray) -> list[np.ndarray]:
        t0 = time.perf_counter()
        rows = np.asarray(rows, np.int64)
        shards = np.unique(np.searchsorted(self.shard_starts, rows, side="right") - 1).tolist()
        if self.remote is None:  # verified before the library reads them
            for shard in shards:
                self.shard_path(shard)
        out = [self._item(int(r))[self.field] for r in rows]
        if self._own_local is not None:  # downloaded by the library: verified before use
            for shard in shards:
                self.verify_shard(shard, os.path.join(self._own_local, self.shard_names[shard]))
        nbytes = sum(int(t.nbytes) for t in out)
        self.stats.rows += len(out)
        self.stats.token_bytes += nbytes
        self.stats.bytes += nbytes  # the dataset hides file reads; payload only
        self.stats.seconds += time.perf_counter() - t0
        return out

    def read_rows_masked(
        self, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`RowReader.read_rows_masked` through the dataset's items."""
        rows = np.asarray(rows, np.int64)
        tokens = self.read_rows(rows)
        spans = [np.asarray(self._item(int(r))[TRAINED], SPAN_DTYPE) for r in rows]
        lens = np.fromiter(map(len, tokens), np.int64, len(tokens))
        flat = np.concatenate(tokens) if tokens else np.zeros(0, self.dtype)
        flat_spans = np.concatenate(spans) if spans else np.zeros(0, SPAN_DTYPE)
        return flat, lens, flat_spans, np.fromiter(map(len, spans), np.int64, len(spans))

    def close(self) -> None:
        """Drop the dataset and unlink its own shared memory and filelocks (not other jobs')."""
        if getattr(self, "ds", None) is None:
            return
        self.ds = None
        release_streaming_prefix(self._prefix)
        if self._own_local is not None:
            import shutil

            shutil.rmtree(self._own_local, ignore_errors=True)


_SHM_NAME = re.compile(r"^(\d{6})_([a-z_]+)$")
_LOCK_NAME = re.compile(r"^(\d{6})_(barrier|cache)_filelock$")
STALE_LOCK_AGE_S = 60.0  # a filelock without shared memory older than this is a dead run's


def _mapped_shm_inodes() -> set[int] | None:
    """Inodes of /dev/shm files that some live process has mapped (from /proc/*/maps), or None
    where /proc cannot tell (not Linux). By inode, not name: a process may still map a segment
    that was unlinked and whose name a new segment now has."""
    if not os.path.isfile("/proc/self/maps"):
        return None
    used: set[int] = set()
    pattern = re.compile(rb"^\S+ \S+ \S+ \S+ (\d+) +/dev/shm/", re.MULTILINE)
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/maps", "rb") as f:
                    used.update(int(i) for i in pattern.findall(f.read()))
            except OSError:  # gone meanwhile, or not ours to read
                continue
    return used


def clean_stale_streaming() -> list[str]:
    """Remove the StreamingDataset shared memory and /tmp filelocks that dead processes left (the
    library leaves them after a crash: its issues #781, #893). A prefix is dead when no live
    process maps any of its segments; its filelocks go with it, as do filelocks of prefixes that
    have no segment at all once they are STALE_LOCK_AGE_S old (a stale one there would also stop
    the library's own `clean_stale_shared_memory`, which gives up at the first empty prefix).
    Unlike that function it never unlinks a live job's memory. Returns the names removed."""
    from streaming.base.constant import SHM_TO_CLEAN

    used = _mapped_shm_inodes()
    if used is None or not os.path.isdir("/dev/shm"):
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        return []
    segments: dict[str, list[str]] = {}
    live: set[str] = set()
    for name in os.listdir("/dev/shm"):
        m = _SHM_NAME.match(name)
        if m and m.group(2) in SHM_TO_CLEAN:
            segments.setdefault(m.group(1), []).append(name)
            with contextlib.suppress(OSError):
                if os.stat(os.path.join("/dev/shm", name)).st_ino in used:
                    live.add(m.group(1))
    removed: list[str] = []
    tmp = tempfile.gettempdir()
    for prefix, names in segments.items():
        if prefix not in live:
            for name in names:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", name))
                    removed.append(name)
    now = time.time()
    for name in os.listdir(tmp):
        m = _LOCK_NAME.match(name)
        if not m or m.group(1) in live:
            continue
        path = os.path.join(tmp, name)
        with contextlib.suppress(OSError):
            if m.group(1) in segments or now - os.path.getmtime(path) > STALE_LOCK_AGE_S:
                os.unlink(path)
                removed.append(name)
    return removed


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
