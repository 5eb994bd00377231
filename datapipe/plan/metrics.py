"""A plan's balance metrics, computed from the plan and its cost model alone: estimated step
time, imbalance, distance to the lower bound, token fill, micro-batches per rank, ring groups,
communication bytes, and each micro-batch's time split into its cost components (what the
reports of `mixlen plan`, `mixlen simulate` and the trainer show)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from datapipe.plan.common import mb_spans_nodes
from datapipe.plan.cost import CostModel
from datapipe.plan.stepplan import StepPlan

__all__ = [
    "COMPONENTS",
    "PlanMetrics",
    "average_metrics",
    "mb_components",
    "plan_metrics",
    "predicted_step_ns",
    "rank_components",
]

COMPONENTS = ("attention", "linear", "communication", "offload", "overhead")


@dataclass
class PlanMetrics:
    """One plan's balance metrics (times in seconds)."""

    policy: str
    est_step_time_s: float  # makespan + the cost model's `step` (the work around micro-batches)
    makespan_s: float  # the slowest rank's micro-batches
    mean_rank_time_s: float
    imbalance: float  # makespan / mean rank time
    lower_bound_s: float
    max_over_lower_bound: float  # makespan / lower bound
    token_fill: float  # tokens / sum of planned capacity over (rank, micro-batch)
    mb_per_rank_min: int
    mb_per_rank_max: int
    groups_by_size: dict[int, int]  # group size -> number of group micro-batches (k >= 2)
    comm_bytes: float  # ring K/V bytes sent by all members + offload bytes both directions
    plan_ms: float

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["groups_by_size"] = {str(k): v for k, v in self.groups_by_size.items()}
        return d


def mb_components(plan: StepPlan, cost: CostModel) -> np.ndarray:
    """Seconds of one member of each micro-batch by component [M, 5] (COMPONENTS order)."""
    m = plan.num_microbatches
    if m == 0:
        return np.zeros((0, len(COMPONENTS)))
    k = plan.group_sizes
    piece_mb = np.repeat(np.arange(m), np.diff(plan.mb_piece_offsets))
    s = plan.piece_end - plan.piece_start
    kp = k[piece_mb]
    attn = np.bincount(piece_mb, cost.attn_ns(s, kp), minlength=m)
    lin = np.bincount(piece_mb, cost.linear_ns(s, kp), minlength=m)
    member_tokens = np.bincount(piece_mb, s / kp, minlength=m)
    # the size term: non-attention work of the micro-batch's size
    lin = lin + cost.size_ns(member_tokens)
    spans = mb_spans_nodes(cost, plan.mb_group_offsets, plan.group_ranks)
    ring = cost.ring_ns(member_tokens, k, spans)
    off = cost.offload_ns(member_tokens, plan.mb_offload).astype(np.float64)
    comp = attn + lin
    comm_exp = cost.ring_exposed_ns(attn.astype(np.int64), ring).astype(np.float64)
    fwd = np.floor(comp / 3)
    off_exp = np.maximum(off - fwd, 0) + np.maximum(off - (comp - fwd), 0)
    return np.stack([attn, lin, comm_exp, off_exp, np.full(m, float(cost.c_ns))], axis=1) / 1e9


def rank_components(plan: StepPlan, cost: CostModel) -> np.ndarray:
    """Per-rank seconds by component [N, 5] (COMPONENTS order); idle = rank time - row sum."""
    out = np.zeros((plan.num_ranks, len(COMPONENTS)))
    if plan.num_microbatches == 0:
        return out
    per_mb = mb_components(plan, cost)
    mb_of_member = np.repeat(np.arange(plan.num_microbatches), plan.group_sizes)
    np.add.at(out, plan.group_ranks.astype(np.int64), per_mb[mb_of_member])
    return out


def predicted_step_ns(plan: StepPlan, cost: CostModel) -> int:
    """A step's predicted time: the plan's makespan plus the cost model's work around the
    micro-batches (`step`, the same on every rank)."""
    return int(plan.makespan_ns) + cost.step_ns


def plan_metrics(plan: StepPlan, cost: CostModel, plan_ms: float) -> PlanMetrics:
    k = plan.group_sizes
    times = plan.rank_time_ns / 1e9
    mean = float(times.mean()) if times.size else 0.0
    mx = predicted_step_ns(plan, cost) / 1e9
    tokens = int((plan.piece_end - plan.piece_start).sum())
    cap_total = int((plan.mb_capacity * k).sum())
    counts = plan.microbatch_counts()
    piece_mb = np.repeat(np.arange(plan.num_microbatches), np.diff(plan.mb_piece_offsets))
    s = plan.piece_end - plan.piece_start
    member_tokens = np.bincount(piece_mb, s / k[piece_mb], minlength=plan.num_microbatches)
    ring = float((cost.ring_bytes(member_tokens, k) * k).sum())
    off = float((2 * cost.offload_bytes(member_tokens, plan.mb_offload) * k).sum())
    sizes, n = np.unique(k[k >= 2], return_counts=True)
    return PlanMetrics(
        policy=plan.label,
        est_step_time_s=mx,
        makespan_s=plan.makespan_ns / 1e9,
        mean_rank_time_s=mean,
        imbalance=plan.makespan_ns / 1e9 / mean if mean > 0 else 1.0,
        lower_bound_s=plan.lower_bound_ns / 1e9,
        max_over_lower_bound=plan.makespan_ns / plan.lower_bound_ns if plan.lower_bound_ns else 1.0,
        token_fill=tokens / cap_total if cap_total else 0.0,
        mb_per_rank_min=int(counts.min()) if counts.size else 0,
        mb_per_rank_max=int(counts.max()) if counts.size else 0,
        groups_by_size={int(a): int(b) for a, b in zip(sizes, n)},
        comm_bytes=ring + off,
        plan_ms=plan_ms,
    )


def average_metrics(steps: list[PlanMetrics]) -> PlanMetrics:
    """Mean over steps (sums for group counts; min/max for micro-batch counts)."""
    if len(steps) == 1:
        return steps[0]
    groups: dict[int, int] = {}
    for m in steps:
        for k, v in m.groups_by_size.items():
            groups[k] = groups.get(k, 0) + v

    def mean(attr: str) -> float:
        return float(np.mean([getattr(m, attr) for m in steps]))

    return PlanMetrics(
        policy=steps[0].policy,
        est_step_time_s=mean("est_step_time_s"),
        makespan_s=mean("makespan_s"),
        mean_rank_time_s=mean("mean_rank_time_s"),
        imbalance=mean("imbalance"),
        lower_bound_s=mean("lower_bound_s"),
        max_over_lower_bound=mean("max_over_lower_bound"),
        token_fill=mean("token_fill"),
        mb_per_rank_min=min(m.mb_per_rank_min for m in steps),
        mb_per_rank_max=max(m.mb_per_rank_max for m in steps),
        groups_by_size=dict(sorted(groups.items())),
        comm_bytes=mean("comm_bytes"),
        plan_ms=mean("plan_ms"),
    )
