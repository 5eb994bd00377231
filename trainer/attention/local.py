"""Document-masked (varlen) attention returning the log-sum-exp, plus the block primitives ring
attention is built from.

Tensors are packed: ``q_THD`` holds T tokens of several documents back to back, ``cu_seqlens`` holds
the n+1 document boundaries. K/V may have fewer heads than Q (grouped-query attention); query head h
uses KV head ``h // (H_q // H_kv)``. The log-sum-exp is ``lse_TH`` (per token and query head) in
float32, or float64 for float64 inputs.

Backends, chosen per call from the device:
- ``cpu_flash``: torch's fused CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu`` and
  its backward), one call per document; handles GQA without expanding K/V.
- ``math``: explicit scores per document, GQA by broadcasting (no expanded K/V). CUDA fallback.
- ``flash_attn``: the flash-attn package's varlen kernel (CUDA, only for ``attend``; ring blocks on
  CUDA use ``math`` until a flash-attn block backward is wired in).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Protocol

import torch

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

_CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


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


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of log-sum-exps and merge accumulators: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def default_backend(device: torch.device, for_block: bool = False) -> str:
    """Backend used for tensors on `device` (see module docstring)."""
    if device.type == "cpu":
        return "cpu_flash"
    if device.type == "cuda" and not for_block and _flash_attn_available():
        return "flash_attn"
    return "math"


def _bounds(cu: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(cu, torch.Tensor):
        return [int(x) for x in cu.tolist()]
    return [int(x) for x in cu]


# --- one document --------------------------------------------------------------------------------


def _doc_fwd_cpu(
    q_LHD: torch.Tensor, k_SKD: torch.Tensor, v_SKD: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    q = q_LHD.unsqueeze(0).transpose(1, 2)
    k = k_SKD.unsqueeze(0).transpose(1, 2)
    v = v_SKD.unsqueeze(0).transpose(1, 2)
    out_1HLD, lse_1HL = _CPU_FWD(q, k, v, 0.0, causal, scale=scale)
    return out_1HLD[0].transpose(0, 1), lse_1HL[0].transpose(0, 1)


def _doc_bwd_cpu(
    dout_LHD: torch.Tensor,
    q_LHD: torch.Tensor,
    k_SKD: torch.Tensor,
    v_SKD: torch.Tensor,
    out_LHD: torch.Tensor,
    lse_LH: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    def b(x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(0).transpose(1, 2)

    lse_1HL = lse_LH.transpose(0, 1).unsqueeze(0).contiguous()
    dq, dk, dv = _CPU_BWD(
        b(dout_LHD).contiguous(),
        b(q_LHD),
        b(k_SKD),
        b(v_SKD),
        b(out_LHD).contiguous(),
        lse_1HL,
        0.0,
        causal,
        scale=scale,
    )
    return dq[0].transpose(0, 1), dk[0].transpose(0, 1), dv[0].transpose(0, 1)


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


def _math_scores(
    q_LHD: torch.Tensor, k_SKD: torch.Tensor, causal: bool, scale: float
) -> torch.Tensor:
    """Masked scores [Hkv, G*L, S] in the accumulation dtype."""
    acc = accum_dtype(q_LHD.dtype)
    L, S = q_LHD.shape[0], k_SKD.shape[0]
    qg = _grouped(q_LHD, k_SKD.shape[1]).to(acc)
    s = torch.matmul(qg, k_SKD.to(acc).permute(1, 2, 0)) * scale
    if causal:
        row = torch.arange(L, device=q_LHD.device).repeat(qg.shape[1] // L)
        col = torch.arange(S, device=q_LHD.device)
        s = s.masked_fill(col[None, :] > row[:, None], float("-inf"))
    return s


def _doc_fwd_math(
    q_LHD: torch.Tensor, k_SKD: torch.Tensor, v_SKD: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    L = q_LHD.shape[0]
    s = _math_scores(q_LHD, k_SKD, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = torch.matmul(p, v_SKD.to(s.dtype).transpose(0, 1))
    return _ungrouped(out, L).to(q_LHD.dtype), _ungrouped(lse, L)


def _doc_bwd_math(
    dout_LHD: torch.Tensor,
    q_LHD: torch.Tensor,
    k_SKD: torch.Tensor,
    v_SKD: torch.Tensor,
    out_LHD: torch.Tensor,
    lse_LH: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_kv = k_SKD.shape[1]
    s = _math_scores(q_LHD, k_SKD, causal, scale)
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


# --- varlen blocks (no autograd) -----------------------------------------------------------------


def block_forward(
    q_THD: torch.Tensor,
    k_SKD: torch.Tensor,
    v_SKD: torch.Tensor,
    cu_q: torch.Tensor | Sequence[int],
    cu_k: torch.Tensor | Sequence[int],
    causal: bool,
    scale: float | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of document d's queries q[cu_q[d]:cu_q[d+1]] to its keys k[cu_k[d]:cu_k[d+1]].

    `causal` masks key j > query i within a document (top-left aligned; used for square diagonal
    blocks). Returns (out_THD in q's dtype, lse_TH in the accumulation dtype); queries with no
    visible key get out 0 and lse -inf.
    """
    bq, bk = _bounds(cu_q), _bounds(cu_k)
    if len(bq) != len(bk):
        raise ValueError(f"cu_q has {len(bq)} entries but cu_k has {len(bk)}")
    if q_THD.shape[1] % k_SKD.shape[1] != 0:
        raise ValueError(
            f"{q_THD.shape[1]} query heads not a multiple of {k_SKD.shape[1]} KV heads"
        )
    scale = q_THD.shape[-1] ** -0.5 if scale is None else scale
    backend = backend or default_backend(q_THD.device, for_block=True)
    fwd = _doc_fwd_cpu if backend == "cpu_flash" else _doc_fwd_math
    T, H, _ = q_THD.shape
    out = torch.zeros_like(q_THD)
    lse = torch.full((T, H), float("-inf"), dtype=accum_dtype(q_THD.dtype), device=q_THD.device)
    for d in range(len(bq) - 1):
        q0, q1, k0, k1 = bq[d], bq[d + 1], bk[d], bk[d + 1]
        if q1 == q0 or k1 == k0:
            continue  # the CPU kernel faults on empty inputs; nothing to attend anyway
        o, lo = fwd(q_THD[q0:q1], k_SKD[k0:k1], v_SKD[k0:k1], causal, scale)
        out[q0:q1] = o
        lse[q0:q1] = lo
    return out, lse


def block_backward(
    dout_THD: torch.Tensor,
    q_THD: torch.Tensor,
    k_SKD: torch.Tensor,
    v_SKD: torch.Tensor,
    out_THD: torch.Tensor,
    lse_TH: torch.Tensor,
    cu_q: torch.Tensor | Sequence[int],
    cu_k: torch.Tensor | Sequence[int],
    causal: bool,
    scale: float | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of one block given the FINAL out and lse of the queries.

    With out/lse of the whole attention (all blocks merged), block gradients add up to the
    gradient of the whole attention, which is what ring attention needs.
    """
    bq, bk = _bounds(cu_q), _bounds(cu_k)
    scale = q_THD.shape[-1] ** -0.5 if scale is None else scale
    backend = backend or default_backend(q_THD.device, for_block=True)
    bwd = _doc_bwd_cpu if backend == "cpu_flash" else _doc_bwd_math
    dq = torch.zeros_like(q_THD)
    dk = torch.zeros_like(k_SKD)
    dv = torch.zeros_like(v_SKD)
    for d in range(len(bq) - 1):
        q0, q1, k0, k1 = bq[d], bq[d + 1], bk[d], bk[d + 1]
        if q1 == q0 or k1 == k0:
            continue
        g = bwd(
            dout_THD[q0:q1],
            q_THD[q0:q1],
            k_SKD[k0:k1],
            v_SKD[k0:k1],
            out_THD[q0:q1],
            lse_TH[q0:q1],
            causal,
            scale,
        )
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g
    return dq, dk, dv


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
    def forward(ctx, q, k, v, cu_q, cu_k, causal, scale, backend):  # type: ignore[override]
        out, lse = block_forward(q, k, v, cu_q, cu_k, causal, scale, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (cu_q, cu_k, causal, scale, backend)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def _attend_flash_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover - needs CUDA + flash-attn
    from flash_attn import flash_attn_varlen_func

    cu32 = cu.to(device=q.device, dtype=torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0
    out, lse_HT, _ = flash_attn_varlen_func(
        q,
        k,
        v,
        cu32,
        cu32,
        max_len,
        max_len,
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
    cu_seqlens: torch.Tensor | Sequence[int],
    scale: float | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention inside each document of a packed batch: token i attends to the tokens
    j <= i of its own document. Returns (out_THD, lse_TH); differentiable in q, k, v (not lse)."""
    if k_TKD.shape[0] != q_THD.shape[0] or v_TKD.shape != k_TKD.shape:
        raise ValueError(f"q {tuple(q_THD.shape)}, k {tuple(k_TKD.shape)}, v {tuple(v_TKD.shape)}")
    b = _bounds(cu_seqlens)
    if b[0] != 0 or b[-1] != q_THD.shape[0] or any(x > y for x, y in zip(b, b[1:], strict=False)):
        raise ValueError(f"cu_seqlens must rise from 0 to {q_THD.shape[0]}, got {b[:8]}...")
    scale = q_THD.shape[-1] ** -0.5 if scale is None else scale
    backend = backend or default_backend(q_THD.device)
    if backend == "flash_attn":  # pragma: no cover - needs CUDA + flash-attn
        return _attend_flash_attn(q_THD, k_TKD, v_TKD, torch.as_tensor(cu_seqlens), scale)
    return _VarlenAttention.apply(q_THD, k_TKD, v_TKD, b, b, True, scale, backend)


def attend_block(
    q_THD: torch.Tensor,
    k_SKD: torch.Tensor,
    v_SKD: torch.Tensor,
    cu_q: torch.Tensor | Sequence[int],
    cu_k: torch.Tensor | Sequence[int],
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
    backend = backend or default_backend(q_THD.device, for_block=True)
    causal = visibility is Visibility.CAUSAL
    return _VarlenAttention.apply(
        q_THD, k_SKD, v_SKD, _bounds(cu_q), _bounds(cu_k), causal, scale, backend
    )


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
    """Document-masked attention over the tokens of this rank alone."""

    def __init__(
        self, cu_seqlens: torch.Tensor | Sequence[int], backend: str | None = None
    ) -> None:
        self.cu_seqlens = _bounds(cu_seqlens)
        self.backend = backend

    def attend(self, q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor) -> torch.Tensor:
        return attend(q_THD, k_TKD, v_TKD, self.cu_seqlens, backend=self.backend)[0]

    def doc_lengths(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Per token, the largest position of its document (cu_seqlens) + 1."""
        dev = position_ids.device
        sizes = torch.as_tensor(self.cu_seqlens, device=dev).diff()
        if int(sizes.sum()) != position_ids.shape[0]:
            raise ValueError(
                f"cu_seqlens cover {int(sizes.sum())} tokens, position_ids {position_ids.shape[0]}"
            )
        doc = torch.repeat_interleave(torch.arange(sizes.numel(), device=dev), sizes)
        last = torch.full((sizes.numel(),), -1, dtype=torch.int64, device=dev)
        last = last.scatter_reduce(0, doc, position_ids.long(), reduce="amax")
        return (last + 1)[doc]
