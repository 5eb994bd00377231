"""Direct decoding of the token column of MDS rows: one `np.frombuffer` at the column's offset
instead of `MDSReader.decode_sample` (three `mds_decode` calls and a dict per row, about 2/3 of the
fetch's warm time: benchmarks/RESULTS.md, stream section).

An MDS row (mosaicml-streaming's format) is ``[u32 size of each variable-size column, in column
order][each column's bytes, in column order]``. An ``ndarray:<dtype>`` column with a dynamic shape
is ``[ndim << 2 | shape dtype code (1 byte)][shape: ndim x 2**code bytes][values]``. When the token
column is the only variable-size column and has that encoding with the dataset's dtype (mixlen's
writer: ``chunk`` int32, ``sample_id`` int64, ``tokens``), its values start at a fixed offset plus
the shape header. The reader checks this layout from the shard's column table, then once per shard
compares the direct decode of a row with the library's before using it; a shard that fails either
check, and any row that is not 1-D, is decoded by the library.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
from numba import njit

from datapipe.formats.base import TOKENS

Decoder = Callable[[bytes | memoryview], np.ndarray]


class TokenLayout(NamedTuple):
    """Where the token column sits in a row: its offset (after the u32 size and the fixed columns
    before it), whether it is the last column, and its dtype."""

    off: int
    last: bool
    dtype: np.dtype


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
    if variable != [i]:
        return None
    off = 4 + sum(int(s) for s in column_sizes[:i])  # one u32 size, then the fixed columns
    return TokenLayout(off, i == len(names) - 1, np.dtype(dtype))


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
    off, last, dt = layout
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
        size = (
            buf[starts].astype(np.int64)
            | buf[starts + 1].astype(np.int64) << 8
            | buf[starts + 2].astype(np.int64) << 16
            | buf[starts + 3].astype(np.int64) << 24
        )
        stop = starts + layout.off + size
    nbytes = stop - first
    item = layout.dtype.itemsize
    out = np.empty(int(nbytes.sum()), np.uint8)
    _copy_ranges(buf, first, nbytes, out)
    return out.view(layout.dtype), nbytes // item


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
