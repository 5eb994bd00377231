"""hdp `widen` (opt-in, `PlannerConfig.widen`): give long samples more ranks than their smallest
group, or put short samples into a ring's spare room, when that lowers the estimated makespan
(docs/PLAN.md, "Widen"). The plain hdp plan is always a candidate, so widening never raises the
estimate. The last candidate, the batch's static DP x CP mesh, is a whole StepPlan and is tried in
datapipe.plan.hdp.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from datapipe.plan.balance import Schedule, hdp_schedule
from datapipe.plan.common import Layout, group_time_ns, group_times, local_times, pack_local
from datapipe.plan.cost import CostModel
from datapipe.plan.schedule import max_tree, max_tree_first, max_tree_set

WIDEN_SLACK = 1 / 256  # skip the search when the plan is within this of the work bound
WIDEN_EVALS = 12  # widened candidates evaluated at most (besides the plain plan)
WIDEN_FILLS = 2  # fill candidates after them: spare room of widened groups, of all groups
WIDEN_LAMBDA_STEP = 1.25  # geometric step of the scalar family's target


def widen(
    cost: CostModel,
    lengths: np.ndarray,
    caps: np.ndarray,
    cap: int,
    n_ranks: int,
    budget: int,
    work_bound: int,
    layout: Layout,
    sched: Schedule,
) -> tuple[Layout, Schedule, dict]:
    """Search group-size vectors k' >= k (k' <= min(N, S)) for a smaller estimated makespan.

    Candidates, each scheduled by hdp_schedule (rank times as the slot-order replay computes
    them; a wider ring pays its extra hops and every member's per-micro-batch overhead):

    1. scalar family: k_i(lam) = clip(ceil(W_i / (lam * T)), k_i, min(N, S_i)), W_i the sample's
       whole compute, T the work bound ceil(total / N); lam starts where the family equals the
       plain plan and falls by WIDEN_LAMBDA_STEP (new vectors only) until one does not improve;
    2. critical path: on the rank that finishes last, widen one of its groups (longest first) by
       the factor that would take the excess over T off its share; accept the first improvement
       and repeat, stop when no group on that rank improves;
    3. fill: short samples whose zigzag pair fits a group's spare room (C - ceil(S/k) per member;
       groups without offload) join that group's micro-batch (first fit, longest sample and widest
       group first) and the rest is packed again; once into widened groups only, once into all;

    Candidates are scheduled with the plain plan's winning order/placement rule; the best one is
    scheduled again with all rules. At most WIDEN_EVALS + WIDEN_FILLS candidates. The plain plan
    (its tail already balanced sample by sample, balance.rebalance_tail) is one, so the estimate
    never gets worse; nothing is tried when the plan is within WIDEN_SLACK of T (no plan,
    widened or not, finishes before T)."""
    plain = layout
    kg0, jg0 = plain.kg, plain.jg
    meta = {"widen": True, "widen_candidates": 0, "widened": 0, "widen_filled": 0}
    n_g = kg0.shape[0]
    if sched.makespan <= work_bound + work_bound * WIDEN_SLACK:
        return layout, sched, meta
    s_g = lengths[plain.g_items]  # one sample per group in the plain plan
    k_cap = np.minimum(n_ranks, s_g)  # k <= S: every member gets a non-empty chunk
    rules = (sched.rule,)
    best, best_sched = plain, sched
    seen = {kg0.tobytes()}
    evals = 0

    def evaluate(cand: Layout) -> bool:
        """Schedule a layout; keep it if the makespan improves."""
        nonlocal best, best_sched, evals
        s = hdp_schedule(cand.kg, cand.g_time, cand.b_time, n_ranks, budget, rules)
        evals += 1
        if s.makespan < best_sched.makespan:
            best, best_sched = cand, s
            return True
        return False

    def widened(kk: np.ndarray) -> Layout:
        jj = np.minimum(np.searchsorted(caps, -(-s_g // kk)), jg0).astype(np.int64)
        return plain._replace(kg=kk, jg=jj, g_time=group_time_ns(cost, s_g, kk, jj))

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
        kk, t = best.kg, best.g_time
        g_order, g_ranks_sorted, load = (
            best_sched.g_order,
            best_sched.g_ranks_sorted,
            best_sched.load,
        )
        excess = best_sched.makespan - work_bound
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
    kk, jj = best.kg, best.jg
    if plain.b_items.size:
        room = np.where(jj == 0, cap - (-(-s_g // kk)), 0)
        rooms = [np.where(kk > kg0, room, 0)]
        if not np.array_equal(rooms[0], room):
            rooms.append(room)
        for r in rooms:  # at most WIDEN_FILLS more candidates
            if not r.any():
                continue
            filled = fill_layout(lengths, kk, plain.g_items, plain.b_items, r, cap)
            if filled is None:
                continue
            g_off, g_items, b_off, b_items = filled
            evaluate(
                Layout(
                    kk,
                    jj,
                    g_off,
                    g_items,
                    group_times(cost, lengths, g_off, g_items, kk, jj),
                    b_off,
                    b_items,
                    local_times(cost, lengths, b_off, b_items),
                )
            )
    if best is not plain:  # the winner with every order/placement rule
        full = hdp_schedule(best.kg, best.g_time, best.b_time, n_ranks, budget)
        if full.makespan < best_sched.makespan:
            best_sched = full
    meta["widen_candidates"] = evals
    meta["widened"] = int((best.kg > kg0).sum())
    meta["widen_filled"] = int(best.g_items.shape[0] - n_g)
    return best, best_sched, meta


def fill_layout(
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
    dest = fill_rooms(lengths[s_order], kg[g_order], room[g_order].astype(np.int64))
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
    b_off, b_items = pack_local(np.sort(s_order[~moved]), lengths, cap)
    return g_off, items, b_off, b_items


@njit(cache=True)
def fill_rooms(s: np.ndarray, k: np.ndarray, room: np.ndarray) -> np.ndarray:
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
