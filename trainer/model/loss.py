"""The output projection and cross-entropy of a micro-batch, in chunks of tokens: the [T, V]
logits are never held whole, in any dtype.

For each chunk of tokens the logits are computed in the compute dtype, the log-sum-exp and the
labels' logits in float32 (float64 for float64), and, when a gradient is wanted, the gradient of
the chunk's logits (softmax - one-hot, times each position's weight) turns at once into the
chunk's rows of dL/dh and a share of dL/dW (accumulated in float32). The chunk's float32 logits
become their exponentials, then the gradient, in place, in one buffer that every chunk reuses,
and they are passed over five times (max, subtract, exp, sum, scale; the one-hot's scatter and the
two matmuls' reads aside). Backward only scales them by the incoming gradient. Peak memory is one
chunk of [chunk, V] float32 (and its copy in a lower compute dtype) plus dL/dW, instead of
the whole batch's logits, their float32 copy and their log-softmax (about 1.3 MB a token at a
128K vocabulary). The result is the SUM over labelled positions (labels != -100) of
weight x cross-entropy, the same loss and gradients as cross-entropy over whole logits.

With `compile` (a torch.compile backend; `[train] compile = true` passes "inductor") and a lower
compute dtype (bfloat16, float16), a chunk's arithmetic after its matmul is one compiled function
instead: the compiler fuses it into a reduction over each row and one pass that writes the
gradient straight into the compute dtype, so each [chunk, V] element is read from the bfloat16
logits about twice and written once, where the eager passes above read and write the float32
copy about ten times, and no float32 chunk is held. Not in float32 or float64 (the eager chunk
is in place there, the compiled one would hold two) nor with tensor parallelism (compiled blocks
are refused there too).

Under tensor parallelism each process holds the rows [v0, v0 + V/tp) of the output weight: the
chunk's log-sum-exp combines every process's partial one (an all-gather of [chunk] floats), the
labels' logits are summed over the processes (each contributes the ones it owns), and dL/dh,
partial per process, is summed over them once per micro-batch: the vocabulary-parallel loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from datapipe.plan.loss import IGNORE_INDEX
from datapipe.shapes import LOSS_CHUNK_BYTES
from trainer.attention.local import accum_dtype
from trainer.parallel.comm import Communicator

__all__ = ["chunk_tokens", "linear_cross_entropy", "token_losses"]


def chunk_tokens(vocab_rows: int, budget: int = LOSS_CHUNK_BYTES) -> int:
    """Tokens per chunk so that a chunk's float32 logits over `vocab_rows` fit in `budget`."""
    return max(1, budget // (4 * max(1, vocab_rows)))


def _logits(hc: torch.Tensor, w: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """The chunk's logits `hc @ w.T` in `buf`'s (accumulation) dtype, written into `buf`'s first
    rows: one buffer for every chunk of a call (a fresh one each chunk costs page faults on a
    CPU, where large blocks go back to the system when freed)."""
    out = buf[: hc.shape[0]]
    if hc.dtype == buf.dtype:
        return torch.matmul(hc, w.t(), out=out)
    return out.copy_(hc @ w.t())


def _chunk(
    hc: torch.Tensor,
    w: torch.Tensor,
    lab: torch.Tensor,
    wt: torch.Tensor | None,
    v0: int,
    comm: Communicator | None,
    buf: torch.Tensor,
    grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weighted loss sum, gradient of the chunk's logits or None) of one chunk; the logits, then
    their gradient, are held in `buf` ([chunk, Vl] in the accumulation dtype)."""
    acc = buf.dtype
    logits = _logits(hc, w, buf)  # [c, Vl]
    valid = lab != IGNORE_INDEX
    local = lab.long() - v0
    mine = valid & (local >= 0) & (local < w.shape[0])
    idx = local.clamp(0, w.shape[0] - 1)[:, None]
    target = logits.gather(1, idx)[:, 0] * mine
    # exp(logits - row max) in place of the logits: the log-sum-exp and the softmax from one pass
    top = logits.amax(dim=-1)
    e = logits.sub_(top[:, None]).exp_()
    lse = top + e.sum(dim=-1).log()
    if comm is not None and comm.size > 1:  # combine the processes' partial log-sum-exps
        lse_all = torch.logsumexp(torch.stack(comm.all_gather(lse)), dim=0)
        comm.all_reduce(target)
    else:
        lse_all = lse
    scale = valid.to(acc) if wt is None else valid * wt.to(acc)
    loss = ((lse_all - target) * scale).sum()
    if not grad:
        return loss, None
    # softmax x weight: exp(logit - top) x exp(top - lse) x scale, minus the weighted one-hot
    g = e.mul_((torch.exp(top - lse_all) * scale)[:, None])
    g.scatter_add_(1, idx, -(mine * scale)[:, None])
    return loss, g


def _pointwise(
    logits: torch.Tensor, lab: torch.Tensor, wt: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted loss sum, gradient of the logits in their dtype) of one chunk's logits [c, V]
    (all of the vocabulary: no tensor parallelism), in the accumulation dtype inside. Written for
    a compiler to fuse: run eagerly, each line is a pass over [c, V]."""
    x = logits.to(accum_dtype(logits.dtype))
    valid = lab != IGNORE_INDEX
    mine = valid & (lab >= 0) & (lab < x.shape[1])
    idx = lab.long().clamp(0, x.shape[1] - 1)[:, None]
    scale = valid.to(x.dtype) if wt is None else valid * wt.to(x.dtype)
    top = x.amax(dim=-1, keepdim=True)
    lse = top + (x - top).exp().sum(dim=-1, keepdim=True).log()
    target = x.gather(1, idx) * mine[:, None]
    loss = ((lse - target) * scale[:, None]).sum()
    # softmax x weight, minus the weight at the label: in the accumulation dtype, rounded once
    p = (x - lse).exp() * scale[:, None]
    at = torch.arange(x.shape[1], device=x.device)[None, :] == idx
    g = torch.where(at & mine[:, None], p - scale[:, None], p)
    return loss, g.to(logits.dtype)


_COMPILED: dict[str, Callable] = {}


def _compiled(backend: str) -> Callable:
    """`_pointwise` compiled with `backend`, dynamic in the chunk's rows (once per process)."""
    if backend not in _COMPILED:
        _COMPILED[backend] = torch.compile(
            _pointwise, backend=backend, dynamic=True, fullgraph=True
        )
    return _COMPILED[backend]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        h: torch.Tensor,
        w: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor | None,
        chunk: int,
        v0: int,
        comm: Communicator | None,
        grad: bool,
        fused: Callable | None,
    ) -> torch.Tensor:
        acc = accum_dtype(h.dtype)
        loss = torch.zeros((), dtype=acc, device=h.device)
        dh = torch.empty_like(h) if grad else None
        dw = torch.zeros(w.shape, dtype=acc, device=w.device) if grad else None
        # a chunk's share of dL/dW in the compute dtype, one buffer for all chunks (none when the
        # compute dtype is the accumulation dtype: added in place)
        part_dw = torch.empty_like(w) if grad and w.dtype != acc else None
        rows = (min(chunk, h.shape[0]), w.shape[0])  # the eager chunk's float32 logits
        buf = torch.empty(rows, dtype=acc, device=h.device) if fused is None else None
        with torch.no_grad():
            for s in range(0, h.shape[0], chunk):
                e = min(s + chunk, h.shape[0])
                wt = None if weights is None else weights[s:e]
                if fused is not None:  # the compiled arithmetic on the compute dtype's logits
                    # the labels and weights as tensors of their own: a view's offset and its base's
                    # size would be guarded on, and another chunk would compile again
                    lab = labels[s:e].clone()
                    part, gc = fused(h[s:e] @ w.t(), lab, None if wt is None else wt.clone())
                    loss += part
                else:
                    assert buf is not None
                    part, g = _chunk(h[s:e], w, labels[s:e], wt, v0, comm, buf, grad)
                    loss += part
                    gc = None if g is None else g.to(h.dtype)  # g itself in the acc. dtype
                    del g
                if gc is not None:
                    torch.matmul(gc, w, out=dh[s:e])  # type: ignore[index]
                    if part_dw is None:
                        dw.addmm_(gc.t(), h[s:e])  # type: ignore[union-attr]
                    else:
                        dw.add_(torch.matmul(gc.t(), h[s:e], out=part_dw))  # type: ignore[union-attr]
                    del gc
            if dh is not None and comm is not None and comm.size > 1:
                comm.all_reduce(dh)  # each process's vocabulary rows gave a part of dL/dh
        ctx.save_for_backward(dh, dw)
        ctx.w_dtype = w.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, g_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        dh, dw = ctx.saved_tensors
        if dh is None:
            raise RuntimeError("the loss was computed without gradients (torch.no_grad)")
        g = g_loss.to(dw.dtype)
        # in place: the gradients were made for this one backward
        dw_out = dw.mul_(g).to(ctx.w_dtype)
        return (dh.mul_(g.to(dh.dtype)), dw_out, None, None, None, None, None, None, None)


def linear_cross_entropy(
    h: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None = None,
    chunk: int | None = None,
    vocab_start: int = 0,
    comm: Communicator | None = None,
    compile: str | None = None,
) -> torch.Tensor:
    """SUM over positions with a label of weight x cross-entropy of `h @ w.T` (h [T, D], w [V, D]
    or this process's rows [V/tp, D] starting at `vocab_start`, with `comm` the TP group);
    differentiable in h and w. `weights`: [T] per position (None: 1); `chunk`: tokens per chunk
    (default: `chunk_tokens` of w's rows); `compile`: a torch.compile backend for each chunk's
    arithmetic in a lower compute dtype (None: eager; ignored in float32 and float64, whose eager
    chunk works in place in one buffer where the compiled one would hold two, under tensor
    parallelism and without a gradient)."""
    if labels.shape != h.shape[:1] or (weights is not None and weights.shape != labels.shape):
        raise ValueError(
            f"labels {tuple(labels.shape)} and weights "
            f"{None if weights is None else tuple(weights.shape)} must be [T] for h {tuple(h.shape)}"
        )
    step = chunk if chunk is not None else chunk_tokens(w.shape[0])
    grad = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)
    whole = vocab_start == 0 and (comm is None or comm.size == 1)
    low = h.dtype != accum_dtype(h.dtype)
    fused = _compiled(compile) if compile is not None and grad and whole and low else None
    return _LinearCrossEntropy.apply(
        h, w, labels, weights, max(1, step), vocab_start, comm, grad, fused
    )


@torch.no_grad()
def token_losses(
    h: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    chunk: int | None = None,
    vocab_start: int = 0,
    comm: Communicator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position of `h @ w.T`: (cross-entropy in the accumulation dtype, 0 where there is no
    label; is the greedy prediction the label), in chunks of tokens like `linear_cross_entropy`
    (the evaluation's form: no gradient, whole logits never held; vocabulary-parallel with
    `comm`, the greedy prediction taken over every process's rows)."""
    acc = accum_dtype(h.dtype)
    step = max(1, chunk if chunk is not None else chunk_tokens(w.shape[0]))
    loss = torch.zeros(h.shape[0], dtype=acc, device=h.device)
    correct = torch.zeros(h.shape[0], dtype=torch.bool, device=h.device)
    tp = comm is not None and comm.size > 1
    buf = torch.empty((min(step, h.shape[0]), w.shape[0]), dtype=acc, device=h.device)
    for s in range(0, h.shape[0], step):
        e = min(s + step, h.shape[0])
        logits = _logits(h[s:e], w, buf)
        lab = labels[s:e].long()
        best, arg = logits.max(dim=-1)
        arg = arg + vocab_start
        local = lab - vocab_start
        mine = (lab != IGNORE_INDEX) & (local >= 0) & (local < w.shape[0])
        target = logits.gather(1, local.clamp(0, w.shape[0] - 1)[:, None])[:, 0] * mine
        # the log-sum-exp from exp(logits - row max) in place (the logits are not needed after)
        lse = best + logits.sub_(best[:, None]).exp_().sum(dim=-1).log()
        if tp:
            assert comm is not None
            lse = torch.logsumexp(torch.stack(comm.all_gather(lse)), dim=0)
            comm.all_reduce(target)
            bests, args = torch.stack(comm.all_gather(best)), torch.stack(comm.all_gather(arg))
            arg = args.gather(0, bests.argmax(0, keepdim=True))[0]  # first process on a tie
        valid = lab != IGNORE_INDEX
        loss[s:e] = (lse - target) * valid
        correct[s:e] = valid & (arg == lab)
    return loss, correct
