"""`[train] compile = true`: over local attention each block is compiled whole, the attention a
registered operator inside its one graph (trainer.attention.op); over a ring, the segments around
the ring's attention. Both give the eager model's loss and gradients (with activation
checkpointing and offload hooks around them) and compile once for every micro-batch length;
refused with tensor parallelism. The compiler here is the `aot_eager` backend (dynamo's graph
capture and AOTAutograd's joint graph, no code generation): the graph and its backward are what
inductor would get; its speed is measured on a GPU (bench_gpu)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs

from datapipe.errors import ConfigError
from datapipe.shapes import get_config
from trainer.attention import op
from trainer.attention.local import LocalAttention, attend
from trainer.attention.op import varlen_attention
from trainer.model.transformer import build
from trainer.testing.fake_kernels import installed

F64 = torch.float64


def batch(lengths: list[int], vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    labels = torch.roll(ids, -1)
    labels[torch.tensor(lengths).cumsum(0) - 1] = -100
    return ids, pos, torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]), labels


def loss_and_grads(model, lengths, seed, manager=None, context=None):
    """Loss and gradients of one micro-batch; `context(cu)` the attention context if given."""
    ids, pos, cu, labels = batch(lengths, model.cfg.vocab_size, seed)
    model.zero_grad()
    ctx = manager.microbatch(model, 0.5) if manager is not None else _Null()
    attn = None if context is None else context(cu.tolist())
    with ctx:
        loss, _ = model(ids, pos, cu, labels=labels, attn=attn)
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return None


def op_calls(gm: torch.fx.GraphModule, name: str = "varlen_attention") -> int:
    """Calls of the operator `mixlen::name` in a graph."""
    return sum(str(n.target).split(".")[:2] == ["mixlen", name] for n in gm.graph.nodes)


class Wrapped:
    """An attention context that is not LocalAttention (as a ring is not): the block runs its
    compiled segments around it."""

    def __init__(self, cu: list[int]) -> None:
        self.inner = LocalAttention(cu)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.inner.attend(q, k, v)

    def doc_lengths(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.inner.doc_lengths(position_ids)


def manager_of(managed: str | None, cfg, dtype: torch.dtype = F64):
    if managed is None:
        return None
    from trainer.offload.config import OffloadConfig
    from trainer.offload.manager import activation_manager

    return activation_manager(
        OffloadConfig(enabled=True, force_ratio=0.5), managed, cfg, "cpu", dtype
    )


@pytest.mark.slow
# torch's recording backend returns unboxed graph functions (its own warning; nothing of ours)
@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd is returning a function")
@pytest.mark.parametrize("context", ["local", "other"])
@pytest.mark.parametrize("managed", [None, "every:1"])
def test_compiled_blocks_equal_eager(context, managed) -> None:
    """Loss and gradients of 3 layers compiled equal eager's in float64 over micro-batches of
    other lengths and document counts, with nothing compiled again after the first: over local
    attention one graph per block holding the attention operator, over another context the
    segments, none holding it."""
    torch._dynamo.reset()
    cfg = dataclasses.replace(get_config("debug"), n_layers=3)
    eager, compiled = build(cfg, dtype=F64), build(cfg, dtype=F64)
    compiled.load_state_dict(eager.state_dict())
    backend = AotEagerAndRecordGraphs()  # aot_eager, keeping the graphs it was given
    graphs = backend.graphs
    for block in compiled.layers:
        block.compile_block(backend=backend)
    manager = manager_of(managed, cfg)
    ctx = None if context == "local" else Wrapped
    for i, lengths in enumerate(([5, 17, 9], [40, 3], [2, 2, 2, 2, 30], [1, 1])):
        want = loss_and_grads(eager, lengths, i, manager)
        got = loss_and_grads(compiled, lengths, i, manager, ctx)
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=0)
        for g, w in zip(got[1], want[1]):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
        if i == 0:
            first = len(graphs)
    # other lengths reuse the dynamic graphs: nothing recompiles after the first batch
    assert len(graphs) == first
    if context == "local":  # the blocks share one whole graph, the attention inside it
        assert [op_calls(g) for g in graphs] == [1]
        # AOTAutograd's forward and backward graphs: the operator, then its backward operator
        assert [op_calls(g) for g in backend.fw_graphs] == [1]
        assert [op_calls(g, "varlen_attention_backward") for g in backend.bw_graphs] == [1]
    else:  # the norm, the projections and RoPE, the residuals and SwiGLU
        assert [op_calls(g) for g in graphs] == [0, 0, 0]


@pytest.mark.parametrize("dtype,tol", [(F64, 1e-12), (torch.bfloat16, 2e-2)])
def test_the_attention_operator_equals_attend_and_passes_opcheck(dtype, tol) -> None:
    """The registered operator on the CPU's default kernel: out, lse and gradients equal the
    math reference's (float64, on the same rounded inputs) on packed documents (GQA, an empty
    document); torch.library.opcheck checks its schema, its fake (shapes and dtypes: the lse in
    float32 for bfloat16) and its autograd registration (AOTAutograd included)."""
    lengths = [5, 0, 17, 9]
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()])
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(31, h, 8, generator=gen, dtype=F64).to(dtype) for h in (4, 2, 2))
    dout = torch.randn(31, 4, 8, generator=gen, dtype=F64).to(dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = varlen_attention(*leaves, cu, cu.to(torch.int32), 8**-0.5, "")
    out.backward(dout)
    assert out.dtype == dtype and lse.dtype == (F64 if dtype == F64 else torch.float32)
    ref_leaves = [x.to(F64).requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = attend(*ref_leaves, cu.tolist(), backend="math")
    ref_out.backward(dout.to(F64))
    for got, want in zip(
        (out, lse, *(x.grad for x in leaves)), (ref_out, ref_lse, *(x.grad for x in ref_leaves))
    ):
        scale = float(want.detach().abs().max().clamp_min(1.0))
        torch.testing.assert_close(got.to(F64), want.detach(), rtol=0, atol=tol * scale)
    args = (*leaves, cu, cu.to(torch.int32), 8**-0.5, "")
    torch.library.opcheck(torch.ops.mixlen.varlen_attention.default, args)


@pytest.mark.parametrize(
    "backend,dtype", [("cuda_flash", torch.bfloat16), ("cuda_efficient", torch.float32)]
)
def test_the_attention_operator_on_the_cuda_kernels_matches_its_fake(backend, dtype) -> None:
    """On the CUDA backends' CPU fakes (their layouts: the flash kernel's lse is [H, T]
    underneath), opcheck finds the operator's outputs as its fake states them; the operator
    returns contiguous tensors, the strides inductor asserts on a GPU."""
    lengths = [5, 0, 17, 9]
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()])
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(31, h, 8, generator=gen).to(dtype).requires_grad_() for h in (4, 2, 2))
    args = (q, k, v, cu, cu.to(torch.int32), 8**-0.5, backend)
    with installed():
        torch.library.opcheck(torch.ops.mixlen.varlen_attention.default, args)


@pytest.fixture
def docs_built(monkeypatch) -> list:
    """The VarlenDocs the operator builds during the test, in order."""
    built: list = []

    class Counted(op.VarlenDocs):
        def __post_init__(self) -> None:
            built.append(self)
            super().__post_init__()

    monkeypatch.setattr(op, "VarlenDocs", Counted)
    return built


def test_a_compiled_block_calls_the_flash_kernel_once_per_layer_on_shared_boundaries(
    docs_built,
) -> None:
    """bfloat16 blocks on the `cuda_flash` backend's CPU fake (its conventions enforced):
    compiled equals eager, one kernel call forward and one backward per layer, every call of
    a micro-batch on the same device boundaries (copied once, not per layer)."""
    torch._dynamo.reset()
    cfg = dataclasses.replace(get_config("debug"), n_layers=2)
    eager, compiled = build(cfg, dtype=torch.bfloat16), build(cfg, dtype=torch.bfloat16)
    compiled.load_state_dict(eager.state_dict())
    for block in compiled.layers:
        block.compile_block(backend="aot_eager")
    built = docs_built
    made: list[LocalAttention] = []

    def ctx(cu: list[int]) -> LocalAttention:
        made.append(LocalAttention(cu, backend="cuda_flash"))
        return made[-1]

    for i, lengths in enumerate(([7, 30, 11], [3, 3, 50])):
        with installed() as fakes:
            want = loss_and_grads(eager, lengths, i, None, ctx)
        built.clear()
        with installed() as fakes:
            got = loss_and_grads(compiled, lengths, i, None, ctx)
        assert fakes.calls == {"flash_forward": 2, "flash_backward": 2}
        assert len(built) == 1  # the operator's documents: once for the micro-batch's layers
        # every kernel call took the micro-batch's own device boundaries (no copy per call)
        own = made[-1].docs.cu(torch.device("cpu"))[0]
        assert all(cu is own for cu in fakes.cu_seen)
        torch.testing.assert_close(got[0], want[0], rtol=1e-2, atol=0)
        for g, w in zip(got[1], want[1]):
            torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


def test_threaded_ranks_keep_their_own_documents(docs_built) -> None:
    """Two threads (as threaded ranks do) call the operator in turns, each for its own
    micro-batch's layers: each builds its documents once, neither evicts the other's."""
    import threading

    built = docs_built
    turn = threading.Barrier(2)
    gen = torch.Generator().manual_seed(5)
    qkv = [torch.randn(12, 2, 8, generator=gen, dtype=F64) for _ in range(3)]

    errors: list[BaseException] = []

    def rank(lengths: list[int]) -> None:
        cu = torch.tensor([0, *np.cumsum(lengths).tolist()])
        try:
            for _layer in range(3):
                for mine in (True, False):  # one thread calls while the other waits
                    if mine == (lengths[0] == 4):
                        varlen_attention(*qkv, cu, cu.to(torch.int32), 8**-0.5, "")
                    turn.wait(timeout=30)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            turn.abort()

    threads = [threading.Thread(target=rank, args=(n,)) for n in ([4, 8], [7, 5])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(built) == 2, errors


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64."""
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (inductor, the real kernel)")
def test_compiled_blocks_on_cuda_equal_eager() -> None:  # pragma: no cover - GPU only
    """bfloat16 blocks and loss chunks compiled by inductor (the blocks on the real varlen flash
    kernel) are as close to the
    float64 model as eager bfloat16 is, and do not compile again for another micro-batch.
    (Elementwise against eager is no test: inductor keeps its fused pointwise ops in float32
    where eager rounds each to bfloat16, so single gradients differ by a few bfloat16 steps.)"""
    torch._dynamo.reset()
    cfg = dataclasses.replace(get_config("debug"), n_layers=2)
    dev = torch.device("cuda")
    eager = build(cfg, dtype=torch.bfloat16).to(dev)
    compiled = build(cfg, dtype=torch.bfloat16).to(dev)
    compiled.load_state_dict(eager.state_dict())
    ref = build(cfg, dtype=F64).to(dev)  # the same weights in float64 (the math backend)
    ref.load_state_dict(eager.state_dict())
    compiled.compile_layers()  # the blocks and the loss's chunks, as `[train] compile` does
    from torch._dynamo.utils import counters

    for i, lengths in enumerate(([700, 3000, 300], [64, 64, 2048, 900])):
        ids, pos, cu, labels = (t.to(dev) for t in batch(lengths, cfg.vocab_size, i))
        out = []
        for model in (ref, eager, compiled):
            model.zero_grad()
            loss, _ = model(ids, pos, cu.tolist(), labels=labels)
            loss.backward()
            out.append((loss.detach().double(), [p.grad.double() for p in model.parameters()]))
        (ref_loss, ref_grads), (eager_loss, eager_grads), (comp_loss, comp_grads) = out
        assert abs(float(comp_loss - ref_loss)) <= 2e-3 * abs(float(ref_loss))
        for n, (w, g, r) in enumerate(zip(eager_grads, comp_grads, ref_grads)):
            e_eager, e_comp = _rel(w, r), _rel(g, r)
            assert e_eager < 3e-2, (n, e_eager)  # bfloat16 itself, the yardstick
            assert e_comp <= 2 * e_eager + 5e-3, (n, e_comp, e_eager)
        if i == 0:
            frames = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == frames > 0


@pytest.mark.parametrize("managed", [None, "every:1"])
@pytest.mark.parametrize("dtype", [F64, torch.bfloat16])
def test_compile_layers_compiles_the_blocks_and_the_loss_chunks(
    monkeypatch, managed, dtype
) -> None:
    """`Transformer.compile_layers` (what `[train] compile` calls) compiles every block and hands
    the loss its backend: in bfloat16 the loss runs its chunks through the compiled function
    (counted here), in float64 eagerly (in place in one buffer). Loss and gradients equal the eager
    model's, also inside the offload manager's hooks (checkpointing every block, half the rest
    offloaded): in float64 to 1e-12; in bfloat16 within its rounding (the compiled chunk rounds
    softmax x weight once, eager rounds it after a float32 product of two factors)."""
    from trainer.model import loss as loss_module

    torch._dynamo.reset()
    cfg = dataclasses.replace(get_config("debug"), n_layers=2)
    eager, compiled = build(cfg, dtype=dtype), build(cfg, dtype=dtype)
    compiled.load_state_dict(eager.state_dict())
    eager.loss_chunk_tokens = compiled.loss_chunk_tokens = 7
    calls: list[str] = []
    real = loss_module._compiled
    monkeypatch.setattr(loss_module, "_compiled", lambda b: calls.append(b) or real(b))
    compiled.compile_layers("eager")
    assert all(block._compiled is not None for block in compiled.layers)
    lengths = [5, 17, 9]
    manager = manager_of(managed, cfg, dtype)
    want = loss_and_grads(eager, lengths, 0, manager)
    assert calls == []  # the eager model's loss never asks for it
    got = loss_and_grads(compiled, lengths, 0, manager)
    if dtype == F64:
        assert calls == []
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=0)
        for g, w in zip(got[1], want[1]):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
        return
    assert calls == ["eager"]
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=0)
    for g, w in zip(got[1], want[1]):
        assert float((g.double() - w.double()).norm()) <= 1e-2 * float(w.double().norm())


def test_compiling_a_block_with_hooks_on_its_attention_is_refused() -> None:
    """A compiled block calls the attention's projections, not the attention module: a hook on
    it would silently stop running, so compiling refuses it."""
    model = build(dataclasses.replace(get_config("debug"), n_layers=1), dtype=F64)
    model.layers[0].attention.register_forward_hook(lambda *_: None)
    with pytest.raises(ValueError, match="hooks registered on it would not run"):
        model.layers[0].compile_block(backend="aot_eager")


def test_compile_is_refused_with_tensor_parallelism(tmp_path) -> None:
    from trainer.config.toml import load_config

    cfg = tmp_path / "run.toml"
    cfg.write_text('[model]\nname = "debug"\n[data]\npath = "unused"\n[train]\ncompile = true\n')
    load_config(cfg)
    with pytest.raises(ConfigError, match="train.compile: not with parallel.tp = 2"):
        load_config(cfg, ["parallel.tp=2"])


def test_the_compiled_local_path_equals_the_block_with_an_explicit_head_dim() -> None:
    """`Block.local_forward` (what `compile_block` captures over local attention), run as plain
    Python, equals the eager block on a shape whose heads are not dim / n_heads wide (4 heads of
    24 over a width of 64: the attention's scale is 24^-0.5, not 16^-0.5), in float64."""
    cfg = dataclasses.replace(
        get_config("debug"), dim=64, n_heads=4, n_kv_heads=2, explicit_head_dim=24, n_layers=1
    )
    model = build(cfg, dtype=F64)
    block = model.layers[0]
    lengths = [7, 20, 1, 12]
    _, pos, cu, _ = batch(lengths, cfg.vocab_size, 0)
    x = torch.randn(sum(lengths), cfg.dim, dtype=F64, generator=torch.Generator().manual_seed(1))
    cos, sin = model.rope.cos_sin(pos, F64)
    attn = LocalAttention(cu.tolist())
    cu_dev, _ = attn.docs.cu(x.device)
    with torch.no_grad():
        want = block(x, cos, sin, attn)
        got = block.local_forward(x, cos, sin, attn.docs.host_cu(), cu_dev, attn.backend or "")
    assert block.attention.head_dim * cfg.n_heads != cfg.dim
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
