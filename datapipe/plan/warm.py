"""Compile the planner's and the fetch's numba kernels once, in one process.

Every kernel is `@njit(cache=True)`: the first process to run it compiles it and writes the
machine code beside its source; later processes load it. On a fresh install, ranks started
together (`mixlen train --nproc N`, the test suite's spawned ranks) would each compile the same
kernels at once, N times the work on the same cores. `python -m datapipe.plan.warm` plans a small
batch with every policy, replays it, buckets it and packs masked and unmasked micro-batches of
both token widths and gathers MDS rows' tokens as the direct reader does, so the ranks that follow
find every kernel of a step in the cache.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from datapipe.fetch import pack_pieces
from datapipe.formats.mds_direct import _copy_ranges
from datapipe.plan.buckets import group_by_bucket, length_buckets
from datapipe.plan.cost import preset
from datapipe.plan.planner import POLICIES, PlannerConfig
from datapipe.plan.stepplan import replay, replay_starts

__all__ = ["compile_kernels", "main"]


def compile_kernels() -> int:
    """Run each kernel of a training step once on small inputs; returns the plans made."""
    rng = np.random.default_rng(0)
    # mostly short samples and a few longer than one rank's capacity (groups, pieces)
    lengths = np.concatenate([rng.integers(1, 300, 60), [900, 1500, 2600]]).astype(np.int64)
    cost = preset("debug")
    plans = 0
    for policy in POLICIES:
        for ranks in (1,) if policy == "single" else (4, 8):
            for offload in (False, True) if policy in ("hdp", "naive-hdp") else (False,):
                for widen in (True, False) if policy == "hdp" else (True,):
                    cfg = PlannerConfig(policy=policy, capacity=1024, widen=widen)
                    plan = cfg.build(cost, ranks, offload=offload).plan(
                        lengths[lengths <= ranks * 1024]
                    )
                    replay(plan)
                    replay_starts(plan)
                    plans += 1
    group_by_bucket(length_buckets(lengths), 64)
    group_by_bucket(length_buckets(lengths, np.array([128, 1024], np.int64)), 3)
    pieces = np.array([[0, 0, 5], [1, 2, 7]], np.int64)
    for dtype in (np.uint16, np.uint32, np.int64):
        flat = np.arange(16, dtype=dtype)
        starts = np.array([0, 8], np.int64)
        for trained in (None, np.ones(16, np.uint8)):
            pack_pieces(pieces, np.array([6, 8], np.int64), flat, starts, trained)
    buf = np.arange(64, dtype=np.uint8)  # MDS rows' token columns gathered (the direct reader)
    _copy_ranges(
        buf, np.array([0, 10], np.int64), np.array([4, 6], np.int64), np.empty(10, np.uint8)
    )
    return plans


def main() -> None:
    t0 = time.perf_counter()
    n = compile_kernels()
    print(f"numba kernels ready ({n} plans, {time.perf_counter() - t0:.1f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
