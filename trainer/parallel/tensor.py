"""Tensor parallelism of the decoder over a one-dimensional device mesh (torch DTensor).

`parallelize(model, mesh)` applies torch's own plans (`parallelize_module`, no hand-written
matmul collectives) to a `trainer.model.transformer.Transformer`:

| module | plan | what each of the tp processes holds |
| --- | --- | --- |
| tok_embeddings | RowwiseParallel, input replicated | vocabulary rows V/tp (vocabulary-parallel) |
| attention.wq | ColwiseParallel | n_heads/tp query heads |
| attention.wk, wv | ColwiseParallel when tp divides n_kv_heads | n_kv_heads/tp K/V heads |
| attention.wk, wv | replicated when tp > n_kv_heads | all K/V heads; each process keeps its group's |
| attention.wo | RowwiseParallel | the input columns of its heads, output all-reduced |
| feed_forward.w1, w3 | ColwiseParallel | ffn_dim/tp hidden units |
| feed_forward.w2 | RowwiseParallel | their input columns, output all-reduced |
| output (untied) | ColwiseParallel, output kept sharded | vocabulary rows V/tp |
| norms | replicated (no sequence parallelism); the output one replicated DTensor | the whole weight |

Per layer that is 4 all-reduces of [T, dim]: the attention and SwiGLU outputs forward, and their
inputs' gradients backward, once each (the projections reading one norm's output add their
partial gradients before the one all-reduce).

In training the loss is vocabulary-parallel (trainer.model.loss, over the TP group's
communicator `model.tp_comm`): each process computes its vocabulary rows' logits chunk by chunk,
the log-sum-exps and labels' logits combine over the group, and no process materialises [T, V]
logits. Only a forward without labels gathers whole logits (`sharded_logits`).
The loss rule is unchanged: the model returns the SUM of token losses and the labelled count.
Every process of a TP group runs the same micro-batch and attends with its own heads; in the
trainer (`[parallel] tp`, trainer.parallel.runtime) a ring over HDP ranks joins the processes of
one TP index, each ring on its heads.

Norm weights are plain replicated parameters: every process computes the same gradient for them
(their inputs are the all-reduced activations), so no reduction over the TP group is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)

from datapipe.shapes import TP_DEGREES, ModelConfig

__all__ = [
    "TP_DEGREES",
    "check_tp",
    "full_state_dict",
    "is_replicated",
    "local_grad",
    "local_tensor",
    "optimizer_params",
    "parallelize",
    "place_of",
    "sharded_logits",
    "square_norm",
    "tp_sum",
    "tp_mesh",
    "whole_flat",
]


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError naming the shape's field when `cfg` cannot be split over `tp` processes."""
    problem = cfg.tp_problem(tp)
    if problem:
        raise ValueError(f"parallel.tp {problem}")


def tp_mesh(tp: int, device_type: str = "cpu") -> DeviceMesh:
    """A mesh over all processes of the default group, as tp groups of adjacent ranks; the
    returned mesh is this process's TP group (dimension "tp")."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"parallel.tp = {tp} must divide the number of processes ({world})")
    mesh = init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return mesh["tp"]


def _replicated_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    (x,) = inputs
    if isinstance(x, DTensor):  # a norm's output, already one replicated DTensor
        return (x,)
    return (DTensor.from_local(x, mesh, [Replicate()], run_check=False),)


def _own_kv_heads(n_kv_heads: int, head_dim: int) -> Any:
    """An output_fn of distribute_module: the whole K or V projection (replicated) -> this
    process's K/V head: the heads repeated to one per process, then each keeps its own (a local
    chunk; the backward all-gathers the processes' gradients)."""

    def output_fn(module: nn.Module, y: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        T = y.shape[0]
        y = y.view(T, n_kv_heads, head_dim).repeat_interleave(mesh.size() // n_kv_heads, dim=1)
        return y.redistribute(mesh, [Shard(1)]).to_local().reshape(T, head_dim)

    return output_fn


def _one_input() -> PrepareModuleOutput:
    """A norm's output as a replicated DTensor (kept): its readers' input gradients sum as
    partial DTensors, all-reduced once where it was made."""
    return PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=False
    )


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard `model` (a Transformer, on the mesh's device) over `mesh` in place; returns it."""
    cfg: ModelConfig = model.cfg
    tp = mesh.size()
    check_tp(cfg, tp)
    if tp == 1:
        return model
    split_kv = cfg.n_kv_heads % tp == 0
    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
    }
    if model.output is not None:
        plan["output"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, plan)
    for block in model.layers:
        layer_plan: dict[str, Any] = {
            # one replicated DTensor for each norm's output: the projections that read it add
            # their input gradients first, then one all-reduce (not one per projection)
            "attention_norm": _one_input(),
            "ffn_norm": _one_input(),
            "attention.wq": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }
        if split_kv:
            layer_plan["attention.wk"] = ColwiseParallel()
            layer_plan["attention.wv"] = ColwiseParallel()
        parallelize_module(block, mesh, layer_plan)
        if not split_kv:  # K/V weights replicated (torch's distribute_module), heads picked
            own = _own_kv_heads(cfg.n_kv_heads, cfg.head_dim)
            for proj in (block.attention.wk, block.attention.wv):
                distribute_module(proj, mesh, None, _replicated_input, own)
    model.tp_mesh = mesh
    from trainer.parallel.comm import TorchComm

    model.tp_comm = TorchComm(mesh.get_group())  # the vocabulary-parallel loss's reductions
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded parameters of a (possibly) tensor-parallel model, under the plain model's
    names (every process gets all of them: for export and tests)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach()
    return out


def sharded_logits(model: nn.Module, h: torch.Tensor) -> DTensor:
    """Logits [T, V] of the final hidden states `h` (replicated), sharded over the vocabulary."""
    if model.output is not None:
        return model.output(h)
    hd = DTensor.from_local(h, model.tp_mesh, [Replicate()], run_check=False)
    return torch.nn.functional.linear(hd, model.tok_embeddings.weight)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor parameter (the tensor it computes with: rebinding its
    storage rebinds the parameter's), or `p` itself."""
    return p._local_tensor if isinstance(p, DTensor) else p


def is_replicated(p: torch.Tensor) -> bool:
    """Does every process of the TP group hold `p` whole (norms; K/V when tp > n_kv_heads)?"""
    if isinstance(p, DTensor):
        return all(isinstance(pl, Replicate) for pl in p.placements)
    return True


def whole_flat(model: nn.Module, flat: torch.Tensor) -> torch.Tensor:
    """A flat vector over this process's shards of `model`'s trainable parameters (in their
    order), put back together into the flat vector of the whole parameters (collective over the
    TP group; for tests and debugging)."""
    out, at = [], 0
    for p in (p for p in model.parameters() if p.requires_grad):
        local = local_tensor(p)
        piece = flat[at : at + local.numel()].view(local.shape)
        at += local.numel()
        if isinstance(p, DTensor):
            piece = DTensor.from_local(piece, p.device_mesh, p.placements).full_tensor()
        out.append(piece.reshape(-1))
    assert at == flat.numel(), (at, flat.numel())
    return torch.cat(out)


def place_of(name: str, p: torch.Tensor) -> Any:
    """Where this process's tensor of parameter `p` sits in the whole parameter
    (trainer.parallel.slices.Place: tensor-parallel shards split evenly, check_tp)."""
    from trainer.parallel.slices import Place

    local = local_tensor(p)
    offset = [0] * p.dim()
    if isinstance(p, DTensor):
        for dim_mesh, pl in enumerate(p.placements):
            if isinstance(pl, Shard):
                d = pl.dim % p.dim()
                offset[d] += p.device_mesh.get_local_rank(dim_mesh) * local.shape[d]
    return Place(name, tuple(p.shape), tuple(offset))


def optimizer_params(
    model: nn.Module, master: nn.Module | None
) -> tuple[
    list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None, list[bool] | None, list[Any]
]:
    """For trainer.parallel.zero: the tensors the optimizer binds (local shards), the autograd
    leaves, the master module's local shards (None without a separate master), which
    parameters every TP member holds whole (None without TP) and where each local tensor sits
    in its whole parameter (checkpoints name whole parameters)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    leaves = [p for _, p in named]
    params = [local_tensor(p) for p in leaves]
    masters = None
    if master is not None and master is not model:
        masters = [local_tensor(p) for p in master.parameters() if p.requires_grad]
    mesh = getattr(model, "tp_mesh", None)
    replicated = [is_replicated(p) for p in leaves] if mesh is not None else None
    return params, leaves, masters, replicated, [place_of(n, p) for n, p in named]


def tp_sum(
    g: torch.Tensor, parts: Any, replicated: list[bool], tp: int, f: Callable
) -> torch.Tensor:
    """f summed over the pieces of a flat slice `g` that `parts` (trainer.parallel.slices.Part)
    map to parameters, a parameter every member of a TP group of `tp` holds whole weighing 1/tp,
    so the sum over the TP group counts it once; f(g) when nothing is replicated."""
    if tp == 1 or not any(replicated[p.param] for p in parts):
        return f(g)
    pieces = [(g[p.range_start : p.range_start + p.length], replicated[p.param]) for p in parts]
    whole = sum((f(x) for x, rep in pieces if not rep), g.new_zeros(()))
    shared = sum((f(x) for x, rep in pieces if rep), g.new_zeros(()))
    return whole + shared / tp


def square_norm(g: torch.Tensor, parts: Any, replicated: list[bool], tp_comm: Any) -> torch.Tensor:
    """Squared norm [1] of a flat gradient slice (`tp_sum` of its squares: under TP, summed over
    the `tp_comm` group, it counts each parameter once)."""
    if g.numel() == 0:
        return g.new_zeros(1)
    tp = tp_comm.size if tp_comm is not None else 1
    return tp_sum(g, parts, replicated, tp, lambda x: torch.dot(x, x)).reshape(1)


def local_grad(grad: DTensor, leaf: DTensor) -> torch.Tensor:
    """This process's shard of a DTensor parameter's gradient, in the parameter's own layout (an
    embedding's gradient can arrive replicated)."""
    if grad.placements != leaf.placements:
        grad = grad.redistribute(leaf.device_mesh, leaf.placements)
    return grad.to_local()
