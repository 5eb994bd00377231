"""Small planning rules, each against an independent reference (plain Python or a
hand-computed case): plan metrics and their average, widen's critical path, the simulator's batch
fill rule and length statistics, the checker's group agreement, the report's variants, static's
DP deal and context limit, single's lower bound, and naive-hdp's waves."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from datapipe.errors import ConfigError, MixlenError
from datapipe.plan import cost as C
from datapipe.plan import simulate as S
from datapipe.plan.balance import hdp_schedule, rebalance_tail
from datapipe.plan.check import PlanError, check_plan
from datapipe.plan.common import dynamic_layout, lower_bound_terms
from datapipe.plan.compare import policy_variants
from datapipe.plan.metrics import PlanMetrics, average_metrics, plan_metrics
from datapipe.plan.planner import PlannerConfig
from datapipe.plan.static import _deal_round_robin
from datapipe.plan.stepplan import StepPlan
from datapipe.plan.widen import _Search

DEBUG = C.preset("debug")
# 8 layers so Eq. 3 has room; offload copies cheap enough to hide under short samples' compute.
OFFLOAD = C.CostModel(2e-7, 5e-5, 1e-4, 64.0, 1e9, 8, 2000.0, 5e8, name="offload-test")
K, M = 1024, 1024 * 1024


def planner(policy: str, n: int, cap: int, cost=DEBUG, offload: bool = False, **kw):
    kw.setdefault("widen", False)
    return PlannerConfig(policy=policy, capacity=cap, **kw).build(cost, n, offload=offload)


def mb_tokens(p: StepPlan) -> list[int]:
    """Tokens of each micro-batch (whole group), slot order."""
    off = p.mb_piece_offsets
    sizes = p.piece_end - p.piece_start
    return [int(sizes[off[m] : off[m + 1]].sum()) for m in range(p.num_microbatches)]


def mb_groups(p: StepPlan) -> list[tuple[int, ...]]:
    g = p.mb_group_offsets
    return [tuple(int(r) for r in p.group_ranks[g[m] : g[m + 1]]) for m in range(len(g) - 1)]


# --- metrics ---------------------------------------------------------------------------------


def test_plan_metrics_comm_bytes_count_offload_both_ways() -> None:
    """comm_bytes = every member's ring K/V bytes + its offload bytes to host and back (2x), summed
    in plain Python from the cost model's coefficients; other counts likewise."""
    rng = np.random.default_rng(3)
    lengths = np.concatenate([rng.integers(1, 64, 60), [900, 700, 500]]).astype(np.int64)
    p = planner("hdp", 16, 64, OFFLOAD, offload=True).plan(lengths)
    check_plan(p)
    assert (p.mb_offload > 0).any()
    ring = off = 0.0
    fill_cap = 0
    for m, (group, tokens) in enumerate(zip(mb_groups(p), mb_tokens(p))):
        k = len(group)
        member = tokens / k
        ring += k * OFFLOAD.comm_passes * (k - 1) * member * OFFLOAD.kv_bytes_per_token
        layers = max(OFFLOAD.num_layers - 2, 0)
        off += k * 2 * float(p.mb_offload[m]) * layers * OFFLOAD.act_bytes_per_token_layer * member
        fill_cap += k * int(p.mb_capacity[m])
    assert off > 0
    got = plan_metrics(p, OFFLOAD, 1.5)
    assert got.comm_bytes == pytest.approx(ring + off, rel=1e-9)
    assert got.token_fill == pytest.approx(int(lengths.sum()) / fill_cap)
    per_rank = [sum(r in g for g in mb_groups(p)) for r in range(16)]
    assert (got.mb_per_rank_min, got.mb_per_rank_max) == (min(per_rank), max(per_rank))
    sizes = [len(g) for g in mb_groups(p) if len(g) >= 2]
    assert got.groups_by_size == {k: sizes.count(k) for k in sorted(set(sizes))}
    assert got.plan_ms == 1.5


def _metrics(i: int, mb_min: int, mb_max: int, groups: dict[int, int]) -> PlanMetrics:
    return PlanMetrics(
        policy=f"p{i}", est_step_time_s=1.0 + i, makespan_s=2.0 * i, mean_rank_time_s=3.0 + i,
        imbalance=1.0 + i / 10, lower_bound_s=0.5 * i, max_over_lower_bound=1.0 + i,
        token_fill=0.1 * i, mb_per_rank_min=mb_min, mb_per_rank_max=mb_max,
        groups_by_size=groups, comm_bytes=100.0 * i, plan_ms=7.0 * i,
    )  # fmt: skip


def test_average_metrics_field_by_field() -> None:
    """Means of the times and ratios, the smallest mb_per_rank_min and largest mb_per_rank_max
    over steps, group counts summed by size; the first step's policy."""
    steps = [_metrics(1, 4, 9, {2: 1, 4: 3}), _metrics(2, 2, 5, {2: 2}), _metrics(3, 6, 7, {8: 1})]
    got = average_metrics(steps)
    for f in dataclasses.fields(PlanMetrics):
        if f.name in ("policy", "mb_per_rank_min", "mb_per_rank_max", "groups_by_size"):
            continue
        want = sum(getattr(m, f.name) for m in steps) / 3
        assert getattr(got, f.name) == pytest.approx(want), f.name
    assert got.policy == "p1"
    assert (got.mb_per_rank_min, got.mb_per_rank_max) == (2, 9)
    assert got.groups_by_size == {2: 3, 4: 3, 8: 1}
    assert average_metrics(steps[1:]).mb_per_rank_min == 2
    assert average_metrics(steps[:1]) is steps[0]


# --- widen -----------------------------------------------------------------------------------


class _Recording(_Search):
    """widen's search, recording (best group sizes, best schedule, candidate sizes) per candidate."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.seen_candidates: list = []

    def evaluate(self, cand) -> bool:
        self.seen_candidates.append((self.best.kg.copy(), self.best_sched, cand.kg.copy()))
        return super().evaluate(cand)


def _plain_search(lengths: np.ndarray, n: int, cap: int) -> _Recording:
    """The search around hdp's plain plan of the batch, as hdp.plan starts it."""
    pl = planner("hdp", n, cap, widen=True)
    cfg, cost = pl.config, pl.cost
    work, share = lower_bound_terms(cost, lengths, n, cap)
    ids = np.arange(lengths.shape[0], dtype=np.int64)
    layout, caps = dynamic_layout(cfg, cost, lengths, ids, target_ns=max(work, share))
    budget = int(cfg.improve_rounds) * n
    sched = hdp_schedule(layout.kg, layout.g_time, layout.b_time, n, budget)
    layout, sched = rebalance_tail(layout, sched, lengths, cost, cap, budget)
    bound = lower_bound_terms(cost, lengths, n, cap, best_case=False)[0]
    return _Recording(cost, lengths, caps, cap, n, budget, bound, layout, sched)


def _ranks_of_groups(kk: np.ndarray, sched) -> dict[int, set[int]]:
    """Group -> its ranks, from the schedule's group order and their ranks laid end to end."""
    out, at = {}, 0
    for g in sched.g_order.tolist():
        out[g] = {int(r) for r in sched.g_ranks_sorted[at : at + kk[g]]}
        at += int(kk[g])
    return out


WIDEN_CASES = [
    (6, 896, [2622, 1786, 2615, 136, 180, 54, 146, 193, 136, 172, 58, 181, 27, 151, 8, 83, 11,
              94, 52]),
    (4, 256, [900, 700, 30, 40, 50, 20, 10, 60]),
    (8, 512, [3000, 2500, 1200, 100, 90, 80, 300, 200, 150, 60]),
]  # fmt: skip


@pytest.mark.parametrize("n, cap, lengths", WIDEN_CASES)
def test_widen_critical_path_widens_a_group_of_the_last_rank(n, cap, lengths) -> None:
    """widen's step 2: each candidate widens exactly one group by at least one rank, and that
    group runs on a rank that finishes last (largest load) in the best schedule so far."""
    search = _plain_search(np.array(lengths, dtype=np.int64), n, cap)
    search.critical_path()
    assert search.seen_candidates, "the plain plan ends above its bound: step 2 tries something"
    for kk, sched, cand in search.seen_candidates:
        changed = np.flatnonzero(cand != kk)
        assert changed.size == 1 and cand[changed[0]] > kk[changed[0]]
        last = set(np.flatnonzero(sched.load == sched.load.max()).tolist())
        assert _ranks_of_groups(kk, sched)[int(changed[0])] & last


# --- simulate --------------------------------------------------------------------------------


def _draw_reference(pool: list[int], budget: int, steps: int, seed: int) -> list[list[int]]:
    """The stream's fill rule in plain Python: the same shuffles; samples are added while the sum
    stays <= budget (at least one per batch); a batch never runs past the end of a shuffle."""
    rng = np.random.Generator(np.random.PCG64(seed + 1))
    order, pos, out = rng.permutation(len(pool)).tolist(), 0, []
    while len(out) < steps:
        if pos >= len(order):
            order, pos = rng.permutation(len(pool)).tolist(), 0
        take, total = 0, 0
        while pos + take < len(order) and total + pool[order[pos + take]] <= budget:
            total += pool[order[pos + take]]
            take += 1
        take = max(take, 1)
        out.append([pool[i] for i in order[pos : pos + take]])
        pos += take
    return out


def test_draw_batches_against_a_greedy_reference() -> None:
    """draw_batches = the plain-Python greedy fill, on small pools and budgets (sums landing on the
    budget exactly included); a pool below one budget is refused."""
    assert [b.tolist() for b in S.draw_batches(np.array([4, 4]), 8, 1)] == [[4, 4]]
    rng = np.random.default_rng(11)
    exact = 0
    for case in range(300):
        pool = rng.integers(1, 9, int(rng.integers(1, 9))).tolist()
        budget = int(rng.integers(1, 20)) if case % 2 else int(sum(pool[: 1 + case % 3]))
        if sum(pool) < budget:
            with pytest.raises(ConfigError, match="fewer than one global batch"):
                S.draw_batches(np.array(pool), budget, 3, seed=case)
            continue
        got = [b.tolist() for b in S.draw_batches(np.array(pool), budget, 4, seed=case)]
        assert got == _draw_reference(pool, budget, 4, case), (pool, budget, case)
        exact += any(sum(b) == budget for b in got)
    assert exact > 20


def test_length_stats_at_the_thresholds() -> None:
    """Every statistic, hand-counted on lengths at and beside each threshold (4K, 128K, 256K, 2M):
    <= 4K and >= 128K / 2M include the threshold, > 128K / 256K exclude it."""
    s = [1, 4 * K, 4 * K + 1, 128 * K - 1, 128 * K, 128 * K + 1, 256 * K, 256 * K + 1, 2 * M - 1]
    s += [2 * M, 2 * M]
    tot = sum(s)
    got = S.length_stats(np.array(s))
    want = {
        "samples": 11,
        "mean": tot / 11,
        "frac_samples_le_4k": 2 / 11,
        "frac_samples_ge_128k": 7 / 11,
        "frac_tokens_ge_128k": (tot - 1 - 4 * K - (4 * K + 1) - (128 * K - 1)) / tot,
        "frac_samples_ge_2m": 2 / 11,
        "frac_tokens_ge_2m": 4 * M / tot,
        "frac_tokens_gt_128k": (128 * K + 1 + 256 * K + 256 * K + 1 + 2 * M - 1 + 4 * M) / tot,
        "frac_tokens_gt_256k": (256 * K + 1 + 2 * M - 1 + 4 * M) / tot,
    }
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key


# --- check -----------------------------------------------------------------------------------


def _group_plan() -> tuple[StepPlan, int]:
    """An hdp plan with one ring micro-batch of two ranks; the second member's rank."""
    p = planner("hdp", 2, 16).plan(np.array([30, 5, 5], dtype=np.int64))
    check_plan(p)
    (group,) = [g for g in mb_groups(p) if len(g) == 2]
    return p, group[1]


def _skewed(p: StepPlan, rank: int, **change) -> StepPlan:
    """The plan, with `rank`'s view of its ring micro-batch changed."""

    class Skewed(StepPlan):
        def microbatches(self, r):
            mbs = super().microbatches(r)
            if r == rank:
                i = next(i for i, mb in enumerate(mbs) if len(mb.group) == 2)
                mbs[i] = dataclasses.replace(mbs[i], **change)
            return mbs

    return Skewed(**{f.name: getattr(p, f.name) for f in dataclasses.fields(StepPlan)})


def test_checker_catches_members_disagreeing_on_offload_alone_or_capacity_alone() -> None:
    """One member sees offload ratio 0.5 (its capacity C is still allowed at 0.5): the group
    disagrees. With the plan at ratio 0.5, one member sees capacity C + 1 (allowed): likewise."""
    p, rank = _group_plan()
    check_plan(_skewed(p, rank))
    with pytest.raises(PlanError, match="disagree"):
        check_plan(_skewed(p, rank, offload_ratio=0.5))
    p.mb_offload = np.full(p.num_microbatches, 0.5)
    check_plan(p)
    with pytest.raises(PlanError, match="disagree"):
        check_plan(_skewed(p, rank, capacity=17))


# --- compare ---------------------------------------------------------------------------------

VARIANT_LABELS = {  # (policy, offload, widen) -> labels; widen None: the default (on)
    ("all", False, None): ["static", "naive-hdp", "hdp", "hdp+widen"],
    ("all", False, True): ["static", "naive-hdp", "hdp", "hdp+widen"],
    ("all", False, False): ["static", "naive-hdp", "hdp"],
    ("all", True, None): ["static", "naive-hdp+offload", "hdp+offload", "hdp+offload+widen"],
    ("all", True, True): ["static", "naive-hdp+offload", "hdp+offload", "hdp+offload+widen"],
    ("all", True, False): ["static", "naive-hdp+offload", "hdp+offload"],
    ("hdp", False, None): ["hdp+widen"],
    ("hdp", False, True): ["hdp+widen"],
    ("hdp", False, False): ["hdp"],
    ("hdp", True, None): ["hdp+offload+widen"],
    ("hdp", True, True): ["hdp+offload+widen"],
    ("hdp", True, False): ["hdp+offload"],
    ("naive-hdp", False, None): ["naive-hdp"],
    ("naive-hdp", False, False): ["naive-hdp"],
    ("naive-hdp", True, None): ["naive-hdp+offload"],
    ("naive-hdp", True, False): ["naive-hdp+offload"],
    ("static", False, None): ["static"],
    ("static", False, False): ["static"],
    ("static", True, None): ["static"],
    ("static", True, False): ["static"],
    ("single", False, None): ["single"],
    ("single", True, False): ["single"],
}


def test_policy_variants_labels_for_every_combination() -> None:
    """The report's columns, written out by hand: static and single never offload, only hdp
    widens, and widen with another single policy is refused."""
    for (policy, offload, widen), labels in VARIANT_LABELS.items():
        got = policy_variants(policy, offload, widen)
        assert [v.label for v in got] == labels, (policy, offload, widen)
        assert all(v.offload == ("+offload" in v.label) for v in got)
    for policy in ("naive-hdp", "static", "single"):
        for offload in (False, True):
            with pytest.raises(ConfigError, match="hdp policy only"):
                policy_variants(policy, offload, True)


# --- static ----------------------------------------------------------------------------------


def _deal_reference(tokens: list[int], n_dp: int) -> tuple[list[int], list[int]]:
    """Each micro-batch (given order) to the replica with the fewest micro-batches, then the
    fewest tokens, then the lowest index; its round is that replica's count before it."""
    cnt, tok, dp, rnd = [0] * n_dp, [0] * n_dp, [], []
    for t in tokens:
        best = min(range(n_dp), key=lambda g: (cnt[g], tok[g], g))
        dp.append(best)
        rnd.append(cnt[best])
        cnt[best] += 1
        tok[best] += t
    return dp, rnd


def test_static_deal_against_a_reference() -> None:
    """static's DP deal = the plain-Python rule, on random (tie-rich) token lists; a hand case
    through the planner: [10, 9, 8, 7] on 2 replicas of C = 10 go to replicas 0, 1, 1, 0."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        toks = np.sort(rng.integers(1, 6, int(rng.integers(0, 12))))[::-1].astype(np.int64)
        n_dp = int(rng.integers(1, 5))
        dp, rnd = _deal_round_robin(toks, n_dp)
        assert (dp.tolist(), rnd.tolist()) == _deal_reference(toks.tolist(), n_dp)
    p = planner("static", 2, 10).plan(np.array([10, 9, 8, 7], dtype=np.int64))
    check_plan(p)
    rank_of = {}
    for m, group in enumerate(mb_groups(p)):
        for i in p.piece_item[p.mb_piece_offsets[m] : p.mb_piece_offsets[m + 1]].tolist():
            rank_of[i] = group
    assert [rank_of[i] for i in range(4)] == [(0,), (1,), (1,), (0,)]


def test_static_fits_the_smaller_of_mesh_and_max_context() -> None:
    """N = 6, C = 16: the mesh holds 96; max_context 40 lowers that to 40 (never raises it)."""
    capped = planner("static", 6, 16, max_context=40)
    assert capped.fits(np.array([40, 41, 96])).tolist() == [True, False, False]
    with pytest.raises(MixlenError, match="sample 1 has 41 tokens"):
        capped.check_fits(np.array([5, 41, 3]), "data")
    assert planner("static", 6, 16).fits(np.array([96, 97])).tolist() == [True, False]
    big = planner("static", 6, 16, max_context=500)
    assert big.fits(np.array([96, 97])).tolist() == [True, False]


# --- single ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lengths, n_min",
    [([100, 100, 100], 2), ([300, 100, 100], 2), ([300, 256, 1], 3), ([256, 256], 2)],
)
def test_single_lower_bound_by_hand(lengths: list[int], n_min: int) -> None:
    """single's bound: all work + c per micro-batch any plan needs (each sample over C = 256
    alone, the others ceil(tokens / 256)); n_min counted by hand."""
    p = planner("single", 1, 256).plan(np.array(lengths, dtype=np.int64))
    work = sum(int(DEBUG.work_ns(np.array([s]), 1)[0]) for s in lengths)
    assert p.lower_bound_ns == work + DEBUG.c_ns * n_min
    assert p.makespan_ns >= p.lower_bound_ns


# --- naive-hdp -------------------------------------------------------------------------------


def _waves_reference(mbs: list[tuple[int, int]], n: int) -> list[tuple[tuple[int, ...], int]]:
    """ByteScale's waves: micro-batches (k, tokens) by decreasing tokens, each into the first wave
    with k free ranks (ranks taken in increasing order); listed by (wave, first rank)."""
    used: list[int] = []
    placed = []
    for k, tokens in sorted(mbs, key=lambda x: -x[1]):
        w = next((w for w, u in enumerate(used) if u + k <= n), len(used))
        if w == len(used):
            used.append(0)
        placed.append((w, used[w], tuple(range(used[w], used[w] + k)), tokens))
        used[w] += k
    return [(ranks, tokens) for _, _, ranks, tokens in sorted(placed)]


def test_naive_hdp_waves_against_a_reference() -> None:
    """naive-hdp's slot order and groups = the wave rule in plain Python, on batches of distinct
    lengths over C / 2 (one sample per micro-batch: no ties in tokens)."""
    rng = np.random.default_rng(7)
    for _ in range(25):
        n, cap = int(rng.integers(2, 7)), 32
        size = int(rng.integers(1, 12))
        lengths = rng.choice(np.arange(cap // 2 + 1, n * cap + 1), size, replace=False)
        p = planner("naive-hdp", n, cap).plan(lengths.astype(np.int64))
        check_plan(p)
        mbs = [(len(g), t) for g, t in zip(mb_groups(p), mb_tokens(p))]
        assert len({t for _, t in mbs}) == len(mbs)
        assert list(zip(mb_groups(p), mb_tokens(p))) == _waves_reference(mbs, n), lengths
        # every wave starts at rank 0
        assert p.meta["waves"] == sum(r[0] == 0 for r, _ in _waves_reference(mbs, n))
