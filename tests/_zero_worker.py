"""Shared scenario of tests/test_zero.py and its gloo worker: a small float64 network trained by
ZeroOptimizer on ranks with unequal micro-batch counts, against torch.optim.AdamW on the whole
model fed the sum of every rank's micro-batch gradients (the reference)."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from trainer.parallel.comm import Communicator, TorchComm, init_local_gloo
from trainer.parallel.zero import ZeroOptimizer

LR, WD, SCALE = 2e-2, 0.1, 0.25
CLIP = 0.05  # below the scenario's gradient norms (~0.2-2): clipping is active
# micro-batches per rank, by island size: unequal, and an idle rank from 3 ranks on
MICROBATCHES = {1: [3], 2: [2, 1], 3: [2, 1, 0], 4: [2, 1, 0, 3]}


class Net(nn.Module):
    """Layers of odd sizes (slices cut through parameters) and a branch that one rank's last
    micro-batch skips (its hooks never fire there, so readiness differs across ranks). `odd`
    adds an input scale registered last but used first: its gradient is final last, so its
    bucket (first in launch order) holds every launch back until the end of the backward."""

    def __init__(self, seed: int = 0, odd: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3)

        self.w1, self.b1 = w(13, 7), w(13)
        self.wb = w(13, 13)
        self.w2, self.b2 = w(5, 13), w(5)
        self.scale = w(7) if odd else None

    def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
        x = x.to(self.w1.dtype)
        if self.scale is not None:
            x = x * self.scale
        h = torch.tanh(x @ self.w1.T + self.b1)
        if branch:
            h = h + torch.tanh(h @ self.wb.T)
        return (h @ self.w2.T + self.b2).pow(2).sum()


NETS = {False: Net(), True: Net(odd=True)}  # built once: threads must not share the global RNG


def fresh_net(odd: bool = False) -> Net:
    return copy.deepcopy(NETS[odd])


def batch(step: int, rank: int, mb: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + mb)
    return torch.randn(4, 7, generator=g, dtype=torch.float64)


def branch_used(rank: int, mb: int, count: int) -> bool:
    return not (rank == 0 and mb == count - 1)


def run_zero(
    comm: Communicator,
    level: int,
    hooks: bool,
    clip: float,
    steps: range,
    net: Net | None = None,
    zero: ZeroOptimizer | None = None,
    bucket_bytes: int = 8 * 40,
) -> dict:
    """Train `steps` (global step numbers, for the data) on this rank; returns the network, the
    optimizer, the norms and the bucket launch sequence."""
    net = net if net is not None else fresh_net()
    if zero is None:
        zero = ZeroOptimizer(
            list(net.parameters()),
            comm,
            level=level,
            lr=LR,
            weight_decay=WD,
            grad_clip=clip,
            bucket_bytes=bucket_bytes,
        )
    if hooks:
        zero.install_hooks()
    counts = MICROBATCHES[comm.size]
    norms, launched = [], []
    for step in steps:
        zero.begin_step()
        k = counts[comm.rank]
        for j in range(k):
            zero.begin_microbatch(last=j == k - 1)
            net(batch(step, comm.rank, j), branch_used(comm.rank, j, k)).backward()
            if not hooks:
                zero.accumulate_grads()
        zero.finish_backward()
        launched.append([b for b, _ in zero._handles])
        norms.append(zero.step(scale=SCALE))
    return {"net": net, "zero": zero, "norms": norms, "launched": launched}


def reference(ranks_per_step: list[int], clip: float, odd: bool = False) -> tuple[Net, list[float]]:
    """torch.optim.AdamW on the whole network: each step's gradient is the sum over every
    rank's micro-batches (same data as run_zero), scaled, clipped by clip_grad_norm_."""
    net = fresh_net(odd)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for step, size in enumerate(ranks_per_step):
        counts = MICROBATCHES[size]
        for r in range(size):
            for j in range(counts[r]):
                net(batch(step, r, j), branch_used(r, j, counts[r])).backward()
        for p in net.parameters():
            p.grad.mul_(SCALE)
        if clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
        else:
            norms.append(
                float(
                    torch.linalg.vector_norm(
                        torch.cat([p.grad.reshape(-1) for p in net.parameters()])
                    )
                )
            )
        opt.step()
        opt.zero_grad()
    return net, norms


def assert_params_close(got: nn.Module, want: nn.Module, rtol: float = 1e-12) -> None:
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        a, b = a.detach(), b.detach()
        err = float(((a - b).abs() / b.abs().clamp_min(1e-3)).max())
        assert err <= rtol, f"{name}: off by {err:.3g} (relative)"


# --- gloo worker ---------------------------------------------------------------------------------


def gloo_main(rank: int, world: int, port: int, out_dir: str, data_dir: str) -> None:
    """4 processes: the slice collectives against a plain sum; zero 1 with hooks on 4 ranks (two
    steps) against torch AdamW; a DCP save of its sharded state; resume on 2 ranks (zero 1, two
    more steps) and on 1 rank (zero 0, one more step) against the reference run straight; then
    the executor at zero 0 / 1 / 2 (executor_levels) and the Trainer resumed on fewer ranks
    (trainer_resume)."""
    from test_slices import SIZES, _check_chunk_results, _chunk_run

    init_local_gloo(rank, world, port, timeout_s=90)
    torch.set_num_threads(1)
    try:
        comm = TorchComm()
        for native in (False, True):  # per-chunk reduce/broadcast (gloo's default) and native
            for async_op in (False, True):
                got = _chunk_run(TorchComm(native=native), SIZES[world], async_op)
                _check_chunk_results(world, SIZES[world], [got])
        ckpt = os.path.join(out_dir, "ckpt")
        first = run_zero(comm, 1, True, CLIP, range(2))
        want, want_norms = reference([4, 4], CLIP)
        assert_params_close(first["net"], want)
        assert all(abs(a - b) <= 1e-12 * b for a, b in zip(first["norms"], want_norms))
        dcp.save(first["zero"].state_dict(), checkpoint_id=ckpt)
        net_state = {k: v.clone() for k, v in first["net"].state_dict().items()}
        pair = dist.new_group([0, 1])
        solo = dist.new_group([0])
        if rank < 2:
            net = fresh_net()
            net.load_state_dict(net_state)
            zero = ZeroOptimizer(
                list(net.parameters()), TorchComm(pair), level=1, lr=LR, weight_decay=WD,
                grad_clip=CLIP, bucket_bytes=8 * 40,
            )  # fmt: skip
            sd = zero.state_dict()
            dcp.load(sd, checkpoint_id=ckpt, process_group=pair)
            zero.load_state_dict(sd)
            second = run_zero(TorchComm(pair), 1, True, CLIP, range(2, 4), net, zero)
            want, _ = reference([4, 4, 2, 2], CLIP)
            assert_params_close(second["net"], want)
        dist.barrier()
        if rank == 0:
            net = fresh_net()
            net.load_state_dict(net_state)
            solo_comm = TorchComm(solo)
            zero = ZeroOptimizer(
                list(net.parameters()), solo_comm, level=0, lr=LR, weight_decay=WD,
                grad_clip=CLIP, bucket_bytes=8 * 40,
            )  # fmt: skip
            sd = zero.state_dict()
            dcp.load(sd, checkpoint_id=ckpt, process_group=solo)
            zero.load_state_dict(sd)
            third = run_zero(solo_comm, 0, False, CLIP, range(2, 3), net, zero)
            want, _ = reference([4, 4, 1], CLIP)
            assert_params_close(third["net"], want)
            with open(os.path.join(out_dir, "ok.txt"), "w") as f:
                f.write("ok\n")
        dist.barrier()
        lines = executor_levels(comm, TorchComm(dist.new_group(list(range(world)))))
        lines += trainer_resume(data_dir, out_dir)
        if rank == 0:
            with open(os.path.join(out_dir, "levels.txt"), "w") as f:
                f.write("\n".join(lines) + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()


# --- the executor at every level, and the Trainer resumed on fewer ranks ---------------------------

EXEC_CLIP = 0.3  # below every step's gradient norm of the scenario: clipping acts


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def executor_levels(comm: Communicator, grad_comm: Communicator) -> list[str]:
    """hdp plans with unequal micro-batch counts and rings at zero 0 / 1 / 2 (float64, clipping
    active; zero 2 also without), and zero 1 in bfloat16: zero 1 and 2 equal zero 0 (1e-12 on
    every step's reduced gradient, 1e-9 on the loss curve), and every run equals the
    single-process reference (compare(): the executor's exactness bounds). Rank 0 asserts."""
    from _train_worker import ZERO_LENGTHS, compare, run_policy

    from trainer.parallel.comm import SoloComm

    f64, out = torch.float64, []

    def run(level: int, clip: float, dtype: torch.dtype = f64) -> dict:
        return run_policy(comm, "hdp", dtype, zero=level, clip=clip, grad_comm=grad_comm,
                          all_grads=dtype == f64, lengths=ZERO_LENGTHS)  # fmt: skip

    levels = {z: run(z, EXEC_CLIP) for z in (0, 1, 2)}
    unclipped = run(2, 0.0)
    bf16 = run(1, 1.0, torch.bfloat16)
    if comm.rank == 0:
        single = {
            clip: run_policy(SoloComm(), "single", f64, clip=clip, all_grads=True,
                             lengths=ZERO_LENGTHS)
            for clip in (EXEC_CLIP, 0.0)
        }  # fmt: skip
        assert all(n > EXEC_CLIP for n in single[EXEC_CLIP]["grad_norms"]), "clipping must act"
        assert levels[0]["microbatches"] == [3, 3, 3, 2], levels[0]["microbatches"]
        base = levels[0]
        for z, got in levels.items():
            compare(single[EXEC_CLIP], got, f64)
            grad = max(_rel(a, b) for a, b in zip(got["grads"], base["grads"]))
            loss = max(abs(a - b) / b for a, b in zip(got["losses"], base["losses"]))
            assert grad <= 1e-12 and loss <= 1e-9, (z, grad, loss)
            out.append(f"zero {z} clip: grads vs zero 0 {grad:.3e}, losses {loss:.3e}")
        compare(single[0.0], unclipped, f64)
        bf_ref = run_policy(SoloComm(), "single", torch.bfloat16, lengths=ZERO_LENGTHS)
        compare(bf_ref, bf16, torch.bfloat16)
        out.append(
            f"zero 1 bf16 vs single: {float((bf16['grad'] - bf_ref['grad']).norm() / bf_ref['grad'].norm()):.3e}"
        )
    return out


def _trained(cfg, rt) -> tuple[list[float], torch.Tensor]:
    from trainer.trainer import Trainer

    with Trainer(cfg, rt) as t:
        summary = t.train()
        t.zero.wait_weights()
        return summary["losses"], t.zero.flat_params[: t.zero.layout.numel].clone()


def trainer_resume(data_dir: str, out_dir: str) -> list[str]:
    """The Trainer in float64 at zero 1 on 4 ranks (capacity 128): straight for 6 steps, and
    stopped after 3; its checkpoint resumed on 2 ranks (zero 1, capacity 256) and on 1 rank
    (zero 0, single policy, capacity 512): loss curves within 1e-9 and final weights within 1e-9
    of the straight run (HDP plans of 4, 2 and 1 ranks compute the same step)."""
    from _train_worker import train_config

    from trainer.parallel.comm import SoloComm
    from trainer.parallel.runtime import Runtime, setup_runtime

    rank = dist.get_rank()
    rt4 = setup_runtime("cpu")
    f64 = {"dtype": "float64"}

    def cfg(name: str, capacity: int, zero: int, **sections: dict):
        parallel = {"capacity": capacity, "zero": zero, **sections.pop("parallel", {})}
        return train_config(data_dir, os.path.join(out_dir, name), parallel=parallel, **sections)

    straight, w4 = _trained(cfg("straight", 128, 1, train=f64), rt4)
    first, _ = _trained(cfg("part", 128, 1, train={**f64, "stop_after": 3}), rt4)
    step3 = os.path.join(out_dir, "part", "ckpt", "step-00000003")
    pair, pair_grad, solo = (dist.new_group(g) for g in ([0, 1], [0, 1], [0]))
    out = []
    if rank < 2:
        rt2 = Runtime(rank, 2, 0, torch.device("cpu"), TorchComm(pair), False,
                      grad_comm=TorchComm(pair_grad))  # fmt: skip
        resumed = cfg("on2", 256, 1, train=f64, checkpoint={"resume": step3})
        second, w2 = _trained(resumed, rt2)
        check = [("on 2 ranks", second, w2)]
        if rank == 0:
            rt1 = Runtime(0, 1, 0, torch.device("cpu"), SoloComm(), False,
                          run_comm=TorchComm(solo))  # fmt: skip
            alone = cfg("on1", 512, 0, train=f64, parallel={"policy": "single"},
                        checkpoint={"resume": step3})  # fmt: skip
            third, w1 = _trained(alone, rt1)
            check.append(("on 1 rank", third, w1))
        for name, losses, w in check:
            assert first == straight[:3]
            err = max(abs(a - b) / b for a, b in zip(losses, straight[3:]))
            werr = _rel(w, w4)
            assert len(losses) == 3 and err <= 1e-9 and werr <= 1e-9, (name, err, werr)
            out.append(f"resume {name}: losses {err:.3e}, weights {werr:.3e}")
    dist.barrier()
    return out
