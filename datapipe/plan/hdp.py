"""`hdp`: dynamic groups balanced by estimated time, mixlen's balance scheduler after ByteScale's
(not its Algorithm 2: no length buckets, no delta threshold; docs/PLAN.md). Each sample goes on
the smallest group whose largest
zigzag chunk pair fits the capacity (with offload, Eq. 3's ratio, then widened again while the
member share exceeds the lower bound), short samples are packed best-fit into local micro-batches,
and the balance scheduler (datapipe.plan.balance) places rings first and local work around them
by estimated time. With `widen`, wider groups and ring spare-room fills are tried as well
(datapipe.plan.widen), and the batch's static DP x CP mesh (datapipe.plan.static) is taken
instead when it is estimated faster, so hdp+widen is never estimated slower than static.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from datapipe.errors import MixlenError
from datapipe.plan import static
from datapipe.plan.balance import Schedule, hdp_schedule, rebalance_tail
from datapipe.plan.common import (
    Layout,
    assemble_dynamic,
    dynamic_layout,
    dynamic_limit,
    gather,
    lower_bound_terms,
    plan_lower_bound_ns,
)
from datapipe.plan.cost import CostModel
from datapipe.plan.setup import PlanSetup
from datapipe.plan.stepplan import StepPlan
from datapipe.plan.widen import widen

DESCRIPTION = "dynamic groups, cost-balanced (rings first, LPT, improvement pass)"
fits = dynamic_limit


def plan(
    config: PlanSetup, cost: CostModel, lengths: np.ndarray, sample_ids: np.ndarray
) -> StepPlan:
    """Plan one global batch with hdp (and widen, if configured)."""
    n_ranks, cap = config.num_ranks, config.capacity
    work_bound, share_bound = lower_bound_terms(cost, lengths, n_ranks, cap)
    # the smallest-group bound steers the layout; plans record the bound of any plan (reports)
    layout, caps = dynamic_layout(
        config, cost, lengths, sample_ids, target_ns=max(work_bound, share_bound)
    )
    lb = plan_lower_bound_ns(cost, lengths, n_ranks, cap)
    budget = int(config.improve_rounds) * n_ranks
    sched = hdp_schedule(layout.kg, layout.g_time, layout.b_time, n_ranks, budget)
    layout, sched = rebalance_tail(layout, sched, lengths, cost, cap, budget)
    if not config.widen:
        return _assemble(config, cost, lengths, sample_ids, layout, caps, sched, {}, lb)
    # widen compares candidates timed as placed groups are planned: its work bound likewise
    planned_bound = lower_bound_terms(cost, lengths, n_ranks, cap, best_case=False)[0]
    won, won_sched, meta = widen(
        cost, lengths, caps, cap, n_ranks, budget, planned_bound, layout, sched
    )
    out = None
    if won is not layout:  # a widened candidate: its tail sample by sample as well
        won, won_sched = rebalance_tail(won, won_sched, lengths, cost, cap, budget)
        filled = {**meta, "widen_filled": int(won.g_items.shape[0] - won.kg.shape[0])}
        out = _assemble(config, cost, lengths, sample_ids, won, caps, won_sched, filled, lb)
    # candidates were compared as groups are timed before placement; placed in one node, a group
    # is re-timed on the node link, which may favour the plain plan after all
    plain_meta = {**meta, "widened": 0, "widen_filled": 0}
    plain = _assemble(config, cost, lengths, sample_ids, layout, caps, sched, plain_meta, lb)
    if out is None or plain.makespan_ns <= out.makespan_ns:
        out = plain
    # also when widen stopped near the bound: static may still be a bit faster
    mesh = static_mesh(config, cost, lengths, sample_ids, lb)
    out.meta["widen_candidates"] += mesh is not None
    if mesh is not None and mesh.makespan_ns < out.makespan_ns:
        meta = {**out.meta, "widened": 0, "widen_filled": 0}
        meta["static_mesh"] = {"cp": mesh.meta["cp"], "dp": mesh.meta["dp"]}
        return dataclasses.replace(mesh, policy="hdp", meta=meta)
    return out


def _assemble(
    config: PlanSetup,
    cost: CostModel,
    lengths: np.ndarray,
    sample_ids: np.ndarray,
    layout: Layout,
    caps: np.ndarray,
    sched: Schedule,
    meta: dict,
    lb: int,
) -> StepPlan:
    """The StepPlan of a scheduled layout. Slot keys: group g (in placement order) at 2g+1, gap
    fillers at 2g, tails after all groups."""
    kg, g_order = layout.kg, sched.g_order
    n_g = kg.shape[0]
    g_key = np.empty(n_g, dtype=np.int64)
    g_key[g_order] = 2 * np.arange(n_g) + 1
    g_src_off = np.zeros(n_g + 1, dtype=np.int64)
    np.cumsum(kg, out=g_src_off[1:])
    g_sorted_off = np.zeros(n_g + 1, dtype=np.int64)
    np.cumsum(kg[g_order], out=g_sorted_off[1:])
    inv = np.argsort(g_order)
    g_ranks = sched.g_ranks_sorted[gather(g_sorted_off, inv, g_src_off)]
    mb_key = np.concatenate([g_key, sched.b_key])
    mb_ranks = np.concatenate([g_ranks, sched.b_rank])
    meta = {"improve_moves": int(sched.moves), "gap_fills": int(sched.fills), **meta}
    return assemble_dynamic(
        "hdp", config, cost, lengths, sample_ids, layout, caps, mb_key, mb_ranks, meta, lb
    )


def static_mesh(
    config: PlanSetup,
    cost: CostModel,
    lengths: np.ndarray,
    sample_ids: np.ndarray,
    bound: int | None = None,
) -> StepPlan | None:
    """widen's last candidate: the batch on a static DP x CP mesh, the fastest (by estimate) of
    the mesh its longest sample needs, the one static itself would use with `max_context` set,
    and the one that splits a dominant sample (whose work alone exceeds the ranks' average) over
    enough ranks to bring it down to that average (None when no CP degree dividing N holds the
    batch). `bound`: the plan's recorded lower bound, if already known."""
    n, cap = config.num_ranks, config.capacity
    longest = max(int(lengths.max()) if lengths.size else 0, 1)
    ctx = max(config.max_context or longest, longest)
    degrees = []
    for c in dict.fromkeys((longest, ctx)):
        try:
            degrees.append(static.static_cp_degree(n, cap, c))
        except MixlenError:  # no CP degree dividing N holds c
            continue
    if not degrees:
        return None
    work = cost.work_ns(lengths[lengths > 0], 1).astype(np.float64)
    need = int(np.ceil(work.max() * n / max(work.sum(), 1.0))) if work.size else 1
    # the smallest CP degree dividing N that splits the dominant sample to the average (if any)
    split = range(max(need, degrees[0]), min(n, longest) + 1)
    dominant = next((d for d in split if n % d == 0), None)
    cfg = dataclasses.replace(config, policy="static", widen=False, max_context=ctx)
    best = None
    for cp in dict.fromkeys(degrees + ([dominant] if dominant else [])):
        p = static.plan_mesh(cfg, cost, lengths, sample_ids, cp, ctx, bound)
        if best is None or p.makespan_ns < best.makespan_ns:
            best = p
    return best
