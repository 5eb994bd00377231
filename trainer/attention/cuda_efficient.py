"""The `cuda_efficient` attention backend: torch's own memory-efficient varlen kernel
(``aten._efficient_attention_forward`` / ``_efficient_attention_backward`` with cumulative
sequence lengths) on CUDA, for float32 (tests and smoke runs on a GPU; the flash kernel has no
float32). One kernel call per block for all its documents; memory linear in the tokens. The
kernel has no grouped-query form: K/V heads are repeated for their query heads on the way in and
their gradients summed back on the way out.

The kernel's conventions, translated here and nowhere else: a batch of one ([1, T, H, D]),
int32 boundaries on the device, the longest documents as host integers, the causal mask as
mask type 1 (top-left), and the log-sum-exp as float32 [documents, H, L] with L the longest
document rounded up to 32 (mixlen's is [T, H]: gathered by each token's document and offset,
which trainer.attention.varlen keeps on the device). Rows with no key are set to out 0 and
log-sum-exp -inf here whatever the kernel left in them.
"""

from __future__ import annotations

import torch

from trainer.attention.varlen import Kernels, VarlenDocs, check_inputs

__all__ = ["DTYPES", "LSE_ALIGN", "NAME", "backward", "check", "forward"]

NAME = "cuda_efficient"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LSE_ALIGN = 32  # the kernel pads each document's log-sum-exp row to a multiple of this
_CAUSAL_TOP_LEFT, _NO_MASK = 1, 0


kernels: Kernels | None = None  # None: torch's own (trainer.testing.fake_kernels swaps in fakes)


def _ops() -> Kernels:
    if kernels is not None:
        return kernels
    return Kernels(
        torch.ops.aten._efficient_attention_forward, torch.ops.aten._efficient_attention_backward
    )


def check(q: torch.Tensor, k: torch.Tensor) -> None:
    """Refuse what the kernel cannot compute, naming the setting."""
    check_inputs(q, k, "memory-efficient", DTYPES, 4 if q.dtype == torch.float32 else 8)


def _expand(x: torch.Tensor, g: int) -> torch.Tensor:
    """[S, Hkv, D] -> [1, S, Hkv * g, D], each KV head repeated for its g query heads."""
    return (x if g == 1 else x.repeat_interleave(g, dim=1)).unsqueeze(0)


def _reduce(dx: torch.Tensor, g: int) -> torch.Tensor:
    """Gradient of `_expand`: [1, S, Hkv * g, D] -> [S, Hkv, D]."""
    s, h, d = dx.shape[1:]
    return dx[0] if g == 1 else dx[0].reshape(s, h // g, g, d).sum(2)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: VarlenDocs, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_THD, lse_TH float32) of every document in one kernel call."""
    check(q, k)
    docs.check_tokens(q, k)
    assert not causal or docs.same_sides(), "causal blocks are square (top-left = bottom-right)"
    if docs.max_q == 0 or docs.max_k == 0:
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        return torch.zeros_like(q), lse
    g = q.shape[1] // k.shape[1]
    cu_q, cu_k = docs.cu(q.device)
    out4, lse_nhl, *_ = _ops().forward(
        q.contiguous().unsqueeze(0),
        _expand(k.contiguous(), g),
        _expand(v.contiguous(), g),
        None,
        cu_q,
        cu_k,
        docs.max_q,
        docs.max_k,
        0.0,
        _CAUSAL_TOP_LEFT if causal else _NO_MASK,
        True,
        scale=scale,
    )
    doc, off = docs.token_rows(q.device)
    out, lse = out4[0], lse_nhl[doc, :, off]  # [T, H] by each token's document and offset
    rows = docs.no_key_rows(q.device)
    if rows is not None:
        out = out.masked_fill(rows[:, None, None], 0.0)
        lse = lse.masked_fill(rows[:, None], float("-inf"))
    return out, lse


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
    """(dq, dk, dv) of every document against the given out and lse_TH, in one kernel call."""
    check(q, k)
    docs.check_tokens(q, k)
    if docs.max_q == 0 or docs.max_k == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    g = q.shape[1] // k.shape[1]
    cu_q, cu_k = docs.cu(q.device)
    doc, off = docs.token_rows(q.device)
    width = -(-docs.max_q // LSE_ALIGN) * LSE_ALIGN
    lse_nhl = torch.zeros((docs.n, q.shape[1], width), dtype=torch.float32, device=q.device)
    lse_nhl[doc, :, off] = lse.to(torch.float32)
    seed = torch.zeros((), dtype=torch.int64)  # no dropout: unused
    dq, dk, dv, _ = _ops().backward(
        dout.contiguous().unsqueeze(0),
        q.contiguous().unsqueeze(0),
        _expand(k.contiguous(), g),
        _expand(v.contiguous(), g),
        None,
        out.contiguous().unsqueeze(0),
        cu_q,
        cu_k,
        docs.max_q,
        docs.max_k,
        lse_nhl,
        0.0,
        seed,
        seed,
        _CAUSAL_TOP_LEFT if causal else _NO_MASK,
        False,
        scale=scale,
    )
    return docs.zero_lonely(dq[0], _reduce(dk, g), _reduce(dv, g))
