"""The chunked output projection + cross-entropy (trainer.model.loss) against cross-entropy over
whole logits (torch's F.cross_entropy, the way the model computed its loss before): loss and
gradients in float64, any chunk size, ignored labels, per-position weights, tied embeddings; the
vocabulary-parallel form through two threaded processes; and its peak memory at a 131,072
vocabulary."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from datapipe.plan.loss import IGNORE_INDEX
from datapipe.shapes import get_config
from trainer.model.loss import chunk_tokens, linear_cross_entropy
from trainer.model.transformer import build
from trainer.testing.threads import run_threads

F64 = torch.float64


@pytest.fixture(autouse=True)
def _fresh_compiles():
    """Each test's compiled loss chunks compile afresh: one process of a job meets one dtype and
    one kind of weights, this module all of them, past dynamo's limit on recompiling a function."""
    torch._dynamo.reset()
    yield


def whole_logits_loss(h, w, labels, weights=None):
    """The reference: whole logits, F.cross_entropy per position, weighted sum."""
    per = F.cross_entropy(h @ w.t(), labels.long(), ignore_index=IGNORE_INDEX, reduction="none")
    return (per if weights is None else per * weights).sum()


def inputs(t: int = 23, d: int = 6, v: int = 37, seed: int = 0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(t, d, generator=gen, dtype=dtype)
    w = torch.randn(v, d, generator=gen, dtype=dtype)
    labels = torch.randint(0, v, (t,), generator=gen)
    labels[torch.randperm(t, generator=gen)[: t // 3]] = IGNORE_INDEX
    weights = torch.rand(t, generator=gen, dtype=dtype) + 0.5
    return h, w, labels, weights


def compiled_loss(h, w, labels, weights, chunk, backend):
    """The loss with each chunk's arithmetic through `_pointwise` compiled by `backend`, in any
    dtype (`linear_cross_entropy(compile=...)` takes that path in a lower compute dtype only)."""
    from trainer.model import loss

    fused = None if backend is None else loss._compiled(backend)
    step = chunk if chunk is not None else chunk_tokens(w.shape[0])
    return loss._LinearCrossEntropy.apply(h, w, labels, weights, step, 0, None, True, fused)


def grads(fn, h, w):
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(hr, wr)
    (loss * 1.7).backward()  # a non-unit incoming gradient
    return loss.detach(), hr.grad, wr.grad


@pytest.mark.parametrize("chunk", [1, 5, 23, 100, None])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("compile", [None, "eager"])
def test_chunked_equals_whole_logits_float64(chunk, weighted, compile) -> None:
    """Eager, and each chunk's arithmetic through torch.compile (the `eager` backend: traced,
    then run as written, so the compiled function's own arithmetic is what is checked)."""
    h, w, labels, weights = inputs()
    wt = weights if weighted else None
    want = grads(lambda a, b: whole_logits_loss(a, b, labels, wt), h, w)
    got = grads(lambda a, b: compiled_loss(a, b, labels, wt, chunk, compile), h, w)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("dtype", "used"), [(torch.float64, False), (torch.float32, False), (torch.bfloat16, True)]
)
def test_compile_is_taken_in_a_lower_compute_dtype_only(monkeypatch, dtype, used) -> None:
    """`compile=` compiles the chunks in bfloat16; in float32 and float64 the eager chunk works
    in place in one buffer (the compiled one would hold two), so it stays eager; nor without a
    gradient or under tensor parallelism (vocab_start)."""
    from trainer.model import loss as loss_module

    calls: list[str] = []
    real = loss_module._compiled
    monkeypatch.setattr(loss_module, "_compiled", lambda b: calls.append(b) or real(b))
    h, w, labels, _ = inputs(t=12, d=8, v=50, seed=2, dtype=dtype)
    h.requires_grad_()
    linear_cross_entropy(h, w, labels, None, 5, compile="eager")
    assert calls == (["eager"] if used else [])
    with torch.no_grad():
        linear_cross_entropy(h, w, labels, None, 5, compile="eager")
    linear_cross_entropy(h, w[:25], labels, None, 5, vocab_start=25, compile="eager")
    assert calls == (["eager"] if used else [])

    def member(comm):  # tensor parallelism's first process: its rows start at 0, still not whole
        hr = h.detach().clone().requires_grad_()
        return linear_cross_entropy(hr, w[comm.rank * 25 : (comm.rank + 1) * 25], labels, None, 5,
                                    comm.rank * 25, comm, compile="eager")  # fmt: skip

    run_threads(2, member, timeout=30)
    assert calls == (["eager"] if used else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_compiled_chunks_equal_float64(dtype) -> None:
    """Each chunk's arithmetic compiled by inductor (fused kernels; here the CPU's), chunks that
    do not divide the tokens, weights and ignored labels: loss and gradients within the dtype's
    rounding of the float64 reference of the same rounded inputs, and as close as eager's."""
    h, w, labels, weights = inputs(t=200, d=16, v=3001, seed=12)
    hd, wd, wt = h.to(dtype), w.to(dtype), weights.to(dtype)
    want = grads(lambda a, b: whole_logits_loss(a, b, labels, wt.double()), hd.double(),
                 wd.double())  # fmt: skip
    eager = grads(lambda a, b: linear_cross_entropy(a, b, labels, wt, 64), hd, wd)
    got = grads(lambda a, b: compiled_loss(a, b, labels, wt, 64, "inductor"), hd, wd)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for g, e, r in zip(got, eager, want):
        err = float((g.double() - r).norm() / r.norm())
        assert err < tol and err <= 2 * float((e.double() - r).norm() / r.norm()) + 1e-6, err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compile", [None, "inductor"])
def test_chunked_loss_cuda_equals_float64(dtype, compile) -> None:
    """On the GPU, in the compute dtype, with chunks that do not divide the tokens, eager and
    with each chunk's arithmetic compiled (inductor's Triton kernels): the loss and gradients
    equal the float64 whole-logits reference (3e-2 relative in bfloat16)."""
    h, w, labels, weights = inputs(t=1000, d=64, v=5003, seed=3)
    dev = torch.device("cuda")
    hd, wd = h.to(dev, dtype), w.to(dev, dtype)
    lab, wt = labels.to(dev), weights.to(dev, dtype)
    got = grads(lambda a, b: linear_cross_entropy(a, b, lab, wt, 333, compile=compile), hd, wd)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bfloat16 gradients: about 1e-2 on a CPU
    # inputs rounded to the dtype: the reference of the rounded inputs, in float64
    want = grads(
        lambda a, b: whole_logits_loss(a, b, labels, weights), hd.double().cpu(), wd.double().cpu()
    )
    for g, r in zip(got, want):
        g = g.double().cpu()
        assert (g - r).norm() <= tol * r.norm(), (dtype, float((g - r).norm() / r.norm()))


def test_no_label_and_no_grad() -> None:
    h, w, labels, _ = inputs()
    none = torch.full_like(labels, IGNORE_INDEX)
    assert float(linear_cross_entropy(h, w, none)) == 0.0
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, labels, chunk=4)
    torch.testing.assert_close(loss, whole_logits_loss(h, w, labels), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(h, w, labels[:-1])


@pytest.mark.parametrize("tied", [True, False])
def test_the_model_loss_equals_its_logits_cross_entropy(tied) -> None:
    """The decoder's loss (chunked) and every parameter's gradient equal F.cross_entropy over
    the logits the same model returns without labels (float64, tied and untied output)."""
    cfg = dataclasses.replace(get_config("debug"), n_layers=1, tie_embeddings=tied)
    model = build(cfg, dtype=F64)
    model.loss_chunk_tokens = 7
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (30,), generator=gen)
    pos = torch.cat([torch.arange(18), torch.arange(12)])
    labels = torch.cat([ids[1:], ids[:1]]).clone()
    labels[17] = labels[29] = IGNORE_INDEX
    wts = torch.rand(30, generator=gen, dtype=F64)

    def run(chunked: bool):
        model.zero_grad()
        if chunked:
            loss, n = model(ids, pos, [0, 18, 30], labels=labels, label_weights=wts)
        else:
            logits = model(ids, pos, [0, 18, 30])
            per = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
            loss, n = (per * wts).sum(), (labels != IGNORE_INDEX).sum()
        loss.backward()
        return loss.detach(), int(n), {k: p.grad.clone() for k, p in model.named_parameters()}

    got, want = run(True), run(False)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=0)
    assert got[1] == want[1] == 28
    for name, g in want[2].items():
        torch.testing.assert_close(got[2][name], g, rtol=1e-10, atol=1e-12, msg=name)


def test_vocabulary_parallel_through_two_threaded_processes() -> None:
    """Each of 2 processes holds half the vocabulary rows: the loss equals the whole one on
    both, dL/dh is whole on both, and each process's dL/dW is its rows of the whole one. Labels
    at both edges of each half (19 | 20: a label one past a process's rows is not its own)."""
    h, w, labels, weights = inputs(t=19, v=40, seed=4)
    labels[:4] = torch.tensor([19, 20, 0, 39])
    want = grads(lambda a, b: whole_logits_loss(a, b, labels, weights), h, w)

    def member(comm):
        rows = w[comm.rank * 20 : (comm.rank + 1) * 20]
        return grads(
            lambda a, b: linear_cross_entropy(a, b, labels, weights, 6, comm.rank * 20, comm),
            h,
            rows,
        )

    parts = run_threads(2, member, timeout=30)
    for rank, (loss, dh, dw) in enumerate(parts):
        torch.testing.assert_close(loss, want[0], rtol=1e-12, atol=0)
        torch.testing.assert_close(dh, want[1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dw, want[2][rank * 20 : (rank + 1) * 20], rtol=1e-12, atol=1e-12)


def test_bfloat16_close_to_the_float32_loss_of_whole_logits() -> None:
    """bfloat16 compute: the chunked loss (float32 log-sum-exp) is as close to the float64
    loss as cross-entropy over bfloat16 logits cast to float32 (the former computation)."""
    h, w, labels, _ = inputs(t=64, d=32, v=300, seed=7)
    exact = whole_logits_loss(h, w, labels)
    hb, wb = h.bfloat16(), w.bfloat16()
    old = F.cross_entropy((hb @ wb.t()).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    new = linear_cross_entropy(hb, wb, labels, chunk=16)
    assert new.dtype == torch.float32
    assert abs(float(new) - float(exact)) <= 2 * abs(float(old) - float(exact)) + 1e-3 * float(
        exact
    )


# (tokens, dtype) of the peak-memory check: the 16K tokens in float32, and a chunk of as
# many float64 logits (twice the bytes)
PEAK_CASES = [(16384, "float32"), (1024, "float64")]


@pytest.mark.slow
def test_peak_memory_at_16k_tokens_and_a_131072_vocabulary() -> None:
    """16,384 tokens at a 131,072 vocabulary, forward and backward in float32: whole float32
    logits alone would be 8 GiB (and their log-softmax as much again); the chunked loss stays
    under 4 GB of peak resident memory (a fresh process, its resident set before and after),
    and what it adds is what the memory model (ModelConfig.loss_bytes) says, within 25%; the
    same for 1,024 tokens in float64 (a 1 GiB chunk: their whole logits in float64). One process
    for both cases: the kernel's peak (VmHWM) is
    reset between them (`/proc/self/clear_refs`), the first case's tensors freed."""
    assert chunk_tokens(131072) == 2048
    code = textwrap.dedent(
        f"""
        import torch
        from trainer.model.loss import linear_cross_entropy
        def peak():  # this process's peak resident bytes (ru_maxrss would keep the forking
            # parent's peak: a test process that had grown larger would hide the loss's)
            line = [x for x in open("/proc/self/status") if x.startswith("VmHWM:")][0]
            return int(line.split()[1]) * 1024
        torch.set_num_threads(2)
        for tokens, dtype in {PEAK_CASES!r}:
            g = torch.Generator().manual_seed(0)
            h = torch.randn(tokens, 32, generator=g, dtype=getattr(torch, dtype))
            w = torch.randn(131072, 32, generator=g, dtype=getattr(torch, dtype)) * 0.1
            h.requires_grad_(), w.requires_grad_()
            labels = torch.randint(0, 131072, (tokens,), generator=g)
            with open("/proc/self/clear_refs", "w") as f:  # the peak from here on
                f.write("5")
            before = peak()
            loss = linear_cross_entropy(h, w, labels)
            loss.backward()
            after = peak()
            assert h.grad is not None and w.grad is not None and torch.isfinite(loss)
            print(before, after)
            del h, w, labels, loss
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=150, check=True
    )
    for (tokens, dtype), line in zip(PEAK_CASES, out.stdout.splitlines(), strict=True):
        before, after = (int(x) for x in line.split())
        added = after - before
        print(
            f"{tokens} {dtype}: peak resident {after / 1e9:.2f} GB, the loss added {added / 1e9:.2f} GB"
        )
        assert after < 4e9, f"{tokens} {dtype}: peak resident memory {after / 1e9:.2f} GB"
        assert added < 2e9, f"{tokens} {dtype}: the loss added {added / 1e9:.2f} GB"
        # the planner's memory model of the loss (datapipe.shapes.ModelConfig.loss_bytes)
        shape = dataclasses.replace(get_config("debug"), vocab_size=131072, dim=32)
        model = shape.loss_bytes(tokens, 4 if dtype == "float32" else 8)
        assert 0.75 * model < added < 1.25 * model, (tokens, dtype, added, model)


@pytest.mark.parametrize("chunk", [1, 6, None])
def test_token_losses_equal_whole_logits(chunk) -> None:
    """Evaluation's per-position losses and greedy hits, chunk by chunk, against whole logits;
    the same over two threaded vocabulary-parallel processes."""
    from trainer.model.loss import token_losses

    h, w, labels, _ = inputs(t=21, v=40, seed=9)
    logits = h @ w.t()
    some = (torch.arange(21) % 3 == 0) & (labels != IGNORE_INDEX)
    labels = torch.where(some, logits.argmax(-1), labels)  # some greedy hits, in both halves
    want = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    hits = (logits.argmax(-1) == labels) & (labels != IGNORE_INDEX)
    loss, correct = token_losses(h, w, labels, chunk)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(correct, hits) and 0 < int(hits.sum()) < 21 - int((labels < 0).sum())

    def member(comm):
        rows = w[comm.rank * 20 : (comm.rank + 1) * 20]
        return token_losses(h, rows, labels, chunk, comm.rank * 20, comm)

    for loss, correct in run_threads(2, member, timeout=30):
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
        assert torch.equal(correct, hits)


def test_bfloat16_gradients_accumulate_in_float32() -> None:
    """bfloat16 compute with several chunks: dL/dh and dL/dW (each chunk's share summed in
    float32) within bfloat16 rounding of the float64 gradients of the same rounded inputs."""
    h, w, labels, weights = inputs(t=96, d=32, v=300, seed=8)
    hb, wb = h.bfloat16(), w.bfloat16()
    want = grads(lambda a, b: whole_logits_loss(a, b, labels, weights), hb.double(), wb.double())
    got = grads(lambda a, b: linear_cross_entropy(a, b, labels, weights.bfloat16(), 16), hb, wb)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    for g, r in zip(got, want):
        err = float((g.double() - r).norm() / r.norm())
        assert err < 1e-2, err


@pytest.mark.parametrize("compile", [None, "inductor"])
def test_bfloat16_gradient_at_a_confident_label_is_rounded_once(compile) -> None:
    """A label whose softmax is 0.998: its logit's gradient, softmax - 1 = -0.0018, is computed in
    float32 and rounded to bfloat16 once (rounding the softmax first gives 1.0 - 1 = 0). With h the
    identity, dL/dW's column i is position i's logit gradient, so each label's entry is read
    directly and compared with the float64 gradient of the same rounded inputs."""
    t, v = 8, 300
    gen = torch.Generator().manual_seed(11)
    labels = torch.randint(0, v, (t,), generator=gen)
    w = torch.randn(v, t, generator=gen) * 0.01
    w[labels, torch.arange(t)] = 12.0  # logit 12 at the label, about 0 elsewhere: softmax 0.998
    hb, wb = torch.eye(t, dtype=torch.bfloat16), w.bfloat16()
    want = grads(lambda a, b: whole_logits_loss(a, b, labels), hb.double(), wb.double())[2]
    got = grads(lambda a, b: linear_cross_entropy(a, b, labels, None, 3, compile=compile), hb, wb)[
        2
    ]
    at, ref = got[labels, torch.arange(t)].double(), want[labels, torch.arange(t)]
    assert bool((ref < -1e-3).all()), ref
    torch.testing.assert_close(at, ref, rtol=2**-7, atol=0.0)


@pytest.mark.parametrize("compile", [None, "eager"])
def test_large_logits_stay_finite(compile) -> None:
    """Logits in the hundreds (float32 exp overflows past 88): the loss, its gradients and
    evaluation's per-position losses equal whole-logits cross-entropy of the same float32
    inputs, computed in float64."""
    from trainer.model.loss import token_losses

    h, w, labels, weights = inputs(t=16, d=8, v=37, seed=4, dtype=torch.float32)
    h = h * 30
    assert float((h @ w.t()).abs().max()) > 200
    want = grads(lambda a, b: whole_logits_loss(a, b, labels, weights.double()), h.double(),
                 w.double())  # fmt: skip
    got = grads(lambda a, b: compiled_loss(a, b, labels, weights, 5, compile), h, w)
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-4)
    per = F.cross_entropy(h.double() @ w.double().t(), labels, ignore_index=IGNORE_INDEX,
                          reduction="none")  # fmt: skip
    torch.testing.assert_close(token_losses(h, w, labels, 5)[0].double(), per, rtol=1e-5, atol=1e-4)


def test_gradient_of_the_output_layer_alone() -> None:
    """A frozen trunk: h needs no gradient, w does; w's gradient equals the reference's."""
    h, w, labels, weights = inputs(seed=5)
    wr = w.clone().requires_grad_()
    (whole_logits_loss(h, wr, labels, weights) * 1.7).backward()
    wg = w.clone().requires_grad_()
    (linear_cross_entropy(h, wg, labels, weights, 4) * 1.7).backward()
    torch.testing.assert_close(wg.grad, wr.grad, rtol=1e-12, atol=1e-12)


def test_bfloat16_dw_sums_its_chunks_in_float32() -> None:
    """1,024 chunks of one identical bfloat16 row: each chunk's share of dL/dW is the same
    bfloat16 tensor, and their float32 sum is exactly 1,024 times it (summed in bfloat16,
    small shares are lost once the sum has grown)."""
    h, w, labels, _ = inputs(t=1, d=32, v=300, seed=6)
    labels[0] = 7
    hb, wb = h.bfloat16(), w.bfloat16()
    one = grads(lambda a, b: linear_cross_entropy(a, b, labels, None, 1), hb, wb)[2]
    many = grads(lambda a, b: linear_cross_entropy(a, b, labels.repeat(1024), None, 1),
                 hb.repeat(1024, 1), wb)[2]  # fmt: skip
    assert torch.equal(many, one * 1024)


def test_token_losses_vocabulary_parallel_labels_at_the_edges_of_each_share() -> None:
    """Two threaded processes each holding 20 of 40 vocabulary rows: a label at the first or
    last row of either share (0, 19 | 20, 39) counts on its owner only, so every position's
    loss equals float64 F.cross_entropy over the whole logits and each greedy hit is
    (argmax == label), on both processes."""
    from trainer.model.loss import token_losses

    h, w, _, _ = inputs(t=12, v=40, seed=11)
    labels = torch.tensor([19, 20, 0, 39, 20, 19, IGNORE_INDEX, 39, 0, 21, 18, 20])
    logits = h @ w.t()
    want = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    hits = (logits.argmax(-1) == labels) & (labels != IGNORE_INDEX)

    def member(comm):
        rows = w[comm.rank * 20 : (comm.rank + 1) * 20]
        return token_losses(h, rows, labels, 5, comm.rank * 20, comm)

    for loss, correct in run_threads(2, member, timeout=30):
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
        assert torch.equal(correct, hits)


def test_token_losses_greedy_tie_across_processes_is_the_first_row() -> None:
    """Vocabulary rows 3 (process 0's) and 25 (process 1's) are equal and give every position
    its largest logit (integer values: the tie is exact): the greedy prediction is row 3, the
    first of the tied rows, as argmax over the whole logits takes it, on one process and on
    two threaded vocabulary-parallel processes alike."""
    from trainer.model.loss import token_losses

    gen = torch.Generator().manual_seed(12)
    h = torch.randint(1, 4, (10, 6), generator=gen).to(F64)
    w = torch.randint(-1, 2, (40, 6), generator=gen).to(F64)
    w[3] = w[25] = 5.0
    labels = torch.tensor([3, 25, 3, 25, 3, 25, 7, 3, IGNORE_INDEX, 25])
    logits = h @ w.t()
    assert torch.equal(logits[:, 3], logits[:, 25]) and bool((logits.argmax(-1) == 3).all())
    want = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    hits = labels == 3

    def member(comm):
        rows = w[comm.rank * 20 : (comm.rank + 1) * 20]
        return token_losses(h, rows, labels, 4, comm.rank * 20, comm)

    for loss, correct in [token_losses(h, w, labels, 4), *run_threads(2, member, timeout=30)]:
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
        assert torch.equal(correct, hits)
