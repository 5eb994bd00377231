"""trainer.compare's CPU-time measure against a plain-Python replay of the same plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datapipe.plan.cost import preset
from datapipe.plan.planner import PlannerConfig
from trainer.compare import replayed_cpu_s


class _TwoRanks:
    """Rank `rank` of 2: all_reduce adds the other rank's tensor (given up front)."""

    size = 2

    def __init__(self, other: torch.Tensor) -> None:
        self.other = other

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> None:
        tensor += self.other


def _reference(plan, cpu: np.ndarray) -> float:
    """Micro-batches in slot order; each starts when all its members are free and lasts its
    slowest member's CPU time; the result is the last rank's finish (seconds)."""
    free = [0.0, 0.0]
    for m in range(plan.num_microbatches):
        members = plan.group_ranks[plan.mb_group_offsets[m] : plan.mb_group_offsets[m + 1]]
        start = max(free[r] for r in members)
        for r in members:
            free[r] = start + max(cpu[q, m] for q in members)
    return max(free)


@pytest.mark.parametrize("rank", [0, 1])
def test_replayed_cpu_time_equals_a_plain_replay(rank):
    lengths = np.array([900, 300, 200, 120, 80, 40], dtype=np.int64)  # 900: a ring of 2 at C 512
    plan = PlannerConfig(policy="hdp", capacity=512).build(preset("debug"), num_ranks=2)
    plan = plan.plan(lengths, np.arange(lengths.shape[0]))
    assert 2 in set(plan.group_sizes.tolist()) and plan.num_microbatches >= 3
    rng = np.random.default_rng(0)
    cpu = np.zeros((2, plan.num_microbatches))  # each rank's logged CPU s per slot it runs
    for r in range(2):
        for pm in plan.microbatches(r):
            cpu[r, pm.slot] = rng.uniform(0.01, 0.5)
    other = torch.zeros(2, plan.num_microbatches, dtype=torch.float64)
    other[1 - rank] = torch.from_numpy(cpu[1 - rank])  # what the other rank contributes
    mb_log = [(pm.slot, 0.0, cpu[rank, pm.slot]) for pm in plan.microbatches(rank)]
    got = replayed_cpu_s(_TwoRanks(other), mb_log, plan, rank)
    assert got == pytest.approx(_reference(plan, cpu), abs=2e-9)


@pytest.mark.parametrize(("max_context", "cp"), [(None, 2), (1024, 4)])
def test_compare_mode_sizes_the_static_mesh_for_max_context(max_context, cp):
    """The compare mode's static mesh is sized for parallel.max_context whatever the run's policy
    (it was dropped unless the run was static or widened: an hdp run compared with the mesh of
    its dataset's longest sample, 300 tokens here, CP 2 at capacity 256)."""
    from types import SimpleNamespace

    from trainer.compare import PolicyComparison
    from trainer.config.job import from_dict

    par = {"policy": "hdp", "capacity": 256, "max_context": max_context}
    cfg = from_dict({"data": {"path": "unused"}, "parallel": par})
    spec = cfg.planner_spec(4)
    data = SimpleNamespace(
        planner_spec=spec, planner=spec.build(300, 0), fetcher=SimpleNamespace(lengths=[300, 20])
    )
    other = PolicyComparison("static", 1, data, executor=None, rank=0).planners["other"]
    assert other.plan(np.array([100, 100, 100, 100])).meta["cp"] == cp
