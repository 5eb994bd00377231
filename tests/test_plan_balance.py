"""The lower bound against a plain-Python reference, and balance in every regime: from one sample
to many times N x C, no rank idles while the step has a sample for it, and hdp stays within its
list-scheduling guarantee of the bound, which is 5% wherever sample and micro-batch granularity
allow it (hypothesis; docs/PLAN.md, "Balance in every regime")."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from datapipe.plan import cost as C
from datapipe.plan.check import check_plan
from datapipe.plan.common import (
    local_times,
    lower_bound_ns,
    lower_bound_terms,
    pack_local,
    plan_lower_bound_ns,
)
from datapipe.plan.planner import PlannerConfig
from datapipe.plan.schedule import spread_samples

DEBUG = C.preset("debug")
# 8 layers so Eq. 3 has room; offload copies cheap enough to hide under short samples' compute.
OFFLOAD = C.CostModel(2e-7, 5e-5, 1e-4, 64.0, 1e9, 8, 2000.0, 5e8, name="offload-test")
# a micro-batch's size term d on (a position of a full micro-batch costs more)
SIZED = C.CostModel(6e-8, 5e-5, 1e-3, 1024.0, 1.25e9, 2, 10776.0, 5e9, d=2e-9, name="sized")
COSTS = [DEBUG, C.preset("small"), C.preset("llama-7b")]
VARIANTS = [("hdp", False), ("hdp", True), ("naive-hdp", False), ("static", False)]


def plan(policy: str, lengths, n: int, cap: int, cost=DEBUG, **kw):
    run = {k: kw.pop(k) for k in ("seed", "offload") if k in kw}
    kw.setdefault("widen", False)  # plain hdp unless a test widens (the config's default is true)
    cfg = PlannerConfig(policy=policy, capacity=cap, **kw)
    return cfg.build(cost, n, **run).plan(np.asarray(lengths, dtype=np.int64))


# --- the lower bound -----------------------------------------------------------------------------
def reference_lower_bound(cost: C.CostModel, lengths, n: int, cap: int) -> tuple[int, int]:
    """lower_bound_ns's rule, spelled out sample by sample in plain Python (the cost model's
    documented terms, each rounded once to integer ns as the cost module states): a sample of
    S > 0 tokens on its smallest group k = ceil(S / C) (whose largest zigzag pair is ceil(S / k)
    <= C) has the member share a*S^2/k / eff(S/k) + b*S/k (eff(x) = x / (x + attn_n_half)) plus,
    on a ring, its ring time (hops * latency + K/V bytes over the link: the node link when the
    group fits in a node, the best case) not hidden under its attention. Work bound:
    ceil((sum of k * share + c * max(ceil(tokens / C), N)) / N); share bound: the largest share + c."""
    c_ns = round(cost.c * 1e9)
    h = cost.attn_n_half
    shares, ranks, tokens = [], [], 0
    for s in (int(x) for x in lengths):
        if s <= 0:
            continue
        k = -(-s // cap)
        # a*S^2/k / eff(S/k) = a*S*(S + h*k)/k, in the cost module's order of operations
        attn_s = cost.a * s * (s + h * k) / k
        share = round((cost.a * s * (s + h * k) + cost.b * s) / k * 1e9)
        if k > 1:
            attn = round(attn_s * 1e9)
            ring_bytes = cost.comm_passes * (k - 1) * (s / k) * cost.kv_bytes_per_token
            inside = cost.ranks_per_node and k <= cost.ranks_per_node
            link = cost.node_link_bytes_per_s if inside else cost.link_bytes_per_s
            hops = cost.num_layers * (cost.comm_passes * (k - 1) + 1)
            ring = round((ring_bytes / link + hops * cost.hop_latency_s) * 1e9)
            hide = round(ring * cost.overlap)
            share += ring - hide + max(hide - attn, 0)
        shares.append(share)
        ranks.append(k)
        tokens += s
    if not shares:
        return 0, 0
    rank_mbs = max(-(-tokens // cap), n)  # at least ceil(tokens / C), and one per rank
    total = sum(k * t for k, t in zip(ranks, shares)) + c_ns * rank_mbs
    return -(-total // n), max(shares) + c_ns


def member_ref(cost: C.CostModel, s: int, k: int, unhidden_only: bool = False) -> int:
    """A member's time for one sample of s tokens on a group of k (no offload, best-case link):
    c + a*S^2/k / eff(S/k) + b*S/k + its size term + its exposed ring time, in plain Python
    (`unhidden_only`: only the ring time no compute can hide, (1 - overlap) * ring)."""
    h = cost.attn_n_half
    attn = round(cost.a * s * (s + h * k) / k * 1e9)
    t = round((cost.a * s * (s + h * k) + cost.b * s) / k * 1e9) + size_ref(
        s / k, cost.d * 1e9, cost.size_knots, tuple(r * 1e9 for r in cost.size_rates)
    )
    if k > 1:
        ring_bytes = cost.comm_passes * (k - 1) * (s / k) * cost.kv_bytes_per_token
        inside = cost.ranks_per_node and k <= cost.ranks_per_node
        link = cost.node_link_bytes_per_s if inside else cost.link_bytes_per_s
        hops = cost.num_layers * (cost.comm_passes * (k - 1) + 1)
        ring = round((ring_bytes / link + hops * cost.hop_latency_s) * 1e9)
        hide = round(ring * cost.overlap)
        t += ring - hide + (0 if unhidden_only else max(hide - attn, 0))
    return round(cost.c * 1e9) + t


def reference_plan_bound(cost: C.CostModel, lengths, n: int, cap: int) -> tuple[float, int]:
    """What every plan records (plan_lower_bound_ns), in plain Python: per sample, its work and
    the ring time no compute can hide on its smallest group plus its size term split over all N ranks (the
    least it can be), c per rank-micro-batch, less 2 ns of rounding room per sample and rank of its
    widest group, over N; and the longest sample's least member
    time over every group from its smallest to min(N, S). Returns (work term before the
    ceiling, share term)."""
    c_ns = round(cost.c * 1e9)
    knots, rates = cost.size_knots, tuple(r * 1e9 for r in cost.size_rates)
    live = [int(x) for x in lengths if x > 0]
    if not live:
        return 0.0, 0
    total = c_ns * max(-(-sum(live) // cap), n) - 2 * sum(min(s, n) for s in live)
    for s in live:
        k = -(-s // cap)
        work = member_ref(cost, s, k, unhidden_only=True)
        total += k * (work - c_ns - size_ref(s / k, cost.d * 1e9, knots, rates))
        total += n * size_ref(s / n, cost.d * 1e9, knots, rates)
    s = max(live)
    share = min(member_ref(cost, s, k) for k in range(-(-s // cap), min(n, s) + 1))
    return total / n, share


# slow links: rings expose most of their traffic
SLOW_LINK = C.CostModel(1e-9, 2e-6, 3e-5, 4096.0, 1e8, 4, 2000.0, 5e8, name="slow-link")


@given(
    st.integers(1, 64),
    st.sampled_from([1, 7, 64, 4096]),
    st.lists(st.integers(0, 10**6), max_size=40),
    st.sampled_from([DEBUG, C.preset("llama-7b"), OFFLOAD, SLOW_LINK]),
)
@example(1, 1, [1] * 7, C.preset("llama-7b"))  # CI found 3 ns of rounding on 7 samples, 1 rank
@settings(deadline=None, max_examples=150)
def test_lower_bound_is_its_formula(n: int, cap: int, raw: list[int], cost) -> None:
    lengths = np.array([x % (n * cap + 1) for x in raw], dtype=np.int64)
    want = reference_lower_bound(cost, lengths, n, cap)
    assert lower_bound_terms(cost, lengths, n, cap) == want
    assert lower_bound_ns(cost, lengths, n, cap) == max(want)
    work, share = reference_plan_bound(cost, lengths, n, cap)
    recorded = plan_lower_bound_ns(cost, lengths, n, cap)
    assert recorded <= max(want)  # never above the smallest-group bound
    # rounding: the plan rounds each sample's member time and size terms to whole ns, the
    # reference sums them unrounded (up to about 2 ns a sample, then the ceiling)
    live = int(np.count_nonzero(lengths))
    assert recorded == share or abs(recorded - work) <= 1 + n + 2 * live
    for policy in ("hdp", "naive-hdp", "static"):  # what the plans record for reports
        assert plan(policy, lengths, n, cap, cost).lower_bound_ns == recorded, policy


SIZE_TABLE = dataclasses.replace(
    C.preset("debug"), size_knots=(256.0, 1024.0, 4096.0), size_rates=(1e-7, 4e-7, 9e-7)
)


@given(
    st.integers(1, 12),
    st.sampled_from([64, 256, 1024]),
    st.lists(st.integers(0, 12 * 1024), min_size=1, max_size=30),
    st.sampled_from([DEBUG, SIZED, SIZE_TABLE, SLOW_LINK, C.preset("llama-7b")]),
)
@settings(deadline=None, max_examples=150)
def test_recorded_bound_bounds_every_plan(n: int, cap: int, raw: list[int], cost) -> None:
    """No plan without offload, widened or not, static or dynamic, finishes before the bound it
    records, with a size table or d in the cost model too (a wider split lowers a member's
    per-position rate; the bound charges the size term at its least). issue 30: the demo's
    hdp+widen recorded 0.945 of its bound."""
    lengths = np.array([x % (n * cap + 1) for x in raw], dtype=np.int64)
    for policy, widen in VARIANTS:
        p = plan(policy, lengths, n, cap, cost, widen=widen)
        assert p.lower_bound_ns <= p.makespan_ns, (policy, widen, p.makespan_ns / p.lower_bound_ns)


def test_recorded_bound_under_a_wide_split() -> None:
    """A case the smallest-group bound gets wrong: one sample of 4 C on 8 ranks with a steep size
    table. Its smallest group (4) charges the size rate of C positions; widened to 8 ranks it
    computes C/2 positions per member at a third of that rate, and the widened plan ends below
    the smallest-group bound, but not below the recorded one."""
    cost = dataclasses.replace(
        C.preset("debug"), size_knots=(512.0, 1024.0), size_rates=(1e-7, 3e-6)
    )
    lengths = np.array([4096, 300, 200], dtype=np.int64)
    w = plan("hdp", lengths, 8, 1024, cost, widen=True)
    assert w.meta["widened"] >= 1 or "static_mesh" in w.meta
    assert w.makespan_ns < lower_bound_ns(cost, lengths, 8, 1024)
    assert w.lower_bound_ns <= w.makespan_ns


def test_recorded_bound_under_widen_fills() -> None:
    """Short samples packed into a ring's micro-batch (widen's fill) hide more of its traffic
    than its own attention does: with the ring's exposed time charged as if alone, this plan
    finished 820 ns under the bound it recorded."""
    lengths = np.array(
        [129, 27, 339, 487, 203, 30, 46, 339, 654, 630, 226, 457, 243, 825, 970, 474, 133, 844]
        + [166, 479, 171],
        dtype=np.int64,
    )
    p = plan("hdp", lengths, 2, 512, C.preset("small"), widen=True)
    check_plan(p)
    assert p.meta["widen_filled"] > 0 and p.lower_bound_ns <= p.makespan_ns


def test_lower_bound_terms_each_decide() -> None:
    """Hand-made cases where each term wins, with and without exposed ring traffic."""
    # many short samples on few ranks: total work / N decides
    short = np.full(40, 60, dtype=np.int64)
    work, share = reference_lower_bound(DEBUG, short, 4, 64)
    assert lower_bound_ns(DEBUG, short, 4, 64) == work > share
    # one long sample on many ranks: its member share (plus c) decides; on a slow link its ring
    # traffic shows
    one = np.array([4000, 10], dtype=np.int64)
    work, share = reference_lower_bound(SLOW_LINK, one, 64, 64)
    assert lower_bound_ns(SLOW_LINK, one, 64, 64) == share > work
    k = -(-4000 // 64)
    hidden = round((SLOW_LINK.a * 4000 * 4000 + SLOW_LINK.b * 4000) / k * 1e9)
    assert share > hidden + SLOW_LINK.c_ns  # the exposed traffic is part of the bound


def allowance(cost: C.CostModel, lengths: np.ndarray, n: int, cap: int) -> int:
    """What hdp may exceed the bound by, in ns (its list-scheduling guarantee, for batches whose
    rings all fit side by side, sum of k <= N, with d = 0): the sample placed last on the busiest
    rank went to the least-loaded rank, so that rank ends within one sample's time + c of the
    average load; the average holds the rings' k * (share + c) and c per local micro-batch, of
    which each rank opens at most 2 * its positions / C + 1 (no two of its micro-batches are both
    at most half full). Against the bound's c * max(tokens / C, N), that is
    c * (sum k + 2 * local tokens / C + N - max(tokens / C, N)) / N + the largest local sample's
    time + c."""
    s = np.asarray(lengths, dtype=np.int64)
    s = s[s > 0]
    local = s[s <= cap]
    if local.size == 0:
        return 0
    ring_ranks = int(np.sum(-(-s[s > cap] // cap)))
    tokens, local_tokens = int(s.sum()), int(local.sum())
    c_ns = round(cost.c * 1e9)
    extra = ring_ranks + 2 * local_tokens / cap + n - max(tokens / cap, n)
    largest = max(round((cost.a * x * (x + cost.attn_n_half) + cost.b * x) * 1e9) for x in local)
    return int(np.ceil(c_ns * extra / n)) + largest + c_ns


@st.composite
def batches(draw: st.DrawFn) -> tuple[int, int, C.CostModel, np.ndarray]:
    """(N, C, cost, lengths): short samples as a list (few) or a seeded lognormal batch of 0.001
    to 30 times N x C tokens (median 0.1% to 100% of C), and sometimes long samples on rings that
    all fit side by side (sum of k <= N; with the h100 presets only within one node, N <= 8, so
    the bound's best-case link is the planned one)."""
    cost = draw(st.sampled_from(COSTS))
    n = draw(st.integers(1, 64))
    cap = draw(st.sampled_from([64, 512, 4096, 16384]))
    if draw(st.booleans()):
        short = np.array(draw(st.lists(st.integers(1, cap), min_size=1, max_size=3 * n + 4)))
    else:
        want = draw(st.floats(1e-3, 30.0)) * n * cap
        median, sigma = draw(st.floats(1e-3, 1.0)), draw(st.floats(0.0, 2.0))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        x = np.clip(np.rint(rng.lognormal(np.log(median * cap), sigma, 4000)), 1, cap)
        short = x[: int(np.searchsorted(np.cumsum(x), want)) + 1]
    rings = n >= 2 and (cost is DEBUG or n <= 8)
    ks = draw(st.lists(st.integers(2, max(2, n)), max_size=3)) if rings else []
    ks = [k for i, k in enumerate(ks) if sum(ks[: i + 1]) <= n]
    long = [draw(st.integers((k - 1) * cap + 1, k * cap)) for k in ks]
    lengths = np.concatenate([short.astype(np.int64), np.array(long, dtype=np.int64)])
    order = np.random.default_rng(lengths.size).permutation(lengths.size)
    return n, cap, cost, lengths[order]


@given(batches())
@settings(deadline=None, max_examples=120, suppress_health_check=[HealthCheck.too_slow])
def test_balance_in_every_regime(case) -> None:
    """Every policy: the plan's invariants, and no idle rank when the step holds at least one
    sample per rank. hdp (and hdp+widen): the bound is the reference's, and the makespan is
    within the list-scheduling allowance of it, so within 5% wherever that allowance is."""
    n, cap, cost, lengths = case
    bound = max(reference_lower_bound(cost, lengths, n, cap))  # the smallest-group bound
    extra = allowance(cost, lengths, n, cap)
    for policy, widen in VARIANTS:
        p = plan(policy, lengths, n, cap, cost, widen=widen)
        check_plan(p)
        assert p.lower_bound_ns == plan_lower_bound_ns(cost, lengths, n, cap) <= bound
        if lengths.size >= n:
            assert p.microbatch_counts().min() >= 1, (policy, widen, p.microbatch_counts())
        if policy == "hdp":
            assert p.makespan_ns <= bound + extra, (widen, p.makespan_ns / bound, extra / bound)
            if extra <= 0.05 * bound:
                assert p.makespan_ns <= 1.05 * bound, (widen, p.makespan_ns / bound)


@pytest.mark.parametrize("cost", [DEBUG, C.preset("llama-7b")], ids=["debug", "7b"])
@pytest.mark.parametrize("n", [1, 4, 64])
@pytest.mark.parametrize("scale", [0.02, 0.3, 1.0, 3.0, 20.0])
def test_within_five_percent_from_small_to_large_steps(cost, n: int, scale: float) -> None:
    """Lognormal batches of 2% to 20 times N x C tokens, 64 samples per rank or more: within 1.05
    of the bound (hdp and hdp+widen), every rank busy."""
    cap = 16384
    rng = np.random.default_rng(int(scale * 100) + n)
    count = max(64 * n, int(scale * n * cap / 600))
    lengths = np.clip(rng.lognormal(np.log(scale * n * cap / count), 0.6, count), 1, cap)
    lengths = lengths.astype(np.int64)
    bound = max(reference_lower_bound(cost, lengths, n, cap))
    for widen in (False, True):
        p = plan("hdp", lengths, n, cap, cost, widen=widen)
        assert p.lower_bound_ns <= bound and p.microbatch_counts().min() >= 1
        assert p.makespan_ns <= 1.05 * bound, p.makespan_ns / bound


def test_sized_cost_keeps_every_rank_busy() -> None:
    """With the micro-batch size term d the planners still give every rank work (d favours
    smaller micro-batches, so spreading only helps)."""
    rng = np.random.default_rng(4)
    for n in (2, 5, 16):
        lengths = rng.integers(1, 300, 3 * n)
        for policy, widen in VARIANTS:
            p = plan(policy, lengths, n, 4096, SIZED, widen=widen)
            check_plan(p)
            assert p.microbatch_counts().min() >= 1, (policy, widen)


def test_small_step_spreads_over_all_ranks() -> None:
    """The README's case in small: 4 ranks, C = 16384, a step of 8,192 tokens of short samples.
    Packing to C made one micro-batch on rank 0 (imbalance 4.0); every rank now runs about a
    quarter of the work."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 600, 40)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), 8192))]
    for policy, widen in VARIANTS:
        p = plan(policy, lengths, 4, 16384, widen=widen)
        check_plan(p)
        assert p.microbatch_counts().min() >= 1
    h = plan("hdp", lengths, 4, 16384)
    assert h.rank_time_ns.max() / h.rank_time_ns.mean() < 1.1
    one_rank = plan("hdp", lengths, 1, 16384)  # the same samples on one rank: about 4x longer
    assert one_rank.makespan_ns > 3.5 * h.makespan_ns


def test_hdp_spreads_short_work_over_idle_ranks() -> None:
    """24 samples of 600 tokens on 4 ranks with C = 8192: packing to C made two micro-batches and
    left two ranks idle (c + 13 samples' compute); hdp now forms its tail sample by sample, 6 per
    rank in one micro-batch each (c + 6 samples' compute), with or without widen."""
    lengths = [600] * 24
    one = DEBUG.a * 600 * 600 + DEBUG.b * 600  # seconds, a whole 600-token sample (n_half 0)
    assert DEBUG.attn_n_half == 0
    for w in (plan("hdp", lengths, 4, 8192), plan("hdp", lengths, 4, 8192, widen=True)):
        check_plan(w)
        assert w.num_microbatches == 4 and sorted(w.group_ranks.tolist()) == [0, 1, 2, 3]
        assert w.makespan_ns == pytest.approx((DEBUG.c + 6 * one) * 1e9, abs=8)


def size_ref(t: int, d_ns: float, knots: tuple, rates: tuple) -> int:
    """The size term in plain Python: d*t^2 + t*rate(t), rate linear from 0 at 0 through the
    knots, the last rate beyond them."""
    xs, fs = (0.0, *knots), (0.0, *rates)
    rate = fs[-1]
    for j in range(len(xs) - 1):
        if t < xs[j + 1]:
            rate = (fs[j + 1] - fs[j]) / (xs[j + 1] - xs[j]) * (t - xs[j]) + fs[j]
            break
    return int(d_ns * t * t + t * rate + 0.5)


def spread_samples_ref(w, s, cap: int, cd: tuple, load) -> tuple[list, list]:
    """schedule.spread_samples in plain Python: each sample to the least-loaded rank (lowest on
    ties), into its newest micro-batch if that has room, else the fullest older one with room (the
    newest on ties), else a new one."""
    load = [int(x) for x in load]
    pos: list[int] = []
    mb_rank: list[int] = []
    mb_of = []

    c_ns, d_ns, knots, rates = cd

    def size(t: int) -> int:
        return size_ref(t, d_ns, knots, rates)

    for wi, si in zip(w.tolist(), s.tolist()):
        r = min(range(len(load)), key=lambda x: (load[x], x))
        mine = [b for b in range(len(pos)) if mb_rank[b] == r]
        fits = [b for b in mine if pos[b] + si <= cap]
        if fits:
            b = mine[-1] if mine[-1] in fits else max(fits, key=lambda x: (pos[x], x))
            load[r] += wi + size(pos[b] + si) - size(pos[b])
            pos[b] += si
        else:
            b = len(pos)
            pos.append(si)
            mb_rank.append(r)
            load[r] += c_ns + wi + size(si)
        mb_of.append(b)
    return mb_of, mb_rank, load


@given(
    st.integers(1, 12),
    st.integers(1, 200),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 200)), max_size=60),
    st.lists(st.integers(0, 10**6), min_size=12, max_size=12),
    st.sampled_from(
        [(0, 0.0, (), ()), (1000, 0.0, (), ()), (500, 3.7, (), ()), (300, 0.0, (50, 120), (2, 5.5))]
    ),
)
# a rank's newest micro-batch full, two older ones with room: the fullest takes the sample
@example(1, 10, [(40, 5), (30, 8), (20, 9), (10, 2)], [0] * 12, (0, 0.0, (), ()))
@settings(deadline=None, max_examples=200)
def test_spread_samples_matches_reference(n, cap, samples, base, cd) -> None:
    """The kernel against the plain-Python reference, with and without a size table."""
    w = np.array([x for x, _ in samples], dtype=np.int64)
    s = np.minimum(np.array([y for _, y in samples], dtype=np.int64), cap)
    order = np.lexsort((np.arange(w.size), -w))
    w, s = w[order], s[order]
    load = np.array(base[:n], dtype=np.int64)
    want_mb, want_rank, want_load = spread_samples_ref(w, s, cap, cd, load)
    size_x, size_f = np.array((0.0, *cd[2])), np.array((0.0, *cd[3]), dtype=np.float64)
    mb, rank = spread_samples(w, s, cap, cd[0], cd[1], size_x, size_f, load)
    assert mb.tolist() == want_mb and rank.tolist() == want_rank and load.tolist() == want_load


def test_spread_samples_charges_the_cost_models_size_table() -> None:
    """With a calibrated size table (and an older file's d), what spread_samples adds to each
    rank's load is what the cost model times that rank's micro-batches at (local_times: c, the
    samples' work, CostModel.size_ns of each micro-batch's positions), up to rounding."""
    base = C.preset("debug")
    rng = np.random.default_rng(4)
    for size in (
        {"size_knots": (300.0, 900.0), "size_rates": (2e-6, 9e-6)},
        {"d": 3e-9, "size_knots": (500.0,), "size_rates": (4e-6,)},
    ):
        cost = dataclasses.replace(base, **size)
        lengths = rng.integers(1, 700, 80).astype(np.int64)
        w = cost.work_ns(lengths, 1)
        order = np.lexsort((np.arange(80), -w))
        load = np.zeros(6, dtype=np.int64)
        size_x, size_f = cost.size_table_ns()
        mb, rank = spread_samples(
            w[order], lengths[order], 1024, cost.c_ns, cost.d * 1e9, size_x, size_f, load
        )
        per_mb = [order[mb == b] for b in range(rank.shape[0])]
        off = np.cumsum([0, *map(len, per_mb)])
        times = local_times(cost, lengths, off, np.concatenate(per_mb))
        want = np.bincount(rank, times, minlength=6)
        assert np.abs(load - want).max() <= 2 * len(per_mb)  # each size term rounded apart


def test_idle_rank_filled_without_raising_the_step() -> None:
    """54 ranks, 211 short samples whose best-fit packing makes 53 micro-batches (the longest sets
    the step), while spreading the samples one by one ends later: hdp keeps the packed schedule
    and gives the idle rank a micro-batch from a rank that runs two. No rank idles, and the step
    is no longer than the packed one's."""
    rng = np.random.default_rng(23)
    cost = C.preset("llama-7b")
    while True:
        lengths = np.clip(rng.lognormal(np.log(400), 0.6, 211), 1, 2048).astype(np.int64)
        off, items = pack_local(np.arange(211), lengths, 2048)
        if off.shape[0] - 1 == 53:
            break
    packed = int(local_times(cost, lengths, off, items).max())
    w = cost.work_ns(lengths, 1)
    order = np.lexsort((np.arange(211), -w))
    load = np.zeros(54, dtype=np.int64)
    zero = np.zeros(1)
    spread_samples(w[order], lengths[order], 2048, cost.c_ns, 0.0, zero, zero, load)
    assert load.max() > packed  # the premise: spreading alone would end later
    p = plan("hdp", lengths, 54, 2048, cost)
    check_plan(p)
    assert p.microbatch_counts().min() >= 1
    assert p.makespan_ns <= packed


def test_widen_never_slower_than_plain_after_node_retiming() -> None:
    """43 ranks in nodes of 8 (llama-7b@h100): widen compares candidates with groups timed on
    the link between nodes, as placement may put them; the plain plan's ring of 7 lands inside one
    node and is re-timed on NVLink, which makes it faster than the widened candidate that won the
    comparison. hdp+widen returns the faster of the two as replayed."""
    lengths = [12932, 16, 10, 9, 8, 7, 7, 7, 6, 6, 6, 5, 5, 5, 4, 4, 3]
    cost = C.preset("llama-7b")
    h = plan("hdp", lengths, 43, 2048, cost)
    w = plan("hdp", lengths, 43, 2048, cost, widen=True)
    check_plan(w)
    assert cost.ranks_per_node == 8 and h.group_sizes.max() == 7
    assert w.makespan_ns <= h.makespan_ns


def test_a_dominant_sample_is_split_by_default() -> None:
    """The README example's shape: one sample whose work alone is most of a small step (7,000
    tokens among 30 short ones, 4 ranks, C = 16384). It fits one rank, so ByteScale's smallest-
    group rule (widen = false) leaves it there and the step takes about 3.9x the mean rank time;
    the default planner (widen) takes the static mesh that splits it over every rank."""
    rng = np.random.default_rng(0)
    lengths = np.concatenate([[7000], rng.integers(20, 80, 30)]).astype(np.int64)
    plain = plan("hdp", lengths, 4, 16384)
    assert plain.rank_time_ns.max() / plain.rank_time_ns.mean() > 3.5
    default = PlannerConfig(policy="hdp", capacity=16384).build(DEBUG, 4).plan(lengths)
    check_plan(default)
    t = default.rank_time_ns
    assert t.max() / t.mean() < 1.05 and default.makespan_ns < 0.3 * plain.makespan_ns
    assert default.meta["static_mesh"] == {"cp": 4, "dp": 1}
    # the sample's positions are computed on all four ranks, each a zigzag pair of its chunks
    mbs = [default.microbatches(r) for r in range(4)]
    covered = [sum(e - s for m in ms for sid, s, e in m.pieces if sid == 0) for ms in mbs]
    assert covered == [1750] * 4
