"""The documented zigzag split (docs/ARCHITECTURE.md, "Zigzag split") against a plain reference:
datapipe.plan.zigzag, the per-rank view StepPlan.microbatches of real plans, and the ring's
ZigzagLayout (tests/test_ring.py).

The rule: a piece of S tokens on a group of k ranks is cut into 2k chunks whose sizes differ by at
most one, the first S mod 2k chunks one token longer; the member with group index p computes chunks
p and 2k-1-p.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.plan import cost as C
from datapipe.plan.planner import PlannerConfig
from datapipe.plan.zigzag import chunk_bounds, max_member_tokens, member_ranges, smallest_group


def reference_chunks(n: int, k: int) -> list[tuple[int, int]]:
    """The 2k chunks [start, end) of n tokens: the first n mod 2k chunks hold one token more."""
    chunks, start = [], 0
    for c in range(2 * k):
        size = n // (2 * k) + (1 if c < n % (2 * k) else 0)
        chunks.append((start, start + size))
        start += size
    return chunks


def reference_member(n: int, k: int, p: int) -> list[tuple[int, int]]:
    """The two chunks member p computes: chunk p, then chunk 2k-1-p."""
    chunks = reference_chunks(n, k)
    return [chunks[p], chunks[2 * k - 1 - p]]


def test_reference_spells_out_the_documented_examples() -> None:
    # 10 tokens on 2 ranks: chunks 3, 3, 2, 2; member 0 gets chunks 0 and 3, member 1 chunks 1, 2
    assert reference_member(10, 2, 0) == [(0, 3), (8, 10)]
    assert reference_member(10, 2, 1) == [(3, 6), (6, 8)]
    # 155 on 3 ranks (the exactness scenario): five chunks of 26, then one of 25
    assert [b - a for a, b in reference_chunks(155, 3)] == [26, 26, 26, 26, 26, 25]
    assert reference_member(155, 3, 0) == [(0, 26), (130, 155)]
    assert reference_member(155, 3, 2) == [(52, 78), (78, 104)]
    # 7 tokens on 4 ranks: one token in each of the first seven chunks, none in the last
    assert reference_member(7, 4, 0) == [(0, 1), (7, 7)]


@pytest.mark.parametrize("k", range(1, 10))
def test_zigzag_module_matches_reference(k: int) -> None:
    for n in range(0, 8 * k + 40):
        chunks = reference_chunks(n, k)
        assert chunk_bounds(n, k).tolist() == [0] + [b for _, b in chunks], (n, k)
        pairs = []
        for p in range(k):
            got = [tuple(r) for r in member_ranges(n, k, p)]
            assert got == reference_member(n, k, p), (n, k, p)
            pairs.append(sum(b - a for a, b in got))
        assert max_member_tokens(n, k) == max(pairs), (n, k)


@pytest.mark.parametrize("capacity", [1, 2, 5, 16, 64])
def test_smallest_group_is_the_smallest_that_fits(capacity: int) -> None:
    """The smallest k whose largest chunk pair fits the capacity, by brute force over the
    reference (0 when none up to max_k does)."""
    max_k = 12
    for n in range(0, max_k * capacity + 3):
        fits = [
            k
            for k in range(1, max_k + 1)
            if max(sum(b - a for a, b in reference_member(n, k, p)) for p in range(k)) <= capacity
        ]
        assert smallest_group(n, capacity, max_k) == (fits[0] if fits else 0), (n, capacity)


def _pieces_reference(group_pieces, k: int, p: int) -> list[tuple[int, int, int]]:
    """Member p's pieces of a group micro-batch: each group piece split by the reference."""
    out = []
    for sid, s, e in group_pieces:
        ranges = [(s, e)] if k == 1 else reference_member(e - s, k, p)
        out += [(sid, s + a, s + b) for a, b in ranges if b > a]
    return out


@settings(deadline=None, max_examples=40)
@given(
    st.integers(2, 8),
    st.lists(st.integers(0, 8 * 24), min_size=1, max_size=30),
    st.sampled_from(["hdp", "hdp+widen", "static", "naive-hdp"]),
)
def test_plan_views_follow_the_zigzag_rule(n: int, lengths: list[int], policy: str) -> None:
    """Every rank's view of real plans (rings of several samples under static and widen): its
    group index is its place in the group and its pieces are the reference split."""
    cap = 24
    lengths = [x % (n * cap + 1) for x in lengths]
    plan = (
        PlannerConfig(
            policy=policy.removesuffix("+widen"), capacity=cap, widen=policy.endswith("+widen")
        )
        .build(C.preset("debug"), num_ranks=n)
        .plan(np.asarray(lengths, dtype=np.int64), np.arange(50, 50 + len(lengths)))
    )
    for r in range(n):
        for mb in plan.microbatches(r):
            assert mb.group[mb.group_index] == r
            assert list(mb.pieces) == _pieces_reference(
                mb.group_pieces, len(mb.group), mb.group_index
            )


def test_plan_views_on_uneven_samples() -> None:
    """The exactness scenario's long samples (155 on 3 ranks, 103 on 2): the documented chunks
    (smallest rings: widen off)."""
    plan = (
        PlannerConfig(policy="hdp", capacity=64, widen=False)
        .build(C.preset("debug"), num_ranks=4)
        .plan(np.array([155, 103, 20, 17], dtype=np.int64), np.array([7, 8, 9, 10]))
    )
    rings = {}
    for r in range(4):
        for mb in plan.microbatches(r):
            if len(mb.group) > 1:
                rings.setdefault(mb.group_pieces, {})[mb.group_index] = mb.pieces
    assert rings[((7, 0, 155),)] == {
        0: ((7, 0, 26), (7, 130, 155)),
        1: ((7, 26, 52), (7, 104, 130)),
        2: ((7, 52, 78), (7, 78, 104)),
    }
    assert rings[((8, 0, 103),)] == {0: ((8, 0, 26), (8, 78, 103)), 1: ((8, 26, 52), (8, 52, 78))}
