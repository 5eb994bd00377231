"""Subprocess worker for tests/test_stream.py: computes stream digests in a fresh process.

usage: python _stream_worker.py SPEC_JSON OUT_JSON

SPEC_JSON holds {"path", "budget", "runs": [[seed, num_islands, island, steps], ...],
"resume": {"seed", "num_islands", "island", "state", "steps"}, "fetch": {...} | null}.
OUT_JSON receives {"runs": [hex digest per run], "resume": [hex digest per batch], "fetch": hex}.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np


def main(spec_path: str, out_path: str) -> int:
    from datapipe.stream import StreamConfig

    with open(spec_path) as f:
        spec = json.load(f)
    out: dict = {"runs": [], "resume": [], "fetch": None}
    for seed, num_islands, island, steps in spec["runs"]:
        stream = StreamConfig(seed=seed).open(
            spec["path"], spec["budget"], island=island, num_islands=num_islands
        )
        h = hashlib.blake2b(digest_size=16)
        for _ in range(steps):
            h.update(next(stream).digest())
        out["runs"].append(h.hexdigest())
    r = spec["resume"]
    stream = StreamConfig(seed=r["seed"]).open(
        spec["path"], spec["budget"], island=r["island"], num_islands=r["num_islands"]
    )
    stream.load_state_dict(r["state"])
    out["resume"] = [next(stream).digest().hex() for _ in range(r["steps"])]
    heavy = ("torch", "streaming", "webdataset")
    out["heavy_after_stream"] = sorted(m for m in heavy if m in sys.modules)
    fspec = spec.get("fetch")
    if fspec:
        from datapipe.fetch import FetchConfig

        fetcher = FetchConfig().build(fspec["path"])
        try:
            h = hashlib.blake2b(digest_size=16)
            for mb in fetcher.fetch_step([np.asarray(p, dtype=np.int64) for p in fspec["pieces"]]):
                for arr in (mb.input_ids, mb.labels, mb.position_ids, mb.cu_seqlens):
                    h.update(np.ascontiguousarray(arr).tobytes())
            out["fetch"] = h.hexdigest()
        finally:
            fetcher.close()
        out["heavy_after_parquet_fetch"] = sorted(m for m in heavy if m in sys.modules)
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
