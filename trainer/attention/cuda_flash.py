"""The `cuda_flash` attention backend: torch's own varlen flash kernel
(``aten._flash_attention_forward`` / ``_flash_attention_backward`` with cumulative sequence
lengths), float16 and bfloat16 on CUDA. One kernel call per block for all its documents; GQA
without expanding K/V (the kernel reads each KV head for its query heads); memory linear in the
tokens. The backward takes the out and log-sum-exp it is given, so ring attention computes each
block's gradient against the merged ones.

The kernel's conventions, translated here and nowhere else: boundaries as int32 tensors on the
device (trainer.attention.varlen builds them once per micro-batch), the longest document as host
integers, the log-sum-exp as float32 [H, T] (mixlen's is [T, H]), and a query row with no key
(a document whose key side is empty in a ring block) gets out 0 and log-sum-exp +inf from the
kernel, which is -inf here. Dropout is never used, so the random state is a dummy.
"""

from __future__ import annotations

import torch

from trainer.attention.varlen import Kernels, VarlenDocs, check_inputs

__all__ = ["DTYPES", "MAX_HEAD_DIM", "NAME", "backward", "check", "forward"]

NAME = "cuda_flash"
DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


kernels: Kernels | None = None  # None: torch's own (trainer.testing.fake_kernels swaps in fakes)


def _ops() -> Kernels:
    if kernels is not None:
        return kernels
    return Kernels(
        torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward
    )


def check(q: torch.Tensor, k: torch.Tensor) -> None:
    """Refuse what the kernel cannot compute, naming the setting."""
    check_inputs(q, k, "flash", DTYPES, 8, MAX_HEAD_DIM)


def _lse_th(lse_ht: torch.Tensor) -> torch.Tensor:
    """The kernel's [H, T] log-sum-exp as [T, H], rows with no key at -inf."""
    lse = lse_ht.transpose(0, 1)
    return lse.masked_fill(lse == float("inf"), float("-inf"))


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
    cu_q, cu_k = docs.cu(q.device)
    out, lse_ht, *_ = _ops().forward(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        cu_q,
        cu_k,
        docs.max_q,
        docs.max_k,
        0.0,
        causal,
        False,
        scale=scale,
    )
    return out, _lse_th(lse_ht)


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
    cu_q, cu_k = docs.cu(q.device)
    rng = torch.zeros((2,), dtype=torch.uint64, device=q.device)  # no dropout: unused
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = _ops().backward(
        dout.contiguous(),
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        out.contiguous(),
        lse.to(torch.float32).transpose(0, 1).contiguous(),
        cu_q,
        cu_k,
        docs.max_q,
        docs.max_k,
        0.0,
        causal,
        rng,
        unused,
        scale=scale,
    )
    return docs.zero_lonely(dq, dk, dv)
