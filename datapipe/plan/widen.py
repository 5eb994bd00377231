"""hdp `widen` (`PlannerConfig.widen`, on by default): give long samples more ranks than their smallest
group, or put short samples into a ring's spare room, when that lowers the estimated makespan
(docs/PLAN.md, "Widen"). The plain hdp plan is always a candidate, so widening never raises the
estimate. The last candidate, the batch's static DP x CP mesh, is a whole StepPlan and is tried in
datapipe.plan.hdp.
"""

from __future__ import annotations

import numpy as np

from datapipe.jit import njit
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
    meta = {"widen": True, "widen_candidates": 0, "widened": 0, "widen_filled": 0}
    if sched.makespan <= work_bound + work_bound * WIDEN_SLACK:
        return layout, sched, meta
    search = _Search(cost, lengths, caps, cap, n_ranks, budget, work_bound, layout, sched)
    search.scalar_family()
    search.critical_path()
    search.fill()
    best, best_sched = search.best, search.best_sched
    if best is not layout:  # the winner with every order/placement rule
        full = hdp_schedule(best.kg, best.g_time, best.b_time, n_ranks, budget)
        if full.makespan < best_sched.makespan:
            best_sched = full
    meta["widen_candidates"] = search.evals
    meta["widened"] = int((best.kg > layout.kg).sum())
    meta["widen_filled"] = int(best.g_items.shape[0] - layout.kg.shape[0])
    return best, best_sched, meta


class _Search:
    """widen's candidates around one plain plan: the best layout and schedule so far, the group
    size vectors tried, and how many candidates were scheduled."""

    def __init__(
        self,
        cost: CostModel,
        lengths: np.ndarray,
        caps: np.ndarray,
        cap: int,
        n_ranks: int,
        budget: int,
        work_bound: int,
        plain: Layout,
        sched: Schedule,
    ) -> None:
        self.cost, self.lengths, self.caps, self.cap = cost, lengths, caps, cap
        self.n_ranks, self.budget, self.work_bound = n_ranks, budget, work_bound
        self.plain = plain
        self.s_g = lengths[plain.g_items]  # one sample per group in the plain plan
        self.k_cap = np.minimum(n_ranks, self.s_g)  # k <= S: every member gets a non-empty chunk
        self.rules = (sched.rule,)
        self.best, self.best_sched = plain, sched
        self.seen = {plain.kg.tobytes()}
        self.evals = 0

    def evaluate(self, cand: Layout) -> bool:
        """Schedule a layout; keep it if the makespan improves."""
        s = hdp_schedule(cand.kg, cand.g_time, cand.b_time, self.n_ranks, self.budget, self.rules)
        self.evals += 1
        if s.makespan < self.best_sched.makespan:
            self.best, self.best_sched = cand, s
            return True
        return False

    def widened(self, kk: np.ndarray) -> Layout:
        """The plain layout with group sizes kk (offload layers lowered to what kk needs)."""
        jj = np.minimum(np.searchsorted(self.caps, -(-self.s_g // kk)), self.plain.jg)
        jj = jj.astype(np.int64)
        return self.plain._replace(kg=kk, jg=jj, g_time=group_time_ns(self.cost, self.s_g, kk, jj))

    def scalar_family(self) -> None:
        """1. k_i(lam) = clip(ceil(W_i / (lam * T)), k_i, min(N, S_i)), lam falling."""
        kg0, k_cap = self.plain.kg, self.k_cap
        if not (kg0 < k_cap).any():
            return
        w = self.cost.work_ns(self.s_g, 1).astype(np.float64)
        tw = float(max(self.work_bound, 1))
        lam = float((w / (kg0 * tw)).max())
        for _ in range(64):
            if self.evals >= WIDEN_EVALS:
                break
            lam /= WIDEN_LAMBDA_STEP
            kk = np.clip(np.ceil(w / (lam * tw)).astype(np.int64), kg0, k_cap)
            key = kk.tobytes()
            if key in self.seen:
                if (kk == k_cap).all():
                    break
                continue
            self.seen.add(key)
            if not self.evaluate(self.widened(kk)):
                break

    def critical_path(self) -> None:
        """2. Widen one group on the rank that finishes last, until none improves."""
        n_g, k_cap = self.plain.kg.shape[0], self.k_cap
        while self.evals < WIDEN_EVALS:
            kk, t, sched = self.best.kg, self.best.g_time, self.best_sched
            excess = sched.makespan - self.work_bound
            if excess <= 0:
                break
            off = np.zeros(n_g + 1, dtype=np.int64)
            np.cumsum(kk[sched.g_order], out=off[1:])
            pos = np.flatnonzero(sched.g_ranks_sorted == int(np.argmax(sched.load)))
            on = sched.g_order[np.searchsorted(off, pos, side="right") - 1]
            on = on[kk[on] < k_cap[on]]
            on = on[np.lexsort((on, -t[on]))]
            improved = False
            for g in on.tolist():
                share = float(t[g] - self.cost.c_ns)
                left = max(share - excess, share / 4)
                kn = min(int(k_cap[g]), max(int(kk[g]) + 1, int(np.ceil(kk[g] * share / left))))
                cand = kk.copy()
                cand[g] = kn
                key = cand.tobytes()
                if key in self.seen:
                    continue
                self.seen.add(key)
                improved = self.evaluate(self.widened(cand))
                if improved or self.evals >= WIDEN_EVALS:
                    break
            if not improved:
                break

    def fill(self) -> None:
        """3. Short samples into spare ring room: of widened groups, then of all groups."""
        plain, cost, lengths, cap = self.plain, self.cost, self.lengths, self.cap
        kk, jj = self.best.kg, self.best.jg
        if not plain.b_items.size:
            return
        room = np.where(jj == 0, cap - (-(-self.s_g // kk)), 0)
        rooms = [np.where(kk > plain.kg, room, 0)]
        if not np.array_equal(rooms[0], room):
            rooms.append(room)
        for r in rooms:  # at most WIDEN_FILLS more candidates
            if not r.any():
                continue
            filled = fill_layout(lengths, kk, plain.g_items, plain.b_items, r, cap)
            if filled is None:
                continue
            g_off, g_items, b_off, b_items = filled
            g_time = group_times(cost, lengths, g_off, g_items, kk, jj)
            b_time = local_times(cost, lengths, b_off, b_items)
            self.evaluate(Layout(kk, jj, g_off, g_items, g_time, b_off, b_items, b_time))


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
