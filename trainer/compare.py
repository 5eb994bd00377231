"""`[metrics] compare = "static"`: run every `compare_interval`-th step's global batch a second time
under another policy's plan and report, at the end of the run, both policies' predicted and
measured times on the same batches.

The second pass is forward, backward and the gradient all-reduce (`HDPExecutor.accumulate`), with
no optimizer update: its reduced gradient is discarded, so training
follows the configured policy exactly as without the comparison. Measured time of a pass: the
slowest rank's compute span (first micro-batch start to last micro-batch end, wall clock, ring
waits included), for both passes alike; and, since ranks that share cores cannot show balance in
wall time, each micro-batch's thread CPU time (the slowest member of its group) replayed in the
plan's slot order. Predicted: the plan's estimated makespan, in the cost file's clock
(`compare_clock` says which measurement the report sets beside it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from datapipe.plan.planner import Planner
from datapipe.plan.stepplan import StepPlan, replay_kernel
from trainer.data import TrainData, rank_pieces
from trainer.parallel.comm import Communicator
from trainer.parallel.executor import HDPExecutor, StepResult

__all__ = ["PolicyComparison"]


class PolicyComparison:
    """The second policy's planner, its passes' times beside the run's, and the report."""

    def __init__(
        self,
        policy: str,
        interval: int,
        data: TrainData,
        executor: HDPExecutor,
        rank: int,
        clock: str = "wall",
    ) -> None:
        cfg = data.planner.config
        max_len = int(np.max(data.fetcher.lengths)) if len(data.fetcher.lengths) else 1
        other = dataclasses.replace(
            cfg,
            policy=policy,
            widen=False,
            max_context=(cfg.max_context or max_len) if policy == "static" else None,
        )
        self.planner: Planner = other.build(data.planner.cost)
        self.policy, self.interval, self.clock = policy, interval, clock
        self.data, self.executor, self.rank = data, executor, rank
        self.rows: list[dict[str, Any]] = []
        self.label = ""
        self.other_label = policy

    def after_step(self, step: int, batch: Any, plan: StepPlan, res: StepResult) -> dict | None:
        """On every `interval`-th step: plan the same batch with the other policy, run it (no
        update) and record both; returns the record (None on other steps)."""
        if step % self.interval:
            return None
        ex = self.executor
        cpu = replayed_cpu_s(ex.comm, ex.mb_log, plan, self.rank)  # the run's pass (its log)
        other = self.planner.plan(batch.lengths, self.data.train_ids[batch.sample_ids])
        fetched = self.data.fetcher.fetch_step(rank_pieces(other, self.rank))
        res2 = self.executor.accumulate(other, fetched, step)
        cpu2 = replayed_cpu_s(ex.comm, ex.mb_log, other, self.rank)
        self.executor.zero.discard()  # the run's next step starts from a clean gradient
        self.label, self.other_label = plan.label, other.label
        row = {
            "policy": plan.label,
            "predicted_s": plan.makespan_ns / 1e9,
            "measured_wall_s": max(res.compute_s),
            "measured_cpu_s": cpu,
            "other_policy": other.label,
            "other_predicted_s": other.makespan_ns / 1e9,
            "other_measured_wall_s": max(res2.compute_s),
            "other_measured_cpu_s": cpu2,
            "other_groups": sorted({int(k) for k in other.group_sizes}),
            "local_samples": _local_share(plan),
            "other_meta": {k: v for k, v in other.meta.items() if k in ("cp", "dp")},
        }
        row["measured_s"] = row[f"measured_{self.clock}_s"]
        row["other_measured_s"] = row[f"other_measured_{self.clock}_s"]
        self.rows.append(row)
        return row

    def render(self) -> str:
        """A few lines for the end of the run (also in balance.md)."""
        if not self.rows:
            return ""
        a, b = self.label, self.other_label
        tot = {k: sum(r[k] for r in self.rows) for k in self.rows[0] if k.endswith("_s")}
        pa, pb = tot["predicted_s"], tot["other_predicted_s"]
        ma, mb = tot["measured_s"], tot["other_measured_s"]
        local = float(np.mean([r["local_samples"] for r in self.rows]))
        meta = self.rows[0]["other_meta"]
        mesh = f" (CP {meta['cp']} x DP {meta['dp']}: every sample split over {meta['cp']} ranks)"
        every = "every step" if self.interval == 1 else f"every {_nth(self.interval)} step"
        lines = [
            f"{a} vs {b} on the same {len(self.rows)} global batches ({every}; {b} runs them a "
            "second time without updating the model):",
            f"  {a}: each sample on as few ranks as it needs ({local:.0%} of the samples computed "
            "whole on one rank, no ring)",
            f"  {b}{mesh if 'cp' in meta else ''}",
            "",
            "| policy | predicted s | measured s, wall clock | measured s, CPU replayed |",
            "| --- | ---: | ---: | ---: |",
            f"| {a} | {pa:.2f} | {tot['measured_wall_s']:.2f} | {tot['measured_cpu_s']:.2f} |",
            f"| {b} | {pb:.2f} | {tot['other_measured_wall_s']:.2f} | "
            f"{tot['other_measured_cpu_s']:.2f} |",
            "",
            f"{a} is {mb / ma:.2f}x as fast as {b} on these batches (the planner predicted "
            f"{pb / pa:.2f}x). Measured: {CLOCKS[self.clock]}",
        ]
        return "\n".join(lines) + "\n"


CLOCKS = {
    "wall": "the slowest rank's compute time per step (wall clock), summed.",
    "cpu": "each micro-batch's CPU time replayed in the plan's order (ranks share cores here; "
    "the cost file is calibrated with --clock cpu), summed over steps.",
}


def replayed_cpu_s(comm: Communicator, mb_log: list, plan: StepPlan, rank: int) -> float:
    """Makespan of a pass of `plan` with each micro-batch's thread CPU time (from the executor's
    `mb_log` of (slot, start, cpu s) on every rank; a group waits for its slowest member) replayed
    in slot order; one all-reduce over `comm`, the plan's ranks."""
    log = torch.zeros(comm.size, plan.num_microbatches, dtype=torch.float64)
    for slot, _, cpu in mb_log:
        log[rank, slot] = cpu
    comm.all_reduce(log)
    mb_ns = (log.amax(dim=0).numpy() * 1e9).astype(np.int64)
    finish = replay_kernel(
        plan.mb_group_offsets.astype(np.int64), plan.group_ranks.astype(np.int64), mb_ns, comm.size
    )
    return float(finish.max()) / 1e9 if finish.size else 0.0


def _local_share(plan: StepPlan) -> float:
    """Fraction of the plan's samples computed whole by one rank."""
    k = plan.group_sizes
    items = np.repeat(k, np.diff(plan.mb_piece_offsets))
    n = plan.lengths[plan.lengths > 0].shape[0]
    return float((items == 1).sum() / n) if n else 1.0


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
