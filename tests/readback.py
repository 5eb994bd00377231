"""Read shards back with each library's own reader (test helper, independent of mixlen's fetch)."""

from __future__ import annotations

import io
import os

import numpy as np


def read_rows(root: str, manifest: dict) -> list[tuple[int, int, np.ndarray]]:
    """All storage rows (sample_id, chunk, tokens) in storage order."""
    fmt = manifest["format"]
    rows: list[tuple[int, int, np.ndarray]] = []
    if fmt == "mds":
        from conftest import open_streaming_dataset

        with open_streaming_dataset(root) as ds:
            for i in range(len(ds)):
                r = ds[i]
                rows.append((int(r["sample_id"]), int(r["chunk"]), np.asarray(r["tokens"])))
    elif fmt == "wds":
        import webdataset as wds

        urls = [os.path.join(root, s["name"]) for s in manifest["shards"]]
        for r in wds.WebDataset(urls, shardshuffle=False):
            key = r["__key__"]
            sid, chunk = key[1:].split("_c")
            rows.append((int(sid), int(chunk), np.load(io.BytesIO(r["tokens.npy"]))))
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        for s in manifest["shards"]:
            t = pq.read_table(os.path.join(root, s["name"]))
            for sid, chunk, toks in zip(
                t.column("sample_id").to_pylist(),
                t.column("chunk").to_pylist(),
                t.column("tokens").to_pylist(),
            ):
                rows.append((sid, chunk, np.asarray(toks, dtype=manifest["dtype"])))
    else:  # pragma: no cover
        raise AssertionError(fmt)
    return rows


def samples_from_rows(rows: list[tuple[int, int, np.ndarray]]) -> dict[int, np.ndarray]:
    """Concatenate chunk rows per sample, checking chunks arrive in order."""
    parts: dict[int, list[np.ndarray]] = {}
    for sid, chunk, toks in rows:
        lst = parts.setdefault(sid, [])
        assert chunk == len(lst), f"sample {sid}: chunk {chunk} out of order"
        lst.append(toks)
    return {sid: np.concatenate(p) for sid, p in parts.items()}
