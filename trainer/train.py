"""The training loop of `mixlen train`: build everything from a TrainerConfig, run steps, write
metrics, evaluate, checkpoint, resume.

Per step, every rank of the island: takes the next global batch from the length-aware stream,
plans it (the same plan everywhere, from lengths alone), fetches only its own token ranges (in a
background thread, one step ahead) and hands the plan and its micro-batches to the HDP executor.
Run it under torchrun (one process per rank: RANK/WORLD_SIZE/LOCAL_RANK in the environment) or as
one process.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from datapipe.errors import ConfigError
from datapipe.fetch import FetchConfig, Fetcher
from datapipe.files import write_text_atomic
from datapipe.plan import StepPlan
from datapipe.planners import PlannerConfig
from datapipe.stream import GlobalBatch, LengthAwareStream, StreamConfig, greedy_boundaries
from trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.comm import Communicator, TorchComm
from trainer.config import DTYPES as CONFIG_DTYPES
from trainer.config import TrainerConfig, resume_conflicts, to_toml
from trainer.executor import HDPExecutor, SoloComm, build_model, single_plan
from trainer.metrics import BalanceSummary, MetricsWriter, imbalance
from trainer.model import get_config

__all__ = ["Runtime", "held_out_mask", "run_training", "setup_runtime"]

DTYPES = {name: getattr(torch, name) for name in CONFIG_DTYPES}  # config name -> torch dtype
TIMEOUT_ENV = "MIXLEN_DIST_TIMEOUT"  # seconds a collective may wait (default 600)


# --- process setup -------------------------------------------------------------------------------


@dataclass
class Runtime:
    """Where this process runs: its rank in the island, the island's communicator, the device."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    comm: Communicator
    owns_group: bool  # this module initialised torch.distributed (and tears it down)


def setup_runtime(device: str = "auto") -> Runtime:
    """Join the process group named by torchrun's environment (gloo on CPU, NCCL with eager
    `device_id` initialisation on CUDA), or run as one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        world = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("train.device: 'cuda' requested but no CUDA device is available")
    if use_cuda:
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
        env = os.environ.get("OMP_NUM_THREADS", "")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = int(env) if env.isdigit() else (cores or 1) // max(local_world, 1)
        torch.set_num_threads(max(1, threads))  # OMP_NUM_THREADS if set, else a core share
    owns = False
    if world > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "600")))
        if use_cuda:
            dist.init_process_group("nccl", timeout=timeout, device_id=dev)
        else:
            dist.init_process_group("gloo", timeout=timeout)
        owns = True
    if dist.is_initialized() and dist.get_world_size() > 1:
        comm: Communicator = TorchComm()
        dist.barrier()
        return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, dev, comm, owns)
    return Runtime(0, 1, 0, dev, SoloComm(), owns)


# --- data ----------------------------------------------------------------------------------------


def held_out_mask(sample_ids: np.ndarray, seed: int, fraction: float) -> np.ndarray:
    """True for held-out samples: splitmix64(id ^ seed) / 2^64 < fraction (stable across runs,
    datasets sizes and ranks)."""
    with np.errstate(over="ignore"):
        z = np.asarray(sample_ids, dtype=np.uint64) ^ np.uint64(seed)
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)) < fraction


class _Planner:
    """Plans a global batch with the configured policy."""

    def __init__(self, cfg: TrainerConfig, world: int, max_len: int) -> None:
        p = cfg.parallel
        self.policy = p.policy
        self.capacity = p.capacity
        if p.policy == "single":
            if world != 1:
                raise ConfigError(
                    f"parallel.policy: 'single' runs one process, but {world} ranks were launched"
                )
            self.planner = None
            return
        if max_len > world * p.capacity:
            raise ConfigError(
                f"parallel.capacity: the dataset's longest sample has {max_len} tokens, more than "
                f"{world} ranks x capacity {p.capacity} can hold; raise capacity or ranks, or cap "
                "sample length at preprocess time (--max-len)"
            )
        cost = p.cost_model()
        if cfg.offload.bytes_per_s is not None:
            cost = cost.with_offload_bandwidth(cfg.offload.bytes_per_s)
        max_ctx = p.max_context if p.max_context is not None else max_len
        if p.policy != "static":
            max_ctx = None
        self.planner = PlannerConfig(
            policy=p.policy,
            num_ranks=world,
            capacity=p.capacity,
            offload=cfg.offload.enabled,
            widen=p.widen,
            max_context=max_ctx,
            seed=cfg.data.seed,
        ).build(cost)

    def plan(self, lengths: np.ndarray, ids: np.ndarray) -> StepPlan:
        if self.planner is None:
            return single_plan(lengths, ids, self.capacity)
        return self.planner.plan(lengths, ids)


def _rank_pieces(plan: StepPlan, rank: int) -> list[tuple]:
    """This rank's pieces per micro-batch, in slot order (the fetcher takes them as they are)."""
    return [m.pieces for m in plan.microbatches(rank)]


# --- training ------------------------------------------------------------------------------------


def _lr_lambda(cfg: TrainerConfig):
    t = cfg.train

    def f(step: int) -> float:
        if t.warmup and step < t.warmup:
            return (step + 1) / t.warmup
        if t.schedule == "constant":
            return 1.0
        span = max(t.steps - t.warmup, 1)
        frac = min(max(step - t.warmup, 0) / span, 1.0)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    return f


class _Validation:
    """A fixed held-out set, planned once; evaluated forward-only on the island."""

    def __init__(
        self,
        cfg: TrainerConfig,
        rt: Runtime,
        fetcher: Fetcher,
        ids: np.ndarray,
        lengths: np.ndarray,
        planner: _Planner,
    ) -> None:
        keep = lengths > 0
        if planner.planner is not None:  # a held-out dataset may hold longer samples than N * C
            keep &= lengths <= cfg.parallel.capacity * rt.world
        ids, lengths = ids[keep], lengths[keep]
        n = int(np.searchsorted(np.cumsum(lengths), cfg.data.val_tokens, side="right"))
        n = max(n, min(1, len(ids)))  # at least one sample when there is one
        ids, lengths = ids[:n], lengths[:n]
        bounds = greedy_boundaries(lengths, cfg.train.global_batch_tokens) if len(ids) else [0]
        self.batches = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            plan = planner.plan(lengths[a:b], ids[a:b])
            self.batches.append((plan, fetcher.fetch_step(_rank_pieces(plan, rt.rank))))
        self.tokens = int(lengths.sum())

    def run(self, executor: HDPExecutor) -> float:
        total, labels = 0.0, 0
        for plan, fetched in self.batches:
            s, n = executor.evaluate(plan, fetched)
            total += s
            labels += n
        return total / max(labels, 1)


def run_training(cfg: TrainerConfig, rt: Runtime | None = None) -> dict[str, Any]:
    """Train as configured; returns a summary (losses, val losses, paths). Collective: every rank
    of the island calls it."""
    cfg.validate()
    own_rt = rt is None
    rt = rt or setup_runtime(cfg.train.device)
    closers: list = []
    try:
        return _train(cfg, rt, closers)
    finally:
        for close in reversed(closers):  # also on errors before the loop starts
            close()
        if own_rt and rt.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: TrainerConfig, rt: Runtime, closers: list) -> dict[str, Any]:
    t_start = time.perf_counter()
    dtype = DTYPES[cfg.train.dtype]
    torch.manual_seed(cfg.train.seed)
    mcfg = get_config(cfg.model.name, **cfg.model.overrides())
    model, master = build_model(mcfg, dtype, rt.device, seed=cfg.train.seed)
    opt = torch.optim.AdamW(
        master.parameters(),
        lr=cfg.train.lr,
        betas=(cfg.train.beta1, cfg.train.beta2),
        weight_decay=cfg.train.weight_decay,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg))
    executor = HDPExecutor(
        model,
        opt,
        rt.comm,
        master=master,
        scheduler=sched,
        grad_clip=cfg.train.grad_clip,
        device=rt.device,
    )

    # data: train/held-out split, stream, planner, fetch
    fetcher = FetchConfig(
        cfg.data.path, cfg.data.cache_dir, prefetch_depth=cfg.data.prefetch_depth
    ).build()
    closers.append(fetcher.close)
    all_lengths = np.asarray(fetcher.lengths, dtype=np.int64)
    if mcfg.vocab_size < int(fetcher.index.manifest.get("vocab_size", 0)):
        raise ConfigError(
            f"model: vocab_size {mcfg.vocab_size} < the dataset's {fetcher.index.manifest['vocab_size']}"
        )
    all_ids = np.arange(all_lengths.shape[0], dtype=np.int64)
    val_fetcher, val_ids = None, np.zeros(0, np.int64)
    if cfg.data.val_path:
        val_fetcher = FetchConfig(cfg.data.val_path, cfg.data.cache_dir).build()
        closers.append(val_fetcher.close)
        val_ids = np.arange(len(val_fetcher.lengths), dtype=np.int64)
        train_ids = all_ids
    elif cfg.data.val_fraction > 0:
        held = held_out_mask(all_ids, cfg.data.seed, cfg.data.val_fraction)
        train_ids, val_ids = all_ids[~held], all_ids[held]
        val_fetcher = fetcher
    else:
        train_ids = all_ids
    if train_ids.size == 0:
        raise ConfigError("data.val_fraction: leaves no training samples")
    stream = LengthAwareStream(
        StreamConfig(
            cfg.data.path,
            cfg.train.global_batch_tokens,
            seed=cfg.data.seed,
            oversize=cfg.data.oversize,
            lookahead=cfg.data.lookahead,
            cache_dir=cfg.data.cache_dir,
        ),
        all_lengths[train_ids],
    )
    planner = _Planner(cfg, rt.world, int(all_lengths.max()))

    # resume
    start = 0
    ckpt_dir = cfg.checkpoint.dir
    resume = cfg.checkpoint.resume
    if resume:
        path = (
            resume
            if isinstance(resume, str)
            else (latest_checkpoint(ckpt_dir) if ckpt_dir else None)
        )
        if path is None:
            if rt.rank == 0:
                print(f"checkpoint.resume: no checkpoint in {ckpt_dir}; starting from step 0")
        else:
            extra = load_checkpoint(
                path, master, opt, sched, {"stream": stream.state_dict(), "config": ""}
            )
            conflicts = resume_conflicts(json.loads(extra["config"] or "{}"), cfg)
            if conflicts:
                raise ConfigError(
                    f"checkpoint.resume: {path} belongs to a run with other settings ("
                    + "; ".join(conflicts)
                    + "); resume with its settings, or start a new run (checkpoint.resume = false)"
                )
            if master is not model:
                model.load_state_dict(master.state_dict())
            stream.load_state_dict(extra["stream"])
            start = int(extra["step"])
            if rt.rank == 0:
                print(f"resumed from {path} at step {start}")

    writer = MetricsWriter(
        cfg.metrics.dir,
        cfg.train.steps,
        active=rt.rank == 0,
        tensorboard=cfg.metrics.tensorboard,
        progress=cfg.metrics.progress,
        console_interval=cfg.metrics.console_interval,
        resume_step=start if cfg.checkpoint.resume else None,
    )
    closers.append(writer.close)
    if rt.rank == 0:
        write_text_atomic(os.path.join(cfg.metrics.dir, "config.toml"), to_toml(cfg))
    writer.set_start(start)
    validation = None
    if cfg.train.eval_interval and val_fetcher is not None and val_ids.size:
        validation = _Validation(
            cfg, rt, val_fetcher, val_ids, np.asarray(val_fetcher.lengths)[val_ids], planner
        )

    def batches() -> Iterator[tuple[tuple[GlobalBatch, StepPlan, dict], list[np.ndarray]]]:
        while True:
            b = next(stream)
            ids = train_ids[b.sample_ids]
            plan = planner.plan(b.lengths, ids)
            yield (b, plan, stream.state_dict()), _rank_pieces(plan, rt.rank)

    balance = BalanceSummary()
    losses: list[float] = []
    val_losses: list[tuple[int, float]] = []
    prefetch = fetcher.prefetch(batches())
    try:
        last = cfg.train.steps
        if cfg.train.stop_after:
            last = min(last, cfg.train.stop_after)
        for step in range(start + 1, last + 1):
            t0 = time.perf_counter()
            (batch, plan, state), fetched = next(prefetch)
            wait = prefetch.last_wait_s
            lr = opt.param_groups[0]["lr"]
            res = executor.step(plan, fetched, step)
            step_s = time.perf_counter() - t0
            losses.append(res.loss)
            planned = (plan.rank_time_ns / 1e9).tolist()
            balance.add(res.compute_s, planned, res.microbatches, step_s, res.tokens)
            rec = {
                "step": step,
                "loss": res.loss,
                "tokens": res.tokens,
                "samples": int(batch.sample_ids.shape[0]),
                "labelled": res.n_labels,
                "lr": lr,
                "grad_norm": res.grad_norm,
                "step_time_s": step_s,
                "tokens_per_s": res.tokens / step_s if step_s > 0 else 0.0,
                "data_wait_s": wait,
                "compute_time_s_per_rank": res.compute_s,
                "comm_time_s": res.rank_comm_s,
                "ring_wait_s_per_rank": res.ring_wait_s,
                "ring_bytes_per_rank": res.p2p_bytes,
                "allreduce_bytes": res.reduce_bytes,
                "microbatches_per_rank": res.microbatches,
                "imbalance_measured": imbalance(res.compute_s),
                "imbalance_planned": imbalance(planned),
                "planned_makespan_s": plan.makespan_ns / 1e9,
                "policy": plan.policy,
                "epoch": batch.epoch,
            }
            if validation is not None and step % cfg.train.eval_interval == 0:
                rec["val_loss"] = validation.run(executor)
                rec["val_tokens"] = validation.tokens
                val_losses.append((step, rec["val_loss"]))
            writer.log(rec)
            if ckpt_dir and (
                (cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0) or step == last
            ):
                save_checkpoint(
                    ckpt_dir,
                    step,
                    master,
                    opt,
                    sched,
                    {"stream": state, "config": json.dumps(cfg.to_dict(), sort_keys=True)},
                    keep=cfg.checkpoint.keep,
                )
    finally:
        prefetch.close()
        fetcher.close()
        if val_fetcher is not None and val_fetcher is not fetcher:
            val_fetcher.close()
        writer.close()
    summary = {
        "losses": losses,
        "val_losses": val_losses,
        "start_step": start,
        "metrics": os.path.join(cfg.metrics.dir, "metrics.jsonl"),
        "balance_report": os.path.join(cfg.metrics.dir, "balance.md"),
        "checkpoint_dir": ckpt_dir,
        "wall_s": time.perf_counter() - t_start,
    }
    if rt.rank == 0:
        report = balance.render(plan.label if last > start else cfg.parallel.policy)
        write_text_atomic(summary["balance_report"], report)
        print(report)
        print(f"metrics:        {summary['metrics']}")
        print(f"balance report: {summary['balance_report']}")
        if ckpt_dir:
            print(f"checkpoints:    {ckpt_dir}")
    return summary
