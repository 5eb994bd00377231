"""Planners: invariants on random batches (hypothesis), edge cases, determinism across processes,
group sizes against datapipe.plan.zigzag, static's CP degree, Eq. 3 offload, and hdp against a
brute-force optimum on tiny cases."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.errors import ConfigError, MixlenError
from datapipe.plan import cost as C
from datapipe.plan import widen as W
from datapipe.plan.check import check_plan
from datapipe.plan.common import group_times, lower_bound_ns
from datapipe.plan.planner import PlannerConfig
from datapipe.plan.static import static_cp_degree
from datapipe.plan.zigzag import smallest_group

DEBUG = C.preset("debug")
# 8 layers so Eq. 3 has room; offload copies cheap enough to hide under short samples' compute.
OFFLOAD = C.CostModel(2e-7, 5e-5, 1e-4, 64.0, 1e9, 8, 2000.0, 5e8, name="offload-test")


def plan(policy: str, lengths, n: int, cap: int, cost=DEBUG, **kw):
    run = {k: kw.pop(k) for k in ("seed", "offload") if k in kw}
    kw.setdefault("widen", False)  # plain hdp unless a test widens (the config's default is true)
    cfg = PlannerConfig(policy=policy, capacity=cap, **kw)
    return cfg.build(cost, n, **run).plan(np.asarray(lengths, dtype=np.int64))


batches = st.integers(1, 12).flatmap(
    lambda n: st.tuples(
        st.just(n),
        st.integers(1, 64),
        st.lists(st.integers(0, 10**6), max_size=40),
        st.floats(0.0, 1.0),
    )
)


def _lengths(n: int, cap: int, raw: list[int], long_share: float) -> np.ndarray:
    """Mostly short samples, some up to N*C (raw values folded into range)."""
    out = []
    for i, x in enumerate(raw):
        if (i * 0.618) % 1.0 < long_share:
            out.append(x % (n * cap + 1))
        else:
            out.append(x % (cap + 1))
    return np.array(out, dtype=np.int64)


@given(batches)
@settings(deadline=None, max_examples=120)
def test_invariants_all_policies(case) -> None:
    n, cap, raw, long_share = case
    lengths = _lengths(n, cap, raw, long_share)
    plain = {}
    for policy, cost, offload, widen in (
        ("hdp", DEBUG, False, False),
        ("naive-hdp", DEBUG, False, False),
        ("static", DEBUG, False, False),
        ("hdp", OFFLOAD, True, False),
        ("naive-hdp", OFFLOAD, True, False),
        ("hdp", DEBUG, False, True),
        ("hdp", OFFLOAD, True, True),
    ):
        p = plan(policy, lengths, n, cap, cost, offload=offload, widen=widen)
        check_plan(p)
        again = plan(policy, lengths, n, cap, cost, offload=offload, widen=widen)
        assert again.digest() == p.digest()
        if policy == "hdp" and not widen:
            plain[offload] = p
        if widen:  # the plain plan is a candidate: widening never makes the estimate worse
            assert p.makespan_ns <= plain[offload].makespan_ns
            if longest_fits_static(lengths, n, cap):  # nor slower than the batch's static mesh
                assert p.makespan_ns <= plan("static", lengths, n, cap, cost).makespan_ns
        caps = cost.offload_capacity(cap, np.arange(cost.num_layers + 1))
        k = p.group_sizes
        for m in range(p.num_microbatches):
            j = round(p.mb_offload[m] * cost.num_layers)
            assert p.mb_capacity[m] == caps[j]
            if not offload:
                assert j == 0
        if policy == "static" or "static_mesh" in p.meta:  # widen's static-mesh candidate too
            assert len(set(k.tolist())) <= 1
            cp = p.meta["cp"] if policy == "static" else p.meta["static_mesh"]["cp"]
            assert all(cp * cap >= s for s in lengths)
            continue
        # One micro-batch per long sample, on exactly the group Eq. 3 / the zigzag rule allows
        # (widen: any group from that one up to min(N, S), short samples may share its ring).
        for m in range(p.num_microbatches):
            items = p.piece_item[p.mb_piece_offsets[m] : p.mb_piece_offsets[m + 1]]
            if k[m] == 1 and p.mb_offload[m] == 0:
                assert all(lengths[i] <= cap for i in items)
                continue
            i, *extra = items
            s = int(lengths[i])
            if extra:
                assert widen and p.mb_offload[m] == 0
                assert sum(-(-int(lengths[x]) // int(k[m])) for x in items) <= cap
                assert all(lengths[x] <= cap for x in extra)
            kmin = _eq3_ranks(cost, s, cap) if offload else smallest_group(s, cap, n)
            if widen:
                assert kmin <= k[m] <= min(n, s)
            elif not offload:
                assert k[m] == kmin
            else:
                assert kmin <= k[m] <= max(kmin, smallest_group(s, cap, n))
                if policy == "naive-hdp":
                    assert k[m] == kmin
        if not offload and not widen:
            assert p.lower_bound_ns <= p.makespan_ns


def longest_fits_static(lengths: np.ndarray, n: int, cap: int) -> bool:
    """Some CP degree dividing n holds the batch's longest sample (a static mesh exists)."""
    longest = int(np.max(lengths)) if len(lengths) else 0
    return any(n % d == 0 and -(-longest // d) <= cap for d in range(1, n + 1))


def _eq3_ranks(cost: C.CostModel, s: int, cap: int) -> int:
    """Reference: fewest ranks over offload ratios j/l whose copies hide under the forward."""
    l_ = cost.num_layers
    best = None
    for j in range(l_ + 1):
        r = Fraction(j, l_)
        copy = (  # r of the l - 2 layers Eq. 3 can move (the last two stay on the device)
            r
            * max(l_ - 2, 0)
            * Fraction(cost.act_bytes_per_token_layer)
            * s
            / Fraction(cost.offload_bytes_per_s)
        )
        fwd = (Fraction(cost.a) * s * s + Fraction(cost.b) * s) / 3
        if copy > fwd:  # per member both scale by 1/k
            continue
        d = 1
        while (2 + (1 - r) * (l_ - 2)) * (-(-s // d)) > l_ * cap:
            d += 1
        best = d if best is None else min(best, d)
    return best


def test_offload_shrinks_groups_and_hdp_keeps_makespan() -> None:
    rng = np.random.default_rng(3)
    lengths = np.concatenate([rng.integers(1, 64, 300), [900, 700, 500]])
    plain = plan("hdp", lengths, 16, 64, OFFLOAD)
    off = plan("hdp", lengths, 16, 64, OFFLOAD, offload=True)
    naive_off = plan("naive-hdp", lengths, 16, 64, OFFLOAD, offload=True)
    for p in (plain, off, naive_off):
        check_plan(p)
    assert naive_off.group_sizes.max() < plain.group_sizes.max()  # Eq. 3 frees ranks
    assert (off.mb_offload > 0).any()
    # hdp only shrinks a group while its member share stays under the no-offload bound.
    target = lower_bound_ns(OFFLOAD, lengths, 16, 64)
    for m in np.flatnonzero(off.mb_offload > 0):
        assert off.mb_time_ns[m] <= target


def test_widen_beats_static_where_short_work_is_scarce() -> None:
    """4 ranks, C = 4096: plain hdp runs 11856 tokens on a ring of 3 beside one local micro-batch;
    widen puts it on all 4 with the short sample in the ring's spare room, like the static mesh."""
    lengths = [16384, 11856, 1084]
    h = plan("hdp", lengths, 4, 4096)
    w = plan("hdp", lengths, 4, 4096, widen=True)
    st_ = plan("static", lengths, 4, 4096)
    for p in (h, w, st_):
        check_plan(p)
    assert sorted(h.group_sizes.tolist()) == [1, 3, 4]
    assert w.makespan_ns <= st_.makespan_ns < h.makespan_ns
    assert w.group_sizes.tolist() == [4, 4]
    assert w.meta["widened"] == 1 and w.meta["widen_filled"] == 1
    assert plan("hdp", lengths, 4, 4096, widen=True).digest() == w.digest()


def test_widen_takes_the_static_mesh_when_it_is_estimated_faster() -> None:
    """2 ranks, the debug preset (its rings cost nothing): CP 2 x DP 1 splits the demo's first
    batch evenly, which no dynamic candidate does; hdp+widen returns that plan (policy hdp). On a
    slow link it keeps its own plan."""
    lengths = [12818, 9024, 3878, 3813, 1494, 745, 695, 190, 49, 30, 24]
    h = plan("hdp", lengths, 2, 8192)
    w = plan("hdp", lengths, 2, 8192, widen=True)
    st_ = plan("static", lengths, 2, 8192)
    check_plan(w)
    assert w.makespan_ns == st_.makespan_ns < h.makespan_ns
    assert w.policy == "hdp" and w.label == "hdp+widen"
    assert w.meta["static_mesh"] == {"cp": 2, "dp": 1}
    for key in ("mb_group_offsets", "group_ranks", "mb_piece_offsets", "piece_item", "mb_time_ns"):
        np.testing.assert_array_equal(getattr(w, key), getattr(st_, key))
    # the run's mesh (max_context): CP 2 for a short batch too, which hdp+widen may take as well
    short = [5000, 3000, 1000]
    for ctx in (None, 16384):
        ws = plan("hdp", short, 2, 8192, widen=True, max_context=ctx)
        assert ws.makespan_ns <= plan("static", short, 2, 8192, max_context=ctx).makespan_ns
    assert "static_mesh" in ws.meta and ws.meta["static_mesh"]["cp"] == 2  # 4500 | 4500 tokens
    # a slow link: static's one ring carries every sample's K/V, widen's only the long one's
    few = [12000, 3000, 1000]
    dear = dataclasses.replace(DEBUG, link_bytes_per_s=1e7, overlap=0.0)
    w2 = plan("hdp", few, 2, 8192, dear, widen=True)
    assert "static_mesh" not in w2.meta and sorted(w2.group_sizes.tolist()) == [1, 1, 2]
    assert w2.makespan_ns < plan("static", few, 2, 8192, dear).makespan_ns


@pytest.mark.parametrize("cost", [DEBUG, C.preset("llama-7b"), OFFLOAD], ids=["debug", "7b", "off"])
def test_widen_never_worse_than_hdp(cost) -> None:
    rng = np.random.default_rng(7)
    offload = cost is OFFLOAD
    better = 0
    for _ in range(40):
        n = int(rng.integers(2, 48))
        cap = int(rng.choice([64, 512, 4096]))
        m = int(rng.integers(1, 120))
        long_ = rng.random(m) < rng.uniform(0.02, 0.5)
        lengths = np.where(
            long_, rng.integers(cap + 1, n * cap + 1, m), rng.integers(1, cap + 1, m)
        )
        h = plan("hdp", lengths, n, cap, cost, offload=offload)
        w = plan("hdp", lengths, n, cap, cost, offload=offload, widen=True)
        check_plan(w)
        assert w.makespan_ns <= h.makespan_ns
        assert w.lower_bound_ns == h.lower_bound_ns  # same reference bound in reports
        assert w.meta["widen_candidates"] <= W.WIDEN_EVALS + W.WIDEN_FILLS + 2  # + static mesh
        better += w.makespan_ns < h.makespan_ns
    assert better > 0


def test_group_times_of_multi_sample_groups() -> None:
    """A group micro-batch of two samples costs c + both shares + the exposed part of the summed
    attention, linear and ring time of the member's positions (spelled out from the cost model)."""
    rng = np.random.default_rng(1)
    s = rng.integers(1, 1 << 20, 200)
    k = rng.integers(1, 300, 100)
    j = rng.integers(0, OFFLOAD.num_layers + 1, 100)
    off = np.arange(0, 201, 2, dtype=np.int64)
    for cost in (DEBUG, OFFLOAD, C.preset("llama-7b")):
        got = group_times(cost, s, off, np.arange(200), k, j)
        for g in range(100):
            a, b, kk = s[2 * g], s[2 * g + 1], k[g]
            n = float(a + b) / kk
            want = (
                cost.c_ns
                + cost.work_ns(np.array([a]), kk)[0]
                + cost.work_ns(np.array([b]), kk)[0]
                + cost.exposed_ns(
                    cost.attn_ns(np.array([a]), kk) + cost.attn_ns(np.array([b]), kk),
                    cost.linear_ns(np.array([a]), kk) + cost.linear_ns(np.array([b]), kk),
                    cost.ring_ns(np.array([n]), np.array([kk])),
                    cost.offload_ns(np.array([n]), np.array([j[g] / cost.num_layers])),
                )[0]
            )
            assert got[g] == int(want), (cost.name, g)


def test_single_is_a_valid_whole_sample_plan() -> None:
    lengths = np.array([5, 0, 300, 17, 64, 1], dtype=np.int64)
    for cap in (64, 100, 1000):
        p = PlannerConfig(policy="single", capacity=cap).build(DEBUG, num_ranks=1)
        plan = p.plan(lengths, np.arange(10, 16))
        check_plan(plan)  # the reference checker: exact coverage, capacities, order, times
        pieces = [p for mb in plan.microbatches(0) for p in mb.pieces]
        assert sorted(pieces) == [(10, 0, 5), (12, 0, 300), (13, 0, 17), (14, 0, 64), (15, 0, 1)]
        assert plan.makespan_ns >= plan.lower_bound_ns > 0
    assert plan.num_microbatches == 1  # capacity 1000 holds the whole batch
    with pytest.raises(ConfigError, match="single policy plans one rank"):
        PlannerConfig(policy="single", capacity=64).build(DEBUG, num_ranks=4)


def test_widen_only_for_hdp() -> None:
    """widen is on by default and only hdp widens: other policies plan as without it."""
    rng = np.random.default_rng(3)
    lengths = np.concatenate([[7000], rng.integers(20, 80, 30)]).astype(np.int64)
    for policy in ("naive-hdp", "static"):
        on = PlannerConfig(policy=policy, capacity=16384).build(DEBUG, num_ranks=4)
        off = PlannerConfig(policy=policy, capacity=16384, widen=False).build(DEBUG, num_ranks=4)
        assert on.config.widen is False
        assert on.plan(lengths).digest() == off.plan(lengths).digest()
    hdp = PlannerConfig(policy="hdp", capacity=16384).build(DEBUG, num_ranks=4)
    assert hdp.config.widen is True and hdp.plan(lengths).meta.get("widen")
    with pytest.raises(ConfigError, match="widen: expected bool, got str"):
        PlannerConfig(widen="yes").build(DEBUG, num_ranks=8)  # type: ignore[arg-type]


def test_static_cp_degree_bruteforce() -> None:
    for n in range(1, 25):
        for cap in (1, 3, 8):
            for ctx in range(1, n * cap + 1):
                ref = min(d for d in range(1, n + 1) if n % d == 0 and d * cap >= ctx)
                assert static_cp_degree(n, cap, ctx) == ref
    with pytest.raises(MixlenError, match="does not fit"):
        static_cp_degree(4, 8, 33)


def test_static_mesh_is_fixed() -> None:
    lengths = [5, 40, 3, 3, 17, 12, 1, 30]
    p = plan("static", lengths, 6, 16, max_context=40)
    check_plan(p)
    cp = static_cp_degree(6, 16, 40)
    assert p.meta["cp"] == cp == 3
    groups = {
        tuple(p.group_ranks[a:b]) for a, b in zip(p.mb_group_offsets[:-1], p.mb_group_offsets[1:])
    }
    assert groups <= {(0, 1, 2), (3, 4, 5)}
    # micro-batch counts differ by at most one between DP replicas (token balance, not time)
    counts = p.microbatch_counts()
    assert counts.max() - counts.min() <= 1


def test_static_rejects_longer_than_max_context() -> None:
    with pytest.raises(MixlenError, match="sample 2 has 50 tokens, more than max_context"):
        plan("static", [5, 6, 50], 4, 16, max_context=40)


@pytest.mark.parametrize("policy", ["hdp", "naive-hdp", "static", "hdp+widen"])
def test_edge_cases(policy: str) -> None:
    kw = {"widen": True} if policy == "hdp+widen" else {}
    policy = policy.removesuffix("+widen")
    empty = plan(policy, [], 4, 8, **kw)
    check_plan(empty)
    assert empty.num_microbatches == 0 and empty.makespan_ns == 0
    zeros = plan(policy, [0, 0, 0], 4, 8, **kw)
    check_plan(zeros)
    assert zeros.num_microbatches == 0
    full = plan(policy, [8] * 10, 4, 8, **kw)  # all samples exactly C: one local mb each
    check_plan(full)
    assert full.num_microbatches == 10 and set(full.group_sizes.tolist()) == {1}
    assert sorted(full.microbatch_counts().tolist()) == [2, 2, 3, 3]  # equal times: 10 on 4
    one_long = plan(policy, [32, 0, 3], 4, 8, **kw)  # exactly N*C: a ring of all 4 ranks
    check_plan(one_long)
    assert one_long.group_sizes.max() == 4
    tiny = plan(policy, [8, 2, 1], 8, 1, **kw)  # C = 1: k = S already, nothing to widen
    check_plan(tiny)
    # the static mesh runs every sample on its one CP-8 group
    want = [8, 8, 8] if policy == "static" else [8, 2, 1]
    assert sorted(tiny.group_sizes.tolist(), reverse=True) == want
    if policy != "static":
        with pytest.raises(MixlenError, match=r"sample 1 has 33 tokens, more than N \* C = 32"):
            plan(policy, [3, 33], 4, 8, **kw)


def test_sample_ids_carried() -> None:
    p = (
        PlannerConfig(capacity=8)
        .build(DEBUG, num_ranks=2)
        .plan(np.array([3, 12]), np.array([70, 71]))
    )
    check_plan(p)
    assert {pc[0] for r in range(2) for mb in p.microbatches(r) for pc in mb.pieces} == {70, 71}
    with pytest.raises(MixlenError, match="too many|more than"):
        PlannerConfig(capacity=8).build(DEBUG, num_ranks=2).plan(
            np.array([3, 17]), np.array([5, 9])
        )


_SUB = """
import json, sys, numpy as np
from datapipe.plan import cost as C
from datapipe.plan.planner import PlannerConfig
rng = np.random.default_rng(11)
L = np.minimum(rng.lognormal(5, 1.5, 500).astype(np.int64), 2000)
out = {}
for pol in ("hdp", "naive-hdp", "static"):
    out[pol] = PlannerConfig(policy=pol, capacity=256, widen=False).build(C.preset("llama-7b"), 24).plan(L).digest().hex()
out["hdp+widen"] = PlannerConfig(capacity=256, widen=True).build(C.preset("debug"), 24).plan(L).digest().hex()
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_identical_across_processes() -> None:
    rng = np.random.default_rng(11)
    lengths = np.minimum(rng.lognormal(5, 1.5, 500).astype(np.int64), 2000)
    here = {
        pol: plan(pol, lengths, 24, 256, C.preset("llama-7b")).digest().hex()
        for pol in ("hdp", "naive-hdp", "static")
    }
    here["hdp+widen"] = plan("hdp", lengths, 24, 256, widen=True).digest().hex()
    res = subprocess.run([sys.executable, "-c", _SUB], capture_output=True, text=True, check=True)
    assert json.loads(res.stdout) == here


# --- brute-force optimum --------------------------------------------------------------------------
def optimum(n: int, jobs: list[tuple[int, int]], upper: int) -> int:
    """Exact minimum makespan of the same micro-batches (k ranks, time t each) on n identical
    ranks over every slot order and rank choice, under blocking-rendezvous replay (a micro-batch
    starts when its last member is free). Branch and bound over (sorted loads, remaining jobs)."""
    best = [upper]
    seen: set = set()

    def rec(loads: tuple[int, ...], rem: tuple[tuple[int, int], ...]) -> None:
        if (loads, rem) in seen:
            return
        seen.add((loads, rem))
        if not rem:
            best[0] = min(best[0], loads[-1])
            return
        work = sum(k * t for k, t in rem)
        if loads[-1] >= best[0] or -(-(sum(loads) + work) // n) >= best[0]:
            return
        for i, (k, t) in enumerate(rem):
            if i and rem[i - 1] == (k, t):
                continue
            nrem = rem[:i] + rem[i + 1 :]
            tried = set()
            for sub in itertools.combinations(range(n), k):
                vals = tuple(loads[x] for x in sub)
                if vals in tried:
                    continue
                tried.add(vals)
                nl = list(loads)
                for x in sub:
                    nl[x] = max(vals) + t
                rec(tuple(sorted(nl)), nrem)

    rec(tuple([0] * n), tuple(sorted(jobs)))
    return best[0]


def test_hdp_against_bruteforce_optimum() -> None:
    """<= 8 samples, <= 4 ranks. All-local cases: list scheduling by decreasing time is within
    4/3 - 1/(3N) of the optimum (Graham), and the improvement pass only lowers the makespan.
    With group micro-batches no such bound holds for our rules (test_plan.py); we require <= 4/3
    on these cases, and at least 90% of them within 10% of the optimum (the share is printed)."""
    rng = np.random.default_rng(2024)
    within, total, worst = 0, 0, 1.0
    w_within, w_below = 0, 0
    for case in range(250):
        n = int(rng.integers(1, 5))
        cap = 64
        ns = int(rng.integers(1, 9))
        hi = n * cap if case % 2 else cap
        lengths = rng.integers(1, hi + 1, ns)
        p = plan("hdp", lengths, n, cap)
        check_plan(p)
        jobs = [(int(k), int(t)) for k, t in zip(p.group_sizes, p.mb_time_ns)]
        opt = optimum(n, jobs, p.makespan_ns + 1)
        ratio = p.makespan_ns / opt
        w = plan("hdp", lengths, n, cap, widen=True)  # other micro-batches: may beat `opt`
        assert w.makespan_ns <= p.makespan_ns
        w_within += w.makespan_ns <= 1.1 * opt
        w_below += w.makespan_ns < opt
        if all(k == 1 for k, _ in jobs):
            assert p.makespan_ns * 3 * n <= (4 * n - 1) * opt, (lengths, jobs, ratio)
        assert ratio <= 4 / 3, (n, lengths.tolist(), jobs, ratio)
        within += ratio <= 1.1
        total += 1
        worst = max(worst, ratio)
    print(f"hdp within 10% of optimum: {within}/{total}; worst ratio {worst:.3f}")
    print(f"hdp+widen within 10% of hdp's optimum: {w_within}/{total}; below it: {w_below}")
    # widen is never above plain hdp per case (asserted above); here: it reaches plans that no
    # schedule of hdp's own micro-batches reaches
    assert within >= 0.9 * total and w_below > 0


def test_hdp_beats_naive_and_static_on_mixed_lengths() -> None:
    """Not a theorem, but the point of the planner: on a skewed batch its makespan is lower."""
    rng = np.random.default_rng(5)
    lengths = np.minimum(rng.lognormal(np.log(512), 1.6, 4000).astype(np.int64) + 1, 1 << 18)
    cost = C.preset("llama-7b")
    h, nv, st_ = (plan(pol, lengths, 64, 8192, cost) for pol in ("hdp", "naive-hdp", "static"))
    for p in (h, nv, st_):
        check_plan(p)
    assert h.makespan_ns < nv.makespan_ns < st_.makespan_ns
    assert h.makespan_ns <= 1.05 * h.lower_bound_ns


def test_plan_records_cost_file_hash(tmp_path) -> None:
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(C.preset("debug").to_dict()))  # not the canonical layout
    loaded = C.load(path)
    p = plan("hdp", [5, 9, 30], 4, 8, loaded)
    assert p.cost_hash == hashlib.sha256(path.read_bytes()).hexdigest()
    # Same numbers from another file: same decisions, different recorded hash and digest.
    q = plan("hdp", [5, 9, 30], 4, 8, C.preset("debug"))
    assert np.array_equal(p.group_ranks, q.group_ranks) and p.digest() != q.digest()


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="policy: 'fancy' is not one of hdp, naive-hdp"):
        PlannerConfig(policy="fancy").build(DEBUG, num_ranks=8)
    with pytest.raises(ConfigError, match="num_ranks"):
        PlannerConfig().build(DEBUG, num_ranks=0)
    with pytest.raises(ConfigError, match="capacity"):
        PlannerConfig(capacity=0).build(DEBUG, num_ranks=8)
    with pytest.raises(MixlenError, match=">= 0"):
        plan("hdp", [3, -1], 2, 8)
