"""Step planners: `hdp` (ByteScale's balance scheduler), `naive-hdp` (dynamic groups, no balance)
and `static` (a fixed DP x CP mesh), each producing a StepPlan.

Shared rules:

- A sample of length S goes on the smallest group k whose largest zigzag chunk pair, ceil(S/k),
  fits the capacity (any k from 1 to N). With offload on, ByteScale's Eq. 3 picks the offload ratio
  r = j/l that minimises the ranks D(s) subject to the copies hiding under the forward compute
  (CostModel.offload_capacity / max_offload_layers); hdp then widens the group again while its
  member share would exceed the no-offload lower bound, so offload only frees ranks where that does
  not lengthen the critical path (naive-hdp uses the smallest D as is).
- Short samples (k = 1) are packed best-fit into micro-batches of at most C positions
  (datapipe.packing); long samples get a group micro-batch of their own.
- hdp with `widen` (opt-in) also tries groups from that smallest k up to min(N, S) and short
  samples in a ring's spare room, keeping the candidate with the smallest estimated makespan
  (_widen; docs/PLAN.md, "Widen").
- Zero-length samples get no micro-batch (nothing to compute). A sample that no group of N ranks can
  hold (S > N * C, or N * C_eff with offload) is an error (MixlenError naming the sample).
- Times are int64 nanoseconds from datapipe.cost; rank times come from the slot-order replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from datapipe.cost import CostModel
from datapipe.errors import ConfigError, MixlenError
from datapipe.packing import bfd_kernel, group_by_bucket_kernel
from datapipe.plan import StepPlan, replay_kernel
from datapipe.schedule import (
    fill_gaps,
    improve_local,
    list_schedule_groups,
    max_tree,
    max_tree_first,
    max_tree_set,
    place_groups,
    place_local,
    place_waves,
)

POLICIES = ("hdp", "naive-hdp", "static")


@dataclass(frozen=True)
class PlannerConfig:
    """Planner settings; `build(cost)` returns a Planner."""

    policy: str = "hdp"
    num_ranks: int = 8
    capacity: int = 8192
    offload: bool = False
    max_context: int | None = None  # static: the run's longest context (default: batch maximum)
    seed: int = 0
    improve_rounds: int = 4  # hdp: improvement pass budget, in multiples of N moves
    widen: bool = False  # hdp: also try groups wider than the smallest (docs/PLAN.md, "Widen")

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy: unknown '{self.policy}' (known: {', '.join(POLICIES)})")
        if not (isinstance(self.num_ranks, int) and self.num_ranks >= 1):
            raise ConfigError(f"num_ranks: must be an int >= 1, got {self.num_ranks!r}")
        if not (isinstance(self.capacity, int) and self.capacity >= 1):
            raise ConfigError(f"capacity: must be an int >= 1, got {self.capacity!r}")
        if self.max_context is not None and self.max_context < 1:
            raise ConfigError(f"max_context: must be >= 1, got {self.max_context!r}")
        if not isinstance(self.widen, bool):
            raise ConfigError(f"widen: must be a bool, got {self.widen!r}")
        if self.widen and self.policy != "hdp":
            raise ConfigError(
                f"widen: only the hdp policy widens groups, not '{self.policy}' (unset widen)"
            )

    def build(self, cost: CostModel) -> Planner:
        self.validate()
        return Planner(self, cost)


class Planner:
    """Plans steps for one configuration and cost model."""

    def __init__(self, config: PlannerConfig, cost: CostModel) -> None:
        self.config = config
        self.cost = cost

    def plan(self, lengths: np.ndarray, sample_ids: np.ndarray | None = None) -> StepPlan:
        """Plan one global batch (lengths in batch order; ids default to 0..n-1)."""
        lengths = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
        if sample_ids is None:
            sample_ids = np.arange(lengths.shape[0], dtype=np.int64)
        sample_ids = np.ascontiguousarray(sample_ids, dtype=np.int64).reshape(-1)
        if sample_ids.shape != lengths.shape:
            raise MixlenError("sample_ids and lengths must have the same size")
        if lengths.size and lengths.min() < 0:
            raise MixlenError("sample lengths must be >= 0")
        policy = self.config.policy
        if policy == "static":
            return _plan_static(self.config, self.cost, lengths, sample_ids)
        return _plan_dynamic(self.config, self.cost, lengths, sample_ids, balance=policy == "hdp")


def plan_step(
    lengths: np.ndarray,
    config: PlannerConfig,
    cost: CostModel,
    sample_ids: np.ndarray | None = None,
) -> StepPlan:
    """One-call form of PlannerConfig(...).build(cost).plan(lengths, sample_ids)."""
    return config.build(cost).plan(lengths, sample_ids)


# ------------------------------------------------------------------------------------------------
# Shared pieces
# ------------------------------------------------------------------------------------------------
def group_time_ns(
    cost: CostModel, lengths: np.ndarray, k: np.ndarray, offload_layers: np.ndarray
) -> np.ndarray:
    """Member time of a group micro-batch holding one sample: c + share + exposed comm/offload."""
    s = np.asarray(lengths, dtype=np.int64)
    one = np.arange(s.shape[0] + 1, dtype=np.int64)
    return _group_times(
        cost, s, one, one[:-1], np.asarray(k, np.int64), np.asarray(offload_layers, np.int64)
    )


def lower_bound_ns(cost: CostModel, lengths: np.ndarray, num_ranks: int, capacity: int) -> int:
    """max(total work / N, largest member share): each sample on its smallest group with no
    offload (member shares in integer ns with their exposed ring traffic, as the planners charge
    them), plus c for the fewest rank-micro-batches any plan needs (ceil(tokens / C)). A larger
    group only adds exposed traffic in total, so this bounds every hdp/naive-hdp plan without
    offload or widening from below (static and widen split more, offload changes group sizes:
    they may go under it)."""
    return max(_lower_bound_terms(cost, lengths, num_ranks, capacity))


def _lower_bound_terms(
    cost: CostModel, lengths: np.ndarray, num_ranks: int, capacity: int
) -> tuple[int, int]:
    """(ceil(total work / N), largest member share) of lower_bound_ns. The first term also bounds
    widened plans (a wider group adds exposed traffic and overhead in total, never removes work)."""
    s = lengths[lengths > 0]
    if s.size == 0:
        return 0, 0
    k = np.maximum(1, -(-s // capacity))
    shares = cost.work_ns(s, 1)
    long_ = np.flatnonzero(k > 1)
    shares[long_] = group_time_ns(cost, s[long_], k[long_], np.zeros_like(long_)) - cost.c_ns
    total = int((k * shares).sum()) + cost.c_ns * int(-(-int(s.sum()) // capacity))
    share = int(shares.max()) + cost.c_ns
    return -(-total // num_ranks), share


def _too_long(lengths: np.ndarray, sample_ids: np.ndarray, limit: int, what: str) -> None:
    bad = np.flatnonzero(lengths > limit)
    if bad.size:
        i = int(bad[np.argmax(lengths[bad])])
        raise MixlenError(
            f"sample {int(sample_ids[i])} has {int(lengths[i])} tokens, more than {what} = {limit}: "
            "no group can hold it (raise --ranks or --capacity, enable --offload, or cap sample "
            "length at preprocess time)"
        )


def _assemble(
    policy: str,
    config: PlannerConfig,
    cost: CostModel,
    lengths: np.ndarray,
    sample_ids: np.ndarray,
    mb_key: np.ndarray,
    mb_k: np.ndarray,
    mb_ranks: np.ndarray,
    mb_capacity: np.ndarray,
    mb_offload_layers: np.ndarray,
    mb_items_off: np.ndarray,
    items: np.ndarray,
    mb_time: np.ndarray,
    meta: dict,
    lower_bound: int,
) -> StepPlan:
    """Order micro-batches by key (the slot order), replay, and build the StepPlan."""
    n_mb = mb_k.shape[0]
    order = np.argsort(mb_key, kind="stable")
    k = mb_k[order]
    goff = np.zeros(n_mb + 1, dtype=np.int64)
    np.cumsum(k, out=goff[1:])
    src_goff = np.zeros(n_mb + 1, dtype=np.int64)
    np.cumsum(mb_k, out=src_goff[1:])
    gidx = _gather(src_goff, order, goff)
    ranks = mb_ranks[gidx].astype(np.int32)
    cnt = np.diff(mb_items_off)[order]
    poff = np.zeros(n_mb + 1, dtype=np.int64)
    np.cumsum(cnt, out=poff[1:])
    pidx = _gather(mb_items_off, order, poff)
    item = items[pidx]
    times = mb_time[order].astype(np.int64)
    finish = replay_kernel(goff, ranks.astype(np.int64), times, config.num_ranks)
    offload = mb_offload_layers[order].astype(np.float64) / cost.num_layers
    return StepPlan(
        policy=policy,
        num_ranks=config.num_ranks,
        capacity=config.capacity,
        cost_hash=cost.hash,
        seed=config.seed,
        sample_ids=sample_ids,
        lengths=lengths,
        mb_group_offsets=goff,
        group_ranks=ranks,
        mb_capacity=mb_capacity[order].astype(np.int64),
        mb_offload=offload,
        mb_piece_offsets=poff,
        piece_item=item.astype(np.int64),
        piece_start=np.zeros(item.shape[0], dtype=np.int64),
        piece_end=lengths[item].astype(np.int64),
        mb_time_ns=times,
        rank_time_ns=finish,
        makespan_ns=int(finish.max()) if finish.size else 0,
        lower_bound_ns=lower_bound,
        meta=meta,
    )


@njit(cache=True)
def _gather(src_off: np.ndarray, order: np.ndarray, dst_off: np.ndarray) -> np.ndarray:
    """Flat source positions of segments `order` laid out at dst_off."""
    out = np.empty(dst_off[-1], dtype=np.int64)
    for i in range(order.shape[0]):
        s = src_off[order[i]]
        for j in range(dst_off[i + 1] - dst_off[i]):
            out[dst_off[i] + j] = s + j
    return out


def _pack_local(
    short_idx: np.ndarray, lengths: np.ndarray, capacity: int
) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit pack samples short_idx into micro-batches: (items_off [B+1], items by bin)."""
    if short_idx.size == 0:
        return np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    b = bfd_kernel(np.ascontiguousarray(lengths[short_idx]), int(capacity))
    order, off = group_by_bucket_kernel(b, int(b.max()) + 1)
    return off, short_idx[order]


def _dynamic_groups(
    cost: CostModel,
    lengths: np.ndarray,
    sample_ids: np.ndarray,
    num_ranks: int,
    capacity: int,
    offload: bool,
    target_ns: int | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Group size k and offload layers j of every sample (k = 0 for zero-length samples)."""
    s = lengths
    k = np.where(s > 0, np.maximum(1, -(-s // capacity)), 0)
    j = np.zeros_like(s)
    if not offload:
        _too_long(lengths, sample_ids, num_ranks * capacity, "N * C")
        return k, j
    l_ = cost.num_layers
    caps = cost.offload_capacity(capacity, np.arange(l_ + 1))  # nondecreasing in j
    jmax = cost.max_offload_layers(s)
    bad = np.flatnonzero(s > caps[jmax] * num_ranks)
    if bad.size:
        i = int(bad[0])
        _too_long(s[i : i + 1], sample_ids[i : i + 1], int(caps[jmax[i]]) * num_ranks, "N * C_eff")
    long_idx = np.flatnonzero(s > capacity)
    sl = s[long_idx]
    d_min = -(-sl // caps[jmax[long_idx]])
    k_hi = np.maximum(k[long_idx], d_min)
    if target_ns is None:
        kk = d_min
    else:
        # Smallest k in [d_min, k_hi] whose member time fits the target (k_hi if none): time is
        # at least c + work/k, so start at the k that bound allows and step up.
        work = cost.a * sl.astype(np.float64) ** 2 + cost.b * sl
        room = max(target_ns - cost.c_ns, 1)
        kk = np.clip(np.floor(work * 1e9 / room).astype(np.int64), d_min, k_hi)
        todo = np.arange(sl.shape[0])
        while todo.size:
            kt = kk[todo]
            jt = np.searchsorted(caps, -(-sl[todo] // kt))
            t = group_time_ns(cost, sl[todo], kt, jt)
            todo = todo[(t > target_ns) & (kt < k_hi[todo])]
            kk[todo] += 1
    k[long_idx] = kk
    j[long_idx] = np.searchsorted(caps, -(-sl // kk))
    return k, j


# ------------------------------------------------------------------------------------------------
# hdp and naive-hdp
# ------------------------------------------------------------------------------------------------
def _plan_dynamic(
    config: PlannerConfig,
    cost: CostModel,
    lengths: np.ndarray,
    sample_ids: np.ndarray,
    balance: bool,
) -> StepPlan:
    n_ranks, cap = config.num_ranks, config.capacity
    work_bound, share_bound = _lower_bound_terms(cost, lengths, n_ranks, cap)
    lb = max(work_bound, share_bound)
    target = lb if balance else None
    k, j = _dynamic_groups(cost, lengths, sample_ids, n_ranks, cap, config.offload, target)
    caps = cost.offload_capacity(cap, np.arange(cost.num_layers + 1))
    # Group micro-batches: one per sample that needs k >= 2 ranks or offload (widen may add short
    # samples to them); local micro-batches: the short samples packed best-fit.
    grp = np.flatnonzero((k >= 2) | (j > 0))
    short = np.flatnonzero((k == 1) & (j == 0))
    n_g = grp.shape[0]
    kg, jg = k[grp], j[grp]
    g_off = np.arange(n_g + 1, dtype=np.int64)
    g_items = grp.astype(np.int64)
    g_time = group_time_ns(cost, lengths[grp], kg, jg)
    b_off, b_items = _pack_local(short, lengths, cap)
    b_time = _local_times(cost, lengths, b_off, b_items)
    if balance:
        budget = int(config.improve_rounds) * n_ranks
        sched = _hdp_schedule(kg, g_time, b_time, n_ranks, budget)
        meta: dict = {}
        if config.widen:
            layout = (kg, jg, g_off, g_items, g_time, b_off, b_items, b_time, sched)
            layout, meta = _widen(cost, lengths, caps, cap, n_ranks, budget, work_bound, layout)
            kg, jg, g_off, g_items, g_time, b_off, b_items, b_time, sched = layout
        _, g_order, g_ranks_sorted, b_rank, b_key, fills, moves, _, _ = sched
        n_g = kg.shape[0]
        g_key = np.empty(n_g, dtype=np.int64)
        g_key[g_order] = 2 * np.arange(n_g) + 1
        g_src_off = np.zeros(n_g + 1, dtype=np.int64)
        np.cumsum(kg, out=g_src_off[1:])
        g_sorted_off = np.zeros(n_g + 1, dtype=np.int64)
        np.cumsum(kg[g_order], out=g_sorted_off[1:])
        inv = np.argsort(g_order)
        g_ranks = g_ranks_sorted[_gather(g_sorted_off, inv, g_src_off)]
        mb_key = np.concatenate([g_key, b_key])
        mb_ranks = np.concatenate([g_ranks, b_rank])
        meta = {"improve_moves": int(moves), "gap_fills": int(fills), **meta}
    n_bins = b_off.shape[0] - 1
    mb_k = np.concatenate([kg, np.ones(n_bins, dtype=np.int64)])
    mb_time = np.concatenate([g_time, b_time]).astype(np.int64)
    if not balance:
        # ByteScale Alg. 1: micro-batches by decreasing tokens, first fit into waves of N ranks (one
        # micro-batch per rank per wave); no cost balancing.
        b_tokens = (
            np.add.reduceat(lengths[b_items], b_off[:-1]) if n_bins else np.zeros(0, np.int64)
        )
        tokens = np.concatenate([lengths[grp], b_tokens]).astype(np.int64)
        order = np.lexsort((np.arange(mb_k.shape[0]), -tokens)).astype(np.int64)
        ranks_sorted, wave = place_waves(mb_k[order], n_ranks)
        src_off = np.zeros(mb_k.shape[0] + 1, dtype=np.int64)
        np.cumsum(mb_k, out=src_off[1:])
        sorted_off = np.zeros(mb_k.shape[0] + 1, dtype=np.int64)
        np.cumsum(mb_k[order], out=sorted_off[1:])
        inv = np.argsort(order)
        mb_ranks = ranks_sorted[_gather(sorted_off, inv, src_off)]
        w = np.empty(mb_k.shape[0], dtype=np.int64)
        w[order] = wave
        first_rank = mb_ranks[src_off[:-1]]
        mb_key = w * n_ranks + first_rank
        meta = {"waves": int(wave.max()) + 1 if wave.size else 0}
    mb_cap = np.concatenate([caps[jg], np.full(n_bins, cap, dtype=np.int64)])
    mb_off_layers = np.concatenate([jg, np.zeros(n_bins, dtype=np.int64)])
    items_off = np.concatenate([g_off[:-1], g_off[-1] + b_off])
    items = np.concatenate([g_items, b_items]).astype(np.int64)
    meta["offload"] = bool(config.offload)
    return _assemble(
        "hdp" if balance else "naive-hdp",
        config,
        cost,
        lengths,
        sample_ids,
        mb_key,
        mb_k,
        mb_ranks,
        mb_cap,
        mb_off_layers,
        items_off,
        items,
        mb_time,
        meta,
        lb,
    )


def _local_times(
    cost: CostModel, lengths: np.ndarray, b_off: np.ndarray, b_items: np.ndarray
) -> np.ndarray:
    """Time of each local micro-batch: c + the whole compute of its samples."""
    if b_off.shape[0] <= 1:
        return np.zeros(0, np.int64)
    w1 = cost.work_ns(lengths[b_items], 1)
    return (cost.c_ns + np.add.reduceat(w1, b_off[:-1])).astype(np.int64)


def _hdp_schedule(
    kg: np.ndarray,
    g_time: np.ndarray,
    b_time: np.ndarray,
    n_ranks: int,
    budget: int,
    rules: tuple[tuple[int, bool], ...] | None = None,
) -> tuple:
    """hdp's balance for fixed micro-batches: three group orders x two placements (`rules`, all by
    default) through _balance, the smallest makespan kept, then the improvement pass on its tail.
    Returns (makespan after improvement, g_order, group ranks in that order, local ranks, local
    slot keys, gap fills, improvement moves, rank loads, the winning rule)."""
    n_g, n_bins = kg.shape[0], b_time.shape[0]
    orders = [np.lexsort((np.arange(n_g), -kg, -g_time))]
    if n_g > 1:
        orders.append(np.lexsort((np.arange(n_g), -g_time, -kg)))
        orders.append(np.lexsort((np.arange(n_g), -kg, -g_time * kg)))
    if rules is None or n_g <= 1:
        rules = tuple(
            (o, bf) for o in range(len(orders)) for bf in ((False, True)[: 1 + (n_g > 1)])
        )
    best, best_rule = None, None
    b_order = np.lexsort((np.arange(n_bins), -b_time)).astype(np.int64)
    for rule in rules:
        g_order = orders[rule[0]].astype(np.int64)
        cand = _balance(g_order, kg, g_time, b_time, b_order, n_ranks, rule[1])
        if best is None or cand[0] < best[0]:
            best, best_rule = cand, rule
    _, g_order, g_ranks_sorted, b_rank, b_key, fills, tail, tail_rank, load = best
    moves = improve_local(tail_rank, b_time[tail], load, budget)
    b_rank[tail] = tail_rank
    # Tail micro-batches run after every group, so their rank's order among them is free.
    b_key[tail] = 2 * n_g + tail_rank
    makespan = int(load.max()) if n_ranks else 0
    return makespan, g_order, g_ranks_sorted, b_rank, b_key, fills, int(moves), load, best_rule


# ------------------------------------------------------------------------------------------------
# hdp widen: give long samples more ranks than the smallest group when that shortens the step
# ------------------------------------------------------------------------------------------------
WIDEN_SLACK = 1 / 256  # skip the search when the plan is within this of the work bound
WIDEN_EVALS = 12  # widened candidates evaluated at most (besides the plain plan)
WIDEN_FILLS = 2  # fill candidates after them: spare room of widened groups, of all groups
WIDEN_LAMBDA_STEP = 1.25  # geometric step of the scalar family's target


def _group_times(
    cost: CostModel,
    lengths: np.ndarray,
    g_off: np.ndarray,
    g_items: np.ndarray,
    kg: np.ndarray,
    jg: np.ndarray,
) -> np.ndarray:
    """Member time of group micro-batches holding one or more samples (each split zigzag over the
    group; group g holds g_items[g_off[g]:g_off[g + 1]]): c + shares + exposed ring/offload of the
    member's total positions."""
    if kg.shape[0] == 0:
        return np.zeros(0, np.int64)
    per = np.repeat(kg, np.diff(g_off))
    s = lengths[g_items]
    attn = np.add.reduceat(cost.attn_ns(s, per), g_off[:-1])
    lin = np.add.reduceat(cost.linear_ns(s, per), g_off[:-1])
    work = np.add.reduceat(cost.work_ns(s, per), g_off[:-1])
    n = np.add.reduceat(s, g_off[:-1]).astype(np.float64) / kg
    ring = cost.ring_ns(n, kg)
    off = cost.offload_ns(n, jg.astype(np.float64) / cost.num_layers)
    return (cost.c_ns + work + cost.exposed_ns(attn, lin, ring, off)).astype(np.int64)


def _widen(
    cost: CostModel,
    lengths: np.ndarray,
    caps: np.ndarray,
    cap: int,
    n_ranks: int,
    budget: int,
    work_bound: int,
    layout: tuple,
) -> tuple[tuple, dict]:
    """Search group-size vectors k' >= k (k' <= min(N, S)) for a smaller estimated makespan.

    Candidates, each scheduled by _hdp_schedule (rank times as the slot-order replay computes
    them; a wider ring pays its extra hops and every member's per-micro-batch overhead):

    1. scalar family: k_i(lam) = clip(ceil(W_i / (lam * T)), k_i, min(N, S_i)), W_i the sample's
       whole compute, T the work bound ceil(total / N); lam starts where the family equals the
       plain plan and falls by WIDEN_LAMBDA_STEP (new vectors only) until one does not improve;
    2. critical path: on the rank that finishes last, widen one of its groups (longest first) by
       the factor that would take the excess over T off its share; accept the first improvement
       and repeat, stop when no group on that rank improves;
    3. fill: short samples whose zigzag pair fits a group's spare room (C - ceil(S/k) per member;
       groups without offload) join that group's micro-batch (first fit, longest sample and widest
       group first) and the rest is packed again; once into widened groups only, once into all.

    Candidates are scheduled with the plain plan's winning order/placement rule; the best one is
    scheduled again with all rules. At most WIDEN_EVALS + WIDEN_FILLS candidates. The plain plan
    is one, so the
    estimate never gets worse; nothing is tried when the plan is within WIDEN_SLACK of T (no plan,
    widened or not, finishes before T)."""
    kg0, jg0, g_off0, g_items0, g_time0, b_off0, b_items0, b_time0, sched0 = layout
    meta = {"widen": True, "widen_candidates": 0, "widened": 0, "widen_filled": 0}
    n_g = kg0.shape[0]
    if n_g == 0 or sched0[0] <= work_bound + work_bound * WIDEN_SLACK:
        return layout, meta
    s_g = lengths[g_items0]  # one sample per group in the plain plan
    k_cap = np.minimum(n_ranks, s_g)  # k <= S: every member gets a non-empty chunk
    rules = (sched0[8],)
    best = layout
    seen = {kg0.tobytes()}
    evals = 0

    def evaluate(cand: tuple) -> bool:
        """Schedule a layout (sched slot ignored); keep it if the makespan improves."""
        nonlocal best, evals
        kk, jj, g_off, g_items, t, b_off, b_items, bt, _ = cand
        sched = _hdp_schedule(kk, t, bt, n_ranks, budget, rules)
        evals += 1
        if sched[0] < best[8][0]:
            best = (kk, jj, g_off, g_items, t, b_off, b_items, bt, sched)
            return True
        return False

    def widened(kk: np.ndarray) -> tuple:
        jj = np.minimum(np.searchsorted(caps, -(-s_g // kk)), jg0).astype(np.int64)
        t = group_time_ns(cost, s_g, kk, jj)
        return (kk, jj, g_off0, g_items0, t, b_off0, b_items0, b_time0, None)

    # 1. scalar family
    if (kg0 < k_cap).any():
        w = cost.work_ns(s_g, 1).astype(np.float64)
        tw = float(max(work_bound, 1))
        lam = float((w / (kg0 * tw)).max())
        for _ in range(64):
            if evals >= WIDEN_EVALS:
                break
            lam /= WIDEN_LAMBDA_STEP
            kk = np.clip(np.ceil(w / (lam * tw)).astype(np.int64), kg0, k_cap)
            key = kk.tobytes()
            if key in seen:
                if (kk == k_cap).all():
                    break
                continue
            seen.add(key)
            if not evaluate(widened(kk)):
                break
    # 2. critical path: widen one group on the rank that finishes last
    while evals < WIDEN_EVALS:
        kk, t, sched = best[0], best[4], best[8]
        makespan, g_order, g_ranks_sorted, load = sched[0], sched[1], sched[2], sched[7]
        excess = makespan - work_bound
        if excess <= 0:
            break
        off = np.zeros(n_g + 1, dtype=np.int64)
        np.cumsum(kk[g_order], out=off[1:])
        pos = np.flatnonzero(g_ranks_sorted == int(np.argmax(load)))
        on = g_order[np.searchsorted(off, pos, side="right") - 1]
        on = on[kk[on] < k_cap[on]]
        on = on[np.lexsort((on, -t[on]))]
        improved = False
        for g in on.tolist():
            share = float(t[g] - cost.c_ns)
            left = max(share - excess, share / 4)
            kn = min(int(k_cap[g]), max(int(kk[g]) + 1, int(np.ceil(kk[g] * share / left))))
            cand = kk.copy()
            cand[g] = kn
            key = cand.tobytes()
            if key in seen:
                continue
            seen.add(key)
            improved = evaluate(widened(cand))
            if improved or evals >= WIDEN_EVALS:
                break
        if not improved:
            break
    # 3. fill spare ring room with short samples
    kk, jj = best[0], best[1]
    if b_items0.size:
        room = np.where(jj == 0, cap - (-(-s_g // kk)), 0)
        rooms = [np.where(kk > kg0, room, 0)]
        if not np.array_equal(rooms[0], room):
            rooms.append(room)
        for r in rooms:  # at most WIDEN_FILLS more candidates
            if not r.any():
                continue
            filled = _fill_layout(lengths, kk, g_items0, b_items0, r, cap)
            if filled is None:
                continue
            g_off, g_items, b_off, b_items = filled
            t = _group_times(cost, lengths, g_off, g_items, kk, jj)
            bt = _local_times(cost, lengths, b_off, b_items)
            evaluate((kk, jj, g_off, g_items, t, b_off, b_items, bt, None))
    if best is not layout:  # the winner with every order/placement rule
        kk, jj, g_off, g_items, t, b_off, b_items, bt, sched = best
        full = _hdp_schedule(kk, t, bt, n_ranks, budget)
        if full[0] < sched[0]:
            best = (kk, jj, g_off, g_items, t, b_off, b_items, bt, full)
    meta["widen_candidates"] = evals
    meta["widened"] = int((best[0] > kg0).sum())
    meta["widen_filled"] = int(best[3].shape[0] - n_g)
    return best, meta


def _fill_layout(
    lengths: np.ndarray,
    kg: np.ndarray,
    g_items: np.ndarray,
    short: np.ndarray,
    room: np.ndarray,
    cap: int,
) -> tuple | None:
    """Move short samples into groups' spare room (`room` positions per member; a sample of S takes
    ceil(S/k)) and pack the rest into local micro-batches again: (g_off, g_items, b_off, b_items),
    or None if nothing moves."""
    s_order = short[np.lexsort((short, -lengths[short]))]
    g_order = np.lexsort((np.arange(kg.shape[0]), -kg)).astype(np.int64)
    dest = _fill_rooms(lengths[s_order], kg[g_order], room[g_order].astype(np.int64))
    moved = dest >= 0
    if not moved.any():
        return None
    grp_of = g_order[dest[moved]]
    extra = s_order[moved]
    o = np.lexsort((extra, grp_of))
    grp_of, extra = grp_of[o], extra[o]
    g_off = np.zeros(kg.shape[0] + 1, dtype=np.int64)
    np.cumsum(1 + np.bincount(grp_of, minlength=kg.shape[0]), out=g_off[1:])
    items = np.empty(g_off[-1], dtype=np.int64)
    items[g_off[:-1]] = g_items
    rank_in = np.arange(extra.shape[0]) - np.searchsorted(grp_of, grp_of)
    items[g_off[grp_of] + 1 + rank_in] = extra
    b_off, b_items = _pack_local(np.sort(s_order[~moved]), lengths, cap)
    return g_off, items, b_off, b_items


@njit(cache=True)
def _fill_rooms(s: np.ndarray, k: np.ndarray, room: np.ndarray) -> np.ndarray:
    """First fit of samples (given order) into groups' per-member room: a sample of s positions
    takes ceil(s/k) of group room; returns the group index per sample or -1. A max segment tree
    over room*k (the longest sample a group can still take) finds the first fit in O(log G)."""
    out = -np.ones(s.shape[0], dtype=np.int64)
    if k.shape[0] == 0:
        return out
    tree = max_tree(room * k)
    for b in range(s.shape[0]):
        if s[b] > tree[1]:
            continue
        g = max_tree_first(tree, s[b])
        out[b] = g
        room[g] -= (s[b] + k[g] - 1) // k[g]
        max_tree_set(tree, g, room[g] * k[g])
    return out


def _balance(
    g_order: np.ndarray,
    kg: np.ndarray,
    g_time: np.ndarray,
    b_time: np.ndarray,
    b_order: np.ndarray,
    n_ranks: int,
    backfill: bool,
) -> tuple:
    """hdp's assignment for one order of the group micro-batches: rings first, each on the k ranks
    furthest below the maximum (or, with backfill, list scheduling: whenever ranks free up, the
    first group in the order that fits starts on them); local micro-batches fill the idle gaps before groups, then go by
    decreasing time to the least-loaded rank. Returns (makespan, g_order, group ranks in that
    order, rank of each local micro-batch, its slot key, gap fills, the tail micro-batches, their
    ranks, and the rank loads)."""
    n_g, n_bins = g_order.shape[0], b_time.shape[0]
    if backfill:
        placed, g_ranks_sorted, load, gap_rank, gap_group, gap_size = list_schedule_groups(
            kg[g_order], g_time[g_order], n_ranks
        )
        g_order = g_order[placed]
    else:
        g_ranks_sorted, load, gap_rank, gap_group, gap_size = place_groups(
            kg[g_order], g_time[g_order], n_ranks
        )
    t_sorted = b_time[b_order]
    in_gap = fill_gaps(t_sorted, gap_size)
    filled = in_gap >= 0
    tail = np.flatnonzero(~filled)
    tail_rank = place_local(t_sorted[tail], load)
    sorted_rank = np.empty(n_bins, dtype=np.int64)
    sorted_rank[filled] = gap_rank[in_gap[filled]]
    sorted_rank[tail] = tail_rank
    # Slot keys: a gap filler just before its group (2g), group g at 2g+1, tails after all groups.
    sorted_key = np.empty(n_bins, dtype=np.int64)
    sorted_key[filled] = 2 * gap_group[in_gap[filled]]
    sorted_key[tail] = 2 * n_g
    b_rank = np.empty(n_bins, dtype=np.int64)
    b_rank[b_order] = sorted_rank
    b_key = np.empty(n_bins, dtype=np.int64)
    b_key[b_order] = sorted_key
    makespan = int(load.max()) if n_ranks else 0
    tail_orig = b_order[tail]
    return (
        makespan,
        g_order,
        g_ranks_sorted,
        b_rank,
        b_key,
        int(filled.sum()),
        tail_orig,
        tail_rank,
        load,
    )


# ------------------------------------------------------------------------------------------------
# static DP x CP mesh
# ------------------------------------------------------------------------------------------------
def static_cp_degree(num_ranks: int, capacity: int, max_context: int) -> int:
    """Smallest divisor d of N whose group holds max_context (largest chunk pair ceil(S/d) <= C)."""
    for d in range(1, num_ranks + 1):
        if num_ranks % d == 0 and -(-max_context // d) <= capacity:
            return d
    raise MixlenError(
        f"max context {max_context} does not fit N * C = {num_ranks * capacity} "
        "(no CP degree dividing N holds it)"
    )


def _plan_static(
    config: PlannerConfig, cost: CostModel, lengths: np.ndarray, sample_ids: np.ndarray
) -> StepPlan:
    n_ranks, cap = config.num_ranks, config.capacity
    longest = int(lengths.max()) if lengths.size else 0
    max_ctx = config.max_context if config.max_context is not None else max(longest, 1)
    if longest > max_ctx:
        _too_long(lengths, sample_ids, max_ctx, "max_context")
    cp = static_cp_degree(n_ranks, cap, max_ctx)
    n_dp = n_ranks // cp
    live = np.flatnonzero(lengths > 0)
    share = -(-lengths[live] // cp)  # each member's positions are at most ceil(S / cp)
    b_off, b_pos = _pack_local(np.arange(live.shape[0], dtype=np.int64), share, cap)
    b_items = live[b_pos]
    n_bins = b_off.shape[0] - 1
    if n_bins:
        s = lengths[b_items]
        attn = np.add.reduceat(cost.attn_ns(s, cp), b_off[:-1])
        lin = np.add.reduceat(cost.linear_ns(s, cp), b_off[:-1])
        work = np.add.reduceat(cost.work_ns(s, cp), b_off[:-1])
        toks = np.add.reduceat(s, b_off[:-1])
        ring = cost.ring_ns(toks.astype(np.float64) / cp, cp)
        b_time = cost.c_ns + work + cost.exposed_ns(attn, lin, ring, np.zeros_like(ring))
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
    return _assemble(
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
        lower_bound_ns(cost, lengths, n_ranks, cap),
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


def describe_policy(policy: str) -> str:
    """One line per policy for reports."""
    return {
        "hdp": "dynamic groups, cost-balanced (rings first, LPT, improvement pass)",
        "naive-hdp": "dynamic groups, token waves, no balancing (ByteScale Alg. 1)",
        "static": "fixed DP x CP mesh, every sample split over the CP group",
    }[policy]
