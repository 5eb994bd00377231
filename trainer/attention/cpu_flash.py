"""The `cpu_flash` attention backend: torch's fused CPU flash kernel
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward), one call per document (the
CPU kernel has no varlen form); GQA without expanding K/V. The CPU default for every dtype."""

from __future__ import annotations

import torch

from trainer.attention.math_ref import loop_backward, loop_forward
from trainer.attention.varlen import VarlenDocs

__all__ = ["NAME", "backward", "forward"]

NAME = "cpu_flash"

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _b(x: torch.Tensor) -> torch.Tensor:
    """[L, H, D] -> [1, H, L, D] (a view)."""
    return x.unsqueeze(0).transpose(1, 2)


def _doc_fwd(
    q_LHD: torch.Tensor, k_SKD: torch.Tensor, v_SKD: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out_1HLD, lse_1HL = _FWD(_b(q_LHD), _b(k_SKD), _b(v_SKD), 0.0, causal, scale=scale)
    return out_1HLD[0].transpose(0, 1), lse_1HL[0].transpose(0, 1)


def _doc_bwd(
    dout_LHD: torch.Tensor,
    q_LHD: torch.Tensor,
    k_SKD: torch.Tensor,
    v_SKD: torch.Tensor,
    out_LHD: torch.Tensor,
    lse_LH: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lse_1HL = lse_LH.transpose(0, 1).unsqueeze(0).contiguous()
    dq, dk, dv = _BWD(
        _b(dout_LHD).contiguous(),
        _b(q_LHD),
        _b(k_SKD),
        _b(v_SKD),
        _b(out_LHD).contiguous(),
        lse_1HL,
        0.0,
        causal,
        scale=scale,
    )
    return dq[0].transpose(0, 1), dk[0].transpose(0, 1), dv[0].transpose(0, 1)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: VarlenDocs, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_THD, lse_TH) of every document (see trainer.attention.dispatch)."""
    return loop_forward(_doc_fwd, q, k, v, docs, causal, scale)


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
    return loop_backward(_doc_bwd, dout, q, k, v, out, lse, docs, causal, scale)
