"""`static`: a fixed DP x CP mesh, the baseline HDP is measured against. The CP degree is the
smallest divisor of N whose group holds the run's longest context (`max_context`, default: the
batch's longest sample); every sample is split zigzag over its CP group, micro-batches are dealt
to DP replicas round-robin by decreasing tokens (equal micro-batch counts, token balance).
"""

from __future__ import annotations

import numpy as np

from datapipe.errors import MixlenError
from datapipe.jit import njit
from datapipe.plan.common import assemble, group_times, pack_local, plan_lower_bound_ns, too_long
from datapipe.plan.cost import CostModel
from datapipe.plan.setup import PlanSetup
from datapipe.plan.stepplan import StepPlan

DESCRIPTION = "fixed DP x CP mesh, every sample split over the CP group"


def static_cp_degree(num_ranks: int, capacity: int, max_context: int) -> int:
    """Smallest divisor d of N whose group holds max_context (largest chunk pair ceil(S/d) <= C)."""
    for d in range(1, num_ranks + 1):
        if num_ranks % d == 0 and -(-max_context // d) <= capacity:
            return d
    raise MixlenError(
        f"max context {max_context} does not fit N * C = {num_ranks * capacity} "
        "(no CP degree dividing N holds it)"
    )


def fits(config: PlanSetup, cost: CostModel, lengths: np.ndarray) -> np.ndarray:
    """Longest sample the mesh holds, per sample: N * C, or max_context when that is set."""
    limit = config.num_ranks * config.capacity
    if config.max_context is not None:
        limit = min(limit, int(config.max_context))
    return np.full(np.shape(lengths), limit, dtype=np.int64)


def plan(
    config: PlanSetup, cost: CostModel, lengths: np.ndarray, sample_ids: np.ndarray
) -> StepPlan:
    """Plan one global batch on the static DP x CP mesh."""
    longest = int(lengths.max()) if lengths.size else 0
    max_ctx = config.max_context if config.max_context is not None else max(longest, 1)
    if longest > max_ctx:
        key = config.key("max_context")  # the static mesh's context: that setting alone
        too_long(config, lengths, sample_ids, max_ctx, key, f"raise {key}, or cap sample length "
                 "at preprocess time")  # fmt: skip
    cp = static_cp_degree(config.num_ranks, config.capacity, max_ctx)
    return plan_mesh(config, cost, lengths, sample_ids, cp, max_ctx)


def plan_mesh(
    config: PlanSetup,
    cost: CostModel,
    lengths: np.ndarray,
    sample_ids: np.ndarray,
    cp: int,
    max_ctx: int,
    bound: int | None = None,
) -> StepPlan:
    """The batch on the DP x CP mesh of CP degree `cp` (a divisor of N whose group holds every
    sample; `max_ctx` is recorded). `bound`: the recorded lower bound if already known (else
    plan_lower_bound_ns)."""
    n_ranks, cap = config.num_ranks, config.capacity
    n_dp = n_ranks // cp
    live = np.flatnonzero(lengths > 0)
    share = -(-lengths[live] // cp)  # each member's positions are at most ceil(S / cp)
    # at least one micro-batch per DP replica when there are that many samples
    b_off, b_pos = pack_local(np.arange(live.shape[0], dtype=np.int64), share, cap, n_dp)
    b_items = live[b_pos]
    n_bins = b_off.shape[0] - 1
    if n_bins:
        toks = np.add.reduceat(lengths[b_items], b_off[:-1])
        cps = np.full(n_bins, cp, dtype=np.int64)
        b_time = group_times(cost, lengths, b_off, b_items, cps, np.zeros_like(cps))
    else:
        toks = np.zeros(0, dtype=np.int64)
        b_time = np.zeros(0, dtype=np.int64)
    order = np.lexsort((np.arange(n_bins), -toks)).astype(np.int64)
    dp_of, rnd = _deal_round_robin(toks[order], n_dp)
    dp = np.empty(n_bins, dtype=np.int64)
    dp[order] = dp_of
    rd = np.empty(n_bins, dtype=np.int64)
    rd[order] = rnd
    mb_ranks = (dp[:, None] * cp + np.arange(cp)[None, :]).reshape(-1)
    meta = {"cp": cp, "dp": n_dp, "max_context": max_ctx, "offload": False}
    return assemble(
        "static",
        config,
        cost,
        lengths,
        sample_ids,
        rd * n_dp + dp,
        np.full(n_bins, cp, dtype=np.int64),
        mb_ranks,
        np.full(n_bins, cap, dtype=np.int64),
        np.zeros(n_bins, dtype=np.int64),
        b_off,
        b_items.astype(np.int64),
        b_time.astype(np.int64),
        meta,
        plan_lower_bound_ns(cost, lengths, n_ranks, cap) if bound is None else bound,
    )


@njit(cache=True)
def _deal_round_robin(tokens: np.ndarray, n_dp: int) -> tuple[np.ndarray, np.ndarray]:
    """Deal micro-batches (by decreasing tokens) to DP replicas: fewest micro-batches first, then
    fewest tokens (equal micro-batch counts, token balance, as a static trainer does)."""
    m = tokens.shape[0]
    cnt = np.zeros(n_dp, dtype=np.int64)
    tok = np.zeros(n_dp, dtype=np.int64)
    dp = np.empty(m, dtype=np.int64)
    rnd = np.empty(m, dtype=np.int64)
    for i in range(m):
        best = 0
        for g in range(1, n_dp):
            if cnt[g] < cnt[best] or (cnt[g] == cnt[best] and tok[g] < tok[best]):
                best = g
        dp[i] = best
        rnd[i] = cnt[best]
        cnt[best] += 1
        tok[best] += tokens[i]
    return dp, rnd
