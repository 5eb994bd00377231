"""Policy comparison: plan the same global batches under several planner variants and measure
each plan, the one service behind `mixlen plan`, `mixlen simulate`, the trainer's compare mode and
the planning benchmarks.

Every variant first plans every batch once, untimed (numba compiles or loads a kernel on its first
use, and some kernels are first used by a later batch); then the timed passes plan every batch
again, the variants interleaved batch by batch (and pass by pass) so that machine noise hits them
alike, their order rotating from one batch to the next so that none always plans first. A
variant's result holds its plans, each plan's time and metrics (datapipe.plan.metrics) and their
average over the batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from datapipe.errors import ConfigError
from datapipe.plan.cost import CostModel
from datapipe.plan.metrics import PlanMetrics, average_metrics, plan_metrics
from datapipe.plan.planner import Planner, PlannerConfig
from datapipe.plan.stepplan import StepPlan
from datapipe.settings import Names

__all__ = [
    "Batch",
    "Variant",
    "VariantResult",
    "compare",
    "policy_variants",
    "variant_planners",
    "widens_by_default",
]

Batch = tuple[np.ndarray, np.ndarray | None]  # (lengths, sample ids or None)


@dataclass(frozen=True)
class Variant:
    """One column of a comparison: a policy, with offload and widen or not."""

    policy: str
    offload: bool = False
    widen: bool = False

    @property
    def label(self) -> str:
        return self.policy + ("+offload" if self.offload else "") + ("+widen" if self.widen else "")


@dataclass
class VariantResult:
    """A variant's plans of the batches, the milliseconds per plan (the median over the timed
    passes; every pass's in `pass_ms`), the warm-up pass's total, and the plans' metrics."""

    label: str
    plans: list[StepPlan]
    plan_ms: list[float]
    warmup_ms: float
    metrics: list[PlanMetrics] = field(default_factory=list)
    pass_ms: list[list[float]] = field(default_factory=list)
    pass_cpu_ms: list[list[float]] = field(default_factory=list)  # the thread's CPU time

    @property
    def average(self) -> PlanMetrics:
        """The metrics' mean over the batches, labelled with the variant."""
        m = average_metrics(self.metrics)
        m.policy = self.label
        return m


DYNAMIC = ("hdp", "naive-hdp")  # the policies that may offload


def widens_by_default() -> bool:
    """Does hdp widen unless told otherwise? `[parallel] widen`'s default (PlannerConfig's, the
    one copy): `mixlen plan` and `mixlen simulate` plan what `mixlen train` runs."""
    return bool(PlannerConfig().widen)


def policy_variants(policy: str, offload: bool = False, widen: bool | None = None) -> list[Variant]:
    """The columns of a report. `widen`: None takes `[parallel] widen`'s default (on), as
    `mixlen train` does; it counts for hdp only (True with another single policy is refused).
    A single policy plans itself (hdp: hdp+widen, or plain hdp with widen False); `all` plans
    static, naive-hdp and hdp with ByteScale's smallest-group rule, and hdp+widen beside them
    when widen is on. `offload` applies to the dynamic policies (static and single never
    offload)."""
    if widen and policy not in ("hdp", "all"):
        raise ConfigError(f"--widen applies to the hdp policy only, not --policy {policy}")
    wide = widens_by_default() if widen is None else widen
    names = ("static", "naive-hdp", "hdp") if policy == "all" else (policy,)
    out = [Variant(n, offload and n in DYNAMIC, wide and policy == "hdp") for n in names]
    if wide and policy == "all":
        out.append(Variant("hdp", offload, True))
    return out


def variant_planners(
    variants: Sequence[Variant],
    base: PlannerConfig,
    cost: CostModel,
    num_ranks: int,
    seed: int = 0,
    names: Names | None = None,
) -> dict[str, Planner]:
    """A planner per variant: `base`'s settings with the variant's policy and widen."""
    out = {}
    for v in variants:
        cfg = PlannerConfig(
            policy=v.policy,
            capacity=base.capacity,
            max_context=base.max_context,
            widen=v.widen,
            improve_rounds=base.improve_rounds,
        )
        out[v.label] = cfg.build(cost, num_ranks, seed, v.offload, names)
    return out


def compare(
    planners: dict[str, Planner],
    batches: Sequence[Batch],
    cost: CostModel | None = None,
    passes: int = 1,
    on_plan: Callable[[], None] | None = None,
) -> dict[str, VariantResult]:
    """Plan every batch with every planner: an untimed warm-up pass, then `passes` timed passes
    with the planners interleaved, the first one rotating batch by batch; returns each planner's
    plans (of the first timed pass), plan times (median over the timed passes) and metrics under
    `cost` (default: each planner's own). `on_plan()` is called after each plan."""
    out: dict[str, VariantResult] = {}
    for label, planner in planners.items():
        t0 = time.perf_counter()
        for lengths, ids in batches:
            planner.plan(lengths, ids)
            if on_plan is not None:
                on_plan()
        out[label] = VariantResult(label, [], [], (time.perf_counter() - t0) * 1e3)
    ms: dict[str, list[list[float]]] = {label: [[] for _ in batches] for label in planners}
    cpu: dict[str, list[list[float]]] = {label: [[] for _ in batches] for label in planners}
    order = list(planners.items())
    for p in range(passes):
        for i, (lengths, ids) in enumerate(batches):
            turn = (p * len(batches) + i) % len(order)
            for label, planner in order[turn:] + order[:turn]:
                c0, t0 = time.thread_time(), time.perf_counter()
                plan = planner.plan(lengths, ids)
                ms[label][i].append((time.perf_counter() - t0) * 1e3)
                cpu[label][i].append((time.thread_time() - c0) * 1e3)
                if len(out[label].plans) <= i:
                    out[label].plans.append(plan)
                if on_plan is not None:
                    on_plan()
    for label, res in out.items():
        res.pass_ms, res.pass_cpu_ms = ms[label], cpu[label]
        res.plan_ms = [float(np.median(t)) for t in ms[label]]
        c = cost if cost is not None else planners[label].cost
        res.metrics = [plan_metrics(p, c, t) for p, t in zip(res.plans, res.plan_ms)]
    return out
