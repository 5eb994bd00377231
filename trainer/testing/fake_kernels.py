"""Test support: CPU stand-ins for torch's CUDA varlen attention kernels, with their calling
conventions, so the `cuda_flash` and `cuda_efficient` backends' translation (int32 device
boundaries, host maxima, log-sum-exp layouts, rows with no key, GQA) is tested on a machine
without a GPU. Production code never imports this module.

Each fake checks what the real kernel requires (and fails loudly on anything else), computes
every document in float64 with its own plain formulas, and answers in the kernel's layouts:

- flash: q/k/v [T, H, D] in float16/bfloat16, K/V may have fewer heads; lse float32 [H, T]; a
  causal mask is bottom-right aligned when a document's query and key counts differ (what
  FlashAttention 2 does); a row with no key: out 0, lse +inf.
- both backwards leave the gradient rows of a document empty on the other side unwritten (NaN
  here: the real kernels allocate them uninitialised), so a backend must zero them itself.
- memory-efficient: q/k/v [1, T, H, D] with equal head counts; lse float32 [documents, H, L],
  L the longest query count rounded up to 32, the padding NaN; mask type 1 is top-left causal;
  a row with no key: out NaN, lse NaN (the backend must not rely on what is there).

Every call is first bound to the real operator's schema, as this torch declares it
(`bind_schema`): its positional and keyword arguments, each of the kind the schema names, so a
backend cannot call a fake in a way torch's kernel would refuse.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.attention import cuda_efficient, cuda_flash
from trainer.attention.varlen import Kernels

__all__ = ["FakeKernels", "bind_schema", "installed"]

F64 = torch.float64

# a schema argument's type (as torch prints it) -> the Python values a call may pass for it
_KINDS: dict[str, tuple[type, ...]] = {
    "Tensor": (torch.Tensor,),
    "int": (int,),
    "float": (float, int),
    "bool": (bool,),
}


def bind_schema(op: torch._ops.OpOverload, args: tuple, kwargs: dict[str, Any]) -> None:
    """Refuse (TypeError) a call of `op` that its schema would not take: too many positional
    arguments, an unknown or repeated keyword, a keyword-only one passed by position, a required
    one missing, or a value of another kind (a bool for an int, None where no `?`, a list for a
    tensor). Stricter than torch where torch converts: only a Python int passes for an int.
    Arguments of the kinds _KINDS does not name (lists, dtypes, devices, scalars) are bound by
    name and position only: the attention kernels take none."""
    name = op._schema.name
    params = op._schema.arguments
    positional = [a for a in params if not a.kwarg_only]
    if len(args) > len(positional):
        raise TypeError(
            f"{name}: {len(args)} positional arguments, the schema takes {len(positional)}"
        )
    known = {a.name for a in params}
    for key in kwargs:
        if key not in known:
            raise TypeError(f"{name}: no argument {key!r}")
    for i, a in enumerate(params):
        given = i < len(args)
        if given and a.name in kwargs:
            raise TypeError(f"{name}: {a.name!r} given by position and by keyword")
        if not given and a.name not in kwargs:
            if not a.has_default_value():
                raise TypeError(f"{name}: required argument {a.name!r} missing")
            continue
        value = args[i] if given else kwargs[a.name]
        kind = str(a.real_type)  # `type` prints a ScalarType, Layout or MemoryFormat as int
        optional = kind.startswith("Optional[")
        base = kind[len("Optional[") : -1] if optional else kind
        if value is None:
            if not optional:
                raise TypeError(f"{name}: {a.name!r} ({kind}) got None")
            continue
        ok = _KINDS.get(base)
        wrong = ok is not None and (
            type(value) not in ok if base != "Tensor" else not isinstance(value, torch.Tensor)
        )
        if wrong or (base in ("int", "float") and isinstance(value, bool)):
            raise TypeError(f"{name}: {a.name!r} ({kind}) got {type(value).__name__}")


def _real(op_name: str) -> Callable[[Callable], Callable]:
    """Bind each call of the decorated fake to `torch.ops.aten.<op_name>`'s schema first."""

    def wrap(fake: Callable) -> Callable:
        @functools.wraps(fake)
        def checked(self: FakeKernels, *args: Any, **kwargs: Any) -> Any:
            bind_schema(getattr(torch.ops.aten, op_name).default, args, kwargs)
            return fake(self, *args, **kwargs)

        return checked

    return wrap


def _bounds(cu: torch.Tensor, total: int, device: torch.device, what: str) -> list[int]:
    if cu.dtype != torch.int32 or cu.dim() != 1:
        raise TypeError(f"{what}: int32 1-D boundaries expected, got {cu.dtype} {tuple(cu.shape)}")
    if cu.device != device:
        raise TypeError(f"{what} on {cu.device}, the inputs on {device}")
    b = [int(x) for x in cu.tolist()]
    if b[0] != 0 or b[-1] != total or any(y < x for x, y in zip(b, b[1:])):
        raise ValueError(f"{what} {b} does not rise from 0 to {total}")
    return b


def _visible(lq: int, lk: int, causal: str | None) -> torch.Tensor:
    """[lq, lk] bool: which keys each query sees."""
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None, :]
    if causal == "top_left":
        return j <= i
    if causal == "bottom_right":
        return j <= i + (lk - lq)
    return torch.ones(lq, lk, dtype=torch.bool)


def _doc_fwd(q, k, v, causal, scale):  # noqa: ANN001, ANN202 - [L,H,D] float64 each
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    s = s.masked_fill(~_visible(q.shape[0], k.shape[0], causal), float("-inf"))
    lse = torch.logsumexp(s, -1)  # [H, L]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hij,jhd->ihd", p, v), lse


def _doc_bwd(do, q, k, v, o, lse_hl, causal, scale):  # noqa: ANN001, ANN202 - float64
    g = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("ihd,jhd->hij", q, ke) * scale
    s = s.masked_fill(~_visible(q.shape[0], k.shape[0], causal), float("-inf"))
    p = torch.exp(s - lse_hl[..., None])
    dv = torch.einsum("hij,ihd->jhd", p, do)
    dp = torch.einsum("ihd,jhd->hij", do, ve)
    delta = (do * o).sum(-1).transpose(0, 1)[..., None]  # [H, L, 1]
    ds = p * (dp - delta) * scale
    dq = torch.einsum("hij,jhd->ihd", ds, ke)
    dk = torch.einsum("hij,ihd->jhd", ds, q)

    def fold(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1, g, x.shape[-1]).sum(2)

    return dq, fold(dk), fold(dv)


@dataclass
class FakeKernels:
    """The fakes, with a count of calls per op and the boundary tensors each call received."""

    calls: dict[str, int] = field(default_factory=dict)
    cu_seen: list[torch.Tensor] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)  # threaded fake ranks call too

    def _count(self, op: str, cu: torch.Tensor) -> None:
        with self.lock:
            self.calls[op] = self.calls.get(op, 0) + 1
            self.cu_seen.append(cu)

    # -- flash: [T, H, D], lse [H, T] -----------------------------------------------------------

    def _flash_args(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p):  # noqa: ANN001, ANN202
        if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype:
            raise TypeError(f"flash: float16/bfloat16 only, got {q.dtype}/{k.dtype}")
        if q.dim() != 3 or k.shape != v.shape or q.shape[1] % k.shape[1] or dropout_p != 0.0:
            raise ValueError(f"flash: bad shapes q {tuple(q.shape)} k {tuple(k.shape)}")
        if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
            raise ValueError("flash: contiguous inputs expected")
        bq = _bounds(cu_q, q.shape[0], q.device, "cum_seq_q")
        bk = _bounds(cu_k, k.shape[0], q.device, "cum_seq_k")
        if len(bq) != len(bk):
            raise ValueError("flash: cum_seq_q and cum_seq_k differ in length")
        lens_q = [b - a for a, b in zip(bq, bq[1:])]
        lens_k = [b - a for a, b in zip(bk, bk[1:])]
        if (max_q, max_k) != (max(lens_q), max(lens_k)):
            raise ValueError(f"flash: max_q/max_k {max_q}/{max_k}, documents {lens_q}/{lens_k}")
        return bq, bk

    @_real("_flash_attention_forward")
    def flash_forward(
        self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug, *, scale
    ):  # noqa: ANN001, ANN201, E501
        bq, bk = self._flash_args(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p)
        self._count("flash_forward", cu_q)
        out = torch.zeros(q.shape, dtype=F64)
        lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=F64)
        for d in range(len(bq) - 1):
            (q0, q1), (k0, k1) = (bq[d], bq[d + 1]), (bk[d], bk[d + 1])
            if q1 > q0 and k1 > k0:
                o, lo = _doc_fwd(
                    *(x.to(F64) for x in (q[q0:q1], k[k0:k1], v[k0:k1])),
                    "bottom_right" if is_causal else None,
                    scale,
                )
                out[q0:q1], lse[:, q0:q1] = o, lo
        rng = torch.zeros(2, dtype=torch.uint64)
        return out.to(q.dtype), lse.float(), rng, torch.empty(0), torch.empty(0)

    @_real("_flash_attention_backward")
    def flash_backward(
        self,
        do,
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        rng,
        unused,
        *,
        scale,
    ):  # noqa: ANN001, ANN201, E501
        bq, bk = self._flash_args(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p)
        if lse.dtype != torch.float32 or tuple(lse.shape) != (q.shape[1], q.shape[0]):
            raise ValueError(f"flash backward: lse float32 [H, T] expected, got {tuple(lse.shape)}")
        if not lse.is_contiguous() or out.dtype != q.dtype or do.shape != q.shape:
            raise ValueError("flash backward: contiguous lse, out and dout like q expected")
        self._count("flash_backward", cu_q)
        dq, dk, dv = (torch.full(x.shape, float("nan"), dtype=F64) for x in (q, k, v))
        for d in range(len(bq) - 1):
            (q0, q1), (k0, k1) = (bq[d], bq[d + 1]), (bk[d], bk[d + 1])
            if q1 > q0 and k1 > k0:
                xs = (x.to(F64) for x in (do[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1], out[q0:q1]))
                lse_d = lse[:, q0:q1].to(F64)
                mask = "bottom_right" if is_causal else None
                dq[q0:q1], dk[k0:k1], dv[k0:k1] = _doc_bwd(*xs, lse_d, mask, scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    # -- memory-efficient: [1, T, H, D], lse [documents, H, L32] --------------------------------

    def _eff_args(self, q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout_p, mask_type):  # noqa: ANN001, ANN202, E501
        if q.dim() != 4 or q.shape[0] != 1 or k.shape != v.shape or k.shape[2] != q.shape[2]:
            raise ValueError(
                f"efficient: [1, T, H, D], equal heads; q {tuple(q.shape)} k {tuple(k.shape)}"
            )
        if bias is not None or dropout_p != 0.0 or mask_type not in (0, 1):
            raise ValueError("efficient: no bias, no dropout, mask type 0 or 1 expected")
        bq = _bounds(cu_q, q.shape[1], q.device, "cu_seqlens_q")
        bk = _bounds(cu_k, k.shape[1], q.device, "cu_seqlens_k")
        if max_q < max(b - a for a, b in zip(bq, bq[1:])):
            raise ValueError("efficient: max_seqlen_q below the longest document")
        return bq, bk

    @_real("_efficient_attention_forward")
    def efficient_forward(
        self, q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout_p, mask_type, compute_lse, *, scale
    ):  # noqa: ANN001, ANN201, E501
        bq, bk = self._eff_args(q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout_p, mask_type)
        assert compute_lse
        self._count("efficient_forward", cu_q)
        n, h = len(bq) - 1, q.shape[2]
        width = -(-max_q // 32) * 32
        out = torch.full(q.shape, float("nan"), dtype=F64)
        lse = torch.full((n, h, width), float("nan"), dtype=F64)
        for d in range(n):
            (q0, q1), (k0, k1) = (bq[d], bq[d + 1]), (bk[d], bk[d + 1])
            if q1 > q0 and k1 > k0:
                xs = (x[0].to(F64) for x in (q[:, q0:q1], k[:, k0:k1], v[:, k0:k1]))
                o, lo = _doc_fwd(*xs, "top_left" if mask_type == 1 else None, scale)
                out[0, q0:q1], lse[d, :, : q1 - q0] = o, lo
        seed = torch.zeros((), dtype=torch.int64)
        return out.to(q.dtype), lse.float(), seed, seed, max_q, max_k

    @_real("_efficient_attention_backward")
    def efficient_backward(
        self,
        do,
        q,
        k,
        v,
        bias,
        out,
        cu_q,
        cu_k,
        max_q,
        max_k,
        lse,
        dropout_p,
        seed,
        offset,
        mask_type,
        bias_grad,
        *,
        scale,
    ):  # noqa: ANN001, ANN201, E501
        bq, bk = self._eff_args(q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout_p, mask_type)
        width = -(-max_q // 32) * 32
        if lse.dtype != torch.float32 or tuple(lse.shape) != (len(bq) - 1, q.shape[2], width):
            raise ValueError(
                f"efficient backward: lse float32 [n, H, {width}], got {tuple(lse.shape)}"
            )
        self._count("efficient_backward", cu_q)
        dq, dk, dv = (torch.full(x.shape, float("nan"), dtype=F64) for x in (q, k, v))
        for d in range(len(bq) - 1):
            (q0, q1), (k0, k1) = (bq[d], bq[d + 1]), (bk[d], bk[d + 1])
            if q1 > q0 and k1 > k0:
                xs = [x[0].to(F64) for x in (do[:, q0:q1], q[:, q0:q1], k[:, k0:k1], v[:, k0:k1])]
                xs.append(out[0, q0:q1].to(F64))
                lse_d = lse[d, :, : q1 - q0].to(F64)
                g = _doc_bwd(*xs, lse_d, "top_left" if mask_type == 1 else None, scale)
                dq[0, q0:q1], dk[0, k0:k1], dv[0, k0:k1] = g
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


@contextlib.contextmanager
def installed() -> Iterator[FakeKernels]:
    """The fakes in place of torch's CUDA kernels inside the `with` block."""
    fakes = FakeKernels()
    saved = cuda_flash.kernels, cuda_efficient.kernels
    cuda_flash.kernels = Kernels(fakes.flash_forward, fakes.flash_backward)
    cuda_efficient.kernels = Kernels(fakes.efficient_forward, fakes.efficient_backward)
    try:
        yield fakes
    finally:
        cuda_flash.kernels, cuda_efficient.kernels = saved
