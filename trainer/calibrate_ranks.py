"""What each process of `mixlen calibrate` times (trainer.calibrate spawns them and fits the
timings): the grid of cases, local micro-batches, ring hops and ring micro-batches over rings of
HDP ranks, the TP group's all-reduces (`--tp`) and whole steps; the module docstring of
trainer/calibrate.py says how cases are repeated and reduced over ranks."""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import numpy as np

from datapipe.plan.costfit import Timing
from datapipe.shapes import ModelConfig

__all__ = ["MAX_RUNS", "CalibrationGrid", "measure_rank", "runs_for"]


@dataclass(frozen=True)
class CalibrationGrid:
    """What `mixlen calibrate` times (lengths in positions, hop sizes in bytes)."""

    lengths: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192)
    # (samples, length) per micro-batch: packs of short samples at 2,048, 4,096 and 8,192
    # positions, several sample lengths at each, so that the fit sees how a position's cost grows
    # with the micro-batch (the d term) apart from the samples' attention (a*S^2)
    packed: tuple[tuple[int, int], ...] = (
        (16, 128),
        (8, 256),
        (4, 512),
        (2, 1024),
        (8, 512),
        (4, 1024),
        (2, 2048),
        (32, 256),
        (4, 2048),
    )
    ring_lengths: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
    ring_sizes: tuple[int, ...] = ()  # default: 2..K
    hop_bytes: tuple[int, ...] = (4096, 65536, 1 << 20, 4 << 20)
    hops_per_timing: int = 20
    repeats: int = 3  # timed runs per case at least (the least is kept)
    min_seconds: float = 2.0  # a short case runs until its timed runs add up to this

    def sizes(self, nproc: int) -> tuple[int, ...]:
        return self.ring_sizes or tuple(range(2, nproc + 1))


# --- one process -----------------------------------------------------------------------------


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(kind: str) -> float:
    return time.thread_time() if kind == "cpu" else time.perf_counter()


def _run_mb(model, attn_factory, positions: np.ndarray, job: dict, gen) -> float:
    """Seconds of one forward + backward (the attention context is built inside the timing, as
    the executor builds it per micro-batch)."""
    import torch

    dev = torch.device(job["device"])
    ids = torch.randint(0, model.cfg.vocab_size, (len(positions),), generator=gen).to(dev)
    pos = torch.from_numpy(positions).to(dev)
    _sync(dev)
    t0 = _clock(job["clock"])
    loss, _ = model(ids, pos, labels=ids, attn=attn_factory())
    loss.backward()
    _sync(dev)
    dt = _clock(job["clock"]) - t0
    model.zero_grad(set_to_none=True)
    return dt


def _reduce(value: float, op: str, dev) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=dev)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        if op == "mean":
            t /= dist.get_world_size()
    return float(t.item())


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


MAX_RUNS = 30  # timed runs of one case at most, however short


def runs_for(warm_s: float, repeats: int, min_seconds: float) -> int:
    """Timed runs of a case whose warm-up took `warm_s`: at least `repeats`, and enough to add
    up to `min_seconds` (at most MAX_RUNS, never fewer than `repeats`)."""
    if warm_s <= 0 or warm_s * repeats >= min_seconds:
        return repeats
    return max(repeats, min(math.ceil(min_seconds / warm_s), MAX_RUNS))


def _best(runs: list, grid: CalibrationGrid, op: str, dev) -> list[float]:
    """The least reduced (max or mean over ranks) time of each case over its `runs_for` runs,
    after one warm-up pass. The cases take turns (round r runs every case that wants more than r
    runs), so a slow spell of the machine hits all of them alike rather than the few timed in it;
    every rank sees the same reduced warm-up times, so all run the same rounds."""
    counts = []
    for run in runs:
        _barrier()
        counts.append(runs_for(_reduce(run(), op, dev), grid.repeats, grid.min_seconds))
    best = [float("inf")] * len(runs)
    for r in range(max(counts, default=0)):
        for i, run in enumerate(runs):
            if r < counts[i]:
                _barrier()
                best[i] = min(best[i], _reduce(run(), op, dev))
    return best


def measure_rank(rank: int, world: int, job: dict) -> list[dict]:
    """Every timing of the grid on this rank (all ranks call it together); returns Timing dicts
    (identical on every rank)."""
    import torch

    from trainer.attention.local import LocalAttention
    from trainer.model.transformer import build_model, torch_dtype
    from trainer.parallel.runtime import keep_freed_memory

    torch.set_num_threads(job["threads"])
    grid = CalibrationGrid(**{k: _tup(v) for k, v in job["grid"].items()})
    dev = torch.device(job["device"])
    if dev.type == "cpu":
        keep_freed_memory()  # as the trainer's CPU ranks run: no page faults step after step
    dtype = torch_dtype(job["dtype"])
    tp = int(job.get("tp", 1))
    model, _ = build_model(ModelConfig(**job["shape"]), dtype, dev, seed=0)
    groups = _tp_groups(world, tp)
    if tp > 1:  # every TP group computes each micro-batch together, one HDP rank to the plans
        from trainer.parallel.tensor import parallelize

        parallelize(model, groups["mesh"])
    gen = torch.Generator().manual_seed(1000 + rank // tp)  # a TP group draws the same tokens
    out: list[dict] = []
    # 1. local micro-batches on every rank at once
    cases = [(n,) for n in grid.lengths] + [(n,) * m for m, n in grid.packed]
    runs = []
    for lens in cases:
        cu = [0, *np.cumsum(lens).tolist()]
        pos = np.concatenate([np.arange(n) for n in lens])

        def local(cu=cu, pos=pos) -> float:
            return _run_mb(model, lambda: LocalAttention(cu), pos, job, gen)

        runs.append(local)
    for lens, t in zip(cases, _best(runs, grid, "mean", dev)):
        out.append(Timing("local", 1, tuple(lens), 0.0, t).to_dict())
    if tp > 1:
        out += _tp_timings(model, groups["tp"], grid, job, dev, dtype)
    if world // tp > 1:
        out += _ring_timings(rank, world, model, grid, job, gen, dev, dtype, tp)
    # 4. whole steps (the optimizer, the reduction, the plan check around the micro-batches)
    for m, n in grid.packed:
        t = _step_overhead(model, groups, (n,) * m, grid, job, dev)
        out.append(Timing("step", world // tp, (n,) * m, 0.0, t).to_dict())
    return out


def _tp_groups(world: int, tp: int) -> dict:
    """This process's communicators, as the trainer's runtime makes them
    (trainer.parallel.runtime.island_groups, one island): "hdp" and "grad", the HDP ranks of its
    TP index, and at tp > 1 "tp" and "mesh", its TP group and that group's DeviceMesh."""
    from trainer.parallel.comm import SoloComm

    if world == 1:
        return {"hdp": SoloComm(), "grad": SoloComm()}
    from trainer.parallel.runtime import island_groups

    g = island_groups(1, tp)
    return {"hdp": g.comm, "grad": g.grad_comm, "tp": g.tp_comm, "mesh": g.tp_mesh}


def _tp_timings(model, tp_comm, grid: CalibrationGrid, job: dict, dev, dtype) -> list[dict]:
    """The TP group's all-reduce of a micro-batch's activations [T, dim] for each local length
    T (what each layer's attention and SwiGLU outputs, and their inputs' gradients, cost)."""
    import torch

    sizes = [n * model.cfg.dim for n in grid.lengths]
    runs = []
    for n_el in sizes:
        buf = torch.ones(n_el, dtype=dtype, device=dev)
        runs.append(functools.partial(_all_reduces, tp_comm, buf, grid.hops_per_timing, job, dev))
    return [
        Timing("tp", tp_comm.size, (), float(n_el * dtype.itemsize), t).to_dict()
        for n_el, t in zip(sizes, _best(runs, grid, "max", dev))
    ]


def _all_reduces(comm, buf, n: int, job: dict, dev) -> float:
    """Seconds per all-reduce of `buf` over `comm` (n in a row, after two to warm up)."""
    for _ in range(2):
        comm.all_reduce(buf)
    _sync(dev)
    t0 = _clock(job["clock"])
    for _ in range(n):
        comm.all_reduce(buf)
    _sync(dev)
    return (_clock(job["clock"]) - t0) / n


def ring_of(rank: int, world: int, tp: int, k: int) -> tuple[list[int], int] | None:
    """The timed ring of size `k` that process `rank` joins, as (global ranks in ring order, its
    index in it), or None if it waits: rings of k consecutive HDP ranks, as many as fit, each TP
    index ringing with the same index of the other HDP ranks."""
    hdp, me, tp_index = world // tp, rank // tp, rank % tp
    g = me // k
    if g >= hdp // k:
        return None
    return [(g * k + i) * tp + tp_index for i in range(k)], me - g * k


def _ring_timings(rank, world, model, grid, job, gen, dev, dtype, tp: int = 1) -> list[dict]:
    """Hop and ring micro-batch timings over rings of every size of the grid (rings of HDP
    ranks; at tp > 1 each TP index rings with the same index of the other ranks)."""
    import torch

    from trainer.parallel.comm import TorchComm

    out: list[dict] = []
    comm = TorchComm()
    for k in grid.sizes(world // tp):
        ring = ring_of(rank, world, tp, k)
        # 2. hops
        sizes = [max(1, nbytes // dtype.itemsize) for nbytes in grid.hop_bytes]
        runs = []
        for n_el in sizes:
            bufs = [torch.zeros(n_el, dtype=dtype, device=dev) for _ in range(2)]
            runs.append(functools.partial(_hops, comm, ring, bufs, grid.hops_per_timing, job, dev))
        for n_el, secs in zip(sizes, _best(runs, grid, "max", dev)):
            out.append(Timing("hop", k, (), float(n_el * dtype.itemsize), secs).to_dict())
        # 3. ring micro-batches
        ring_cases = [(n,) for n in grid.ring_lengths if n >= 2 * k]
        ring_cases += [(n,) * m for m, n in grid.packed if n >= 2 * k]
        runs = [
            functools.partial(_ring_mb, model, comm, ring, lens, job, gen, dev)
            for lens in ring_cases
        ]
        for lens, secs in zip(ring_cases, _best(runs, grid, "max", dev)):
            out.append(Timing("ring", k, tuple(lens), 0.0, secs).to_dict())
    return out


def _step_overhead(
    model, groups: dict, lens: tuple, grid: CalibrationGrid, job: dict, dev
) -> float:
    """Seconds of a whole optimizer step beyond its micro-batches: each rank runs one local
    micro-batch of `lens` through the trainer's executor and sharded optimizer; the slowest
    rank's step minus the slowest rank's micro-batches (on the wall clock as the executor timed
    them, synchronised with the device), the least over `runs_for` steps after a warm-up (at
    least 1 us: a timing is positive)."""
    from datapipe.fetch import MemoryFetcher
    from datapipe.plan.cost import preset
    from datapipe.plan.planner import PlannerConfig
    from trainer.parallel.executor import HDPExecutor
    from trainer.parallel.zero import ZeroOptimizer

    comm, tp_comm = groups["hdp"], groups.get("tp")
    rank, world = comm.rank, comm.size
    zero = ZeroOptimizer.for_model(
        model,
        comm,
        level=1 if world > 1 else 0,
        grad_clip=1.0,
        grad_comm=groups["grad"],
        tp_comm=tp_comm,
    )
    ex = HDPExecutor(model, zero, comm, device=dev)
    lengths = np.full(world * len(lens), lens[0], dtype=np.int64)
    plan = (
        PlannerConfig(capacity=int(sum(lens)), widen=False)
        .build(preset("debug"), world)
        .plan(lengths)
    )
    vocab = model.cfg.vocab_size
    fetcher = MemoryFetcher([(np.arange(n) * 7919 + i) % vocab for i, n in enumerate(lengths)])
    fetched = fetcher.fetch_step([m.pieces for m in plan.microbatches(rank)])
    best, n, i = float("inf"), 1, 0
    while i <= n:
        _barrier()
        _sync(dev)
        t0 = _clock(job["clock"])
        result = ex.step(plan, fetched, i)
        _sync(dev)
        step = _reduce(_clock(job["clock"]) - t0, "max", dev)
        # wall: the rank's micro-batches as the executor timed them, synchronised with the device
        busy = result.compute_s[rank] if job["clock"] == "wall" else sum(c for _, c in ex.mb_log)
        if i:
            best = min(best, step - _reduce(busy, "max", dev))
        else:  # the warm-up step decides how many are timed (the same on every rank)
            n = runs_for(step, grid.repeats, grid.min_seconds)
        i += 1
    zero.remove_hooks()
    return max(best, 1e-6)


def _hops(comm, ring, bufs, n: int, job: dict, dev) -> float:
    """Seconds per hop of `n` send_recv + wait around `ring` = (group, index) (0: not a member)."""
    if ring is None:
        return 0.0
    group, p = ring
    k = len(group)
    send, recv = bufs
    nxt, prv = group[(p + 1) % k], group[(p - 1) % k]
    for _ in range(2):  # warm-up
        comm.send_recv(send, nxt, recv, prv).wait()
    _sync(dev)
    t0 = _clock(job["clock"])
    for _ in range(n):
        comm.send_recv(send, nxt, recv, prv).wait()
    _sync(dev)
    return (_clock(job["clock"]) - t0) / n


def _ring_mb(model, comm, ring, lens: tuple[int, ...], job: dict, gen, dev) -> float:
    """Seconds of a member's forward + backward of `lens` split zigzag over `ring`."""
    from trainer.attention.ring import RingAttention

    if ring is None:
        return 0.0
    group, p = ring

    def make() -> RingAttention:
        return RingAttention(comm, group, p, lens, device=dev)

    return _run_mb(model, make, make().layout.position_ids(p), job, gen)


def _tup(v):
    """Lists (from JSON) back to the grid's tuples, nested."""
    return tuple(_tup(x) for x in v) if isinstance(v, (list, tuple)) else v
