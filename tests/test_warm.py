"""datapipe.plan.warm compiles what a rank's steps run: in a fresh process, after
`compile_kernels()`, planning other batches with every policy (other sizes, ranks, capacities,
offload and widening) and packing micro-batches of each token width, masked or not, compiles
no numba kernel that was not compiled already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import gc, json, sys
import numpy as np
from numba.core.registry import CPUDispatcher

def compiled():
    return {
        f"{d.py_func.__module__}.{d.py_func.__qualname__}": len(d.signatures)
        for d in gc.get_objects() if isinstance(d, CPUDispatcher)
    }

from datapipe.fetch import pack_pieces
from datapipe.plan.cost import preset
from datapipe.plan.planner import POLICIES, PlannerConfig
from datapipe.plan.stepplan import replay
before = compiled()
if sys.argv[1] == "warm":
    from datapipe.plan.warm import compile_kernels
    compile_kernels()
warm = compiled()
rng = np.random.default_rng(7)
for policy in POLICIES:
    for ranks in (1,) if policy == "single" else (2, 3, 8):
        for offload in (False, True) if policy in ("hdp", "naive-hdp") else (False,):
            for widen in (True, False):
                cap = int(rng.integers(512, 4096))
                lengths = rng.integers(1, cap * (1 if ranks == 1 else ranks), 50)
                cfg = PlannerConfig(policy=policy, capacity=cap, widen=widen)
                plan = cfg.build(preset("small"), ranks, offload=offload).plan(lengths)
                replay(plan)
for dtype in (np.uint16, np.uint32, np.int64):
    flat = rng.integers(0, 60000, 400).astype(dtype)
    pieces = np.array([[0, 0, 100], [1, 30, 200], [2, 0, 50]], np.int64)
    for trained in (None, rng.integers(0, 2, 400).astype(np.uint8)):
        pack_pieces(pieces, np.array([100, 250, 50]), flat, np.array([0, 100, 300]), trained)
from datapipe.formats.mds_direct import _copy_ranges
_copy_ranges(np.arange(99, dtype=np.uint8), np.array([3, 50]), np.array([5, 9]), np.empty(14, np.uint8))
after = compiled()
new = {k: v - warm.get(k, 0) for k, v in after.items() if v > warm.get(k, 0)}
print(json.dumps({"by_warm": sum(warm.values()) - sum(before.values()), "new": new}))
"""


def _run(mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=env, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_compile_kernels_leaves_nothing_for_a_rank_to_compile() -> None:
    warm = _run("warm")
    assert warm["by_warm"] >= 15  # it compiled the planner's and the fetch's kernels
    assert warm["new"] == {}, f"kernels a rank still compiles after the warm-up: {warm['new']}"
    # the same work without the warm-up compiles kernels (so the check above can fail)
    cold = _run("cold")
    assert cold["by_warm"] == 0 and len(cold["new"]) >= 15
