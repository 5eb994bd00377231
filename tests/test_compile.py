"""`[train] compile = true`: each block's segments before and after attention compiled (one graph
each, dynamic shapes) give the eager model's loss and gradients, with activation checkpointing and
offload hooks around them; refused with tensor parallelism. The compiler here is the `aot_eager`
backend (dynamo's graph capture and AOTAutograd's joint graph, no code generation): the graph
and its backward are what inductor would get; its speed is measured on a GPU (bench_gpu)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from datapipe.errors import ConfigError
from datapipe.shapes import get_config
from trainer.model.transformer import build

F64 = torch.float64


def batch(lengths: list[int], vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    labels = torch.roll(ids, -1)
    labels[torch.tensor(lengths).cumsum(0) - 1] = -100
    return ids, pos, torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]), labels


def loss_and_grads(model, lengths, seed, manager=None):
    ids, pos, cu, labels = batch(lengths, model.cfg.vocab_size, seed)
    model.zero_grad()
    ctx = manager.microbatch(model, 0.5) if manager is not None else _Null()
    with ctx:
        loss, _ = model(ids, pos, cu, labels=labels)
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return None


@pytest.mark.slow
@pytest.mark.parametrize("managed", [None, "every:1"])
def test_compiled_segments_equal_eager(managed) -> None:
    torch._dynamo.reset()
    cfg = dataclasses.replace(get_config("debug"), n_layers=3)
    eager, compiled = build(cfg, dtype=F64), build(cfg, dtype=F64)
    compiled.load_state_dict(eager.state_dict())
    for block in compiled.layers:
        block.compile_segments(backend="aot_eager")
    manager = None
    if managed is not None:
        from trainer.offload.config import OffloadConfig
        from trainer.offload.manager import activation_manager

        manager = activation_manager(
            OffloadConfig(enabled=True, force_ratio=0.5), managed, cfg, "cpu", F64
        )
    from torch._dynamo.utils import counters

    for i, lengths in enumerate(([5, 17, 9], [40, 3], [2, 2, 2, 2, 30])):
        want = loss_and_grads(eager, lengths, i, manager)
        got = loss_and_grads(compiled, lengths, i, manager)
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=0)
        for g, w in zip(got[1], want[1]):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
        if i == 0:
            frames = counters["stats"]["unique_graphs"]
    # other lengths reuse the dynamic graphs: nothing recompiles after the first batch
    assert counters["stats"]["unique_graphs"] == frames > 0


def test_compile_is_refused_with_tensor_parallelism(tmp_path) -> None:
    from trainer.config.toml import load_config

    cfg = tmp_path / "run.toml"
    cfg.write_text('[model]\nname = "debug"\n[data]\npath = "unused"\n[train]\ncompile = true\n')
    load_config(cfg)
    with pytest.raises(ConfigError, match="train.compile: not with parallel.tp = 2"):
        load_config(cfg, ["parallel.tp=2"])
