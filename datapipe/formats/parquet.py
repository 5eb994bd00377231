"""Parquet shards: columns (sample_id, chunk, tokens: list of the token dtype), uncompressed. The
writer closes a row group once it holds `chunk_tokens` tokens, so a reader that needs one row reads
at most about one storage chunk of other rows (`ParquetFile.read_row_group`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np

from datapipe.errors import InputError
from datapipe.formats.base import SPAN_DTYPE, TOKENS, TRAINED, OwnShardWriter, RowReader


class Writer(OwnShardWriter):
    """Parquet shards; a row group closes once it holds `chunk_tokens` tokens, so a reader that
    needs one row reads at most about one storage chunk of other rows."""

    suffix = ".parquet"

    def __post_init__(self) -> None:
        super().__post_init__()
        import pyarrow as pa

        self._pa = pa
        fields = [
            ("sample_id", pa.int64()),
            ("chunk", pa.int32()),
            (TOKENS, pa.list_(pa.from_numpy_dtype(self.dtype))),
        ]
        if self.masks:
            fields.append((TRAINED, pa.list_(pa.from_numpy_dtype(SPAN_DTYPE))))
        self._schema = pa.schema(fields)
        self._pending: list[tuple[int, int, np.ndarray]] = []
        self._pending_spans: list[np.ndarray] = []
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
        columns = [
            pa.array([s for s, _, _ in self._pending], pa.int64()),
            pa.array([c for _, c, _ in self._pending], pa.int32()),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
        ]
        if self.masks:
            columns.append(_list_array(pa, self._pending_spans, SPAN_DTYPE))
        table = pa.Table.from_arrays(columns, schema=self._schema)
        self._pq.write_table(table, row_group_size=len(self._pending))
        self._pending = []
        self._pending_spans = []
        self._pending_tokens = 0

    def _close(self) -> None:
        self._flush_group()
        self._pq.close()

    def _abort(self) -> None:
        with contextlib.suppress(Exception):  # the footer may not fit either
            self._pq.close()

    def _write_rows(
        self, sample_id: int, rows: list[np.ndarray], spans: list[np.ndarray] | None
    ) -> int:
        for j, row in enumerate(rows):
            if self._pending and self._pending_tokens + len(row) > self.chunk_tokens:
                self._flush_group()
            self._pending.append((sample_id, j, row))
            if spans is not None:
                self._pending_spans.append(spans[j])
            self._pending_tokens += len(row)
        if len(rows) > 1:  # rows left pending are views: copy them, not to keep all alive
            self._pending = [(s, j, r.copy() if s == sample_id else r) for s, j, r in self._pending]
        return sum(int(r.nbytes) + 16 for r in rows) + sum(int(x.nbytes) for x in spans or ())


def _list_array(pa, arrays: list[np.ndarray], dtype: np.dtype):
    """A pyarrow list<dtype> array of numpy arrays."""
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


class Reader(RowReader):
    """Parquet rows: read the row groups that hold them."""

    def __init__(self, local: str, remote: str | None, manifest: dict) -> None:
        super().__init__(local, remote, manifest)
        self._files: dict[int, tuple[Any, np.ndarray]] = {}

    def _open(self, shard: int) -> tuple[Any, np.ndarray]:
        if shard not in self._files:
            import pyarrow.parquet as pq

            path = self.shard_path(shard)
            pf = pq.ParquetFile(path)
            md = pf.metadata
            want = int(self.shard_starts[shard + 1] - self.shard_starts[shard])
            if md.num_rows != want:
                raise InputError(f"{path}: {md.num_rows} rows, manifest.json says {want}")
            starts = np.zeros(md.num_row_groups + 1, np.int64)
            np.cumsum([md.row_group(g).num_rows for g in range(md.num_row_groups)], out=starts[1:])
            self._files[shard] = (pf, starts)
        return self._files[shard]

    def _read_shard(self, shard: int, local_rows: np.ndarray) -> list[np.ndarray]:
        return [cols[0] for cols in self._read_columns(shard, local_rows, (TOKENS,))]

    def _read_shard_masked(self, shard: int, local_rows: np.ndarray):
        return [(t, m) for t, m in self._read_columns(shard, local_rows, (TOKENS, TRAINED))]

    def _read_columns(
        self, shard: int, local_rows: np.ndarray, names: tuple[str, ...]
    ) -> list[tuple[np.ndarray, ...]]:
        """The given list columns of the rows, read by row group: per row, one array each."""
        pf, starts = self._open(shard)
        group_of = np.searchsorted(starts, local_rows, side="right") - 1
        out: list[tuple[np.ndarray, ...]] = []
        for g in np.unique(group_of):
            table = pf.read_row_group(int(g), columns=list(names))
            rg = pf.metadata.row_group(int(g))
            self.stats.bytes += sum(
                rg.column(c).total_compressed_size
                for c in range(rg.num_columns)
                if rg.column(c).path_in_schema.split(".")[0] in names
            )
            cols = []
            for name in names:
                lists = table.column(name).combine_chunks()
                cols.append((lists.values.to_numpy(zero_copy_only=False), lists.offsets.to_numpy()))
            for r in local_rows[group_of == g] - starts[g]:
                out.append(tuple(v[o[r] : o[r + 1]] for v, o in cols))
        return out


# ----------------------------------------------------------------------------- fetcher


def open_reader(
    local: str, remote: str | None, manifest: dict, cache_dir: str | None, mds_access: str
) -> RowReader:
    """The parquet row reader."""
    return Reader(local, remote, manifest)
