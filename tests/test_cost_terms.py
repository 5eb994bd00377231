"""The ring terms of the cost model (mixlen-cost/2) as the planners use them: per-hop latency, link
bandwidth (inside and between nodes), chunk efficiency of attention, the part of a hop that
overlaps compute, and the micro-batch size term (d*T^2, or T*r(T) from a size table). Each is checked against a plain formula written here, for plan times and for
one decision it moves; /1 cost files load with the costs they always had."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from datapipe.errors import InputError
from datapipe.plan import cost as C
from datapipe.plan.check import check_plan
from datapipe.plan.planner import PlannerConfig

# A small CPU-like model: 2 layers, K/V 1 KiB per position; terms switched on one at a time.
BASE = C.CostModel(
    a=4e-8,
    b=5e-5,
    c=2e-3,
    kv_bytes_per_token=1024.0,
    link_bytes_per_s=1e9,
    num_layers=2,
    act_bytes_per_token_layer=100.0,
    offload_bytes_per_s=1e9,
    name="terms",
)


def table_rate(knots: tuple, rates: tuple, t: float) -> float:
    """Seconds per position of the size table at t: 0 at 0, straight lines between the knots,
    the last rate beyond them (0 without a table)."""
    if not knots:
        return 0.0
    if t >= knots[-1]:
        return rates[-1]
    xs, fs = [0.0, *knots], [0.0, *rates]
    j = max(i for i in range(len(xs)) if xs[i] <= t)
    return fs[j] + (fs[j + 1] - fs[j]) * (t - xs[j]) / (xs[j + 1] - xs[j])


def member_s(cost: C.CostModel, lengths: list[int], k: int, spans: bool = True) -> float:
    """Reference member time (seconds) of a micro-batch of `lengths`, each split over k ranks."""
    attn = lin = 0.0
    for s in lengths:
        chunk = s / k
        eff = chunk / (chunk + cost.attn_n_half)
        attn += cost.a * s * s / k / eff
        lin += cost.b * s / k
    n = sum(lengths) / k  # the micro-batch's size term, T = member positions
    lin += cost.d * n * n + n * table_rate(cost.size_knots, cost.size_rates, n)
    ring = 0.0
    if k > 1:
        n = sum(lengths) / k
        hops = cost.num_layers * (3 * (k - 1) + 1)
        link = cost.link_bytes_per_s if spans else cost.node_link_bytes_per_s
        ring = hops * cost.hop_latency_s + 3 * (k - 1) * n * cost.kv_bytes_per_token / link
    exposed = (1 - cost.overlap) * ring + max(cost.overlap * ring - attn, 0.0)
    return cost.c + attn + lin + exposed


def plan(cost: C.CostModel, policy: str, lengths, n: int, cap: int, **kw):
    run = {k: kw.pop(k) for k in ("seed", "offload") if k in kw}
    cfg = PlannerConfig(policy=policy.split("+")[0], widen=policy.endswith("+widen"), **kw)
    p = dataclasses.replace(cfg, capacity=cap).build(cost, n, **run).plan(np.asarray(lengths))
    check_plan(p)
    return p


def lone_ring(cost: C.CostModel, s: int, n: int, cap: int) -> tuple[int, float]:
    """(group size widen picks, makespan s) for one sample alone on n ranks."""
    p = plan(cost, "hdp+widen", [s], n, cap)
    assert p.num_microbatches == 1
    return int(p.group_sizes[0]), p.makespan_ns / 1e9


def best_k(cost: C.CostModel, s: int, n: int, cap: int) -> int:
    """Reference: the ring width with the smallest member time, from the smallest that fits."""
    k0 = -(-s // cap)
    times = {k: member_s(cost, [s], k) for k in range(k0, n + 1)}
    return min(times, key=lambda k: (times[k], k))


def check_lone_ring(cost: C.CostModel, s: int, n: int, cap: int) -> int:
    """widen's ring for a lone sample: timed by the formula, within 2% of the formula's best width
    (widen searches a few widths, not all); returns the width it picked."""
    k, t = lone_ring(cost, s, n, cap)
    assert t == pytest.approx(member_s(cost, [s], k), abs=1e-8)
    assert t <= 1.02 * member_s(cost, [s], best_k(cost, s, n, cap))
    return k


def assert_close(ns: int, seconds: float) -> None:
    assert ns == pytest.approx(seconds * 1e9, abs=8)  # a few ns: one rounding per term


def test_hop_latency() -> None:
    # time: the static mesh (CP 2) runs two short samples in one ring micro-batch
    for lat in (0.0, 1e-4, 1e-3):
        cost = dataclasses.replace(BASE, hop_latency_s=lat, overlap=0.0)
        p = plan(cost, "static", [300, 500], 2, 4096, max_context=8192)
        assert p.group_sizes.tolist() == [2]
        assert_close(p.makespan_ns, member_s(cost, [300, 500], 2))
        assert_close(int(p.rank_time_ns[0]), member_s(cost, [300, 500], 2))
    # decision: a lone sample's ring narrows as hops get dearer
    picked = []
    for lat in (0.0, 1e-2, 3e-2):
        cost = dataclasses.replace(BASE, hop_latency_s=lat, overlap=0.0)
        picked.append(check_lone_ring(cost, 6000, 8, 4096))
    assert picked[0] > picked[1] > picked[2] > 2


def test_link_bandwidth_and_nodes() -> None:
    # decision: a slower link narrows the lone ring
    picked = []
    for bw in (1e11, 3e7, 1e7):
        cost = dataclasses.replace(BASE, link_bytes_per_s=bw, overlap=0.5)
        picked.append(check_lone_ring(cost, 6000, 8, 4096))
    assert picked[0] > picked[1] > picked[2]
    # nodes: 3 ranks per node; static CP 2 on 6 ranks forms (0,1) (2,3) (4,5): (2,3) spans two
    # nodes and pays the slow link, the others the node link
    cost = dataclasses.replace(
        BASE, link_bytes_per_s=1e8, node_link_bytes_per_s=1e10, ranks_per_node=3, overlap=0.0
    )
    p = plan(cost, "static", [1800] * 3, 6, 1024, max_context=2048)
    assert sorted(map(tuple, p.group_ranks.reshape(-1, 2).tolist())) == [(0, 1), (2, 3), (4, 5)]
    for r in range(6):
        want = member_s(cost, [1800], 2, spans=r in (2, 3))
        assert_close(int(p.rank_time_ns[r]), want)
    assert p.rank_time_ns[2] > p.rank_time_ns[0]
    # hdp places groups by load alone; each placed group is timed on the link its ranks use
    for lengths in ([1800, 1700, 1600], [1800, 300, 1700, 200, 1600]):
        p = plan(cost, "hdp", lengths, 6, 1024)
        for m in range(p.num_microbatches):
            ranks = p.group_ranks[p.mb_group_offsets[m] : p.mb_group_offsets[m + 1]].tolist()
            items = p.piece_item[p.mb_piece_offsets[m] : p.mb_piece_offsets[m + 1]]
            spans = len({r // 3 for r in ranks}) > 1
            want = member_s(cost, [lengths[i] for i in items], len(ranks), spans)
            assert_close(int(p.mb_time_ns[m]), want)
    # a group that needs more than one node is charged the slow link wherever it is placed
    big = plan(cost, "hdp", [9000], 6, 2048)
    assert big.group_sizes.tolist() == [5]
    assert_close(big.makespan_ns, member_s(cost, [9000], 5, spans=True))


def test_attention_chunk_efficiency() -> None:
    # time: local and split attention at eff(S/k) = (S/k) / (S/k + n_half)
    cost = dataclasses.replace(BASE, attn_n_half=256.0, overlap=0.0)
    single = plan(cost, "single", [3000], 1, 4096)
    assert_close(single.makespan_ns, member_s(cost, [3000], 1))
    ring = plan(cost, "hdp", [6000], 2, 4096)
    assert_close(ring.makespan_ns, member_s(cost, [6000], 2))
    # decision (policy ranking): two short samples on 2 ranks; hdp keeps them local (one per rank,
    # unevenly loaded), static (CP 2) splits both over the ring (even, but splitting adds
    # a*n_half*S per sample to each member). Which is faster flips where the formula says.
    s = [1500, 1200]

    def static_minus_hdp(h: float) -> float:
        c = dataclasses.replace(BASE, attn_n_half=h, hop_latency_s=0.0, overlap=1.0)
        return member_s(c, s, 2) - member_s(c, [s[0]], 1)

    assert static_minus_hdp(0.0) < 0 < static_minus_hdp(1600.0)  # the ranking flips in between
    for h in (0.0, 100.0, 400.0, 1600.0):
        c = dataclasses.replace(BASE, attn_n_half=h, hop_latency_s=0.0, overlap=1.0)
        hd = plan(c, "hdp", s, 2, 2048)
        st = plan(c, "static", s, 2, 2048, max_context=4096)
        assert hd.group_sizes.tolist() == [1, 1] and st.group_sizes.tolist() == [2]
        assert_close(hd.makespan_ns, member_s(c, [s[0]], 1))
        assert_close(st.makespan_ns, member_s(c, s, 2))
        assert (st.makespan_ns > hd.makespan_ns) == (static_minus_hdp(h) > 0)


def test_overlap() -> None:
    # time: (1 - overlap) of the ring always shows, the rest only beyond the attention
    for ov in (1.0, 0.6, 0.0):
        cost = dataclasses.replace(BASE, overlap=ov, hop_latency_s=1e-4)
        p = plan(cost, "hdp", [6000], 2, 4096)
        assert_close(p.makespan_ns, member_s(cost, [6000], 2))
    # decision: how much of a hop hides moves the lone ring's width (here full overlap makes the
    # ring's excess over the attention show at once, so it stays narrower)
    picked = []
    for ov in (1.0, 0.5, 0.0):
        cost = dataclasses.replace(BASE, overlap=ov, link_bytes_per_s=5e7)
        picked.append(check_lone_ring(cost, 6000, 8, 4096))
    assert len(set(picked)) > 1


@pytest.mark.parametrize(
    "size",
    [{"d": 2e-9}, {"size_knots": (1500.0, 4000.0), "size_rates": (3e-6, 8e-6)}],
    ids=["d", "table"],
)
def test_micro_batch_size_term(size) -> None:
    # time: d*T^2 or T*r(T), T the positions one rank computes in the micro-batch, local and ring
    cost = dataclasses.replace(BASE, **size, overlap=0.0, hop_latency_s=1e-4)
    local = plan(cost, "single", [3000, 2000, 500], 1, 8192)
    assert local.num_microbatches == 1
    assert_close(local.makespan_ns, member_s(cost, [3000, 2000, 500], 1))
    ring = plan(cost, "static", [6000, 1000], 2, 4096, max_context=8192)
    assert ring.group_sizes.tolist() == [2]
    assert_close(ring.makespan_ns, member_s(cost, [6000, 1000], 2))
    hd = plan(cost, "hdp", [6000, 1000, 900], 2, 4096)
    for m in range(hd.num_microbatches):
        items = hd.piece_item[hd.mb_piece_offsets[m] : hd.mb_piece_offsets[m + 1]]
        want = member_s(cost, [[6000, 1000, 900][i] for i in items], int(hd.group_sizes[m]))
        assert_close(int(hd.mb_time_ns[m]), want)
    # decision: a lone sample's ring widens as large micro-batches get dearer
    picked = [
        check_lone_ring(
            dataclasses.replace(BASE, hop_latency_s=1e-2, overlap=0.0, d=d), 6000, 8, 4096
        )
        for d in (0.0, 1e-7, 1e-6)
    ]
    assert picked[0] < picked[1] <= picked[2]
    # the file: written only when set (older files keep their bytes and hashes), read back
    assert "d" not in BASE.to_dict()
    assert C.from_dict(dataclasses.replace(BASE, d=1e-9).to_dict()).d == 1e-9
    with pytest.raises(InputError, match="'d' must be a finite number >= 0"):
        C.from_dict({**dataclasses.replace(BASE, d=1e-9).to_dict(), "d": -1.0})


def test_v1_cost_files_keep_their_costs(tmp_path) -> None:
    """A mixlen-cost/1 file (no ring terms) loads with neutral terms: group times are the /1
    formula, c + (a*S^2 + b*S)/k + max(ring bytes / link - attention, 0)."""
    d = {
        "schema": "mixlen-cost/1",
        "name": "old",
        "a": 3.38e-8,
        "b": 5.25e-5,
        "c": 7.2e-3,
        "kv_bytes_per_token": 2048.0,
        "link_bytes_per_s": 1.25e9,
        "comm_passes": 3,
        "num_layers": 2,
        "act_bytes_per_token_layer": 8704.0,
        "offload_bytes_per_s": 5e9,
    }
    p = tmp_path / "old.json"
    p.write_text(json.dumps(d))
    cost = C.load(p)
    assert (cost.hop_latency_s, cost.attn_n_half, cost.overlap, cost.ranks_per_node) == (
        0.0,
        0.0,
        1.0,
        0,
    )
    rng = np.random.default_rng(0)
    for _ in range(200):
        k = int(rng.integers(1, 9))
        s = rng.integers(1, 40000, int(rng.integers(1, 4))).tolist()
        n = sum(s) / k
        attn = sum(d["a"] * x * x / k for x in s)
        work = sum((d["a"] * x * x + d["b"] * x) / k for x in s)
        ring = 3 * (k - 1) * n * d["kv_bytes_per_token"] / d["link_bytes_per_s"]
        want = d["c"] + work + max(ring - attn, 0.0)
        from datapipe.plan.common import group_times

        got = group_times(
            cost,
            np.asarray(s),
            np.array([0, len(s)]),
            np.arange(len(s)),
            np.array([k]),
            np.array([0]),
        )[0]
        assert got == pytest.approx(want * 1e9, abs=4)
    # the file's bytes are its hash, as before
    assert plan(cost, "hdp", [5000, 30], 2, 4096).cost_hash == cost.hash
    # a /1 file may not carry /2 keys; a /2 file must carry them all
    p.write_text(json.dumps({**d, "overlap": 0.5}))
    with pytest.raises(InputError, match="overlap need 'schema' 'mixlen-cost/2'"):
        C.load(p)
    p.write_text(json.dumps({**d, "schema": "mixlen-cost/2", "overlap": 0.5}))
    with pytest.raises(InputError, match=r"missing key\(s\) attn_n_half, hop_latency_s"):
        C.load(p)
    p.write_text(json.dumps({**d, "schema": "mixlen-cost/9"}))
    with pytest.raises(InputError, match="'schema' is 'mixlen-cost/9'"):
        C.load(p)


def test_v2_roundtrip_and_checks(tmp_path) -> None:
    m = C.preset("llama-70b")
    assert m.ranks_per_node == 8 and m.node_link_bytes_per_s > m.link_bytes_per_s
    assert m.hop_latency_s > 0 and m.attn_n_half > 0 and 0 < m.overlap < 1
    p = tmp_path / "c.json"
    p.write_text(m.to_json())
    assert json.loads(p.read_text())["schema"] == "mixlen-cost/2"
    assert C.load(p) == m
    assert "tp" not in m.to_dict()  # a tp 1 file keeps its bytes and hash
    tp2 = dataclasses.replace(m, tp=2, tp_latency_s=1e-4, tp_bytes_per_s=1e9)
    p.write_text(tp2.to_json())
    assert C.load(p) == tp2
    bad_values = (("overlap", 1.5), ("hop_latency_s", -1.0), ("ranks_per_node", 2.5))
    bad_values += (("tp", 3), ("tp", True), ("tp_bytes_per_s", -1.0))
    for key, bad in bad_values:
        p.write_text(json.dumps({**m.to_dict(), key: bad}))
        with pytest.raises(InputError, match=f"'{key}' must be"):
            C.load(p)
    p.write_text(json.dumps({**m.to_dict(), "node_link_bytes_per_s": 0.0}))
    with pytest.raises(InputError, match="'node_link_bytes_per_s' must be > 0 when"):
        C.load(p)


def test_report_components_add_up_to_plan_times() -> None:
    """The report's per-micro-batch split (attention, linear incl. d*T^2, exposed communication,
    exposed offload, overhead) sums to the time the planner gave each micro-batch, with every term
    of the model switched on."""
    from datapipe.plan.metrics import mb_components

    cost = dataclasses.replace(
        BASE,
        num_layers=8,  # offload moves some of l - 2 layers: none with BASE's 2
        act_bytes_per_token_layer=2e4,
        d=1e-9,
        hop_latency_s=2e-4,
        attn_n_half=64.0,
        overlap=0.5,
        link_bytes_per_s=5e8,
    )
    rng = np.random.default_rng(3)
    lengths = np.concatenate([rng.integers(1, 4096, 40), rng.integers(4097, 20000, 5)])
    for policy, kw in (
        ("hdp", {}),
        ("hdp+widen", {}),
        ("static", {"max_context": 20000}),
        ("naive-hdp", {}),
        ("hdp", {"offload": True}),
    ):
        p = plan(cost, policy, lengths, 8, 4096, **kw)
        assert (p.group_sizes > 1).any() and (policy == "static" or (p.group_sizes == 1).any())
        assert (p.mb_offload > 0).any() == ("offload" in kw)
        parts = mb_components(p, cost).sum(axis=1) * 1e9
        per_mb = np.diff(p.mb_piece_offsets)
        assert np.all(np.abs(parts - p.mb_time_ns) <= 2 * per_mb + 2), policy


def test_size_table_in_files_and_times() -> None:
    """The size table: T*r(T) per micro-batch against the plain formula on both sides of every
    knot; written only when set (files without it keep their bytes and hashes), read back; bad
    tables refused naming the key."""
    cost = dataclasses.replace(BASE, size_knots=(2048.0, 4096.0), size_rates=(1e-5, 2.5e-5))
    ts = [1, 1000, 2047, 2048, 3000, 4096, 5000, 70000]
    want = [round(t * table_rate(cost.size_knots, cost.size_rates, t) * 1e9) for t in ts]
    assert cost.size_ns(np.array(ts)).tolist() == want
    assert "size_knots" not in BASE.to_dict() and "size_rates" not in BASE.to_dict()
    back = C.from_dict(json.loads(cost.to_json()))
    assert (back.size_knots, back.size_rates) == (cost.size_knots, cost.size_rates)
    assert back.hash == cost.hash != BASE.hash
    d = cost.to_dict()
    bad = [
        ({"size_rates": [1e-5]}, "one rate per knot"),
        ({"size_knots": [4096, 2048]}, "'size_knots' must increase strictly"),
        ({"size_rates": [2e-5, 1e-5]}, "'size_rates' must not decrease"),
        ({"size_rates": [-1e-5, 1e-5]}, r"'size_rates\[0\]' must be a finite number >= 0"),
        ({"size_knots": [0, 2048]}, r"'size_knots\[0\]' must be a finite number > 0"),
        ({"size_knots": "2048"}, "'size_knots' must be a list of numbers"),
    ]
    for change, match in bad:
        with pytest.raises(InputError, match=match):
            C.from_dict({**d, **change}, "cost.json")
