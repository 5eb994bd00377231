"""Planner units at their boundaries, each against a plain-Python reference or a hand count:
first fit into idle gaps (an exact fit fits), offload hiding under compute that includes the size
term, the tie rule of hdp's sample-by-sample tail, and the smallest offload group whose member
time meets the target exactly, and the factor by which widen's critical path widens a group."""

from __future__ import annotations

import numpy as np

from datapipe.plan import cost as C
from datapipe.plan.balance import hdp_schedule, rebalance_tail
from datapipe.plan.common import dynamic_groups, dynamic_layout, group_times, lower_bound_terms
from datapipe.plan.planner import PlannerConfig
from datapipe.plan.schedule import fill_gaps
from datapipe.plan.widen import _Search

DEBUG = C.preset("debug")


def first_fit_gaps(times: list[int], gaps: list[int]) -> list[int]:
    """Reference: each item (given order) into the lowest gap whose room is at least its time."""
    room = list(gaps)
    out = []
    for t in times:
        g = next((i for i, r in enumerate(room) if r >= t), -1)
        if g >= 0:
            room[g] -= t
        out.append(g)
    return out


def test_fill_gaps_takes_exact_fits() -> None:
    """A micro-batch exactly as long as a gap's room goes into it (first fit by room >= time),
    on a hand case and on random cases against the plain first-fit reference."""
    assert fill_gaps(np.array([5, 3, 2]), np.array([5, 3])).tolist() == [0, 1, -1]
    rng = np.random.default_rng(7)
    for _ in range(200):
        gaps = rng.integers(1, 12, rng.integers(1, 6))
        times = np.sort(rng.integers(1, 12, rng.integers(1, 8)))[::-1].copy()
        want = first_fit_gaps(times.tolist(), gaps.tolist())
        assert fill_gaps(times, gaps.astype(np.int64)).tolist() == want


def test_offload_hides_under_compute_including_the_size_term() -> None:
    """A group member's offload copies hide under its forward (1/3 of compute) and backward (2/3),
    compute being attention + linear + the size term T*r(T) (docs/PLAN.md, "Cost model"): the
    member time is c + work + size + exposed offload, written out here."""
    cost = C.CostModel(
        a=1e-12,
        b=1e-6,
        c=1e-4,
        kv_bytes_per_token=0.0,  # no ring traffic: only offload can be exposed
        link_bytes_per_s=1e9,
        num_layers=8,
        act_bytes_per_token_layer=1000.0,
        offload_bytes_per_s=1.5e9,
        size_knots=(100.0,),
        size_rates=(1e-5,),
    )
    seen_hidden_by_size = False
    for s, k, j in ((200, 2, 4), (400, 4, 4), (300, 2, 8), (150, 3, 2), (800, 2, 8)):
        n = s / k
        attn = round(cost.a * s * s / k * 1e9)
        lin = round(cost.b * s / k * 1e9)
        work = round((cost.a * s * s + cost.b * s) / k * 1e9)
        rate = float(np.interp(n, (0.0, 100.0), (0.0, 1e-5)))
        size = round(n * rate * 1e9)
        off = round(j / 8 * 6 * 1000.0 * n / 1.5e9 * 1e9)
        comp = attn + lin + size
        fwd = comp // 3
        exposed = max(off - fwd, 0) + max(off - (comp - fwd), 0)
        want = round(cost.c * 1e9) + work + size + exposed
        got = group_times(
            cost,
            np.array([s], dtype=np.int64),
            np.array([0, 1]),
            np.array([0]),
            np.array([k], dtype=np.int64),
            np.array([j], dtype=np.int64),
        )
        assert abs(int(got[0]) - want) <= 2, (s, k, j, int(got[0]), want)
        seen_hidden_by_size |= off > (attn + lin) // 3 and exposed == 0
    assert seen_hidden_by_size  # a case whose copies only the size term's time hides


def test_tail_tie_keeps_the_sample_by_sample_tail() -> None:
    """hdp forms its tail again sample by sample and keeps it unless the packed schedule is
    estimated faster (docs/PLAN.md, "Balance in every regime"): a tie keeps the new tail. 3 ranks,
    C = 10, [10, 3, 3, 3, 3]: best fit packs {10} {3,3,3} {3}; sample by sample, 10 on rank 0
    and the 3s alternate onto ranks 1 and 2 (6 positions each), the same makespan c + w(10)."""
    cfg = PlannerConfig(policy="hdp", capacity=10, widen=False)
    p = cfg.build(DEBUG, 3).plan(np.array([10, 3, 3, 3, 3], dtype=np.int64))
    w = DEBUG.work_ns(np.array([10, 3]), 1)
    assert p.makespan_ns == DEBUG.c_ns + int(w[0])  # the tie: both schedules end here
    tokens = sorted(
        sum(e - s for mb in p.microbatches(r) for _, s, e in mb.pieces) for r in range(3)
    )
    assert tokens == [6, 6, 10]
    assert p.microbatch_counts().tolist() == [1, 1, 1]


def test_offload_group_is_the_smallest_whose_time_meets_the_target() -> None:
    """With offload, hdp takes the smallest group k from Eq. 3's D up to the no-offload group
    whose member time does not exceed the target (docs/PLAN.md: widened "while the member time
    would exceed" the bound): a time exactly equal to the target is accepted. Member times are
    written out (no ring traffic; offload layers the fewest whose C_eff holds ceil(S/k))."""
    cost = C.CostModel(2e-7, 5e-5, 1e-4, 0.0, 1e9, 8, 2000.0, 5e8, name="offload-unit")
    n_ranks, cap, s = 16, 64, 900
    planner = PlannerConfig(policy="hdp", capacity=cap, widen=False).build(
        cost, n_ranks, offload=True
    )
    l_ = 8
    c_eff = [(l_ * l_ * cap) // (2 * l_ + (l_ - j) * (l_ - 2)) for j in range(l_ + 1)]

    def member_ns(k: int) -> int:
        share = -(-s // k)
        j = next(j for j in range(l_ + 1) if c_eff[j] >= share)
        n = s / k
        attn = round(cost.a * s * s / k * 1e9)
        lin = round(cost.b * s / k * 1e9)
        work = round((cost.a * s * s + cost.b * s) / k * 1e9)
        off = round(j / l_ * (l_ - 2) * 2000.0 * n / 5e8 * 1e9)
        comp = attn + lin
        exposed = max(off - comp // 3, 0) + max(off - (comp - comp // 3), 0)
        return round(cost.c * 1e9) + work + exposed

    d_min, k_hi = -(-s // c_eff[l_]), -(-s // cap)
    assert (d_min, k_hi) == (4, 15)
    times = {k: member_ns(k) for k in range(d_min, k_hi + 1)}
    for k_star in (5, 7, 11):
        target = times[k_star]
        want = min(k for k in times if times[k] <= target)
        assert want == k_star
        k, j = dynamic_groups(
            planner.config, planner.cost, np.array([s], dtype=np.int64), np.array([0]), target
        )
        assert int(k[0]) == want
        assert c_eff[int(j[0])] >= -(-s // want) and (j[0] == 0 or c_eff[j[0] - 1] < -(-s // want))
    # one nanosecond less than k*'s time: the next group
    k, _ = dynamic_groups(
        planner.config, planner.cost, np.array([s], dtype=np.int64), np.array([0]), times[7] - 1
    )
    assert int(k[0]) == min(k for k in times if times[k] <= times[7] - 1)


class _First(_Search):
    """widen's search that records the group sizes of every candidate it schedules."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.tried: list[np.ndarray] = []

    def evaluate(self, cand) -> bool:
        self.tried.append(cand.kg.copy())
        return super().evaluate(cand)


def test_critical_path_widens_by_the_factor_that_removes_the_excess() -> None:
    """widen's step 2 widens a group on the last rank by the factor that would take the excess
    over the work bound T off its member share (docs/PLAN.md, "Widen"): k' = ceil(k * share /
    (share - excess)), here 2 -> 6 (excess about 0.66 of the share: a factor near 3), within
    k + 1 .. min(N, S). 8 ranks, C = 1024: a 2048-token sample on 2 ranks beside eight of 256."""
    n, cap = 8, 1024
    lengths = np.array([2048] + [256] * 8, dtype=np.int64)
    pl = PlannerConfig(policy="hdp", capacity=cap, widen=True).build(DEBUG, n)
    cfg, cost = pl.config, pl.cost
    ids = np.arange(lengths.shape[0], dtype=np.int64)
    layout, caps = dynamic_layout(
        cfg, cost, lengths, ids, max(lower_bound_terms(cost, lengths, n, cap))
    )
    budget = int(cfg.improve_rounds) * n
    sched = hdp_schedule(layout.kg, layout.g_time, layout.b_time, n, budget)
    layout, sched = rebalance_tail(layout, sched, lengths, cost, cap, budget)
    bound = lower_bound_terms(cost, lengths, n, cap, best_case=False)[0]
    search = _First(cost, lengths, caps, cap, n, budget, bound, layout, sched)
    search.critical_path()
    assert layout.kg.tolist() == [2] and search.tried
    share = int(layout.g_time[0]) - cost.c_ns
    excess = sched.makespan - bound
    assert 0.5 * share < excess < 0.75 * share  # a factor between 2 and 4
    want = min(n, max(3, -(-2 * share // (share - excess))))
    assert want == 6
    assert search.tried[0].tolist() == [want]
