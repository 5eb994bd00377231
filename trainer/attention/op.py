"""Local varlen attention as a registered torch operator (``torch.ops.mixlen.varlen_attention``),
so that `torch.compile` captures a whole block, attention included, as one graph.

A compiler sees the call as one opaque node: its output shapes come from the registered fake
(out like q, the log-sum-exp [T, H] in the accumulation dtype), its backward is the registered
``mixlen::varlen_attention_backward`` node, and its arguments are tensors and scalars only. The
documents travel as their boundaries twice: an int64 tensor on the host (the CPU and `math`
kernels loop over documents there; reading it never waits on a GPU) and the int32 tensor on the
device that the CUDA kernels take, both built once per micro-batch by `VarlenDocs`. Inside, the
call is the same `block_forward` / `block_backward` an eager block makes, so every backend
(dispatch) and its conventions apply unchanged.

Only local attention goes through the operator: a ring's attention exchanges K/V with other ranks
between kernel calls, which a graph cannot hold; compiled blocks run it between compiled segments
(trainer.model.transformer).
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import Tensor

from trainer.attention.local import block_backward, block_forward
from trainer.attention.math_ref import accum_dtype
from trainer.attention.varlen import VarlenDocs

__all__ = ["varlen_attention"]

# per thread (threaded ranks, autograd's device threads), the documents of the last host
# boundaries seen (every layer of a micro-batch passes the same tensor): their device tensors and
# token rows are not rebuilt layer by layer
_state = threading.local()


def _docs(cu_host: Tensor, cu_dev: Tensor) -> VarlenDocs:
    """The documents of host boundaries `cu_host`, their device copy `cu_dev` reused."""
    last: tuple[weakref.ref, VarlenDocs] | None = getattr(_state, "last", None)
    if last is not None and last[0]() is cu_host:
        return last[1]
    bounds = tuple(cu_host.tolist())
    docs = VarlenDocs(bounds, bounds)
    docs.adopt_cu(cu_dev)
    _state.last = (weakref.ref(cu_host), docs)
    return docs


@torch.library.custom_op("mixlen::varlen_attention", mutates_args=())
def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_host: Tensor,
    cu_dev: Tensor,
    scale: float,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """Causal attention inside each document: (out [T, H, D], lse [T, H]). `cu_host` and
    `cu_dev` are the same n+1 boundaries on the host and on q's device, `backend` a
    trainer.attention.dispatch name ("" for the device's default)."""
    docs = _docs(cu_host, cu_dev)
    out, lse = block_forward(q, k, v, docs, None, True, scale, backend or None)
    # the layouts the fake states: a kernel's lse may be a transposed view ([H, T] underneath)
    return out.contiguous(), lse.contiguous()


@varlen_attention.register_fake
def _(q, k, v, cu_host, cu_dev, scale, backend):  # noqa: ANN001, ANN202
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=accum_dtype(q.dtype))


@torch.library.custom_op("mixlen::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_host: Tensor,
    cu_dev: Tensor,
    scale: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of `varlen_attention` against its out and lse."""
    docs = _docs(cu_host, cu_dev)
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, docs, None, True, scale, backend or None)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@varlen_attention_backward.register_fake
def _(dout, q, k, v, out, lse, cu_host, cu_dev, scale, backend):  # noqa: ANN001, ANN202
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:  # noqa: ANN001
    q, k, v, cu_host, cu_dev, scale, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_host, cu_dev)
    ctx.args = (scale, backend)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):  # noqa: ANN001, ANN202
    q, k, v, out, lse, cu_host, cu_dev = ctx.saved_tensors
    dq, dk, dv = varlen_attention_backward(dout, q, k, v, out, lse, cu_host, cu_dev, *ctx.args)
    return dq, dk, dv, None, None, None, None


varlen_attention.register_autograd(_backward, setup_context=_setup)
