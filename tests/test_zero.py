"""The sharded optimizer (trainer.parallel.zero) against torch.optim.AdamW on the whole model, its memory
against datapipe.plan.memory's formula, and resharding of its state through DCP."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dcp_join import detached, save_as_ranks
from _zero_worker import (
    CLIP,
    LR,
    MICROBATCHES,
    WD,
    assert_params_close,
    fresh_net,
    gloo_main,
    reference,
    run_zero,
)

from datapipe.plan.memory import model_state_bytes
from trainer.parallel.comm import Done, free_port, spawn
from trainer.parallel.zero import ZeroOptimizer
from trainer.testing.threads import run_threads

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


class _Rank:
    """Rank and size only: enough to build an optimizer that loads or reports memory."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def _zero(net, comm, level, **kw) -> ZeroOptimizer:
    return ZeroOptimizer(
        list(net.parameters()), comm, level=level, lr=LR, weight_decay=WD, bucket_bytes=8 * 40, **kw
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("level", [0, 1, 2])
@pytest.mark.parametrize("hooks", [False, True])
@pytest.mark.parametrize("clip", [0.0, CLIP])
def test_sharded_adamw_equals_torch_adamw(ranks, level, hooks, clip):
    """Unequal micro-batch counts (an idle rank at 3), a branch one rank skips in its last
    micro-batch, with hooks a parameter whose gradient is final last but whose bucket launches
    first: parameters after every step and the norms equal torch's (float64, 1e-12)."""
    steps = 3

    def run(comm):
        return run_zero(comm, level, hooks, clip, range(steps), fresh_net(odd=hooks))

    out = run_threads(ranks, run, timeout=50)
    want, want_norms = reference([ranks] * steps, clip, odd=hooks)
    if clip:
        assert all(n > clip for n in want_norms), "clipping must be active"
    for res in out:
        assert_params_close(res["net"], want)
        for a, b in zip(res["norms"], want_norms):
            assert abs(a - b) <= 1e-12 * b
    # every rank issued the same sequence of bucket reductions
    assert all(r["launched"] == out[0]["launched"] for r in out)


def test_buckets_launch_while_the_last_backward_runs():
    """With hooks, reductions of the late layers are in flight before the first layer's gradient
    is final (communication overlaps the rest of the backward), in the same order on all ranks;
    one micro-batch that uses every parameter launches every bucket during the backward (a
    parameter spanning buckets releases each of them)."""

    def run(comm):
        net = fresh_net()
        zero = _zero(net, comm, 1)
        seen = []  # a probe that runs just before the optimizer's own hook on w1
        net.w1.register_post_accumulate_grad_hook(lambda p: seen.append(len(zero._handles)))
        zero.install_hooks()
        zero.begin_step()
        zero.begin_microbatch(last=True)
        from _zero_worker import batch

        net(batch(0, comm.rank, 0), True).backward()
        zero.finish_backward()
        order = [b for b, _ in zero._handles]
        zero.step()
        return seen[0], order, len(zero.buckets), zero.last_reduce

    out = run_threads(2, run, timeout=30)
    for in_flight, order, n, stats in out:
        assert 0 < in_flight < n
        assert order == list(range(n))
        assert stats.buckets == n and stats.early == n


def test_an_optimizer_with_hooks_is_freed_with_its_model():
    """A model's grad hooks do not keep its optimizer alive: a second executor in one process
    (eval after training, a benchmark's next case) does not inherit the first one's memory."""
    import gc
    import weakref

    from trainer.parallel.comm import SoloComm

    net = fresh_net()
    zero = _zero(net, SoloComm(), 0)
    zero.install_hooks()
    gone = weakref.ref(zero)
    del zero, net
    gc.collect()
    assert gone() is None


class _InstantComm:
    """Rank 0 of 2 whose collectives complete at once (and do nothing): memory bookkeeping."""

    rank, size = 0, 2

    def all_reduce(self, tensor, async_op=False):
        return Done() if async_op else None

    def reduce_scatter(self, flat, out, sizes=None, async_op=False):
        return Done() if async_op else None

    def all_gather_into(self, flat, sizes=None, async_op=False):
        return Done() if async_op else None


class _LateGatherComm(_InstantComm):
    """Rank 0 of 2 whose weight all-gather delivers rank 1's slice (all 7.0) only when its
    handle is waited for, as an asynchronous collective does; reductions complete at once."""

    def all_gather_into(self, flat, sizes=None, async_op=False):
        from trainer.parallel.comm import chunk_offsets

        offs = chunk_offsets(flat.numel(), self.size, sizes)

        def deliver() -> None:
            flat[offs[1] : offs[2]].fill_(7.0)

        late = SimpleNamespace(wait=deliver)
        if async_op:
            return late
        late.wait()
        return None


@pytest.mark.parametrize("async_gather", [False, True])
def test_step_returns_with_the_weights_gathered(async_gather):
    """Without async_gather, step() returns with every rank's slice of the weights in place
    (rank 1's half holds what its gather delivers); with it, they arrive at wait_weights()."""
    from trainer.parallel.slices import FlatLayout

    p = torch.nn.Parameter(torch.zeros(40, dtype=torch.float64))
    comm = _LateGatherComm()
    zero = ZeroOptimizer(
        [p], comm, level=1, lr=0.1, layout=FlatLayout([(40,)], 2, 4), async_gather=async_gather
    )
    assert zero.layout.slice(1) == (20, 40)
    zero.begin_step()
    p.grad = torch.ones(40, dtype=torch.float64)
    zero.accumulate_grads()
    zero.finish_backward()
    zero.step()
    assert torch.all(p.detach()[:20] < 0)  # this rank's slice stepped against the gradient
    want = torch.full((20,), 7.0, dtype=torch.float64)
    assert torch.equal(
        p.detach()[20:], torch.zeros(20, dtype=torch.float64) if async_gather else want
    )
    zero.wait_weights()
    assert torch.equal(p.detach()[20:], want)


def test_zero2_frees_sent_buckets_during_the_backward():
    """zero 2, one micro-batch: a non-owned bucket lives from its first gradient until its
    reduction has completed, so the gradient memory never reaches the whole model."""
    from _zero_worker import batch

    net = fresh_net()
    zero = _zero(net, _InstantComm(), 2)
    zero.install_hooks()
    zero.begin_step()
    zero.begin_microbatch(last=True)
    net(batch(0, 0, 0), True).backward()
    zero.finish_backward()
    zero.step()
    numel = sum(p.numel() for p in net.parameters())
    mem = zero.memory()
    assert mem.grads == zero.grad.numel() * 8  # between steps: this rank's slice only
    bucket = max(b.numel for b in zero.buckets)
    assert mem.grads_peak <= mem.grads + 2 * bucket * 8 < numel * 8


@pytest.mark.parametrize("compute", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("level", [0, 1, 2])
def test_memory_equals_the_formula(compute, ranks, level):
    dtype = getattr(torch, compute)

    def run(comm):
        net = fresh_net().to(dtype)
        zero = _zero(net, comm, level)
        res = run_zero(comm, level, True, 0.0, range(1), net, zero)
        return res["zero"].memory(), MICROBATCHES[ranks][comm.rank]

    numel = sum(p.numel() for p in fresh_net().parameters())
    for rank, (got, count) in enumerate(run_threads(ranks, run, timeout=30)):
        want = model_state_bytes(numel, ranks, level, compute, align=64, rank=rank)
        assert (got.weights, got.master, got.moments, got.grads) == (
            want.weights,
            want.master,
            want.moments,
            want.grads,
        )
        if level < 2 or count >= 2:  # a rank accumulating >= 2 micro-batches holds everything
            assert got.grads_peak == want.grads_peak
        else:
            assert got.grads_peak <= want.grads_peak


def test_memory_formula_by_hand():
    # 1000 parameters, 4 ranks, align 64: S = 256, slices 256, 256, 256, 232
    z1 = model_state_bytes(1000, 4, 1, "bfloat16", align=64, rank=3)
    assert (z1.weights, z1.master, z1.moments, z1.grads) == (2048, 928, 1856, 4096)
    z2 = model_state_bytes(1000, 4, 2, "bfloat16", align=64, rank=0)
    assert (z2.grads, z2.grads_peak, z2.optimizer) == (1024, 4000, 1024 + 2048)
    z0 = model_state_bytes(1000, 4, 0, "float32", align=64)
    assert (z0.weights, z0.master, z0.moments, z0.grads) == (4096, 0, 8000, 4096)
    # 7B in bfloat16 on 8 ranks: optimizer state 12 bytes / parameter / 8 instead of 12
    p = 7_000_000_000
    rep = model_state_bytes(p, 8, 0, "bfloat16")
    sh = model_state_bytes(p, 8, 1, "bfloat16")
    assert rep.optimizer == 4 * p + 8 * p
    assert abs(sh.optimizer - 12 * p / 8) < 12 * 64


def test_bfloat16_levels_agree():
    """bfloat16 compute with float32 master slices: zero 1 and 2 equal zero 0."""

    def run(comm, level):
        net = fresh_net().to(torch.bfloat16)
        master = fresh_net().to(torch.float32)
        zero = _zero(net, comm, level, master_params=list(master.parameters()))
        assert zero.master.dtype == torch.float32
        res = run_zero(comm, level, True, CLIP, range(3), net, zero)
        return torch.cat([p.detach().float().reshape(-1) for p in res["net"].parameters()])

    base = run_threads(3, lambda c: run(c, 0), timeout=30)[0]
    for level in (1, 2):
        for got in run_threads(3, lambda c, lv=level: run(c, lv), timeout=30):
            torch.testing.assert_close(got, base, rtol=1e-6, atol=1e-6)


def test_bfloat16_master_weights_are_restored():
    """bfloat16 compute: the float32 master slice is state (the bf16 weights only its rounding).
    2 steps, the optimizer's state loaded into a fresh one whose master holds the initial
    weights, 2 more steps: the weights equal 4 uninterrupted steps' (zero 1 on 2 ranks)."""

    def bf16_zero(comm, net):
        master = fresh_net().to(torch.float32)  # the initial weights
        return _zero(net, comm, 1, master_params=list(master.parameters()))

    def weights(net):
        return torch.cat([p.detach().float().reshape(-1) for p in net.parameters()])

    def straight(comm):
        net = fresh_net().to(torch.bfloat16)
        return weights(run_zero(comm, 1, True, 0.0, range(4), net, bf16_zero(comm, net))["net"])

    def resumed(comm):
        net = fresh_net().to(torch.bfloat16)
        first = run_zero(comm, 1, True, 0.0, range(2), net, bf16_zero(comm, net))
        sd, net_state = detached(first["zero"].state_dict()), _copy_state(first["net"])
        first["zero"].remove_hooks()
        net2 = fresh_net().to(torch.bfloat16)
        net2.load_state_dict(net_state)
        zero = bf16_zero(comm, net2)
        zero.load_state_dict(sd)
        return weights(run_zero(comm, 1, True, 0.0, range(2, 4), net2, zero)["net"])

    want = run_threads(2, straight, timeout=30)
    got = run_threads(2, resumed, timeout=30)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert not torch.equal(want[0], weights(fresh_net().to(torch.bfloat16)))


def _copy_state(net) -> dict:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("clip", [0.5, 50.0])
def test_clipping_only_scales_down(clip):
    """grad_clip against torch's clip_grad_norm_ + AdamW (which never scale a gradient up), a
    clip below and one above the gradient's norm; eps 1 so that AdamW's step depends on the
    gradient's scale (a scaled-up gradient would show)."""
    gen = torch.Generator().manual_seed(5)
    w0 = torch.randn(7, 3, generator=gen, dtype=torch.float64)
    g = torch.randn(7, 3, generator=gen, dtype=torch.float64)
    assert 0.5 < float(g.norm()) < 50.0

    def ours(comm):
        p = torch.nn.Parameter(w0.clone())
        zero = ZeroOptimizer([p], comm, level=0, lr=0.1, eps=1.0, weight_decay=0.0, grad_clip=clip)
        zero.begin_step()
        p.grad = g.clone()
        zero.accumulate_grads()
        zero.finish_backward()
        norm = zero.step()
        return p.detach().clone(), norm

    ((got, norm),) = run_threads(1, ours, timeout=30)
    ref = torch.nn.Parameter(w0.clone())
    ref.grad = g.clone()
    want_norm = float(torch.nn.utils.clip_grad_norm_([ref], clip))
    torch.optim.AdamW([ref], lr=0.1, eps=1.0, weight_decay=0.0).step()
    assert norm == pytest.approx(want_norm, rel=1e-12)
    torch.testing.assert_close(got, ref.detach(), rtol=1e-12, atol=1e-14)


# --- checkpoints: resharding through DCP ---------------------------------------------------------


def _flat_state(zero) -> dict:
    """The rank's optimizer state as its flat slices (what the checkpoint must restore)."""
    return {
        "exp_avg": zero.exp_avg.clone(),
        "exp_avg_sq": zero.exp_avg_sq.clone(),
        "step": zero.optimizer.state[zero.master]["step"].clone(),
    }


def _load_rank(path: str, net, rank: int, size: int, level: int) -> tuple[dict, dict]:
    zero = _zero(net, _Rank(rank, size), level)
    sd = zero.state_dict()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(sd, checkpoint_id=path)
    zero.load_state_dict(sd)
    return detached(sd), _flat_state(zero)


def _cat(flats: list[dict], key: str) -> torch.Tensor:
    return torch.cat([f[key] for f in flats])


@pytest.mark.timeout(60)
def test_state_reshards_4_to_2_to_1(tmp_path):
    """State of zero 1 on 4 ranks saved by DCP (by parameter, from each rank's slice) loads on
    2 ranks (zero 2), whose state loads on 1 (zero 0); training continues exactly like the
    uninterrupted run."""

    def first(comm):
        res = run_zero(comm, 1, True, CLIP, range(2))
        z = res["zero"]
        return detached(z.state_dict()), res["net"].state_dict(), _flat_state(z)

    out4 = run_threads(4, first, timeout=30)
    net_state = {k: v.clone() for k, v in out4[0][1].items()}
    save_as_ranks(str(tmp_path / "c4"), [sd for sd, _, _ in out4])

    loaded2 = [_load_rank(str(tmp_path / "c4"), fresh_net(), r, 2, 2) for r in range(2)]
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(_cat([f for _, f in loaded2], key), _cat([f for *_, f in out4], key))
    assert float(loaded2[0][1]["step"]) == 2.0

    def second(comm):
        net = fresh_net()
        net.load_state_dict(net_state)
        zero = _zero(net, comm, 2, grad_clip=CLIP)
        zero.load_state_dict(loaded2[comm.rank][0])
        res = run_zero(comm, 2, True, CLIP, range(2, 4), net, zero)
        z = res["zero"]
        return detached(z.state_dict()), res["net"].state_dict(), _flat_state(z)

    out2 = run_threads(2, second, timeout=30)
    want, _ = reference([4, 4, 2, 2], CLIP)
    net2 = fresh_net()
    net2.load_state_dict(out2[0][1])
    assert_params_close(net2, want)
    save_as_ranks(str(tmp_path / "c2"), [sd for sd, _, _ in out2])

    net1 = fresh_net()
    net1.load_state_dict(out2[0][1])
    loaded1, flat1 = _load_rank(str(tmp_path / "c2"), fresh_net(), 0, 1, 0)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(flat1[key], _cat([f for *_, f in out2], key))

    def third(comm):
        zero = _zero(net1, comm, 0, grad_clip=CLIP)
        zero.load_state_dict(loaded1)
        return run_zero(comm, 0, False, CLIP, range(4, 5), net1, zero)["net"]

    (done,) = run_threads(1, third, timeout=30)
    want, _ = reference([4, 4, 2, 2, 1], CLIP)
    assert_params_close(done, want)


def test_load_refuses_other_keys():
    zero = _zero(fresh_net(), _Rank(0, 2), 1)
    with pytest.raises(ValueError, match="keys"):
        zero.load_state_dict({"exp_avg": torch.zeros(3)})


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    from _train_worker import make_dataset

    return make_dataset(str(tmp_path_factory.mktemp("data") / "ds"))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_gloo_collectives_zero_and_resharded_resume(tmp_path, dataset):
    """4 gloo processes: slice collectives (sync and async, equal/uneven/empty chunks, per-chunk
    and gloo's own reduce-scatter/all-gather) against a plain sum; zero 1 with hooks against
    torch AdamW; a real DCP save on 4 ranks resumed on 2 (zero 1) and on 1 (zero 0) equal to the
    uninterrupted reference. Then the executor on hdp plans with unequal micro-batch counts and
    rings: zero 1 and 2 equal zero 0 and the single-process reference (float64, clipping active;
    bfloat16 within the bound); the Trainer at zero 1 on 4 ranks resumed on 2 and on 1 (zero 0)
    equals the straight run; its metrics report the formula's bytes."""
    import json

    from datapipe.shapes import get_config

    spawn(gloo_main, 4, (4, free_port(), str(tmp_path), dataset), timeout=390)
    assert (tmp_path / "ok.txt").read_text() == "ok\n"
    lines = (tmp_path / "levels.txt").read_text().splitlines()
    assert [x.split(":")[0] for x in lines] == [
        "zero 0 clip", "zero 1 clip", "zero 2 clip", "zero 1 bf16 vs single",
        "resume on 2 ranks", "resume on 1 rank",
    ]  # fmt: skip
    numel = get_config("debug", dim=32, ffn_dim=64).num_params()
    want = model_state_bytes(numel, 4, 1, "float64")
    recs = [json.loads(x) for x in open(tmp_path / "straight" / "metrics.jsonl")]
    assert len(recs) == 6
    for r in recs:
        got = (r["mem_weights_bytes"], r["mem_master_bytes"], r["mem_moments_bytes"],
               r["mem_grads_bytes"], r["mem_grads_peak_bytes"])  # fmt: skip
        assert got == (want.weights, want.master, want.moments, want.grads, want.grads_peak)
        assert 0.0 <= r["grad_comm_hidden"] <= 1.0 and r["grad_comm_wait_s"] >= 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", [0, 1, 2])
@pytest.mark.parametrize("hooks", [False, True])
def test_a_parameter_unused_after_a_step_that_used_it_has_a_zero_gradient(level, hooks):
    """The buffer is not zeroed between steps (a step's first gradient is copied in): a
    parameter whose gradient every rank had in step 1 and none has in step 2 reduces to exactly
    zero in step 2, the others to their sum over the ranks times the scale (2 threaded ranks,
    float64, two micro-batches a step)."""
    a_grads = [[torch.full((5,), 1.0 + r + 10 * s) for r in range(2)] for s in range(2)]

    def run(comm):
        a = torch.zeros(5, dtype=torch.float64, requires_grad=True)
        b = torch.zeros(3, dtype=torch.float64, requires_grad=True)
        zero = ZeroOptimizer([a, b], comm, level=level, lr=0.0, bucket_bytes=8 * 4)
        if hooks:
            zero.install_hooks()
        out = []
        for step in range(2):
            zero.begin_step()
            for mb in range(2):
                zero.begin_microbatch(last=mb == 1)
                ga = a_grads[step][comm.rank].double()
                loss = (a * ga).sum() + ((b * 7.0).sum() if step == 0 else 0.0)
                loss.backward()
                if not hooks:
                    zero.accumulate_grads()
            zero.finish_backward()
            zero.reduce(0.5)
            out.append(zero.gather_grad().clone())
            zero.apply(0.0)
        return out

    for got in run_threads(2, run, timeout=40):
        for step in range(2):
            want_a = 0.5 * 2 * sum(g.double() for g in a_grads[step])  # 2 micro-batches each
            want_b = torch.full((3,), 0.5 * 2 * 2 * 7.0 if step == 0 else 0.0, dtype=torch.float64)
            torch.testing.assert_close(got[step][:5], want_a, rtol=1e-15, atol=0)
            torch.testing.assert_close(got[step][5:8], want_b, rtol=1e-15, atol=0)
