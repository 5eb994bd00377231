"""Placement rules of the planners against plain-Python references: place_groups (each group on
the least-loaded ranks, the idle gaps before it), static's deal of micro-batches to DP replicas,
and the planner's fits / check_fits limits."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.errors import MixlenError
from datapipe.plan import cost as C
from datapipe.plan.planner import PlannerConfig
from datapipe.plan.schedule import place_groups

DEBUG = C.preset("debug")


def plan(policy: str, lengths, n: int, cap: int):
    cfg = PlannerConfig(policy=policy, capacity=cap, widen=False)
    return cfg.build(DEBUG, n).plan(np.asarray(lengths, dtype=np.int64))


@given(
    st.integers(1, 8),
    st.lists(st.tuples(st.integers(1, 8), st.integers(0, 1000)), max_size=12),
)
@settings(deadline=None, max_examples=100)
def test_place_groups_matches_reference(n: int, groups: list) -> None:
    """place_groups in plain Python: each group on the k least-loaded ranks (lowest on ties),
    starting when the last of them is free; a member free earlier idles start - load (the gap
    a local micro-batch may fill without delaying the group)."""
    k = np.array([min(x, n) for x, _ in groups], dtype=np.int64)
    t = np.array([y for _, y in groups], dtype=np.int64)
    load = [0] * n
    ranks, gaps = [], []
    for g, (kg, tg) in enumerate(zip(k.tolist(), t.tolist())):
        members = sorted(range(n), key=lambda r: (load[r], r))[:kg]
        start = max(load[r] for r in members)
        gaps += [(r, g, start - load[r]) for r in members if load[r] < start]
        for r in members:
            load[r] = start + tg
        ranks += sorted(members)
    out, got_load, gap_rank, gap_group, gap_size = place_groups(k, t, n)
    assert out.tolist() == ranks and got_load.tolist() == load
    assert list(zip(gap_rank.tolist(), gap_group.tolist(), gap_size.tolist())) == gaps


def test_static_deals_micro_batches_fewest_then_lightest() -> None:
    """Each DP replica's micro-batch count and tokens equal a plain-Python deal of the plan's
    micro-batches, by decreasing tokens, each to the replica with the fewest micro-batches, then
    the fewest tokens, then the lowest index (static's rule: equal counts, token balance)."""
    rng = np.random.default_rng(7)
    for n, cap in ((2, 16), (4, 16), (6, 32), (4, 64)):
        for _ in range(15):
            lengths = rng.integers(1, cap + 1, size=int(rng.integers(n, 5 * n)))
            p = plan("static", lengths, n, cap)
            cp = p.meta["cp"]
            got = [[0, 0] for _ in range(n // cp)]
            want = [[0, 0] for _ in range(n // cp)]
            toks = []
            for m in range(p.num_microbatches):
                a, b = p.mb_piece_offsets[m], p.mb_piece_offsets[m + 1]
                toks.append(int((p.piece_end[a:b] - p.piece_start[a:b]).sum()))
                dp = int(p.group_ranks[p.mb_group_offsets[m]]) // cp
                got[dp] = [got[dp][0] + 1, got[dp][1] + toks[-1]]
            for t in sorted(toks, reverse=True):
                d = min(range(n // cp), key=lambda d: (want[d][0], want[d][1], d))
                want[d] = [want[d][0] + 1, want[d][1] + t]
            assert got == want, (n, cap, lengths.tolist())


def test_check_fits_names_the_longest_sample_no_plan_holds() -> None:
    """fits: N * C for the dynamic policies, max_context for static when set (by hand); the
    refusal names the longest sample that does not fit, not the first."""
    lengths = np.array([5, 20, 3, 40, 16, 17, 12, 13])
    hdp = PlannerConfig(capacity=8, widen=False).build(DEBUG, 2)
    assert hdp.fits(lengths).tolist() == [x <= 16 for x in lengths.tolist()]
    with pytest.raises(MixlenError, match=r"^data: sample 3 has 40 tokens, more than hdp on 2 "):
        hdp.check_fits(lengths, "data")
    static = PlannerConfig(policy="static", capacity=8, max_context=12).build(DEBUG, 2)
    assert static.fits(lengths).tolist() == [x <= 12 for x in lengths.tolist()]
    with pytest.raises(MixlenError, match=r"^data: sample 3 has 40 tokens"):
        static.check_fits(lengths, "data")
