"""Selective activation checkpointing (trainer.offload.selective, trainer.attention.tape):
gradients equal the model's own backward in float64; the backward runs no matmul and no
attention kernel again (counted by a dispatch mode around the backward, beside "none" and
"full"), nor a ring's forward; what each block keeps is the memory model's
`saved_bytes_per_token_layer`, about half of "none"; offload and compile are refused with it."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from test_offload import T, batch, build, build_shape, grads
from torch.utils._python_dispatch import TorchDispatchMode

from datapipe.errors import ConfigError
from trainer.attention import local
from trainer.attention.ring import RingAttention, ZigzagLayout
from trainer.attention.tape import AttentionTape, taped
from trainer.model.transformer import get_config
from trainer.offload.config import OffloadConfig
from trainer.offload.manager import ActivationPolicy
from trainer.testing.threads import run_threads

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

MATMULS = ("aten.mm.default", "aten.addmm.default")


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that run (those a selective checkpoint serves from its cache do not),
    and the attention block forwards called while it is entered (`kernel_calls`: counted in
    Python, since the tape sets dispatch modes aside while a kernel records)."""

    current: OpCounter | None = None

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.kernel_calls = 0

    def __enter__(self) -> OpCounter:
        OpCounter.current = self
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        OpCounter.current = None
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def matmuls(self) -> int:
        return sum(self.ops[k] for k in MATMULS)

    def attention_forwards(self) -> int:
        return sum(n for k, n in self.ops.items() if "attention" in k and "backward" not in k)


def step(policy: ActivationPolicy | None, model=None, **shape):
    """One micro-batch's loss and gradients, with the backward's ops counted."""
    model = model if model is not None else build_shape(get_config("debug", **shape))
    ids, pos, cu, labels = batch()
    counter = OpCounter()
    if policy is None:
        loss, _ = model(ids, pos, cu, labels)
        with counter:
            loss.backward()
        return loss.detach(), grads(model), None, counter
    mgr = policy.build("cpu")
    with mgr.microbatch(model, 0.0) as stats:
        loss, _ = model(ids, pos, cu, labels)
        with counter:
            loss.backward()
    return loss.detach(), grads(model), stats, counter


SHAPES = {
    "gqa": dict(dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, n_layers=3, tie_embeddings=False),
    "bias-mha": dict(dim=32, n_heads=4, n_kv_heads=4, ffn_dim=48, n_layers=2, qkv_bias=True),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_selective_equals_the_plain_backward_float64(name):
    shape = SHAPES[name]
    loss_ref, g_ref, _, _ = step(None, **shape)
    model = build_shape(get_config("debug", **shape))
    runs = [0] * len(model.layers)
    for i, blk in enumerate(model.layers):
        blk.attention.register_forward_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    loss, g, stats, _ = step(ActivationPolicy("selective"), model=model)
    assert runs == [2] * len(runs)  # every block's forward ran again in backward
    assert stats.checkpointed_blocks == len(runs)
    assert abs(float(loss - loss_ref)) <= 1e-12 * abs(float(loss_ref))
    for a, b in zip(g, g_ref):
        assert float((a - b).abs().max()) <= 1e-12 * max(float(b.abs().max()), 1e-300)


@pytest.mark.parametrize("name", sorted(SHAPES))  # bias-mha: the projections are addmm
def test_the_backward_runs_no_matmul_or_attention_kernel_again(name, monkeypatch):
    """Against the plain backward (matmul gradients only) and whole-block checkpointing (each
    block's attention kernel and 6 of its 7 matmuls once more: the recomputation stops once it
    has rebuilt what the backward needs, before SwiGLU's output projection)."""
    forward = local.block_forward

    def counted(*args, **kwargs):
        if OpCounter.current is not None:
            OpCounter.current.kernel_calls += 1
        return forward(*args, **kwargs)

    monkeypatch.setattr(local, "block_forward", counted)
    shape = SHAPES[name]
    _, _, _, plain = step(None, **shape)
    _, _, _, full = step(ActivationPolicy("full"), **shape)
    _, _, _, sel = step(ActivationPolicy("selective"), **shape)
    layers = shape["n_layers"]
    assert plain.attention_forwards() == 0 and plain.matmuls() > 0
    assert full.matmuls() == plain.matmuls() + 6 * layers
    # one kernel forward again per kernel backward (the CPU kernel is called per length group)
    kernel_calls = sum(n for k, n in plain.ops.items() if "attention" in k)
    assert full.attention_forwards() == kernel_calls >= layers
    assert sel.matmuls() == plain.matmuls()
    assert sel.attention_forwards() == 0
    # in Python too: the block forward runs again under full, never under selective
    assert (plain.kernel_calls, full.kernel_calls, sel.kernel_calls) == (0, layers, 0)
    # the pointwise work (norms, RoPE, SiLU) is what it recomputes
    assert sel.ops["aten.rsqrt.default"] == 2 * layers
    assert sel.ops["aten.silu.default"] == layers


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_each_block_keeps_what_the_memory_model_says(name, dtype):
    cfg = get_config("debug", **SHAPES[name])
    model = build_shape(cfg).to(dtype)
    ids, pos, cu, labels = batch()
    mgr = ActivationPolicy("selective").build("cpu")
    with mgr.microbatch(model, 0.0) as stats:
        loss, _ = model(ids, pos, cu, labels)
        loss.backward()
    size = torch.empty(0, dtype=dtype).element_size()
    want = cfg.saved_bytes_per_token_layer(size, "selective") * T
    assert stats.block_bytes == [want] * cfg.n_layers
    assert stats.peak_bytes == want * cfg.n_layers
    # about half of what a block keeps without checkpointing, far above "full"'s input
    none = cfg.saved_bytes_per_token_layer(size, "none")
    assert 0.4 < want / T / none < 0.8
    assert cfg.saved_bytes_per_token_layer(size, "full") == size * cfg.dim


def test_llama_1b_shape_figures():
    """The 1B shape in bf16 (what docs/gpu.md quotes): bytes a position keeps per layer."""
    cfg = get_config("llama3.2-1b")
    assert cfg.saved_bytes_per_token_layer(2, "none") == 108680
    assert cfg.saved_bytes_per_token_layer(2, "selective") == 55424
    assert cfg.saved_bytes_per_token_layer(2, "full") == 4096
    with pytest.raises(ValueError, match="selective"):
        cfg.saved_bytes_per_token_layer(2, "every:2")


@pytest.mark.timeout(120)
def test_ring_attention_is_replayed_not_exchanged_again():
    """One sample zigzag over 4 thread-ranks: selective gradients within float64 1e-12 of the
    plain ones, and each rank runs its ring forward once per layer (whole-block checkpointing:
    twice)."""
    length = 4 * 120
    ids_all = torch.randint(0, 200, (length,), generator=torch.Generator().manual_seed(3))
    calls: Counter[tuple[str, int]] = Counter()
    forward = RingAttention._forward

    def counted(self, q, k, v):
        calls[(mode, self.p)] += 1
        return forward(self, q, k, v)

    def member(comm, policy):
        torch.set_num_threads(1)
        model = build(n_layers=3)
        layout = ZigzagLayout((length,), 4)
        idx = torch.as_tensor(layout.global_index(comm.rank))
        pos = torch.as_tensor(layout.position_ids(comm.rank))
        labels = torch.where(idx + 1 < length, ids_all[(idx + 1).clamp(max=length - 1)], -100)
        ring = RingAttention(comm, [0, 1, 2, 3], comm.rank, [length])
        with policy.build("cpu").microbatch(model, 0.0):
            loss, _ = model(ids_all[idx], pos, labels=labels, attn=ring)
            loss.backward()
        return grads(model)

    got = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RingAttention, "_forward", counted)
        for mode in ("none", "selective", "full"):
            policy = ActivationPolicy(mode)
            got[mode] = run_threads(4, lambda c, p=policy: member(c, p), timeout=100)
    for rank in range(4):
        assert [calls[(m, rank)] for m in ("none", "selective", "full")] == [3, 3, 6]
        for a, b in zip(got["selective"][rank], got["none"][rank]):
            assert float((a - b).abs().max()) <= 1e-12 * max(float(b.abs().max()), 1e-300)


def test_tape_replays_in_order_and_refuses_an_extra_call():
    tape = AttentionTape()
    made = []

    def kernel():
        made.append(1)
        return torch.full((2,), float(len(made))), torch.zeros(2)

    with tape.running(replay=False):
        taped(kernel), taped(kernel)
    with tape.running(replay=True):
        assert [float(taped(kernel)[0][0]) for _ in range(2)] == [1.0, 2.0]
        with pytest.raises(RuntimeError, match="more often"):
            taped(kernel)
    assert len(made) == 2 and tape.nbytes() == 4 * 2 * 4
    assert float(taped(kernel)[0][0]) == 3.0  # no tape: computed


def test_refused_with_offload_and_named():
    with pytest.raises(ConfigError, match="offload.enabled"):
        ActivationPolicy("selective", OffloadConfig(enabled=True))
    assert ActivationPolicy("selective").checkpointed(3) == [True] * 3
    assert dataclasses.replace(ActivationPolicy("selective")).selective
