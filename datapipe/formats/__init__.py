"""Storage formats: one module per format holding its writer and its reader, chosen through
`FORMATS` (a new format is one module and one entry). Each module has `Writer` (a
`base.ShardWriter`) and `open_reader(local, remote, manifest, cache_dir, mds_access)`.
Heavy libraries (mosaicml-streaming, webdataset, pyarrow.parquet) are imported when used.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from datapipe.errors import InputError
from datapipe.formats import mds, parquet, wds
from datapipe.formats.base import RowReader, ShardWriter

FORMATS: dict[str, ModuleType] = {"mds": mds, "wds": wds, "parquet": parquet}


def build_writer(
    fmt: str, root: str, dtype: np.dtype, chunk_tokens: int, shard_bytes: int, masks: bool = False
) -> ShardWriter:
    """The shard writer for `fmt` (mds, wds or parquet) writing into `root`; with `masks` every
    row also stores its trained spans (docs/FORMAT.md)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: expected one of {', '.join(FORMATS)}")
    return FORMATS[fmt].Writer(root, np.dtype(dtype), chunk_tokens, shard_bytes, masks)


def open_reader(
    local: str,
    remote: str | None,
    manifest: dict,
    cache_dir: str | None = None,
    mds_access: str = "reader",
) -> RowReader:
    """The row reader of the dataset's format (manifest.json `format`)."""
    fmt = manifest["format"]
    if fmt not in FORMATS:
        raise InputError(
            f"{local}/manifest.json: unknown format {fmt!r} (known: {', '.join(FORMATS)})"
        )
    return FORMATS[fmt].open_reader(local, remote, manifest, cache_dir, mds_access)
