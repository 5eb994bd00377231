"""Varlen attention and ring block primitives against a naive masked softmax in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datapipe.plan.zigzag import chunk_bounds
from trainer.attention.local import (
    Visibility,
    attend,
    attend_block,
    block_backward,
    block_forward,
    chunk_visibility,
    merge_partial,
)

F64 = torch.float64
BACKENDS = ["cpu_flash", "math"]


def naive(q, k, v, cu_q, cu_k, causal):
    """Masked softmax per document with expanded K/V; rows with no key give out 0, lse -inf."""
    g = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for d in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[d], cu_q[d + 1], cu_k[d], cu_k[d + 1]
        qd = q[q0:q1]
        kd = k[k0:k1].repeat_interleave(g, dim=1)
        vd = v[k0:k1].repeat_interleave(g, dim=1)
        s = torch.einsum("lhd,shd->hls", qd, kd) * q.shape[-1] ** -0.5
        if causal:
            mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril()
            s = s.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, -1) if k1 > k0 else s.new_full((q.shape[1], q1 - q0), -np.inf)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        outs.append(torch.einsum("hls,shd->lhd", p, vd))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def rand_qkv(tq, tk, hq=4, hkv=2, d=8, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, hq, d, dtype=dtype, generator=gen).requires_grad_()
    k = torch.randn(tk, hkv, d, dtype=dtype, generator=gen).requires_grad_()
    v = torch.randn(tk, hkv, d, dtype=dtype, generator=gen).requires_grad_()
    return q, k, v


def grads(out, tensors, seed=1):
    gen = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, dtype=out.dtype, generator=gen)
    return torch.autograd.grad(out, tensors, dout)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("lengths", "hq", "hkv"),
    [
        ([7], 4, 4),
        ([5, 1, 9, 3], 4, 2),
        ([3, 0, 6, 0, 2], 6, 2),
        ([1, 1, 1], 2, 1),
        ([17, 4], 8, 2),
    ],
)
def test_attend_matches_naive(backend, lengths, hq, hkv):
    cu = [0, *np.cumsum(lengths).tolist()]
    q, k, v = rand_qkv(cu[-1], cu[-1], hq, hkv, seed=len(lengths))
    out, lse = attend(q, k, v, torch.tensor(cu, dtype=torch.int32), backend=backend)
    ref_out, ref_lse = naive(q, k, v, cu, cu, True)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    for g, r in zip(grads(out, (q, k, v)), grads(ref_out, (q, k, v)), strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-11)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attend_documents_are_isolated(backend):
    """Changing one document's K/V leaves every other document's output untouched."""
    cu = [0, 4, 9, 12]
    q, k, v = rand_qkv(12, 12)
    out1, _ = attend(q, k, v, cu, backend=backend)
    k2 = k.detach().clone()
    k2[4:9] = torch.randn(5, 2, 8, dtype=F64)  # a constant shift would cancel in softmax
    out2, _ = attend(q, k2, v, cu, backend=backend)
    assert torch.equal(out1[:4], out2[:4]) and torch.equal(out1[9:], out2[9:])
    assert not torch.allclose(out1[4:9], out2[4:9])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("visibility", [Visibility.FULL, Visibility.CAUSAL, Visibility.NONE])
def test_attend_block_matches_naive(backend, visibility):
    if visibility is Visibility.CAUSAL:  # diagonal blocks are square
        lq = lk = [3, 0, 5, 1]
    else:
        lq, lk = [3, 2, 5, 0], [4, 0, 2, 3]
    cu_q = [0, *np.cumsum(lq).tolist()]
    cu_k = [0, *np.cumsum(lk).tolist()]
    q, k, v = rand_qkv(cu_q[-1], cu_k[-1], 4, 2, seed=3)
    out, lse = attend_block(q, k, v, cu_q, cu_k, visibility, backend=backend)
    if visibility is Visibility.NONE:  # out 0, lse -inf (a merge's identity), gradient 0
        assert torch.equal(out, torch.zeros_like(out)) and (lse == -np.inf).all()
        (dq,) = grads(out, (q,))
        assert torch.equal(dq, torch.zeros_like(q))
        return
    ref_out, ref_lse = naive(q, k, v, cu_q, cu_k, visibility is Visibility.CAUSAL)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    for g, r in zip(grads(out, (q, k, v)), grads(ref_out, (q, k, v)), strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-11)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k_split", [2, 3])
def test_blocks_merge_to_whole_attention(backend, k_split):
    """Zigzag chunks of each sample: blocks by visibility, merged by lse, equal causal attention;
    block gradients computed with the merged out/lse sum to the whole attention's gradients."""
    lengths = [13, 6, 3]
    cu = [0, *np.cumsum(lengths).tolist()]
    q, k, v = rand_qkv(cu[-1], cu[-1], 4, 2, seed=7)
    n_chunks = 2 * k_split
    bounds = [chunk_bounds(n, k_split) + off for n, off in zip(lengths, cu, strict=False)]
    with torch.no_grad():
        out_acc, lse_acc = None, None
        blocks = []
        for i in range(n_chunks):
            # all query chunks i of every sample together vs key chunk j of every sample
            qi = torch.cat([torch.arange(b[i], b[i + 1]) for b in bounds])
            cu_qi = [0, *np.cumsum([b[i + 1] - b[i] for b in bounds]).tolist()]
            for j in range(n_chunks):
                vis = chunk_visibility(i, j)
                if vis is Visibility.NONE:
                    continue
                kj = torch.cat([torch.arange(b[j], b[j + 1]) for b in bounds])
                cu_kj = [0, *np.cumsum([b[j + 1] - b[j] for b in bounds]).tolist()]
                o, lo = block_forward(
                    q[qi], k[kj], v[kj], cu_qi, cu_kj, vis is Visibility.CAUSAL, backend=backend
                )
                full_o = torch.zeros_like(q)
                full_l = torch.full(q.shape[:2], float("-inf"), dtype=F64)
                full_o[qi], full_l[qi] = o, lo
                out_acc, lse_acc = merge_partial(out_acc, lse_acc, full_o, full_l)
                blocks.append((qi, kj, cu_qi, cu_kj, vis))
    ref_out, ref_lse = naive(q, k, v, cu, cu, True)
    torch.testing.assert_close(out_acc, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse_acc, ref_lse, rtol=0, atol=1e-12)

    dout = torch.randn(q.shape, dtype=F64, generator=torch.Generator().manual_seed(5))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    out = out_acc.detach()
    for qi, kj, cu_qi, cu_kj, vis in blocks:
        g = block_backward(
            dout[qi],
            q.detach()[qi],
            k.detach()[kj],
            v.detach()[kj],
            out[qi],
            lse_acc[qi],
            cu_qi,
            cu_kj,
            vis is Visibility.CAUSAL,
            backend=backend,
        )
        dq.index_add_(0, qi, g[0])
        dk.index_add_(0, kj, g[1])
        dv.index_add_(0, kj, g[2])
    ref = torch.autograd.grad(ref_out, (q, k, v), dout)
    for g, r in zip((dq, dk, dv), ref, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-11)


@pytest.mark.parametrize(("length", "k"), [(11, 2), (16, 3), (5, 4)])
def test_chunk_visibility_matches_position_mask(length, k):
    """Every pair of zigzag chunks is fully visible, diagonal-causal or invisible by position."""
    b = chunk_bounds(length, k)
    for i in range(2 * k):
        for j in range(2 * k):
            qpos = np.arange(b[i], b[i + 1])[:, None]
            kpos = np.arange(b[j], b[j + 1])[None, :]
            mask = kpos <= qpos
            vis = chunk_visibility(i, j)
            if mask.size == 0:
                continue
            if vis is Visibility.FULL:
                assert mask.all()
            elif vis is Visibility.NONE:
                assert not mask.any()
            else:
                assert np.array_equal(mask, np.tril(np.ones_like(mask)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_attend_close_to_float64(backend):
    """bfloat16 inputs: out within bfloat16 rounding of the float64 reference of the same
    rounded inputs, and the lse, kept in float32 for ring merges, within float32's (a bfloat16
    lse is off by ~2e-2)."""
    cu = [0, 40, 100]
    q, k, v = rand_qkv(100, 100, 4, 2, d=16, seed=2)
    qb, kb, vb = (x.detach().bfloat16() for x in (q, k, v))
    ref, ref_lse = naive(qb.double(), kb.double(), vb.double(), cu, cu, True)
    out, lse = attend(qb, kb, vb, cu, backend=backend)
    assert lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=3e-2)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-4)


def test_attend_rejects_bad_cu_seqlens():
    q, k, v = rand_qkv(6, 6)
    with pytest.raises(ValueError, match="cu_seqlens"):
        attend(q, k, v, [0, 4, 5])
    with pytest.raises(ValueError, match="cu_seqlens"):
        attend(q, k, v, [0, 4, 2, 6])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_attend_cuda_matches_naive():  # pragma: no cover - no GPU here
    cu = [0, 5, 12, 30]
    q, k, v = rand_qkv(30, 30, 4, 2, d=64, dtype=torch.float32)
    out, lse = attend(q.cuda(), k.cuda(), v.cuda(), torch.tensor(cu, device="cuda"))
    ref, ref_lse = naive(q.double(), k.double(), v.double(), cu, cu, True)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=0, atol=2e-3)
    torch.testing.assert_close(lse.double().cpu(), ref_lse, rtol=0, atol=2e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attend_applies_a_given_softmax_scale(backend):
    """A softmax scale other than head_dim ** -0.5 is applied: out, lse and the q/k/v gradients
    equal torch's scaled_dot_product_attention (scale=0.3, causal, per document, K/V heads
    repeated for GQA) and lse the log-sum-exp of 0.3 * q.k over each token's visible keys."""
    cu, scale = [0, 6, 13], 0.3
    q, k, v = rand_qkv(13, 13, 4, 2, seed=11)
    out, lse = attend(q, k, v, cu, scale=scale, backend=backend)
    outs, lses = [], []
    for a, b in zip(cu, cu[1:]):
        qd, kd, vd = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [H, L, D]
        kd, vd = kd.repeat_interleave(2, 0), vd.repeat_interleave(2, 0)
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                qd, kd, vd, is_causal=True, scale=scale
            ).transpose(0, 1)
        )
        s = (qd @ kd.transpose(1, 2)) * scale
        s = s.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), float("-inf"))
        lses.append(torch.logsumexp(s, -1).transpose(0, 1))
    ref = torch.cat(outs)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, torch.cat(lses).detach(), rtol=0, atol=1e-12)
    for g, r in zip(grads(out, (q, k, v)), grads(ref, (q, k, v)), strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-11)
