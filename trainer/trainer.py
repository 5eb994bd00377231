"""The Trainer of `mixlen train`: build everything from a TrainerConfig, then `train()` runs
`train_step()` per optimizer step, evaluates, writes metrics and checkpoints.

Per step, every rank of the island takes the next global batch from the length-aware stream, plans
it (the same plan everywhere, from lengths alone), fetches only its own token ranges (in a
background thread, one step ahead) and hands the plan and its micro-batches to the HDP executor,
whose sharded optimizer (trainer.parallel.zero) steps the island's weights. With several islands, batch j
of an epoch goes to island j mod I and the islands train together as `[co2]` says: co2 / diloco
rounds after the optimizer steps (trainer.islands.cross.CrossIsland), or sync gradients inside them.
Every resource is released through one ExitStack (`close()`), also when building fails.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from datapipe.errors import ConfigError, PeerError
from datapipe.files import write_text_atomic
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.rng import seed_all
from trainer.checkpoint.save import any_rank
from trainer.checkpoint.state import ModelState
from trainer.compare import PolicyComparison
from trainer.config.job import TrainConfig, TrainerConfig
from trainer.config.toml import to_toml
from trainer.data import MixValidation, Step
from trainer.hooks import (
    Interrupted,
    TrainingInterrupted,
    check_finite_step,
    load_hooks,
    signals_as_interrupts,
)
from trainer.islands.cross import CrossIsland, cross_link
from trainer.logs import get_logger
from trainer.metrics import BalanceSummary, MetricsWriter, step_record, world_figures
from trainer.model.config import pretrained_of
from trainer.model.pretrained import load_pretrained_weights
from trainer.model.transformer import build_model, torch_dtype
from trainer.offload.manager import activation_manager
from trainer.offload.plan import OffloadSummary
from trainer.parallel.comm import Communicator
from trainer.parallel.executor import HDPExecutor
from trainer.parallel.runtime import Runtime
from trainer.parallel.zero import ZeroOptimizer

__all__ = ["Trainer", "lr_lambda"]


def lr_lambda(t: TrainConfig) -> Callable[[int], float]:
    """The LR multiplier of the optimizer step after `step` scheduler steps (the LambdaLR
    argument, 0 for the first optimizer step): linear warmup over `warmup` steps, then cosine
    from 1 down to `min_lr_ratio`, reached on the run's last step (or constant)."""

    def f(step: int) -> float:
        if t.warmup and step < t.warmup:
            return (step + 1) / t.warmup
        if t.schedule == "constant":
            return 1.0
        span = max(t.steps - 1 - t.warmup, 1)  # the last step (index steps - 1) ends the cosine
        frac = min(max(step - t.warmup, 0) / span, 1.0)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    return f


def build_optimizer(
    t: TrainConfig,
    level: int,
    model: nn.Module,
    master: nn.Module,
    comm: Communicator,
    grad_comm: Communicator,
    cross: Communicator | None,
    tp_comm: Communicator | None = None,
) -> ZeroOptimizer:
    """The island's AdamW (`[train]`) at ZeRO level `level` (`cross`: sum gradients across
    islands, sync mode; `tp_comm`: the TP group, whose shards make the global norm). The weight
    all-gather of a step is left in flight until the next step needs it."""
    return ZeroOptimizer.for_model(
        model,
        comm,
        master=master,
        level=level,
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        grad_comm=grad_comm,
        cross_comm=cross,
        async_gather=True,
        tp_comm=tp_comm,
    )


def memory_warning(cfg: TrainerConfig, rt: Runtime, device_bytes: int) -> str | None:
    """Will a rank's model state (and CO2's outer state) plus its largest micro-batch
    (`parallel.capacity` positions under `train.activation_checkpoint`, datapipe.plan.memory's
    terms) exceed what a device of `device_bytes` can hold (`usable_bytes`)? The warning naming
    what would fit, or None (also at tp > 1 or with offload: not modelled)."""
    from datapipe.plan.memory import capacity_warning, model_state_bytes, outer_state_bytes

    if rt.tp > 1 or cfg.offload.enabled:
        return None
    shape, ranks, dtype = cfg.model.shape(), rt.comm.size, cfg.train.dtype
    numel = shape.num_params()
    state = model_state_bytes(numel, ranks, cfg.parallel.zero_level(ranks), dtype).total
    if rt.islands > 1 and cfg.co2.mode in ("co2", "diloco"):  # the outer rounds' state
        state += outer_state_bytes(numel, ranks, dtype)
    keys = (cfg.key(cfg.parallel.planner, "capacity"), cfg.key(cfg.train, "activation_checkpoint"))
    return capacity_warning(
        shape,
        cfg.parallel.planner.capacity,
        cfg.train.activation_checkpoint,
        dtype,
        state,
        device_bytes,
        keys,
    )


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
        if rt.islands != cfg.parallel.islands:
            raise ConfigError(
                f"{cfg.key(cfg.parallel, 'islands')}: {cfg.parallel.islands}, but the runtime was "
                f"set up with {rt.islands} island(s)"
            )
        self._build_model()
        if rt.device.type == "cuda" and rt.global_rank == 0:
            self._warn_memory()
        differ = cfg.parallel.timed_shape_differences(cfg.model.shape(), cfg.train.dtype)
        if differ and rt.global_rank == 0:
            get_logger().warning(
                f"{cfg.key(cfg.parallel, 'cost')} {cfg.parallel.cost} was timed on another model "
                f"({'; '.join(differ)}): the plans balance that model's estimated times; time "
                "this one with `mixlen calibrate CONFIG.toml`"
            )
        # hooks (MIXLEN_HOOKS: tests inject faults); no-ops in a normal run
        self.hooks = load_hooks(rt.global_rank)
        self.hooks.attach(self.model)
        # data: fetch, held-out split, this island's stream, planner, validation set
        self.data = cfg.train_data(rt.rank, rt.world, self._stack, island=rt.island)
        if self.data.notice and rt.global_rank == 0:
            get_logger().warning(self.data.notice)
        # resume before the first step
        self.state = ModelState(
            self.model,
            self.zero,
            self.cross,
            rt.island,
            prefixed=self.cross is not None,
        )
        self.checkpointer = Checkpointer(
            cfg.checkpoint, cfg, self.state, self.scheduler, rt.run_comm, rt.device, self.hooks
        )
        self.checkpointer.fingerprint = self.data.fingerprint
        self.start_step = self.checkpointer.resume(self.data.stream)
        self.data.check_supply(cfg.train.steps)  # a mixture running out: found before step 1
        self.checkpointer.lock()  # one job per checkpoint.dir, before the first save
        self._stack.callback(self.checkpointer.unlock)
        self._build_reports()

    def _warn_memory(self) -> None:
        """Log `memory_warning` against the device's total memory; an estimate's failure is
        logged too, never raised (rank 0 alone runs it: the others would wait on it)."""
        try:
            warning = memory_warning(self.cfg, self.rt, torch.cuda.mem_get_info(self.rt.device)[1])
        except Exception as exc:  # noqa: BLE001 - a warning must not stop the run
            get_logger().debug(f"memory estimate skipped: {type(exc).__name__}: {exc}")
            return
        if warning:
            get_logger().warning(warning)

    def _build_model(self) -> None:
        """Model, the island's sharded optimizer, schedule, executor, CO2 rounds; every generator
        seeded."""
        cfg, rt = self.cfg, self.rt
        seed_all(cfg.train.seed)
        dtype = torch_dtype(cfg.train.dtype)
        pre = pretrained_of(cfg.model)  # a Hugging Face folder's weights, or None
        load = None if pre is None else functools.partial(load_pretrained_weights, pretrained=pre)
        shape = cfg.model.shape()
        shard = None
        if rt.tp > 1:  # seeded: built whole, then split; pretrained: each reads its shards only
            from trainer.parallel.tensor import parallelize

            shard = functools.partial(parallelize, mesh=rt.tp_mesh)
        self.model, master = build_model(shape, dtype, rt.device, cfg.train.seed, load, shard)
        if cfg.train.compile:  # each block one graph (a ring: the segments around it), the loss
            self.model.compile_layers()
        assert rt.grad_comm is not None and rt.cross_comm is not None
        mode = cfg.co2.mode if rt.islands > 1 else "single"
        cross = cross_link(cfg.co2, rt.cross_comm)
        self.zero = build_optimizer(
            cfg.train,
            cfg.parallel.zero_level(rt.comm.size),
            self.model,
            master,
            rt.comm,
            rt.grad_comm,
            cross if mode == "sync" else None,
            rt.tp_comm,
        )
        del master  # its values are in the optimizer's master weights now
        self.optimizer = self.zero.optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg.train))
        # offload and activation checkpointing (None: neither)
        self.activations = activation_manager(
            cfg.offload, cfg.train.activation_checkpoint, cfg.model.shape(), rt.device, dtype
        )
        self.executor = HDPExecutor(
            self.model,
            self.zero,
            rt.comm,
            scheduler=self.scheduler,
            device=rt.device,
            activations=self.activations,
            cross_comm=cross if mode == "sync" else None,
            loss_normalization=cfg.train.loss_normalization,
        )
        # co2 / diloco rounds across islands
        self.cross: CrossIsland | None = None
        if mode in ("co2", "diloco"):
            self.cross = CrossIsland(cfg.co2, self.zero, rt.comm, cross)

    def _build_reports(self) -> None:
        """Metrics (the run's rank 0 writes), the balance summary, the policy comparison."""
        cfg, rt = self.cfg, self.rt
        err: Exception | None = None
        try:  # rank 0's files: another run's lock, a full disk stop every rank, at once
            self.metrics = MetricsWriter(
                cfg.metrics.dir,
                cfg.train.steps,
                active=rt.global_rank == 0,
                tensorboard=cfg.metrics.tensorboard,
                progress=cfg.metrics.progress,
                console_interval=cfg.metrics.console_interval,
                resume_step=self.start_step if self.checkpointer.resumed else None,
                run_id=self.checkpointer.run_id,
            )
            self._stack.callback(self.metrics.close)
            if rt.global_rank == 0:
                write_text_atomic(os.path.join(cfg.metrics.dir, "config.toml"), to_toml(cfg))
        except Exception as exc:  # noqa: BLE001 - raised below on every rank, never left waiting
            err = exc
        if any_rank(rt.run_comm, err is not None, rt.device):
            if isinstance(err, OSError):
                raise ConfigError(f"metrics.dir {cfg.metrics.dir}: cannot write ({err})") from None
            if err is not None:
                raise err
            raise PeerError(f"metrics.dir {cfg.metrics.dir}: refused (reported by rank 0)")
        self.metrics.set_start(self.start_step)
        self.balance = BalanceSummary(islands=rt.islands, start_step=self.start_step)
        if self.activations is not None:
            cost = self.data.planner.cost
            n_layers = cfg.model.shape().n_layers
            self.balance.offload = OffloadSummary(n_layers, cost.act_bytes_per_token_layer)
        self.compare = None
        if cfg.metrics.compare:  # another policy on the same batches, for the report
            self.compare = PolicyComparison(
                cfg.metrics.compare,
                cfg.metrics.compare_interval,
                self.data,
                self.executor,
                rt.rank,
                clock=cfg.metrics.compare_clock,
            )

    def memory_record(self) -> dict[str, Any]:
        """This rank's model-state bytes (datapipe.plan.memory's formula counts the same)."""
        mem = self.zero.memory()
        rec: dict[str, Any] = {
            "zero": self.zero.level,
            "mem_weights_bytes": mem.weights,
            "mem_master_bytes": mem.master,
            "mem_moments_bytes": mem.moments,
            "mem_grads_bytes": mem.grads,
            "mem_grads_peak_bytes": mem.grads_peak,
        }
        if self.cross is not None:
            rec["mem_outer_bytes"] = self.cross.memory_bytes()
        return rec

    def train_step(self, step: int, item: Step) -> dict[str, Any]:
        """One optimizer step of the prefetched `item`; returns the metrics record (also
        written)."""
        t0 = time.perf_counter()
        self.hooks.begin_step(step)
        batch, plan = item.batch, item.plan
        lr = self.optimizer.param_groups[0]["lr"]
        compare_s = 0.0
        if self.compare is not None:  # its passes' time is not the step's
            tc = time.perf_counter()
            self.compare.before_step(step, batch, plan)
            compare_s = time.perf_counter() - tc
        res = self.executor.step(plan, item.microbatches, step, item.loss_tokens)
        check_finite_step(step, res.loss, res.grad_norm, self.rt, self.checkpointer.last_path)
        outer = self._outer_step(step)
        step_s = time.perf_counter() - t0 - compare_s + item.wait_s
        planned = (plan.rank_time_ns / 1e9).tolist()
        rec = step_record(step, batch, plan, res, lr, item.wait_s, step_s)
        above = None
        if self.data.mixture:  # tokens by source, against the shares in force
            rec["tokens_by_source"] = self.data.tokens_by_source(batch)
            rec["stage"] = item.stream_state["stage"]
            above = self.data.stream.tokens_above(batch)
        if self.rt.islands > 1:  # the whole run's tokens, samples, loss, step time
            summed = self.executor.cross_comm is not None  # sync: loss and labels already
            above = world_figures(rec, above, self.rt, summed)
        self.balance.add(
            res.compute_s, planned, res.microbatches, rec["step_time_s"], rec["tokens"]
        )
        if self.data.mixture:
            target = dict(zip(self.data.source_names, item.stream_state["segment"]["weights"]))
            self.balance.add_mix(rec["tokens_by_source"], target, above)
        rec.update(outer)
        rec.update(self.memory_record())
        if self.balance.offload is not None and self.executor.plan_offload is not None:
            po = self.executor.plan_offload
            rec.update(self.balance.offload.add(po, res.offload_bytes, res.act_peak_bytes))
        if self.compare is not None and (row := self.compare.after_step(step, res)):
            rec["compare"] = row
            rec["compare_s"] = compare_s
        val = self.data.validation
        if val is not None and step % self.cfg.train.eval_interval == 0:
            held = val.run(self.executor, self.rt.rank)
            rec["val_loss"] = held.loss
            rec["val_tokens"] = val.tokens
            rec["val_by_position"] = held.by_position()
            if isinstance(val, MixValidation):
                rec["val_by_source"] = dict(val.by_source)
        self.metrics.log(rec)
        if self.rt.global_rank != 0:  # global rank 0's line is the metrics console line
            get_logger().info(
                f"step {step}: {res.microbatches[self.rt.rank]} micro-batches, compute "
                f"{res.compute_s[self.rt.rank]:.3f} s, ring wait {res.ring_wait_s[self.rt.rank]:.3f} s"
            )
        return rec

    def _outer_step(self, step: int) -> dict[str, Any]:
        """The co2 / diloco round after an optimizer step; after the run's last step every
        pending average is applied (a stop_after end keeps its round in flight: the checkpoint
        holds it)."""
        if self.cross is None:
            return {}
        rec = self.cross.after_step()
        if step == self.cfg.train.steps:
            rec.update(self.cross.finish())
        return rec

    def train(self) -> dict[str, Any]:
        """Run from the resumed step to `train.steps` (or `train.stop_after`); returns a summary
        (losses, val losses, paths)."""
        cfg = self.cfg
        last = cfg.train.steps
        if cfg.train.stop_after:
            last = min(last, cfg.train.stop_after)
        steps = self.data.steps()
        losses: list[float] = []
        val_losses: list[tuple[int, float]] = []
        label = cfg.parallel.planner.policy
        step = self.start_step
        try:
            with signals_as_interrupts():
                for step in range(self.start_step + 1, last + 1):
                    item = next(steps)
                    rec = self.train_step(step, item)
                    losses.append(rec["loss"])
                    label = item.plan.label
                    if "val_loss" in rec:
                        val_losses.append((step, rec["val_loss"]))
                    if self.checkpointer.due(step, last):
                        self.checkpointer.save(step, item.stream_state)
        except Interrupted as exc:
            raise TrainingInterrupted(exc.signum, step, self.checkpointer.last_path()) from None
        # the last step's weight all-gather may still be in flight (async_gather): finish it so
        # the model is whole and no gloo work is pending when the process group goes
        self.zero.wait_weights()
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
        if self.rt.global_rank == 0:
            log = get_logger()
            if not self.balance.steps:  # a restart of a job that had ended: its report stays
                log.info(f"no step left to run (the run ended at step {self.start_step})")
                return summary
            report = self.balance.render(label)
            if self.compare is not None:
                report += "\n" + self.compare.render()
            write_text_atomic(summary["balance_report"], report)
            log.info(report.rstrip("\n"))
            log.info(f"metrics:        {summary['metrics']}")
            log.info(f"balance report: {summary['balance_report']}")
            if cfg.checkpoint.dir:
                log.info(f"checkpoints:    {cfg.checkpoint.dir}")
        return summary

    def close(self) -> None:
        """Release the prefetcher, readers and metrics files."""
        self._stack.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
