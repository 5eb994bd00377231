"""The CUDA attention backends' translation of torch's varlen kernels, on the CPU: CPU fakes with
the kernels' conventions (trainer.testing.fake_kernels) stand in for the kernels, and every
result is checked against the `math` reference. A wrong boundary dtype, log-sum-exp layout,
mask alignment, GQA fold or empty-row value fails here; whether the real kernels keep those
conventions is checked on a GPU (tests marked cuda, benchmarks/bench_gpu.py). Here the fakes'
answers are also held against torch's own meta functions of those kernels (output shapes,
dtypes and strides from the same arguments), and every call is bound to the kernel's schema."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.attention import cuda_efficient, cuda_flash, dispatch, local, math_ref
from trainer.attention.local import LocalAttention, attend, block_backward, block_forward
from trainer.attention.varlen import VarlenDocs, check_inputs
from trainer.testing.fake_kernels import bind_schema, installed

F64 = torch.float64
# per backend: the dtype it computes in here, and the tolerance against the float64 reference
CASES = {"cuda_flash": (torch.bfloat16, 2e-2), "cuda_efficient": (torch.float32, 1e-5)}


def qkv(tq: int, tk: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, hq, d, generator=gen).to(dtype)
    k = torch.randn(tk, hkv, d, generator=gen).to(dtype)
    v = torch.randn(tk, hkv, d, generator=gen).to(dtype)
    dout = torch.randn(tq, hq, d, generator=gen).to(dtype)
    return q, k, v, dout


def reference(q, k, v, dout, docs: VarlenDocs, causal: bool, scale: float):
    """The math backend in float64 on the same (rounded) inputs: out, lse, dq, dk, dv."""
    x = [t.to(F64) for t in (q, k, v, dout)]
    out, lse = math_ref.forward(x[0], x[1], x[2], docs, causal, scale)
    grads = math_ref.backward(x[3], x[0], x[1], x[2], out, lse, docs, causal, scale)
    return out, lse, *grads


def close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    """Equal to `rtol` of the reference's largest magnitude (-inf where the reference has it)."""
    got = got.to(F64)
    inf = torch.isinf(want)
    assert torch.equal(got == -torch.inf, want == -torch.inf), "rows with no key differ"
    assert torch.isfinite(got[~inf]).all()
    scale = want[~inf].abs().max().clamp_min(1.0)
    torch.testing.assert_close(got[~inf], want[~inf], rtol=0, atol=rtol * float(scale))


@pytest.mark.parametrize("backend", list(CASES))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_backend_equals_the_math_reference_on_packed_documents(backend, hq, hkv, causal) -> None:
    """Several documents in one call, some with no query or no key (ring blocks have them),
    GQA: out, lse and the backward against the given out and lse."""
    dtype, tol = CASES[backend]
    if causal:
        docs = VarlenDocs((0, 5, 5, 17, 18, 40), (0, 5, 5, 17, 18, 40))
    else:
        docs = VarlenDocs((0, 5, 5, 17, 20, 40), (0, 9, 12, 12, 30, 31))
    q, k, v, dout = qkv(docs.total_q, docs.total_k, hq, hkv, 16, dtype)
    scale = 16**-0.5
    want = reference(q, k, v, dout, docs, causal, scale)
    with installed() as fakes:
        out, lse = block_forward(q, k, v, docs, None, causal, scale, backend)
        # the backward against the reference's out and lse: what a ring block gets
        grads = block_backward(
            dout, q, k, v, want[0].to(dtype), want[1], docs, None, causal, scale, backend
        )
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (docs.total_q, hq)
    for got, ref in zip((out, lse, *grads), want):
        close(got, ref, tol)
    kind = "flash" if backend == "cuda_flash" else "efficient"
    assert fakes.calls == {f"{kind}_forward": 1, f"{kind}_backward": 1}  # one call per block


@pytest.mark.parametrize("backend", list(CASES))
def test_attend_through_autograd_and_one_kernel_call_for_many_documents(backend) -> None:
    """`attend` over 60 short documents: one kernel call forward and one backward, the
    gradients of q, k, v equal the reference's."""
    dtype, tol = CASES[backend]
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 9, size=60)
    cu = [0, *np.cumsum(lengths).tolist()]
    q, k, v, dout = qkv(cu[-1], cu[-1], 4, 2, 8, dtype, seed=1)
    want = reference(q, k, v, dout, VarlenDocs(tuple(cu), tuple(cu)), True, 8**-0.5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with installed() as fakes:
        out, lse = attend(*leaves, cu, backend=backend)
        out.backward(dout)
    for got, ref in zip((out.detach(), lse, *(t.grad for t in leaves)), want):
        close(got, ref, tol)
    assert sum(fakes.calls.values()) == 2


def test_a_micro_batch_copies_its_boundaries_once_for_every_layer() -> None:
    """LocalAttention builds the int32 device boundaries once: every layer's kernel call gets
    the same tensor (no per-layer host-to-device copy)."""
    ctx = LocalAttention([0, 3, 10, 16], backend="cuda_flash")
    with installed() as fakes:
        for layer in range(3):
            q, k, v, _ = qkv(16, 16, 4, 4, 8, torch.bfloat16, seed=layer)
            ctx.attend(q, k, v)
    assert len(fakes.cu_seen) == 3 and all(t is fakes.cu_seen[0] for t in fakes.cu_seen)
    assert fakes.cu_seen[0].dtype == torch.int32


# the fakes' names -> torch's kernels; the memory-efficient backward's meta function is left out:
# in torch 2.11-2.14 it lacks the schema's `out` argument, so torch cannot run it on meta tensors
REAL = {
    "flash_forward": torch.ops.aten._flash_attention_forward.default,
    "flash_backward": torch.ops.aten._flash_attention_backward.default,
    "efficient_forward": torch.ops.aten._efficient_attention_forward.default,
}
USED = {"flash_forward": 2, "flash_backward": 3, "efficient_forward": 2}  # outputs a backend reads


def _meta(x: object) -> object:
    return x.to("meta") if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("backend", list(CASES))
@pytest.mark.parametrize("causal", [True, False])
def test_the_fakes_answer_like_torchs_own_kernels_on_the_meta_device(backend, causal) -> None:
    """Each kernel call a backend makes (forward, then backward against the reference's out and
    lse, GQA, packed documents with empty sides) is made again on meta tensors through torch's
    own kernel: the outputs the backend reads have the fake's shapes, dtypes and strides."""
    dtype, _ = CASES[backend]
    if causal:
        docs = VarlenDocs((0, 5, 5, 17, 18, 40), (0, 5, 5, 17, 18, 40))
    else:
        docs = VarlenDocs((0, 5, 5, 17, 20, 40), (0, 9, 12, 12, 30, 31))
    q, k, v, dout = qkv(docs.total_q, docs.total_k, 8, 2, 16, dtype)
    want = reference(q, k, v, dout, docs, causal, 0.25)
    compared = []
    with installed() as fakes:
        module = cuda_flash if backend == "cuda_flash" else cuda_efficient
        kind = "flash" if backend == "cuda_flash" else "efficient"

        def spy(name: str, fake):  # noqa: ANN001, ANN202
            def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                got = fake(*args, **kwargs)
                if name in REAL:
                    meta = REAL[name](*map(_meta, args), **{n: _meta(x) for n, x in kwargs.items()})
                    for g, m in zip(got[: USED[name]], meta[: USED[name]]):
                        same = (g.shape, g.dtype, g.stride()) == (m.shape, m.dtype, m.stride())
                        assert same, (name, g.shape, g.stride(), m.shape, m.stride())
                    compared.append(name)
                return got

            return call

        # installed() puts the saved kernels back on leaving, whatever is in place then
        module.kernels = type(module.kernels)(
            spy(f"{kind}_forward", module.kernels.forward),
            spy(f"{kind}_backward", module.kernels.backward),
        )
        block_forward(q, k, v, docs, None, causal, 0.25, backend)
        block_backward(dout, q, k, v, want[0].to(dtype), want[1], docs, None, causal, 0.25, backend)
    assert sum(fakes.calls.values()) == 2
    assert compared == [n for n in (f"{kind}_forward", f"{kind}_backward") if n in REAL]


def test_a_call_the_kernel_would_refuse_is_refused_before_the_fake_runs() -> None:
    """`bind_schema` against torch's own argument parsing of the same calls on meta tensors:
    both take the call the backend makes, both refuse each broken one."""
    op = torch.ops.aten._flash_attention_forward.default
    q = torch.empty(10, 4, 16, dtype=torch.bfloat16, device="meta")
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device="meta")
    good = [q, q, q, cu, cu, 6, 6, 0.0, True, False]
    bind_schema(op, tuple(good), {"scale": 0.25})
    op(*good, scale=0.25)
    broken = [
        (good + [0.25], {}),  # scale by position: it is keyword-only
        (good[:-1], {"scale": 0.25}),  # return_debug_mask missing
        (good, {"softmax_scale": 0.25}),  # flash-attn's name, not torch's
        (good[:5] + [6.0] + good[6:], {}),  # max_q a float
        (good[:5] + ["6"] + good[6:], {}),  # max_q a string
        (good[:3] + [[0, 4, 10]] + good[4:], {}),  # boundaries as a list
        ([None] + good[1:], {}),  # no query
    ]
    for args, kwargs in broken:
        with pytest.raises(TypeError):
            bind_schema(op, tuple(args), kwargs)
        with pytest.raises((TypeError, RuntimeError)):
            op(*args, **kwargs)


def test_dispatch_by_device_and_dtype(monkeypatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        assert dispatch.default_backend(cpu, dtype) == "cpu_flash"
    monkeypatch.setattr(dispatch, "_flash_runs_on", lambda index: True)  # an Ampere+ GPU
    assert dispatch.default_backend(cuda, torch.bfloat16, 128) == "cuda_flash"
    assert dispatch.default_backend(cuda, torch.float16, 256) == "cuda_flash"
    assert dispatch.default_backend(cuda, torch.bfloat16, 264) == "cuda_efficient"  # too wide
    assert dispatch.default_backend(cuda, torch.float32) == "cuda_efficient"  # never flash
    assert dispatch.default_backend(cuda, torch.float64) == "math"
    monkeypatch.setattr(dispatch, "_flash_runs_on", lambda index: False)  # before Ampere
    assert dispatch.default_backend(cuda, torch.bfloat16, 64) == "cuda_efficient"
    with pytest.raises(ValueError, match="known: cpu_flash"):
        dispatch.get("flash3")


def test_flash_runs_from_ampere_on(monkeypatch) -> None:
    """torch's flash kernel needs compute capability 8.0 (Ampere, an A100) or newer: a T4 (7.5)
    gets the memory-efficient kernel, an A100 and an H100 (9.0) the flash one."""
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    cuda = torch.device("cuda", 0)
    for capability, want in (
        ((7, 5), "cuda_efficient"),
        ((8, 0), "cuda_flash"),
        ((9, 0), "cuda_flash"),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, c=capability: c)
        dispatch._flash_runs_on.cache_clear()
        try:
            assert dispatch.default_backend(cuda, torch.bfloat16, 64) == want, capability
        finally:
            dispatch._flash_runs_on.cache_clear()


def test_kernel_limits_are_refused_naming_the_setting() -> None:
    q, k, v, _ = qkv(4, 4, 2, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="train.dtype"):
        cuda_flash.check(q, k)
    with pytest.raises(ValueError, match="model.dim / model.n_heads"):
        cuda_flash.check(*qkv(4, 4, 2, 2, 264, torch.bfloat16)[:2])
    with pytest.raises(ValueError, match="model.dim / model.n_heads"):
        cuda_flash.check(*qkv(4, 4, 2, 2, 12, torch.bfloat16)[:2])
    cuda_flash.check(*qkv(4, 4, 2, 2, 256, torch.bfloat16)[:2])  # the limit itself
    with pytest.raises(ValueError, match="train.dtype"):
        cuda_efficient.check(*qkv(4, 4, 2, 2, 8, F64)[:2])
    with pytest.raises(ValueError, match="flash-attn package's kernel computes in .*train.dtype"):
        attend(q, k, v, [0, 4], backend="flash_attn")  # the package: never in float32
    big = qkv(4, 4, 2, 2, 264, torch.bfloat16)[:3]  # nor above its head dimension limit
    with pytest.raises(
        ValueError, match="flash-attn package's kernel takes head dimensions up to 256"
    ):
        attend(*big, [0, 4], backend="flash_attn")
    # any size up to it: the package pads a head dimension to a multiple of 8 itself (torch's
    # own flash kernel refuses 12, above)
    check_inputs(*qkv(4, 4, 2, 2, 12, torch.bfloat16)[:2], "flash-attn", *local._FLASH_LIMITS)


@pytest.mark.parametrize("backend", list(CASES))
def test_ring_blocks_on_the_kernels_through_four_threaded_ranks(backend) -> None:
    """Three samples split zigzag over a ring of 4 (one shorter than 8 chunks: empty chunks,
    rows with no key in some hops), every hop's block on the fake kernel: the assembled out,
    lse and gradients equal whole-sample attention (math, float64)."""
    from trainer.attention.ring import RingAttention, ZigzagLayout, ring_attend
    from trainer.testing.threads import run_threads

    dtype, tol = CASES[backend]
    lengths, group = (37, 5, 22), [0, 1, 2, 3]
    cu = (0, *np.cumsum(lengths).tolist())
    q, k, v, dout = qkv(cu[-1], cu[-1], 8, 2, 16, dtype, seed=5)
    want = reference(q, k, v, dout, VarlenDocs(cu, cu), True, 16**-0.5)

    def member(comm):
        p = group.index(comm.rank)
        idx = torch.as_tensor(ZigzagLayout(lengths, 4).global_index(p))
        leaves = [x[idx].clone().requires_grad_() for x in (q, k, v)]
        out, lse = ring_attend(*leaves, RingAttention(comm, group, p, lengths, backend=backend))
        out.backward(dout[idx])
        return idx, [out.detach(), lse, *(t.grad for t in leaves)]

    with installed() as fakes:
        parts = run_threads(4, member, timeout=60)
    got = [torch.zeros(r.shape, dtype=F64) for r in want]
    seen = torch.zeros(cu[-1], dtype=torch.long)
    for idx, results in parts:
        seen[idx] += 1
        for g, r in zip(got, results):
            g[idx] = r.to(F64)
    assert torch.equal(seen, torch.ones_like(seen))
    for g, r in zip(got, want):
        close(g, r, tol)
    kind = "flash" if backend == "cuda_flash" else "efficient"
    assert fakes.calls[f"{kind}_forward"] == 4 * 4  # one call per hop per member


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the real kernels)")


@CUDA
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_kernels_equal_the_math_reference(dtype, tol, causal) -> None:  # pragma: no cover
    """On a GPU, torch's own kernels through the default backend: packed documents (empty
    sides too), GQA, forward and the backward against the given out and lse."""
    if causal:
        docs = VarlenDocs((0, 50, 50, 300, 301, 700), (0, 50, 50, 300, 301, 700))
    else:
        docs = VarlenDocs((0, 50, 50, 300, 320, 700), (0, 90, 120, 120, 500, 510))
    cuda = torch.device("cuda")
    q, k, v, dout = (t.to(cuda) for t in qkv(docs.total_q, docs.total_k, 8, 2, 64, dtype))
    scale = 64**-0.5
    want = reference(q, k, v, dout, docs, causal, scale)
    out, lse = block_forward(q, k, v, docs, None, causal, scale)
    grads = block_backward(dout, q, k, v, want[0].to(dtype), want[1], docs, None, causal, scale)
    for got, ref in zip((out, lse, *grads), want):
        close(got, ref, tol)


@CUDA
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_cuda_ring_through_four_threaded_ranks(dtype, tol) -> None:  # pragma: no cover
    """4 threaded ranks on one GPU, the real kernels in every hop, against whole attention."""
    from trainer.attention.ring import RingAttention, ZigzagLayout, ring_attend
    from trainer.testing.threads import run_threads

    cuda = torch.device("cuda")
    lengths, group = (700, 45, 9), [0, 1, 2, 3]
    cu = (0, *np.cumsum(lengths).tolist())
    q, k, v, dout = (t.to(cuda) for t in qkv(cu[-1], cu[-1], 8, 2, 64, dtype, seed=5))
    want = reference(q, k, v, dout, VarlenDocs(cu, cu), True, 64**-0.5)

    def member(comm):
        p = group.index(comm.rank)
        idx = torch.as_tensor(ZigzagLayout(lengths, 4).global_index(p), device=cuda)
        leaves = [x[idx].clone().requires_grad_() for x in (q, k, v)]
        out, lse = ring_attend(*leaves, RingAttention(comm, group, p, lengths, device=cuda))
        out.backward(dout[idx])
        return idx, [out.detach(), lse, *(t.grad for t in leaves)]

    got = [torch.zeros(r.shape, dtype=F64, device=cuda) for r in want]
    for idx, results in run_threads(4, member, timeout=60):
        for g, r in zip(got, results):
            g[idx] = r.to(F64)
    for g, r in zip(got, want):
        close(g, r, tol)


@pytest.mark.parametrize("longest", [32, 64])
def test_efficient_backward_when_the_longest_document_fills_whole_lse_rows(longest) -> None:
    """The memory-efficient kernel's lse rows are the longest query count rounded up to 32; when
    that count is already a multiple of 32 (no padding) the backward still equals the math
    reference, through a kernel call with rows exactly that wide."""
    docs = VarlenDocs((0, longest, longest + 7), (0, longest, longest + 7))
    q, k, v, dout = qkv(docs.total_q, docs.total_k, 4, 2, 8, torch.float32, seed=2)
    want = reference(q, k, v, dout, docs, True, 8**-0.5)
    with installed():
        out, lse = block_forward(q, k, v, docs, None, True, 8**-0.5, "cuda_efficient")
        grads = block_backward(
            dout, q, k, v, want[0].float(), want[1], docs, None, True, 8**-0.5, "cuda_efficient"
        )
    for got, ref in zip((out, lse, *grads), want):
        close(got, ref, 1e-5)


def test_efficient_head_dimension_alignment_depends_on_the_dtype() -> None:
    """The memory-efficient kernel takes float32 head dimensions in multiples of 4 and half
    precision ones in multiples of 8; others are refused naming model.dim / model.n_heads."""
    for dtype, ok, bad in (
        (torch.float32, (4, 12, 16), (6, 10)),
        (torch.bfloat16, (8, 16), (4, 12)),
    ):
        for d in ok:
            cuda_efficient.check(*qkv(4, 4, 2, 2, d, dtype)[:2])
        for d in bad:
            with pytest.raises(ValueError, match="model.dim / model.n_heads"):
                cuda_efficient.check(*qkv(4, 4, 2, 2, d, dtype)[:2])


@pytest.mark.parametrize("backend", list(CASES))
def test_query_heads_not_a_multiple_of_kv_heads_are_refused_naming_the_setting(backend) -> None:
    """6 query heads over 4 KV heads: the backend refuses before any kernel call, naming
    model.n_heads and model.n_kv_heads (a block's backward has no earlier check)."""
    dtype, _ = CASES[backend]
    q, k, v, dout = qkv(8, 8, 6, 4, 16, dtype)
    docs = VarlenDocs((0, 8), (0, 8))
    with installed() as fakes:
        with pytest.raises(ValueError, match=r"model\.n_heads, model\.n_kv_heads"):
            dispatch.get(backend).check(q, k)
        with pytest.raises(ValueError, match=r"model\.n_heads, model\.n_kv_heads"):
            block_backward(dout, q, k, v, q, q[..., 0].float(), docs, None, True, 0.25, backend)
    assert fakes.calls == {}
