"""Selective activation checkpointing (`train.activation_checkpoint = "selective"`).

A block's forward runs under torch's non-reentrant checkpoint with a selective policy: the
outputs of its matrix multiplications (the Q, K, V and output projections, SwiGLU's three
matmuls) and of its tensor-parallel all-reduces are kept; the attention's out and log-sum-exp
are kept by the attention tape (trainer.attention.tape); everything else (the norms, RoPE, SiLU
and its product, the residual sums) is recomputed from them in backward. So the backward
repeats only pointwise work: no matmul, no attention kernel and no ring exchange runs twice.

What a block keeps per position (`ModelConfig.saved_bytes_per_token_layer`): its input, the
seven matmul outputs and the attention's out and log-sum-exp: about half of what a block keeps
without checkpointing, against one hidden vector with whole-block checkpointing ("full"), which
recomputes everything.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from trainer.attention.tape import AttentionTape

__all__ = ["SAVED_OPS", "SelectiveBlock", "saved_op"]


# ops whose outputs a selectively checkpointed block keeps: the model's projections (2-D matmuls,
# with a bias addmm) and tensor parallelism's all-reduce of the row-split projections' outputs
SAVED_OPS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops._c10d_functional.all_reduce.default,
    }
)


def saved_op(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The policy: keep matmul and all-reduce outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class SelectiveBlock:
    """One selectively checkpointed call of a block: run it, and say what it keeps."""

    def __init__(self) -> None:
        self.tape = AttentionTape()
        self.storage: dict[Any, Any] | None = None
        self.runs = 0
        self.inputs: list[torch.Tensor] = []

    def _contexts(self) -> tuple[Any, Any]:
        fwd, recompute = create_selective_checkpoint_contexts(saved_op)
        self.storage = fwd.storage
        return fwd, recompute

    def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        replay = self.runs > 0  # the first call is the forward, later ones recompute
        self.runs += 1
        with self.tape.running(replay):
            return fn(*args, **kwargs)

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.inputs = [a for a in args[:1] if isinstance(a, torch.Tensor)]  # the hidden state
        return checkpoint(
            functools.partial(self._run, fn),
            *args,
            use_reentrant=False,
            context_fn=self._contexts,
            **kwargs,
        )

    def nbytes(self) -> int:
        """Bytes the block keeps until its backward: its hidden-state input, the kept op
        outputs and the attention's outputs (storages counted once)."""
        seen: dict[int, int] = {}

        def add(t: object) -> None:
            while isinstance(t, (DTensor, AsyncCollectiveTensor)):  # tensor parallelism: local
                t = t._local_tensor if isinstance(t, DTensor) else t.elem
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()

        for t in self.inputs:
            add(t)
        for pair in self.tape.kept:
            for t in pair:
                add(t)
        for per_op in (self.storage or {}).values():
            # a dict by call index (torch 2.14), a list in call order (earlier releases)
            for entry in per_op.values() if isinstance(per_op, dict) else per_op:
                for t in torch.utils._pytree.tree_leaves(entry):
                    add(getattr(t, "val", t))
        return sum(seen.values())
