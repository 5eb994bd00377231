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

import numpy as np

from datapipe.formats.base import TOKENS

Decoder = Callable[[bytes | memoryview], np.ndarray]


def token_decoder(
    column_names: Sequence[str],
    column_encodings: Sequence[str],
    column_sizes: Sequence[int | None],
    dtype: np.dtype,
    library: Decoder,
) -> Decoder | None:
    """A direct decoder of the token column for rows of this column layout, or None when the
    layout is not the one described above. `library` decodes rows it cannot (not 1-D)."""
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
    dt = np.dtype(dtype)
    item = dt.itemsize
    last = i == len(names) - 1  # the values run to the row's end

    def decode(data: bytes | memoryview) -> np.ndarray:
        code = data[off]
        if code >> 2 != 1:  # not 1-D: whatever the library makes of it
            return library(data)
        start = off + 1 + (1 << (code & 3))
        if last:
            return np.frombuffer(data, dt, offset=start)
        size = int.from_bytes(data[0:4], "little")  # the token column's bytes
        return np.frombuffer(data, dt, count=(size - (start - off)) // item, offset=start)

    return decode


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
