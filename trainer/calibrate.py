"""Timings for `mixlen calibrate`: the trainer's real model and real ring attention in K processes,
fitted into a cost model (datapipe.plan.costfit) the planner reads.

K processes (one torch thread each by default, as training runs) join one process group (gloo on
CPU, NCCL on CUDA) and time, all at once so every core is as busy as in training:

1. local micro-batches: forward + backward of whole samples (one per length, and a few packed
   micro-batches of equal short samples) on every rank;
2. ring hops: rings of k consecutive ranks (as many disjoint rings as fit) pass a buffer of each
   size around, one `send_recv` + wait per hop, as ring attention does;
3. ring micro-batches: forward + backward of a member's zigzag share of one or more samples with
   trainer.attention.ring.RingAttention, on the same rings.

Each case is run after a warm-up run at least `repeats` times, and a short one until its runs add
up to `min_seconds` (at most MAX_RUNS): the least of a few runs of a 0.2 s case still varies by
10% on a shared machine, and falls as runs are added, so the benchmark that checks the model times
its short steps with the same budget (the same count for the same duration). The cases of a stage
take turns, one run each per round, so a slow spell of the machine (tens of seconds here) touches
every case alike instead of the few that were timed in it. Ranks are released together by a
barrier; a ring's time is its slowest member's (a group waits for it), a local case's is the mean
over ranks. The clock is the wall clock (what ranks wait for), or with ``clock="cpu"`` each rank's
own thread CPU time (for boxes with fewer cores than ranks, where wall time measures the time
sharing).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from datapipe.errors import ConfigError
from datapipe.plan.cost import DEVICES, CostModel, build_cost_model
from datapipe.plan.costfit import WEIGHT_POWER, FitResult, Timing, fit_terms
from datapipe.shapes import ModelConfig, get_config

CLOCKS = ("wall", "cpu")


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


@dataclass
class Calibration:
    """The fitted cost model and what it was fitted on."""

    cost: CostModel
    fit: FitResult
    meta: dict = field(default_factory=dict)

    def report(self) -> dict:
        """The `calibration` section of the cost file: settings, every timing with its fitted
        time and relative residual, and a residual summary per kind."""
        rows = [
            {**m.to_dict(), "fit_seconds": float(f), "rel_residual": float(r)}
            for m, f, r in zip(self.fit.timings, self.fit.fitted_s, self.fit.rel_residuals)
        ]
        return {
            **self.meta,
            "fitted_terms": self.fit.fitted_terms,
            "notes": self.fit.notes,
            "residuals": self.fit.summary(),
            "timings": rows,
        }

    def to_json(self) -> str:
        d = self.cost.to_dict()
        d["calibration"] = self.report()
        return json.dumps(d, indent=2, sort_keys=True) + "\n"


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
    model, _ = build_model(ModelConfig(**job["shape"]), dtype, dev, seed=0)
    gen = torch.Generator().manual_seed(1000 + rank)
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
    if world > 1:
        out += _ring_timings(rank, world, model, grid, job, gen, dev, dtype)
    # 4. whole steps (the optimizer, the reduction, the plan check around the micro-batches)
    for m, n in grid.packed:
        t = _step_overhead(model, rank, world, (n,) * m, grid, job, dev)
        out.append(Timing("step", world, (n,) * m, 0.0, t).to_dict())
    return out


def _ring_timings(rank, world, model, grid, job, gen, dev, dtype) -> list[dict]:
    """Hop and ring micro-batch timings over rings of every size of the grid."""
    import torch

    from trainer.parallel.comm import TorchComm

    out: list[dict] = []
    comm = TorchComm()
    for k in grid.sizes(world):
        g = rank // k  # rings of k consecutive ranks, as many as fit; the others wait
        ring = (list(range(g * k, g * k + k)), rank - g * k) if g < world // k else None
        # 2. hops
        sizes = [max(1, nbytes // dtype.itemsize) for nbytes in grid.hop_bytes]
        runs = []
        for n_el in sizes:
            bufs = [torch.zeros(n_el, dtype=dtype, device=dev) for _ in range(2)]
            runs.append(functools.partial(_hops, comm, ring, bufs, grid.hops_per_timing, job, dev))
        for n_el, t in zip(sizes, _best(runs, grid, "max", dev)):
            out.append(Timing("hop", k, (), float(n_el * dtype.itemsize), t).to_dict())
        # 3. ring micro-batches
        ring_cases = [(n,) for n in grid.ring_lengths if n >= 2 * k]
        ring_cases += [(n,) * m for m, n in grid.packed if n >= 2 * k]
        runs = [
            functools.partial(_ring_mb, model, comm, ring, lens, job, gen, dev)
            for lens in ring_cases
        ]
        for lens, t in zip(ring_cases, _best(runs, grid, "max", dev)):
            out.append(Timing("ring", k, tuple(lens), 0.0, t).to_dict())
    return out


def _step_overhead(
    model, rank: int, world: int, lens: tuple, grid: CalibrationGrid, job: dict, dev
) -> float:
    """Seconds of a whole optimizer step beyond its micro-batches: each rank runs one local
    micro-batch of `lens` through the trainer's executor and sharded optimizer; the slowest
    rank's step minus the slowest rank's micro-batch, the least over `runs_for` steps after a
    warm-up (at least 1 us: a timing is positive)."""
    from datapipe.fetch import MemoryFetcher
    from datapipe.plan.cost import preset
    from datapipe.plan.planner import PlannerConfig
    from trainer.parallel.comm import SoloComm, TorchComm
    from trainer.parallel.executor import HDPExecutor
    from trainer.parallel.zero import ZeroOptimizer

    comm = TorchComm() if world > 1 else SoloComm()
    zero = ZeroOptimizer.for_model(model, comm, level=1 if world > 1 else 0, grad_clip=1.0)
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
        ex.step(plan, fetched, i)
        _sync(dev)
        step = _reduce(_clock(job["clock"]) - t0, "max", dev)
        busy = sum(w if job["clock"] == "wall" else c for _, w, c in ex.mb_log)
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


def _worker(rank: int, world: int, port: int, job: dict) -> None:
    """Spawned process: join the group, measure, rank 0 writes the timings."""
    import torch.distributed as dist

    if job["device"].startswith("cuda"):
        import datetime

        import torch

        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        job = {**job, "device": str(dev)}
        dist.init_process_group(
            "nccl",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=job["timeout_s"]),
            device_id=dev,
        )
    else:
        from trainer.parallel.comm import init_local_gloo

        init_local_gloo(rank, world, port, timeout_s=job["timeout_s"])
    try:
        rows = measure_rank(rank, world, job)
        if rank == 0:
            tmp = job["out"] + ".tmp"
            with open(tmp, "w") as f:
                json.dump(rows, f)
            os.replace(tmp, job["out"])
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(
    shape: ModelConfig,
    nproc: int = 1,
    grid: CalibrationGrid | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    threads: int = 1,
    clock: str = "wall",
    timeout_s: float = 1800.0,
) -> list[Timing]:
    """Run the grid in `nproc` processes (1: in this process, local timings only) on a model of
    `shape`."""
    grid = grid or CalibrationGrid()
    job = {
        "shape": dataclasses.asdict(shape),
        "grid": dataclasses.asdict(grid),
        "dtype": dtype,
        "device": device,
        "threads": threads,
        "clock": clock,
        "timeout_s": timeout_s,
    }
    if nproc == 1:
        return [Timing.from_dict(d) for d in measure_rank(0, 1, job)]
    from trainer.parallel.comm import free_port, spawn

    with tempfile.TemporaryDirectory(prefix="mixlen-calibrate-") as tmp:
        job["out"] = os.path.join(tmp, "timings.json")
        spawn(_worker, nproc, (nproc, free_port(), job), timeout_s)
        with open(job["out"]) as f:
            return [Timing.from_dict(d) for d in json.load(f)]


def calibrate(
    model_name: str,
    nproc: int = 1,
    grid: CalibrationGrid | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    threads: int = 1,
    clock: str = "wall",
    link_bytes_per_s: float | None = None,
    offload_bytes_per_s: float | None = None,
    ranks_per_node: int = 0,
    inter_node_bytes_per_s: float | None = None,
    timeout_s: float = 1800.0,
    shape: ModelConfig | None = None,
    timings: list[Timing] | None = None,
    weight_power: float = WEIGHT_POWER,
) -> Calibration:
    """Measure (see `measure`) and fit the cost model of `model_name` on this machine. Byte sizes
    come from the model's shape. With rings (nproc >= 2) the link, hop latency, chunk efficiency
    and overlap are fitted; else the link is `link_bytes_per_s` (default: the device preset's)
    and the ring terms are neutral. `ranks_per_node` with `inter_node_bytes_per_s`: the measured
    link becomes the node link and the given one is used between nodes. `shape` overrides the
    named model's shape (e.g. another vocabulary size). `timings`: refit these (a stored
    calibration's) instead of measuring; `weight_power`: the fit's residual weight 1/t**power."""
    import torch

    if clock not in CLOCKS:
        raise ConfigError(f"--clock: expected one of {', '.join(CLOCKS)}, got {clock!r}")
    if shape is None:
        try:
            shape = get_config(model_name)
        except ValueError as exc:
            raise ConfigError(f"--model: {exc}") from None
    itemsize = getattr(torch, dtype).itemsize
    dev_rates = DEVICES["h100" if device.startswith("cuda") else "cpu"]
    base = build_cost_model(model_name, shape, dev_rates, dtype_bytes=itemsize)
    grid = grid or CalibrationGrid()
    t0 = time.perf_counter()
    if timings is None:
        timings = measure(shape, nproc, grid, dtype, device, threads, clock, timeout_s)
    link0 = link_bytes_per_s or base.link_bytes_per_s
    fit = fit_terms(
        timings, base.kv_bytes_per_token, base.num_layers, base.comm_passes, link0, weight_power
    )
    t = fit.terms
    link = t.link_bytes_per_s
    node_link = 0.0
    if ranks_per_node:
        if not inter_node_bytes_per_s:
            raise ConfigError(
                "--ranks-per-node needs --inter-node-bytes-per-s (the link between nodes)"
            )
        node_link, link = link, float(inter_node_bytes_per_s)
    keys = ("a", "b", "c", "size_knots", "size_rates", "attn_n_half", "hop_latency_s")
    terms = {k: getattr(t, k) for k in keys}
    cost = dataclasses.replace(
        base,
        **terms,
        overlap=t.overlap,
        step=t.step,
        link_bytes_per_s=link,
        node_link_bytes_per_s=node_link,
        ranks_per_node=int(ranks_per_node),
        offload_bytes_per_s=offload_bytes_per_s or base.offload_bytes_per_s,
        name=f"{model_name}@calibrated-{device}-{nproc}p-{threads}t-{clock}",
    )
    meta = {
        "model": model_name,
        "vocab_size": shape.vocab_size,
        "shape": dataclasses.asdict(shape),
        "nproc": nproc,
        "threads": threads,
        "dtype": dtype,
        "device": device,
        "clock": clock,
        "grid": dataclasses.asdict(grid),
        "weight_power": weight_power,
        "seconds": time.perf_counter() - t0,
    }
    return Calibration(cost, fit, meta)
