"""Shard writers for the three storage formats (see docs/FORMAT.md).

Every writer stores a sample as consecutive rows of at most ``chunk_tokens`` tokens and reports,
for each sample, the shard and row where its first chunk went.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field

import numpy as np
import xxhash

FORMATS = ("mds", "wds", "parquet")


def checksum_file(path: str) -> str:
    """Hex XXH3-64 of a file's bytes (the manifest's per-shard checksum: fast, not cryptographic)."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


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
    """Base writer: rows out, per-sample (shard, first_row) in."""

    root: str
    dtype: np.dtype
    chunk_tokens: int
    shard_bytes: int
    shards: list[ShardInfo] = field(default_factory=list)
    sample_shard: list[int] = field(default_factory=list)
    sample_first_row: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        pass

    def write(self, sample_id: int, tokens: np.ndarray) -> None:
        """Store one sample as its chunk rows."""
        raise NotImplementedError

    def finish(self) -> list[ShardInfo]:
        """Close the last shard; return all shards with sizes and checksums."""
        raise NotImplementedError

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


class MDSShardWriter(ShardWriter):
    """mosaicml-streaming MDS shards through `MDSWriter`; MDS picks shard boundaries itself, so a
    long sample's rows may continue into the next shard (readers use the global row)."""

    def __init__(self, root: str, dtype: np.dtype, chunk_tokens: int, shard_bytes: int) -> None:
        super().__init__(root, dtype, chunk_tokens, shard_bytes)
        from streaming import MDSWriter

        columns = {"sample_id": "int64", "chunk": "int32", "tokens": f"ndarray:{self.dtype.name}"}
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
            self._w.write({"sample_id": sample_id, "chunk": j, "tokens": row})
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


class _OwnShardWriter(ShardWriter):
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

    def _write_rows(self, sample_id: int, rows: list[np.ndarray]) -> int:
        raise NotImplementedError

    def _name(self, i: int) -> str:
        return f"shard-{i:05d}{self.suffix}"

    def write(self, sample_id: int, tokens: np.ndarray) -> None:
        rows = self._rows(tokens)
        est = int(tokens.nbytes) + 512 * len(rows)
        if self._is_open and self._open_bytes and self._open_bytes + est > self.shard_bytes:
            self._roll()
        if not self._is_open:
            self._open(self._name(len(self.shards)))
            self._is_open = True
            self._open_first = sample_id
        self.sample_shard.append(len(self.shards))
        self.sample_first_row.append(self._open_rows)
        self._open_bytes += self._write_rows(sample_id, rows)
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


class WDSShardWriter(_OwnShardWriter):
    """webdataset tar shards: one `.tokens.npy` member per row, mtime 0 (no PAX headers)."""

    suffix = ".tar"

    def _open(self, name: str) -> None:
        from webdataset import TarWriter

        self._f = open(os.path.join(self.root, name), "wb")
        self._tar = TarWriter(self._f, encoder=False, mtime=0)

    def _close(self) -> None:
        self._tar.close()
        self._f.close()

    def _write_rows(self, sample_id: int, rows: list[np.ndarray]) -> int:
        total = 0
        for j, row in enumerate(rows):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(row), allow_pickle=False)
            data = buf.getvalue()
            self._tar.write({"__key__": f"s{sample_id:010d}_c{j:06d}", "tokens.npy": data})
            total += 512 + -(-len(data) // 512) * 512
        return total


class ParquetShardWriter(_OwnShardWriter):
    """Parquet shards; a row group closes once it holds `chunk_tokens` tokens, so a reader that
    needs one row reads at most about one storage chunk of other rows."""

    suffix = ".parquet"

    def __post_init__(self) -> None:
        super().__post_init__()
        import pyarrow as pa

        self._pa = pa
        self._schema = pa.schema(
            [
                ("sample_id", pa.int64()),
                ("chunk", pa.int32()),
                ("tokens", pa.list_(pa.from_numpy_dtype(self.dtype))),
            ]
        )
        self._pending: list[tuple[int, int, np.ndarray]] = []
        self._pending_tokens = 0

    def _open(self, name: str) -> None:
        import pyarrow.parquet as pq

        self._pq = pq.ParquetWriter(
            os.path.join(self.root, name), self._schema, compression="none", write_statistics=False
        )

    def _flush_group(self) -> None:
        if not self._pending:
            return
        pa = self._pa
        lens = np.array([len(t) for _, _, t in self._pending], dtype=np.int32)
        offsets = np.zeros(len(lens) + 1, dtype=np.int32)
        np.cumsum(lens, out=offsets[1:])
        values = np.concatenate([t for _, _, t in self._pending]).astype(self.dtype, copy=False)
        table = pa.Table.from_arrays(
            [
                pa.array([s for s, _, _ in self._pending], pa.int64()),
                pa.array([c for _, c, _ in self._pending], pa.int32()),
                pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
            ],
            schema=self._schema,
        )
        self._pq.write_table(table, row_group_size=len(self._pending))
        self._pending = []
        self._pending_tokens = 0

    def _close(self) -> None:
        self._flush_group()
        self._pq.close()

    def _write_rows(self, sample_id: int, rows: list[np.ndarray]) -> int:
        for j, row in enumerate(rows):
            if self._pending and self._pending_tokens + len(row) > self.chunk_tokens:
                self._flush_group()
            self._pending.append((sample_id, j, row))
            self._pending_tokens += len(row)
        return sum(int(r.nbytes) + 16 for r in rows)


def build_writer(
    fmt: str, root: str, dtype: np.dtype, chunk_tokens: int, shard_bytes: int
) -> ShardWriter:
    """The shard writer for `fmt` (mds, wds or parquet) writing into `root`."""
    cls = {"mds": MDSShardWriter, "wds": WDSShardWriter, "parquet": ParquetShardWriter}.get(fmt)
    if cls is None:
        raise ValueError(f"unknown format {fmt!r}: expected one of {', '.join(FORMATS)}")
    return cls(root, np.dtype(dtype), chunk_tokens, shard_bytes)
