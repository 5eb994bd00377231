"""The `math` attention backend: explicit scores per document, in float32 (float64 for float64
inputs), GQA by broadcasting (K/V never expanded). The tests' reference for every fused kernel,
and the fallback where no kernel fits. It materialises [heads, L, S] scores per document:
memory grows with the square of the longest document, so it never trains long context on a GPU.

`forward`/`backward` are every backend's signature (trainer.attention.dispatch); the per-document
loop here also serves `cpu_flash`, whose kernel takes one document at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.attention.varlen import VarlenDocs

__all__ = [
    "NAME",
    "backward",
    "doc_backward",
    "doc_forward",
    "forward",
    "loop_backward",
    "loop_forward",
]

NAME = "math"

DocForward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
DocBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of log-sum-exps and merge accumulators: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(q_LHD: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[L, H, D] -> [Hkv, G*L, D] so that one KV head serves its G query heads by broadcasting."""
    L, H, D = q_LHD.shape
    g = H // n_kv
    return q_LHD.reshape(L, n_kv, g, D).permute(1, 2, 0, 3).reshape(n_kv, g * L, D)


def _ungrouped(x_KGLD: torch.Tensor, L: int) -> torch.Tensor:
    """Inverse of `_grouped` for a [Hkv, G*L, ...] tensor: -> [L, H, ...]."""
    n_kv = x_KGLD.shape[0]
    rest = x_KGLD.shape[2:]
    x = x_KGLD.reshape(n_kv, -1, L, *rest).movedim(2, 0)
    return x.reshape(L, -1, *rest)


def _scores(q_LHD: torch.Tensor, k_SKD: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Masked scores [Hkv, G*L, S] in the accumulation dtype (causal: top-left aligned)."""
    acc = accum_dtype(q_LHD.dtype)
    L, S = q_LHD.shape[0], k_SKD.shape[0]
    qg = _grouped(q_LHD, k_SKD.shape[1]).to(acc)
    s = torch.matmul(qg, k_SKD.to(acc).permute(1, 2, 0)) * scale
    if causal:
        row = torch.arange(L, device=q_LHD.device).repeat(qg.shape[1] // L)
        col = torch.arange(S, device=q_LHD.device)
        s = s.masked_fill(col[None, :] > row[:, None], float("-inf"))
    return s


def doc_forward(
    q_LHD: torch.Tensor, k_SKD: torch.Tensor, v_SKD: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One document: (out [L, H, D] in q's dtype, lse [L, H] in the accumulation dtype)."""
    L = q_LHD.shape[0]
    s = _scores(q_LHD, k_SKD, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = torch.matmul(p, v_SKD.to(s.dtype).transpose(0, 1))
    return _ungrouped(out, L).to(q_LHD.dtype), _ungrouped(lse, L)


def doc_backward(
    dout_LHD: torch.Tensor,
    q_LHD: torch.Tensor,
    k_SKD: torch.Tensor,
    v_SKD: torch.Tensor,
    out_LHD: torch.Tensor,
    lse_LH: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One document's (dq, dk, dv) against the given out and lse (which may be the merged ones
    of several key blocks: ring attention)."""
    n_kv = k_SKD.shape[1]
    s = _scores(q_LHD, k_SKD, causal, scale)
    acc = s.dtype
    lse_g = _grouped(lse_LH.to(acc).unsqueeze(-1), n_kv)  # [Hkv, G*L, 1]
    p = torch.exp(s - lse_g)
    do = _grouped(dout_LHD, n_kv).to(acc)
    o = _grouped(out_LHD, n_kv).to(acc)
    v = v_SKD.to(acc).transpose(0, 1)  # [Hkv, S, D]
    k = k_SKD.to(acc).transpose(0, 1)
    dv = torch.matmul(p.transpose(1, 2), do)
    dp = torch.matmul(do, v.transpose(1, 2))
    delta = (do * o).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, k)
    dk = torch.matmul(ds.transpose(1, 2), _grouped(q_LHD, n_kv).to(acc))
    L = q_LHD.shape[0]
    return (
        _ungrouped(dq, L).to(q_LHD.dtype),
        dk.transpose(0, 1).to(k_SKD.dtype),
        dv.transpose(0, 1).to(v_SKD.dtype),
    )


def loop_forward(
    doc_fwd: DocForward,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: VarlenDocs,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`doc_fwd` on each document with queries and keys; the others get out 0 and lse -inf."""
    T, H, _ = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((T, H), float("-inf"), dtype=accum_dtype(q.dtype), device=q.device)
    for d in range(docs.n):
        q0, q1, k0, k1 = docs.q[d], docs.q[d + 1], docs.k[d], docs.k[d + 1]
        if q1 == q0 or k1 == k0:
            continue  # the CPU kernel faults on empty inputs; nothing to attend anyway
        out[q0:q1], lse[q0:q1] = doc_fwd(q[q0:q1], k[k0:k1], v[k0:k1], causal, scale)
    return out, lse


def loop_backward(
    doc_bwd: DocBackward,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    docs: VarlenDocs,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`doc_bwd` on each document with queries and keys; zero gradients elsewhere."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for d in range(docs.n):
        q0, q1, k0, k1 = docs.q[d], docs.q[d + 1], docs.k[d], docs.k[d + 1]
        if q1 == q0 or k1 == k0:
            continue
        g = doc_bwd(
            dout[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1], out[q0:q1], lse[q0:q1], causal, scale
        )
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g
    return dq, dk, dv


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: VarlenDocs, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_THD, lse_TH) of every document (see trainer.attention.dispatch)."""
    return loop_forward(doc_forward, q, k, v, docs, causal, scale)


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    docs: VarlenDocs,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) against the given out and lse_TH (see trainer.attention.dispatch)."""
    return loop_backward(doc_backward, dout, q, k, v, out, lse, docs, causal, scale)
