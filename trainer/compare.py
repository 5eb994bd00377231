"""`[metrics] compare = "static"`: run every `compare_interval`-th step's global batch under both
the run's plan and another policy's and report, at the end of the run, both policies' predicted
and measured times on the same batches, step by step.

Both plans come from the planning package's comparison service (datapipe.plan.compare: the same
planners and metrics as `mixlen plan`); the static mesh's context is `parallel.max_context`
(default: the dataset's longest sample) whatever the run's policy. On a compared step, before the
step itself, each plan runs one timed pass: forward, backward and the gradient reduction
(`HDPExecutor.accumulate`), with no optimizer update (the reduced gradient is discarded), so
training follows the configured policy exactly as without the comparison and both policies are
measured alike. Neither is favoured by order: the first compared step warms both up with an
untimed pass each, and the other policy runs first on odd comparisons, second on even ones.
Measured time of a pass: the slowest rank's compute span (wall clock, ring waits included), and,
since ranks that share cores cannot show balance in wall time, each micro-batch's thread CPU time
(the slowest member of its group) replayed in the plan's slot order. Predicted: the plan's
estimated makespan (the micro-batches: the work around a step, the same for both passes, is in
neither measurement), in the cost file's clock.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from datapipe.errors import MixlenError
from datapipe.plan.compare import Variant, compare, variant_planners
from datapipe.plan.stepplan import StepPlan, replay_kernel
from datapipe.stream import GlobalBatch
from trainer.compare_report import render_comparison
from trainer.data import TrainData
from trainer.parallel.comm import Communicator
from trainer.parallel.executor import HDPExecutor, StepResult

__all__ = ["PolicyComparison", "replayed_cpu_s"]


class PolicyComparison:
    """The second policy's planner, both passes' times on the compared steps, and the report."""

    def __init__(
        self,
        policy: str,
        interval: int,
        data: TrainData,
        executor: HDPExecutor,
        rank: int,
        clock: str = "wall",
    ) -> None:
        spec = data.planner_spec
        max_len = data.longest
        base = dataclasses.replace(spec.config, max_context=spec.config.max_context or max_len)
        seed = data.planner.config.seed
        other = variant_planners(
            [Variant(policy)], base, spec.cost, spec.num_ranks, seed, spec.names
        )
        self.planners = {"run": data.planner, "other": other[policy]}
        self.policy, self.interval, self.clock = policy, interval, clock
        self.data, self.executor, self.rank = data, executor, rank
        self.rows: list[dict[str, Any]] = []
        self._pending: tuple[StepPlan, StepPlan, dict[str, Any]] | None = None

    def _due(self, step: int) -> bool:
        return step % self.interval == 0

    def _pass(self, plan: StepPlan, batch: GlobalBatch, step: int) -> tuple[float, float]:
        """Forward, backward and reduction of `batch`'s `plan` without an update: (wall s,
        CPU-replayed s) of the slowest rank."""
        ex = self.executor
        fetched = self.data.fetcher.fetch_step(self.data.pieces(plan, batch))
        res = ex.accumulate(plan, fetched, step)
        cpu = replayed_cpu_s(ex.comm, ex.mb_log, plan, self.rank)
        ex.zero.discard()  # the run's next step starts from a clean gradient
        return max(res.compute_s), cpu

    def before_step(self, step: int, batch: GlobalBatch, plan: StepPlan) -> None:
        """On a compared step: plan the batch with both policies (on the first, warm both up
        untimed), then time a pass of each, the second policy first on odd comparisons."""
        if not self._due(step):
            return
        res = compare(self.planners, [(batch.lengths, plan.sample_ids)])
        mine, other = res["run"].plans[0], res["other"].plans[0]
        if mine.digest() != plan.digest():
            raise MixlenError(f"step {step}: the comparison re-planned the step differently")
        if not self.rows and self._pending is None:
            self._pass(mine, batch, step)  # warm-up, untimed: the executor's and the
            self._pass(other, batch, step)  # kernels' first use
        first = (step // self.interval) % 2 == 1  # from the step: a resumed run keeps the order
        row: dict[str, Any] = {"step": step, "other_first": first, "planning_ms": {
            "run": res["run"].plan_ms[0], "other": res["other"].plan_ms[0]}}  # fmt: skip
        for who in ("other", "run") if first else ("run", "other"):
            wall, cpu = self._pass(other if who == "other" else mine, batch, step)
            prefix = "other_" if who == "other" else ""
            row[f"{prefix}measured_wall_s"], row[f"{prefix}measured_cpu_s"] = wall, cpu
        self._pending = (mine, other, row)

    def after_step(self, step: int, res: StepResult) -> dict | None:
        """On a compared step, after the step: the record of both passes (None on other
        steps)."""
        if self._pending is None or not self._due(step):
            return None
        mine, other, row = self._pending
        self._pending = None
        row.update(
            policy=mine.label,
            predicted_s=mine.makespan_ns / 1e9,
            other_policy=other.label,
            other_predicted_s=other.makespan_ns / 1e9,
            other_groups=sorted({int(k) for k in other.group_sizes}),
            local_samples=_local_share(mine),
            other_local_samples=_local_share(other),
            meta={k: v for k, v in mine.meta.items() if k in ("cp", "dp")},
            other_meta={k: v for k, v in other.meta.items() if k in ("cp", "dp")},
        )
        row["measured_s"] = row[f"measured_{self.clock}_s"]
        row["other_measured_s"] = row[f"other_measured_{self.clock}_s"]
        self.rows.append(row)
        return row

    def render(self) -> str:
        """The report for the end of the run (also in balance.md)."""
        return render_comparison(self.rows, self.interval, self.clock)


def replayed_cpu_s(comm: Communicator, mb_log: list, plan: StepPlan, rank: int) -> float:
    """Makespan of a pass of `plan` with each micro-batch's thread CPU time (from the executor's
    `mb_log` of (slot, cpu s) on every rank; a group waits for its slowest member) replayed
    in slot order; one all-reduce over `comm`, the plan's ranks."""
    log = torch.zeros(comm.size, plan.num_microbatches, dtype=torch.float64)
    for slot, cpu in mb_log:
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
