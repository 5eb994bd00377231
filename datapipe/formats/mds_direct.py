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
from numba import njit

from datapipe.formats.base import SPAN_DTYPE, TOKENS, TRAINED

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
    some row's columns are not 1-D."""
    assert layout.spans
    got = decode_rows(layout, buf, starts, ends)
    if got is None:
        return None
    starts = np.asarray(starts, np.int64)
    size = _u32(buf, starts)  # the token column's bytes: its spans column starts after them
    col = starts + layout.off + size
    code = buf[col].astype(np.int64)
    if ((code >> 2) != 1).any():
        return None
    first = col + 1 + (1 << (code & 3))
    nbytes = np.asarray(ends, np.int64) - first
    out = np.empty(int(nbytes.sum()), np.uint8)
    _copy_ranges(buf, first, nbytes, out)
    item = SPAN_DTYPE.itemsize
    return got[0], got[1], out.view(SPAN_DTYPE), nbytes // item


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
