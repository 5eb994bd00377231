"""The Trainer of `mixlen train`: build everything from a TrainerConfig, then `train()` runs
`train_step()` per optimizer step, evaluates, writes metrics and checkpoints.

Per step, every rank of the island takes the next global batch from the length-aware stream, plans
it (the same plan everywhere, from lengths alone), fetches only its own token ranges (in a
background thread, one step ahead) and hands the plan and its micro-batches to the HDP executor.
Every resource is released through one ExitStack (`close()`), also when building fails.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch

from datapipe.files import write_text_atomic
from trainer.checkpoint import Checkpointer
from trainer.compare import PolicyComparison
from trainer.config import TrainerConfig, to_toml
from trainer.data import TrainData
from trainer.executor import HDPExecutor
from trainer.faults import FaultInjector
from trainer.metrics import BalanceSummary, MetricsWriter, step_record
from trainer.model import build_model, torch_dtype
from trainer.offload import activation_manager
from trainer.offload_plan import OffloadSummary
from trainer.rng import seed_all
from trainer.runtime import Runtime

__all__ = ["Trainer", "lr_lambda"]


def lr_lambda(cfg: TrainerConfig) -> Callable[[int], float]:
    """The LR multiplier per step: linear warmup, then cosine to `min_lr_ratio` (or constant)."""
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


class Trainer:
    """One rank's training run (collective: every rank of the island builds and runs one)."""

    def __init__(self, cfg: TrainerConfig, rt: Runtime) -> None:
        self.cfg, self.rt = cfg, rt
        self.t_start = time.perf_counter()
        self._stack = ExitStack()
        try:
            self._build()
        except BaseException:
            self._stack.close()
            raise

    def _build(self) -> None:
        cfg, rt = self.cfg, self.rt
        # model, optimizer, schedule, executor; every generator seeded (and checkpointed)
        seed_all(cfg.train.seed)
        shape = cfg.model.shape()
        self.model, self.master = build_model(
            shape, torch_dtype(cfg.train.dtype), rt.device, seed=cfg.train.seed
        )
        self.optimizer = torch.optim.AdamW(
            self.master.parameters(),
            lr=cfg.train.lr,
            betas=(cfg.train.beta1, cfg.train.beta2),
            weight_decay=cfg.train.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        # offload and activation checkpointing (None: neither)
        self.activations = activation_manager(cfg, rt.device, torch_dtype(cfg.train.dtype))
        self.executor = HDPExecutor(
            self.model,
            self.optimizer,
            rt.comm,
            master=self.master,
            scheduler=self.scheduler,
            grad_clip=cfg.train.grad_clip,
            device=rt.device,
            activations=self.activations,
        )
        # test-only fault injection (MIXLEN_FAULT); nothing armed in a normal run
        self.faults = FaultInjector(rt.rank)
        self.faults.attach(self.model)
        # data: fetch, held-out split, stream, planner, validation set
        self.data = TrainData(cfg, rt.rank, rt.world, shape.vocab_size, self._stack)
        # resume before the first step
        self.checkpointer = Checkpointer(
            cfg.checkpoint,
            cfg,
            self.model,
            self.master,
            self.optimizer,
            self.scheduler,
            rt.comm,
            rt.device,
            self.faults,
        )
        self.start_step = self.checkpointer.resume(self.data.stream)
        # metrics (rank 0 writes)
        self.metrics = MetricsWriter(
            cfg.metrics.dir,
            cfg.train.steps,
            active=rt.rank == 0,
            tensorboard=cfg.metrics.tensorboard,
            progress=cfg.metrics.progress,
            console_interval=cfg.metrics.console_interval,
            resume_step=self.start_step if self.checkpointer.resumed else None,
        )
        self._stack.callback(self.metrics.close)
        if rt.rank == 0:
            write_text_atomic(os.path.join(cfg.metrics.dir, "config.toml"), to_toml(cfg))
        self.metrics.set_start(self.start_step)
        self.balance = BalanceSummary()
        if self.activations is not None:
            cost = self.data.planner.cost
            self.balance.offload = OffloadSummary(shape.n_layers, cost.act_bytes_per_token_layer)
        self.compare = None
        if cfg.metrics.compare:  # another policy on the same batches, for the report
            self.compare = PolicyComparison(
                cfg.metrics.compare, cfg.metrics.compare_interval, self.data, self.executor, rt.rank
            )

    def train_step(self, step: int, item: tuple, fetched: list, wait_s: float) -> dict[str, Any]:
        """One optimizer step of the prefetched `item` = (batch, plan, stream state); returns the
        metrics record (also written)."""
        t0 = time.perf_counter()
        self.faults.begin_step(step)
        batch, plan, _ = item
        lr = self.optimizer.param_groups[0]["lr"]
        res = self.executor.step(plan, fetched, step)
        step_s = time.perf_counter() - t0 + wait_s
        planned = (plan.rank_time_ns / 1e9).tolist()
        self.balance.add(res.compute_s, planned, res.microbatches, step_s, res.tokens)
        rec = step_record(step, batch, plan, res, lr, wait_s, step_s)
        if self.balance.offload is not None and self.executor.plan_offload is not None:
            po = self.executor.plan_offload
            rec.update(self.balance.offload.add(po, res.offload_bytes, res.act_peak_bytes))
        if self.compare is not None and (row := self.compare.after_step(step, batch, plan, res)):
            rec["compare"] = row
        val = self.data.validation
        if val is not None and step % self.cfg.train.eval_interval == 0:
            rec["val_loss"] = val.run(self.executor)
            rec["val_tokens"] = val.tokens
        self.metrics.log(rec)
        return rec

    def train(self) -> dict[str, Any]:
        """Run from the resumed step to `train.steps` (or `train.stop_after`); returns a summary
        (losses, val losses, paths)."""
        cfg = self.cfg
        last = cfg.train.steps
        if cfg.train.stop_after:
            last = min(last, cfg.train.stop_after)
        prefetch = self.data.fetcher.prefetch(self.data.steps())
        self._stack.callback(prefetch.close)
        losses: list[float] = []
        val_losses: list[tuple[int, float]] = []
        label = cfg.parallel.policy
        for step in range(self.start_step + 1, last + 1):
            item, fetched = next(prefetch)
            rec = self.train_step(step, item, fetched, prefetch.last_wait_s)
            losses.append(rec["loss"])
            label = item[1].label
            if "val_loss" in rec:
                val_losses.append((step, rec["val_loss"]))
            if self.checkpointer.due(step, last):
                self.checkpointer.save(step, item[2])
        return self._summary(losses, val_losses, label)

    def _summary(
        self, losses: list[float], val_losses: list[tuple[int, float]], label: str
    ) -> dict[str, Any]:
        cfg = self.cfg
        summary = {
            "losses": losses,
            "val_losses": val_losses,
            "start_step": self.start_step,
            "metrics": os.path.join(cfg.metrics.dir, "metrics.jsonl"),
            "balance_report": os.path.join(cfg.metrics.dir, "balance.md"),
            "checkpoint_dir": cfg.checkpoint.dir,
            "wall_s": time.perf_counter() - self.t_start,
        }
        if self.rt.rank == 0:
            report = self.balance.render(label)
            if self.compare is not None:
                report += "\n" + self.compare.render()
            write_text_atomic(summary["balance_report"], report)
            print(report)
            print(f"metrics:        {summary['metrics']}")
            print(f"balance report: {summary['balance_report']}")
            if cfg.checkpoint.dir:
                print(f"checkpoints:    {cfg.checkpoint.dir}")
        return summary

    def close(self) -> None:
        """Release the prefetcher, readers and metrics files."""
        self._stack.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
