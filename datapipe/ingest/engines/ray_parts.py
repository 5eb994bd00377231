"""The Ray engine's parts (datapipe.ingest.engines.ray): each write task's `part-NNNNN/` folder of
shards with its own index, merged by the driver into one dataset's shard list and index columns
(sample ids are global already; shard numbers are offset part by part)."""

from __future__ import annotations

import contextlib
import json
import logging
import os

import numpy as np

from datapipe.formats.base import ShardInfo
from datapipe.index import INDEX_FILE
from datapipe.ingest.engines.base import Written


def part_dir(idx: int) -> str:
    """A part's folder name (a direct child of the output: merge_index keeps one level)."""
    return f"part-{idx:05d}"


def merge_parts(fmt: str, root: str, num_parts: int) -> Written:
    """Merge part-00000 .. part-{num_parts-1} into one dataset's shard list and index columns
    (MDS: also one index.json through merge_index); removes the parts' own index files."""
    import pyarrow.parquet as pq

    shards: list[ShardInfo] = []
    cols: dict[str, list] = {"num_tokens": [], "shard": [], "first_row": [], "source": []}
    first_sample = 0
    for i in range(num_parts):
        part = os.path.join(root, part_dir(i))
        with open(os.path.join(part, "shards.json")) as f:
            part_shards = [ShardInfo(**s) for s in json.load(f)]
        table = pq.read_table(os.path.join(part, INDEX_FILE))
        cols["num_tokens"].append(table.column("num_tokens").to_numpy())
        cols["shard"].append(table.column("shard").to_numpy() + len(shards))
        cols["first_row"].append(table.column("first_row").to_numpy())
        cols["source"].extend(table.column("source").to_pylist())
        for s in part_shards:
            s.name = f"{part_dir(i)}/{s.name}"
            s.first_sample = first_sample
            first_sample += s.samples
        shards.extend(part_shards)
    if fmt == "mds":
        merge_mds_index(root, num_parts)
    for i in range(num_parts):
        for name in (INDEX_FILE, "shards.json", "index.json"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(root, part_dir(i), name))
    return Written(
        np.concatenate(cols["num_tokens"]).astype(np.int64),
        np.concatenate(cols["shard"]).astype(np.int32),
        np.concatenate(cols["first_row"]).astype(np.int64),
        cols["source"],
        shards,
        {},
    )


def merge_mds_index(root: str, num_parts: int) -> None:
    """One index.json from the parts' (mosaicml-streaming's merge_index, explicit sorted list)."""
    from streaming.base.util import merge_index

    names = ("", "streaming.base.storage.upload", "streaming.base.util")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:  # it announces its temporary folder on the root logger
        lg.setLevel(logging.ERROR)
    try:
        merge_index([os.path.join(root, part_dir(i), "index.json") for i in range(num_parts)], root)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
