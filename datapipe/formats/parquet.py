"""Parquet shards: columns (sample_id, chunk, tokens: list of the token dtype; with a loss mask,
trained_spans: binary, each row's uint32 pairs little-endian), uncompressed. The
writer closes a row group once it holds `chunk_tokens` tokens, so a reader that needs one row reads
at most about one storage chunk of other rows (`ParquetFile.read_row_group`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np

from datapipe.errors import InputError
from datapipe.formats.base import (
    SPAN_DTYPE,
    TOKENS,
    TRAINED,
    OwnShardWriter,
    RowReader,
    take_ranges,
)


def shard_schema(dtype: np.dtype, masks: bool) -> Any:
    """A shard's columns: sample_id, chunk, tokens (a list of the token dtype) and, with a loss
    mask, TRAINED (a row's uint32 pairs, little-endian, as bytes)."""
    import pyarrow as pa

    fields = [
        ("sample_id", pa.int64()),
        ("chunk", pa.int32()),
        (TOKENS, pa.list_(pa.from_numpy_dtype(dtype))),
    ]
    if masks:
        fields.append((TRAINED, pa.binary()))
    return pa.schema(fields)


def check_schema(path: str, got: Any, want: Any) -> None:
    """InputError naming the shard and the column that is missing or of another type (a list
    column's item may have any name: other writers call it `element`)."""
    for field in want:
        if field.name not in got.names:
            raise InputError(f"{path}: no column {field.name!r} (expected {_type(field.type)})")
        have = got.field(field.name).type
        if _type(have) != _type(field.type):
            raise InputError(
                f"{path}: column {field.name!r} is {_type(have)}, expected {_type(field.type)}"
            )


def _type(t: Any) -> str:
    """An Arrow type as a short name: list<uint16>, int64, binary."""
    import pyarrow as pa

    return f"list<{t.value_type}>" if pa.types.is_list(t) else str(t)


class Writer(OwnShardWriter):
    """Parquet shards; a row group closes once it holds `chunk_tokens` tokens, so a reader that
    needs one row reads at most about one storage chunk of other rows."""

    suffix = ".parquet"

    def __post_init__(self) -> None:
        super().__post_init__()
        import pyarrow as pa

        self._pa = pa
        self._schema = shard_schema(self.dtype, self.masks)
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
            spans = [
                np.asarray(x, SPAN_DTYPE.newbyteorder("<")).tobytes() for x in self._pending_spans
            ]
            columns.append(pa.array(spans, pa.binary()))
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


class Reader(RowReader):
    """Parquet rows: read the row groups that hold them."""

    def __init__(self, local: str, remote: str | None, manifest: dict) -> None:
        super().__init__(local, remote, manifest)
        self._files: dict[int, tuple[Any, np.ndarray]] = {}
        self._bytes: dict[tuple, np.ndarray] = {}

    def _open(self, shard: int) -> tuple[Any, np.ndarray]:
        if shard not in self._files:
            import pyarrow.parquet as pq

            path = self.shard_path(shard)
            pf = pq.ParquetFile(path)
            check_schema(path, pf.schema_arrow, shard_schema(self.dtype, self.masked))
            md = pf.metadata
            want = int(self.shard_starts[shard + 1] - self.shard_starts[shard])
            if md.num_rows != want:
                raise InputError(f"{path}: {md.num_rows} rows, manifest.json says {want}")
            starts = np.zeros(md.num_row_groups + 1, np.int64)
            np.cumsum([md.row_group(g).num_rows for g in range(md.num_row_groups)], out=starts[1:])
            self._files[shard] = (pf, starts)
        return self._files[shard]

    def _group_bytes(self, shard: int, names: tuple[str, ...]) -> np.ndarray:
        """Bytes of the columns `names` in each row group of a shard (from the metadata, once)."""
        key = (shard, names)
        if key not in self._bytes:
            md = self._open(shard)[0].metadata
            self._bytes[key] = np.array(
                [
                    sum(
                        rg.column(c).total_compressed_size
                        for c in range(rg.num_columns)
                        if rg.column(c).path_in_schema.split(".")[0] in names
                    )
                    for rg in (md.row_group(g) for g in range(md.num_row_groups))
                ],
                np.int64,
            )
        return self._bytes[key]

    def _read_shard(self, shard: int, local_rows: np.ndarray) -> list[np.ndarray]:
        values, offsets = self._read_columns(shard, local_rows, (TOKENS,))[0]
        return [values[offsets[k] : offsets[k + 1]] for k in range(len(local_rows))]

    def _read_shard_flat(self, shard: int, local_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        values, offsets = self._read_columns(shard, local_rows, (TOKENS,))[0]
        return values, np.diff(offsets)

    def _read_shard_masked(self, shard: int, local_rows: np.ndarray) -> tuple:
        (toks, t_off), (spans, s_off) = self._read_columns(shard, local_rows, (TOKENS, TRAINED))
        return toks, np.diff(t_off), spans.astype(SPAN_DTYPE, copy=False), np.diff(s_off)

    def _read_columns(
        self, shard: int, local_rows: np.ndarray, names: tuple[str, ...]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """The given columns of the rows (tokens, a list column; TRAINED, binary), read by row
        group: per column, the rows' values back to back and their offsets (len(local_rows) +
        1), gathered without a loop per row."""
        pf, starts = self._open(shard)
        group_of = np.searchsorted(starts, local_rows, side="right") - 1
        groups, where = np.unique(group_of, return_inverse=True)
        # every row group the rows are in, read in one call; a row's place in the table read
        sizes = starts[groups + 1] - starts[groups]
        base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        rows = base[where] + local_rows - starts[group_of]
        table = pf.read_row_groups([int(g) for g in groups], columns=list(names))
        self.stats.bytes += int(self._group_bytes(shard, names)[groups].sum())
        out = []
        for name in names:
            col = table.column(name).combine_chunks()
            if name == TRAINED:  # binary: the bytes of each row's uint32 pairs
                _, off_buf, data = col.buffers()
                offsets = np.frombuffer(off_buf, np.int32)[col.offset :].astype(np.int64) // 4
                values = np.frombuffer(data, "<u4") if data is not None else np.zeros(0, "<u4")
            else:
                values = col.values.to_numpy(zero_copy_only=False)
                offsets = col.offsets.to_numpy().astype(np.int64)
            begin, end = offsets[rows], offsets[rows + 1]
            taken = np.zeros(len(rows) + 1, np.int64)
            np.cumsum(end - begin, out=taken[1:])
            out.append((take_ranges(values, begin, end), taken))
        return out


# ----------------------------------------------------------------------------- fetcher


def open_reader(
    local: str, remote: str | None, manifest: dict, cache_dir: str | None, mds_access: str
) -> RowReader:
    """The parquet row reader."""
    return Reader(local, remote, manifest)
