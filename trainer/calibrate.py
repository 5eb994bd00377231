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
import json
import os
import tempfile
import time
from dataclasses import dataclass, field

from datapipe.errors import ConfigError
from datapipe.plan.cost import DEVICES, CostModel, build_cost_model
from datapipe.plan.costfit import WEIGHT_POWER, FitResult, Timing, fit_terms
from datapipe.shapes import ModelConfig, get_config
from trainer.calibrate_ranks import CalibrationGrid, measure_rank

CLOCKS = ("wall", "cpu")


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
    tp: int = 1,
) -> list[Timing]:
    """Run the grid in `nproc` processes (1: in this process, local timings only) on a model of
    `shape`, split over TP groups of `tp` adjacent processes (rings over the nproc / tp HDP
    ranks)."""
    grid = grid or CalibrationGrid()
    job = {
        "tp": tp,
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
    tp: int = 1,
) -> Calibration:
    """Measure (see `measure`) and fit the cost model of `model_name` on this machine. Byte sizes
    come from the model's shape. With rings (nproc >= 2) the link, hop latency, chunk efficiency
    and overlap are fitted; else the link is `link_bytes_per_s` (default: the device preset's)
    and the ring terms are neutral. `ranks_per_node` with `inter_node_bytes_per_s`: the measured
    link becomes the node link and the given one is used between nodes. `shape` overrides the
    named model's shape (e.g. another vocabulary size). `timings`: refit these (a stored
    calibration's) instead of measuring; `weight_power`: the fit's residual weight 1/t**power.
    `tp`: time TP groups of that many processes (the micro-batch terms are a group's, the TP
    all-reduces are timed and fitted as their own terms, costfit.fit_terms)."""
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
    _check_tp(shape, nproc, tp)
    if timings is None:
        timings = measure(shape, nproc, grid, dtype, device, threads, clock, timeout_s, tp)
    link0 = link_bytes_per_s or base.link_bytes_per_s
    # a ring of one TP index passes that member's K/V heads (split, or one when replicated)
    kv = base.kv_bytes_per_token * max(shape.n_kv_heads // tp, 1) / shape.n_kv_heads
    args = (base.num_layers, base.comm_passes, link0, weight_power)
    fit = fit_terms(timings, kv, *args, tp_bytes_per_token=shape.dim * itemsize)
    t = fit.terms
    link = t.link_bytes_per_s
    node_link = 0.0
    if ranks_per_node and not inter_node_bytes_per_s:
        raise ConfigError(
            "--ranks-per-node needs --inter-node-bytes-per-s (the link between nodes)"
        )
    if ranks_per_node:
        node_link, link = link, float(inter_node_bytes_per_s)
    keys = ("a", "b", "c", "size_knots", "size_rates", "attn_n_half", "hop_latency_s", "step")
    terms = {k: getattr(t, k) for k in keys}
    cost = dataclasses.replace(
        base,
        **terms,
        kv_bytes_per_token=kv,
        overlap=t.overlap,
        link_bytes_per_s=link,
        node_link_bytes_per_s=node_link,
        ranks_per_node=int(ranks_per_node),
        offload_bytes_per_s=offload_bytes_per_s or base.offload_bytes_per_s,
        tp=tp,
        tp_latency_s=t.tp_latency_s,
        tp_bytes_per_s=t.tp_bytes_per_s,
        name=f"{model_name}@calibrated-{device}-{nproc}p-{threads}t-{clock}"
        + (f"-tp{tp}" if tp > 1 else ""),
    )
    meta = {"model": model_name, "vocab_size": shape.vocab_size}
    meta |= {"shape": dataclasses.asdict(shape), "nproc": nproc, "tp": tp, "threads": threads}
    meta |= {"dtype": dtype, "device": device, "clock": clock, "grid": dataclasses.asdict(grid)}
    meta |= {"weight_power": weight_power, "seconds": time.perf_counter() - t0}
    return Calibration(cost, fit, meta)


def _check_tp(shape: ModelConfig, nproc: int, tp: int) -> None:
    """ConfigError naming --tp when `shape` cannot be split over `tp` or `tp` does not divide
    the processes."""
    if tp == 1:
        return
    from trainer.parallel.tensor import check_tp

    try:
        check_tp(shape, tp)
    except ValueError as exc:
        raise ConfigError(f"--tp: {exc}") from None
    if nproc % tp:
        raise ConfigError(f"--tp {tp} must divide --nproc {nproc}")
