"""Direct decoding of the token column of MDS rows: one `np.frombuffer` at the column's offset
instead of `MDSReader.decode_sample` (three `mds_decode` calls and a dict per row, about 2/3 of the
fetch's warm time: benchmarks/RESULTS.md, stream section).

An MDS row (mosaicml-streaming's format) is ``[u32 size of each variable-size column, in column
order][each column's bytes, in column order]``. An ``ndarray:<dtype>`` column with a dynamic shape
is ``[ndim << 2 | shape dtype code (1 byte)][shape: ndim x 2**code bytes][values]``. When the token
column is the first variable-size column and has that encoding with the dataset's dtype (mixlen's
writer: ``chunk`` int32, ``sample_id`` int64, ``tokens``, and with a loss mask ``trained_spans``
after it), its values start at a fixed offset plus the shape header and its size is the row's
first u32; a ``trained_spans`` column (``ndarray:uint32``) that ends the row right after the tokens
is cut out the same way. The reader checks this layout from the shard's column table, then once per
shard compares the direct decode of a row with the library's before using it; a shard that fails
either check, and any row that is not 1-D, is decoded by the library.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from datapipe.formats.base import SPAN_DTYPE, TOKENS, TRAINED
from datapipe.jit import njit

Decoder = Callable[[bytes | memoryview], np.ndarray]


class TokenLayout(NamedTuple):
    """Where the token column sits in a row: its offset (after the u32 sizes and the fixed columns
    before it), whether it is the last column, its dtype, and whether a TRAINED column follows it
    and ends the row."""

    off: int
    last: bool
    dtype: np.dtype
    spans: bool = False


def token_layout(
    column_names: Sequence[str],
    column_encodings: Sequence[str],
    column_sizes: Sequence[int | None],
    dtype: np.dtype,
) -> TokenLayout | None:
    """The token column's layout in rows of these columns, or None when it is not the one the
    module docstring describes."""
    names = list(column_names)
    if TOKENS not in names or len(column_encodings) != len(names) != len(column_sizes):
        return None
    i = names.index(TOKENS)
    if column_encodings[i] != f"ndarray:{np.dtype(dtype).name}":
        return None
    variable = [j for j, size in enumerate(column_sizes) if not size]
    spans = (
        variable == [i, i + 1]
        and i + 1 == len(names) - 1
        and names[i + 1] == TRAINED
        and column_encodings[i + 1] == f"ndarray:{SPAN_DTYPE.name}"
    )
    if variable != [i] and not spans:
        return None
    # one u32 size per variable-size column, then the fixed columns before the tokens
    off = 4 * len(variable) + sum(int(s) for s in column_sizes[:i])
    return TokenLayout(off, i == len(names) - 1, np.dtype(dtype), spans)


def token_decoder(
    column_names: Sequence[str],
    column_encodings: Sequence[str],
    column_sizes: Sequence[int | None],
    dtype: np.dtype,
    library: Decoder,
) -> Decoder | None:
    """A direct decoder of the token column for rows of this column layout, or None when the
    layout is not the one described above. `library` decodes rows it cannot (not 1-D)."""
    layout = token_layout(column_names, column_encodings, column_sizes, dtype)
    if layout is None:
        return None
    off, last, dt, _ = layout
    item = dt.itemsize

    def decode(data: bytes | memoryview) -> np.ndarray:
        code = data[off]
        if code >> 2 != 1:  # not 1-D: whatever the library makes of it
            return library(data)
        start = off + 1 + (1 << (code & 3))
        if last:
            return np.frombuffer(data, dt, offset=start)
        size = int.from_bytes(data[0:4], "little")  # the token column's bytes
        return np.frombuffer(data, dt, count=(size - (start - off)) // item, offset=start)

    decode.layout = layout  # type: ignore[attr-defined]
    return decode


def decode_rows(
    layout: TokenLayout, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """The token columns of rows buf[starts[i]:ends[i]] (uint8 buffer) back to back, and each
    row's token count, in a few array operations; None if some row is not 1-D (decode those one
    by one)."""
    starts = np.asarray(starts, np.int64)
    ends = np.asarray(ends, np.int64)
    code = buf[starts + layout.off].astype(np.int64)
    if ((code >> 2) != 1).any():
        return None
    first = starts + layout.off + 1 + (1 << (code & 3))
    if layout.last:
        stop = ends
    else:  # the token column's size is the row's leading u32
        stop = starts + layout.off + _u32(buf, starts)
    nbytes = stop - first
    item = layout.dtype.itemsize
    out = np.empty(int(nbytes.sum()), np.uint8)
    _copy_ranges(buf, first, nbytes, out)
    return out.view(layout.dtype), nbytes // item


def decode_rows_masked(
    layout: TokenLayout, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """`decode_rows` of rows whose TRAINED column follows the tokens (``layout.spans``), plus
    their spans: (tokens, token count per row, TRAINED values, value count per row); None if
    some row's columns are not 1-D. One pass of a numba kernel over the rows."""
    assert layout.spans
    starts = np.ascontiguousarray(starts, np.int64)
    ends = np.ascontiguousarray(ends, np.int64)
    got = _decode_masked(buf, starts, ends, layout.off, layout.dtype.itemsize)
    if got is None:
        return None
    tok_bytes, tok_counts, span_bytes, span_counts = got
    return tok_bytes.view(layout.dtype), tok_counts, span_bytes.view(SPAN_DTYPE), span_counts


@njit(cache=True, nogil=True)
def _decode_masked(buf, starts, ends, off, item):  # noqa: ANN001, ANN202 (numba)
    """(token bytes, tokens per row, span bytes, span values per row) of MDS rows laid out as
    [u32 token column size][u32 spans column size][fixed columns][tokens][spans], each
    variable column an ndarray with a 1-D shape header; None if a row's shape is not 1-D."""
    n = starts.shape[0]
    t0 = np.empty(n, np.int64)
    t1 = np.empty(n, np.int64)
    s0 = np.empty(n, np.int64)
    total_t = 0
    total_s = 0
    for r in range(n):
        st = starts[r]
        code = buf[st + off]
        if code >> 2 != 1:
            return None
        size = np.int64(buf[st]) | np.int64(buf[st + 1]) << 8
        size |= np.int64(buf[st + 2]) << 16 | np.int64(buf[st + 3]) << 24
        t0[r] = st + off + 1 + (1 << (code & 3))
        t1[r] = st + off + size
        col = st + off + size
        scode = buf[col]
        if scode >> 2 != 1:
            return None
        s0[r] = col + 1 + (1 << (scode & 3))
        total_t += t1[r] - t0[r]
        total_s += ends[r] - s0[r]
    tok = np.empty(total_t, np.uint8)
    spans = np.empty(total_s, np.uint8)
    tok_counts = np.empty(n, np.int64)
    span_counts = np.empty(n, np.int64)
    pt = 0
    ps = 0
    for r in range(n):
        k = t1[r] - t0[r]
        tok[pt : pt + k] = buf[t0[r] : t1[r]]
        pt += k
        tok_counts[r] = k // item
        k = ends[r] - s0[r]
        spans[ps : ps + k] = buf[s0[r] : ends[r]]
        ps += k
        span_counts[r] = k // 4
    return tok, tok_counts, spans, span_counts


def _u32(buf: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Little-endian u32 at each offset of a uint8 buffer (int64)."""
    return (
        buf[at].astype(np.int64)
        | buf[at + 1].astype(np.int64) << 8
        | buf[at + 2].astype(np.int64) << 16
        | buf[at + 3].astype(np.int64) << 24
    )


@njit(cache=True, nogil=True)
def _copy_ranges(buf: np.ndarray, first: np.ndarray, nbytes: np.ndarray, out: np.ndarray) -> None:
    pos = 0
    for i in range(first.shape[0]):
        f, n = first[i], nbytes[i]
        out[pos : pos + n] = buf[f : f + n]
        pos += n


def verified(direct: Decoder | None, library: Decoder, row: bytes | memoryview) -> Decoder:
    """`direct` if it decodes `row` exactly as `library` does (same dtype, same values), else
    `library`."""
    if direct is None:
        return library
    want = library(row)
    got = direct(row)
    if got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want):
        return direct
    return library
