"""datapipe.index.read_index on hand-written index.parquet + manifest.json files (written with
pyarrow here, not with mixlen's writer): the columns it returns and what it derives from them."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from datapipe.index import read_index


def write_dataset(
    root: Path, num_tokens: list[int], shard: list[int], first_row: list[int], shard_rows: list[int]
) -> None:
    """index.parquet (FORMAT.md's columns) and manifest.json of one-row samples (chunk_tokens 8:
    every sample here fits one row; an empty one takes one row too); no shard files."""
    root.mkdir(parents=True, exist_ok=True)
    n = len(num_tokens)
    table = pa.table(
        {
            "sample_id": pa.array(range(n), pa.int64()),
            "num_tokens": pa.array(num_tokens, pa.int64()),
            "shard": pa.array(shard, pa.int32()),
            "first_row": pa.array(first_row, pa.int64()),
            "num_rows": pa.array([1] * n, pa.int32()),
            "source": pa.array([f"doc:{i}" for i in range(n)], pa.string()),
        }
    )
    pq.write_table(table, root / "index.parquet")
    manifest = {
        "format": "parquet",
        "dtype": "uint16",
        "chunk_tokens": 8,
        "num_samples": n,
        "num_tokens": sum(num_tokens),
        "shards": [{"name": f"shard-{i:05d}.parquet", "rows": r} for i, r in enumerate(shard_rows)],
    }
    (root / "manifest.json").write_text(json.dumps(manifest))


def test_shard_ids_past_int16_and_their_global_rows(tmp_path: Path) -> None:
    """A dataset of 40,000 shards of one sample (one row) each: read_index returns every
    sample's shard id as written (ids above 32,767 included) and its global first row is the
    number of rows in the shards before it (here: its shard id)."""
    n = 40_000
    write_dataset(tmp_path, [3] * n, list(range(n)), [0] * n, [1] * n)
    index = read_index(tmp_path)
    assert index.shard.tolist() == list(range(n))
    assert index.global_first_row.tolist() == list(range(n))


def test_loss_tokens_without_a_mask_are_length_minus_one_never_negative(tmp_path: Path) -> None:
    """Without a loss mask each sample's labelled positions are L - 1, and 0 for a sample of no
    tokens (an indexed dataset may hold one: one empty row), never -1."""
    lengths = [0, 1, 2, 7, 0]
    write_dataset(tmp_path, lengths, [0] * 5, list(range(5)), [5])  # rows 0..4 of one shard
    index = read_index(tmp_path)
    assert index.loss is None and index.num_tokens.tolist() == lengths
    assert index.loss_tokens.tolist() == [0, 0, 1, 6, 0]
    assert int(index.loss_tokens.sum()) == sum(max(n - 1, 0) for n in lengths)
