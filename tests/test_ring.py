"""Ring attention over dynamic groups equals single-process attention over the whole samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_zigzag import reference_member

from trainer.attention.local import attend
from trainer.attention.ring import RingAttention, ZigzagLayout, ring_attend
from trainer.parallel.comm import free_port, spawn
from trainer.testing.threads import ThreadComm, run_threads

F64 = torch.float64


def whole_sample_reference(lengths, hq, hkv, d, seed, dtype=F64):
    """Random q/k/v/dout for the concatenated samples, and single-process out, lse, grads."""
    gen = torch.Generator().manual_seed(seed)
    total = int(sum(lengths))
    q = torch.randn(total, hq, d, dtype=dtype, generator=gen)
    k = torch.randn(total, hkv, d, dtype=dtype, generator=gen)
    v = torch.randn(total, hkv, d, dtype=dtype, generator=gen)
    dout = torch.randn(total, hq, d, dtype=dtype, generator=gen)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    cu = [0, *np.cumsum(lengths).tolist()]
    out, lse = attend(qr, kr, vr, cu, backend="math")
    out.backward(dout)
    ref = {"out": out.detach(), "lse": lse, "dq": qr.grad, "dk": kr.grad, "dv": vr.grad}
    return (q, k, v, dout), ref


def ring_member(comm, group, lengths, inputs):
    """What one rank of the ring computes: its local slice, forward and backward."""
    p = group.index(comm.rank)
    q, k, v, dout = inputs
    idx = torch.as_tensor(ZigzagLayout(tuple(lengths), len(group)).global_index(p))
    ql, kl, vl = (x[idx].clone().requires_grad_() for x in (q, k, v))
    ring = RingAttention(comm, group, p, lengths)
    out, lse = ring_attend(ql, kl, vl, ring)
    out.backward(dout[idx])
    return {
        "idx": idx,
        "out": out.detach(),
        "lse": lse,
        "dq": ql.grad,
        "dk": kl.grad,
        "dv": vl.grad,
    }


def assemble(parts, total):
    """Scatter members' results into whole-sample tensors; each position exactly once."""
    seen = torch.zeros(total, dtype=torch.long)
    full = {}
    for part in parts:
        seen[part["idx"]] += 1
        for name, val in part.items():
            if name != "idx":
                full.setdefault(name, val.new_zeros((total, *val.shape[1:])))[part["idx"]] = val
    assert torch.equal(seen, torch.ones_like(seen)), "positions not computed exactly once"
    return full


def check_ring(world, group, lengths, hq=4, hkv=2, d=8, seed=0, dtype=F64, atol=1e-10):
    inputs, ref = whole_sample_reference(lengths, hq, hkv, d, seed, dtype)

    def fn(comm: ThreadComm):
        if comm.rank not in group:
            return None  # not in this ring: must not be needed by it
        return ring_member(comm, group, lengths, inputs)

    parts = [r for r in run_threads(world, fn, timeout=30) if r is not None]
    full = assemble(parts, int(sum(lengths)))
    for name in ("out", "lse", "dq", "dk", "dv"):
        torch.testing.assert_close(full[name], ref[name].to(full[name].dtype), rtol=0, atol=atol)


@pytest.mark.parametrize(
    ("world", "group", "lengths", "hq", "hkv"),
    [
        (1, [0], [9], 4, 2),
        (3, [2], [5, 7, 1], 4, 4),
        (2, [1, 0], [12, 5], 4, 2),
        (4, [3, 0, 2], [13, 4, 2, 20], 6, 2),  # non-contiguous, lengths < 2k and not divisible
        (4, [0, 1, 2, 3], [8, 31, 3], 4, 1),
        (4, [2, 3, 1, 0], [1, 0, 17], 8, 2),  # an empty sample and a 1-token one
        (5, [4, 1], [6, 6, 6, 6], 2, 2),
    ],
)
def test_ring_matches_whole_attention(world, group, lengths, hq, hkv):
    check_ring(world, group, lengths, hq, hkv, seed=len(lengths) + world)


@settings(deadline=None, max_examples=25)
@given(
    k=st.integers(1, 4),
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    gqa=st.sampled_from([(4, 4), (4, 2), (6, 3), (4, 1)]),
    seed=st.integers(0, 2**16),
)
def test_ring_random_layouts(k, lengths, gqa, seed):
    rng = np.random.default_rng(seed)
    world = k + int(rng.integers(0, 2))
    group = [int(r) for r in rng.permutation(world)[:k]]
    check_ring(world, group, lengths, gqa[0], gqa[1], d=4, seed=seed)


def test_two_rings_at_once_do_not_mix():
    """Rings [3, 0] and [2, 1] run concurrently in one world (same tags), each exact."""
    lengths_a, lengths_b = [11, 4], [7, 9, 2]
    inputs_a, ref_a = whole_sample_reference(lengths_a, 4, 2, 8, seed=1)
    inputs_b, ref_b = whole_sample_reference(lengths_b, 4, 2, 8, seed=2)

    def fn(comm):
        if comm.rank in (3, 0):
            return "a", ring_member(comm, [3, 0], lengths_a, inputs_a)
        return "b", ring_member(comm, [2, 1], lengths_b, inputs_b)

    res = run_threads(4, fn, timeout=30)
    for tag, lengths, ref in (("a", lengths_a, ref_a), ("b", lengths_b, ref_b)):
        full = assemble([r for t, r in res if t == tag], sum(lengths))
        for name in ("out", "dq", "dk", "dv"):
            torch.testing.assert_close(full[name], ref[name], rtol=0, atol=1e-10)


def test_ring_float32_and_bf16_merge_in_float32():
    check_ring(3, [1, 2, 0], [40, 17], 4, 2, d=16, seed=3, dtype=torch.float32, atol=2e-5)
    inputs, ref = whole_sample_reference([30, 21], 4, 2, 16, seed=4)
    bf = tuple(x.bfloat16() for x in inputs)

    def fn(comm):
        return ring_member(comm, [0, 1], [30, 21], bf)

    full = assemble(run_threads(2, fn, timeout=30), 51)
    assert full["lse"].dtype == torch.float32
    torch.testing.assert_close(full["out"].double(), ref["out"], rtol=0, atol=4e-2)
    torch.testing.assert_close(full["lse"].double(), ref["lse"], rtol=0, atol=4e-2)


@pytest.mark.parametrize(
    ("lengths", "k"), [([10, 3, 0, 25], 3), ([7], 1), ([5, 6], 4), ([155], 3), ([103, 9], 2)]
)
def test_layout_follows_the_documented_zigzag(lengths, k):
    """Member p's local buffer holds, sample after sample, the sample's chunk p then its chunk
    2k-1-p of the plain reference split (tests/test_zigzag.py), not merely some cover."""
    lay = ZigzagLayout(tuple(lengths), k)
    offsets = np.cumsum(lengths) - np.asarray(lengths)
    for p in range(k):
        expect_pos, expect_glob, expect_front, expect_back, cu = [], [], [], [], [0]
        for n, off in zip(lengths, offsets, strict=True):
            (a0, a1), (b0, b1) = reference_member(n, k, p)
            row = cu[-1]
            expect_front += range(row, row + a1 - a0)
            expect_back += range(row + a1 - a0, row + a1 - a0 + b1 - b0)
            pos = [*range(a0, a1), *range(b0, b1)]
            expect_pos += pos
            expect_glob += [int(off) + x for x in pos]
            cu.append(row + len(pos))
        assert lay.position_ids(p).tolist() == expect_pos
        assert lay.global_index(p).tolist() == expect_glob
        assert lay.local_count(p) == len(expect_pos) and lay.local_cu(p) == cu
        assert lay.front_rows(p).tolist() == expect_front
        assert lay.back_rows(p).tolist() == expect_back


def test_ring_rejects_wrong_membership():
    def fn(comm):
        with pytest.raises(ValueError, match="not member"):
            RingAttention(comm, [1, 0], comm.rank, [4])
        with pytest.raises(ValueError, match="repeated"):
            RingAttention(comm, [0, 0], 0, [4])

    run_threads(2, fn, timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_ring_gloo_processes():
    """One launch of 4 gloo processes running several rings, incl. a non-contiguous one and one
    addressed through an island subgroup (island-local ranks mapped to global ranks)."""
    import _ring_worker

    world = 4
    spawn(_ring_worker.main, world, (world, free_port()), timeout=75)


def test_bf16_ring_sums_key_gradients_over_hops_in_float32():
    """A bfloat16 ring adds each key's dV contributions from the k members in float32 and rounds
    once: key 0 of a sample of 2k one-token chunks gets 256 from its owner's queries and 1 from
    each other member's (q = 0: uniform attention, dout chosen so), so dV = 256 + (k-1), rounded to
    bfloat16 once (259 -> 260); adding in bfloat16 hop by hop would lose every 1 (256)."""
    k, n, d = 4, 8, 8
    lay = ZigzagLayout((n,), k)
    owner = np.empty(n, dtype=np.int64)  # member holding each position
    for p in range(k):
        owner[lay.global_index(p)] = p
    weight = np.where(owner == 0, 128.0, 0.5)  # member 0's queries: 2 x 128, others: 2 x 0.5
    dout = torch.tensor((np.arange(n) + 1.0) * weight).reshape(n, 1, 1).expand(n, 1, d)
    gen = torch.Generator().manual_seed(0)
    q = torch.zeros(n, 1, d)
    k_, v = torch.randn(n, 1, d, generator=gen), torch.randn(n, 1, d, generator=gen)
    bf = tuple(x.bfloat16() for x in (q, k_, v, dout.float()))

    def fn(comm):
        return ring_member(comm, list(range(k)), [n], bf)

    full = assemble(run_threads(k, fn, timeout=30), n)
    exact = 2 * 128.0 + (k - 1) * 2 * 0.5  # plain sum of the members' contributions: 259
    assert torch.equal(full["dv"][0].float(), torch.full((1, d), exact).bfloat16().float())
