"""Selective activation checkpointing of DTensor blocks, run inside tests/_tp_worker.py's 4
gloo processes (tests/test_tensor_parallel.py checks its report)."""

from __future__ import annotations

import contextlib

import torch
from _tp_worker import batch, reference, shape


def selective_check(rank: int) -> dict:
    """A 3-layer decoder at tp 2 under no, selective and full activation checkpointing: the
    gradients' largest difference from the plain decoder's, and the matmuls and all-reduces its
    backward runs (selective: those of no checkpointing; full: a block's again)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainer.offload.manager import ActivationPolicy
    from trainer.parallel.tensor import parallelize, tp_mesh

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.mm = self.all_reduce = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            self.mm += func is torch.ops.aten.mm.default
            self.all_reduce += "all_reduce" in str(func)
            return func(*args, **(kwargs or {}))

    cfg = shape(n_layers=3, n_kv_heads=2)
    ids, pos, cu, labels = batch(rank // 2)
    ref = reference(cfg, seed=3)
    ref(ids, pos, cu, labels)[0].backward()
    out = {}
    for mode in ("none", "selective", "full"):
        model = parallelize(reference(cfg, seed=3), tp_mesh(2))
        count = Count()
        with (
            ActivationPolicy(mode).build("cpu").microbatch(model, 0.0)
            if mode != "none"
            else (contextlib.nullcontext())
        ):
            loss = model(ids, pos, cu, labels)[0]
            with count:
                loss.backward()
        got = {k: p.grad for k, p in model.named_parameters()}
        got = {k: g.full_tensor() if hasattr(g, "full_tensor") else g for k, g in got.items()}
        err = max((got[k] - p.grad).abs().max().item() for k, p in ref.named_parameters())
        out[mode] = {"grad_err": err, "mm": count.mm, "all_reduce": count.all_reduce}
    return out
