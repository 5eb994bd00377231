"""Document-masked (varlen) attention returning the log-sum-exp, plus the block primitives ring
attention is built from.

Tensors are packed: ``q_THD`` holds T tokens of several documents back to back, ``cu_seqlens`` holds
the n+1 document boundaries. K/V may have fewer heads than Q (grouped-query attention); query head h
uses KV head ``h // (H_q // H_kv)``. The log-sum-exp is ``lse_TH`` (per token and query head) in
float32, or float64 for float64 inputs.

The kernel that computes a block is chosen by device and dtype in trainer.attention.dispatch
(torch's CPU flash kernel, its CUDA varlen flash and memory-efficient kernels, or the `math`
reference); a `backend` argument overrides it. A block's documents are a
trainer.attention.varlen.VarlenDocs, whose device boundaries are built once and reused by every
layer of a micro-batch.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Protocol

import torch

from trainer.attention import cuda_flash, dispatch
from trainer.attention.math_ref import accum_dtype
from trainer.attention.tape import taped
from trainer.attention.varlen import VarlenDocs, as_docs, check_inputs

# the flash-attn package's limits: half precision, head dimensions up to torch's flash kernel's
# (any size below: the package pads it to a multiple of 8 itself)
_FLASH_LIMITS = (cuda_flash.DTYPES, 1, cuda_flash.MAX_HEAD_DIM)

__all__ = [
    "AttentionContext",
    "LocalAttention",
    "Visibility",
    "accum_dtype",
    "attend",
    "attend_block",
    "block_backward",
    "block_forward",
    "chunk_visibility",
    "default_backend",
    "merge_partial",
]

Bounds = VarlenDocs | torch.Tensor | Sequence[int]


class Visibility(enum.Enum):
    """How the queries of one zigzag chunk see the keys of another."""

    NONE = 0  # query chunk before key chunk: nothing visible
    CAUSAL = 1  # same chunk: causal diagonal
    FULL = 2  # query chunk after key chunk: every key visible


def chunk_visibility(i: int, j: int) -> Visibility:
    """Visibility of key chunk j to query chunk i (chunks of one sample, in sequence order)."""
    if i > j:
        return Visibility.FULL
    if i == j:
        return Visibility.CAUSAL
    return Visibility.NONE


def default_backend(
    device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> str:
    """The backend of tensors of `dtype` on `device` (trainer.attention.dispatch)."""
    return dispatch.default_backend(device, dtype, head_dim)


# --- varlen blocks (no autograd) -----------------------------------------------------------------


def _docs(cu_q: Bounds, cu_k: Bounds | None) -> VarlenDocs:
    if isinstance(cu_q, VarlenDocs):
        return cu_q
    return as_docs(cu_q, cu_k)


def block_forward(
    q_THD: torch.Tensor,
    k_SKD: torch.Tensor,
    v_SKD: torch.Tensor,
    cu_q: Bounds,
    cu_k: Bounds | None,
    causal: bool,
    scale: float | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of document d's queries q[cu_q[d]:cu_q[d+1]] to its keys k[cu_k[d]:cu_k[d+1]].

    `cu_q` may be a VarlenDocs (then `cu_k` is ignored). `causal` masks key j > query i within a
    document (top-left aligned; used for square diagonal blocks). Returns (out_THD in q's dtype,
    lse_TH in the accumulation dtype); queries with no visible key get out 0 and lse -inf.
    """
    docs = _docs(cu_q, cu_k)
    if q_THD.shape[1] % k_SKD.shape[1] != 0:
        raise ValueError(
            f"{q_THD.shape[1]} query heads not a multiple of {k_SKD.shape[1]} KV heads"
        )
    scale = q_THD.shape[-1] ** -0.5 if scale is None else scale
    kernel = dispatch.get(backend or default_backend(q_THD.device, q_THD.dtype, q_THD.shape[-1]))
    return kernel.forward(q_THD, k_SKD, v_SKD, docs, causal, scale)


def block_backward(
    dout_THD: torch.Tensor,
    q_THD: torch.Tensor,
    k_SKD: torch.Tensor,
    v_SKD: torch.Tensor,
    out_THD: torch.Tensor,
    lse_TH: torch.Tensor,
    cu_q: Bounds,
    cu_k: Bounds | None,
    causal: bool,
    scale: float | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of one block given the FINAL out and lse of the queries.

    With out/lse of the whole attention (all blocks merged), block gradients add up to the
    gradient of the whole attention, which is what ring attention needs.
    """
    docs = _docs(cu_q, cu_k)
    scale = q_THD.shape[-1] ** -0.5 if scale is None else scale
    kernel = dispatch.get(backend or default_backend(q_THD.device, q_THD.dtype, q_THD.shape[-1]))
    return kernel.backward(dout_THD, q_THD, k_SKD, v_SKD, out_THD, lse_TH, docs, causal, scale)


def merge_partial(
    out_acc: torch.Tensor | None,
    lse_acc: torch.Tensor | None,
    out_blk: torch.Tensor,
    lse_blk: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint key sets by log-sum-exp, in the accumulation
    dtype of the lse (float32 for low-precision compute). Rows empty in both stay (0, -inf)."""
    if out_acc is None or lse_acc is None:
        return out_blk.to(lse_blk.dtype), lse_blk
    lse = torch.logaddexp(lse_acc, lse_blk)
    ref = lse.masked_fill(lse == float("-inf"), 0.0)  # rows with no key yet: weights 0, not nan
    w_acc = torch.exp(lse_acc - ref).unsqueeze(-1)
    w_blk = torch.exp(lse_blk - ref).unsqueeze(-1)
    out = out_acc * w_acc + out_blk.to(out_acc.dtype) * w_blk
    return out, lse


# --- autograd wrappers ---------------------------------------------------------------------------


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, docs, causal, scale, backend):  # type: ignore[override]
        out, lse = taped(lambda: block_forward(q, k, v, docs, None, causal, scale, backend))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (docs, None, causal, scale, backend)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None


def _attend_flash_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: VarlenDocs, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover - needs CUDA + flash-attn
    """The optional flash-attn package's varlen kernel (its own autograd), half precision only."""
    from flash_attn import flash_attn_varlen_func

    cu_q, cu_k = docs.cu(q.device)
    out, lse_HT, _ = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        docs.max_q,
        docs.max_k,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=True,
        return_attn_probs=True,
    )
    return out, lse_HT.transpose(0, 1).float()


def attend(
    q_THD: torch.Tensor,
    k_TKD: torch.Tensor,
    v_TKD: torch.Tensor,
    cu_seqlens: Bounds,
    scale: float | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention inside each document of a packed batch: token i attends to the tokens
    j <= i of its own document. Returns (out_THD, lse_TH); differentiable in q, k, v (not lse)."""
    if k_TKD.shape[0] != q_THD.shape[0] or v_TKD.shape != k_TKD.shape:
        raise ValueError(f"q {tuple(q_THD.shape)}, k {tuple(k_TKD.shape)}, v {tuple(v_TKD.shape)}")
    docs = _docs(cu_seqlens, None)
    if docs.total_q != q_THD.shape[0]:
        raise ValueError(
            f"cu_seqlens must rise from 0 to {q_THD.shape[0]}, got {list(docs.q[:8])}..."
        )
    scale = q_THD.shape[-1] ** -0.5 if scale is None else scale
    if backend == dispatch.FLASH_ATTN:
        check_inputs(q_THD, k_TKD, "flash-attn package's", *_FLASH_LIMITS)
        return _attend_flash_attn(q_THD, k_TKD, v_TKD, docs, scale)
    return _VarlenAttention.apply(q_THD, k_TKD, v_TKD, docs, True, scale, backend)


def attend_block(
    q_THD: torch.Tensor,
    k_SKD: torch.Tensor,
    v_SKD: torch.Tensor,
    cu_q: Bounds,
    cu_k: Bounds | None,
    visibility: Visibility,
    scale: float | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable block attention between a query chunk and a key chunk per document:
    FULL (every key), CAUSAL (same chunk, diagonal) or NONE (out 0, lse -inf)."""
    if visibility is Visibility.NONE:
        out = q_THD * 0.0  # keeps the graph: zero gradient
        lse = torch.full(
            q_THD.shape[:2], -math.inf, dtype=accum_dtype(q_THD.dtype), device=q_THD.device
        )
        return out, lse
    scale = q_THD.shape[-1] ** -0.5 if scale is None else scale
    causal = visibility is Visibility.CAUSAL
    return _VarlenAttention.apply(q_THD, k_SKD, v_SKD, _docs(cu_q, cu_k), causal, scale, backend)


# --- attention contexts (what a model layer calls) -----------------------------------------------


class AttentionContext(Protocol):
    """Decides how a layer's packed q/k/v attend: locally or over a ring of ranks."""

    def attend(self, q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor) -> torch.Tensor:
        """Attention output [T, H_q, D] for this rank's tokens."""
        ...

    def doc_lengths(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Length of each token's document (its largest position + 1, over all ranks holding
        it), int64 [T] on position_ids' device. Only dynamic RoPE asks."""
        ...


class LocalAttention:
    """Document-masked attention over the tokens of this rank alone. The documents' device
    boundaries are built once (on the first layer's device) and reused by every layer."""

    def __init__(self, cu_seqlens: Bounds, backend: str | None = None) -> None:
        self.docs = _docs(cu_seqlens, None)
        self.backend = backend

    @property
    def cu_seqlens(self) -> list[int]:
        return list(self.docs.q)

    def attend(self, q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor) -> torch.Tensor:
        return attend(q_THD, k_TKD, v_TKD, self.docs, backend=self.backend)[0]

    def doc_lengths(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Per token, the largest position of its document (cu_seqlens) + 1."""
        dev = position_ids.device
        if self.docs.total_q != position_ids.shape[0]:
            raise ValueError(
                f"cu_seqlens cover {self.docs.total_q} tokens, position_ids {position_ids.shape[0]}"
            )
        doc, _ = self.docs.token_rows(dev)
        last = torch.full((self.docs.n,), -1, dtype=torch.int64, device=dev)
        last = last.scatter_reduce(0, doc, position_ids.long(), reduce="amax")
        return (last + 1)[doc]
