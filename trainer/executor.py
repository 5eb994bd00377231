"""The HDP step executor: runs one rank's share of a StepPlan and updates the model.

Each rank runs its micro-batches in slot order (forward, backward, gradients accumulate), with ring
attention over the micro-batch's group for group micro-batches and document-masked local attention
otherwise. After its last micro-batch it joins ONE coalesced SUM all-reduce over the island of a
flat buffer holding every gradient, the loss sum and its own timings; then gradients are divided by
the step's labelled positions (sum of L-1 over the step's samples), clipped, and AdamW steps. No
per-bucket hooks (ranks run different numbers of micro-batches) and no process group per step:
rings talk point-to-point inside the island's communicator.

The same code runs every policy's plans (datapipe.plan.planner): hdp, naive-hdp, static and single.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from datapipe.errors import MixlenError
from datapipe.fetch import PackedMicroBatch
from datapipe.plan.stepplan import PlannedMicroBatch, StepPlan
from trainer.attention import LocalAttention, accum_dtype
from trainer.comm import Communicator, CountingComm
from trainer.offload import ActivationManager, MicrobatchStats
from trainer.offload_plan import PlanOffload
from trainer.ring import RingAttention

__all__ = ["HDPExecutor", "StepResult", "labelled_positions"]


def labelled_positions(lengths: np.ndarray) -> int:
    """Loss denominator of a step: sum of L-1 over its non-empty samples."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return int(np.maximum(lengths - 1, 0).sum())


# --- the executor --------------------------------------------------------------------------------


@dataclass
class StepResult:
    """What one step did (identical on every rank of the island, except the `rank_*` fields)."""

    loss: float  # sum of token losses / labelled positions of the step
    n_labels: int
    tokens: int
    grad_norm: float  # before clipping
    compute_s: list[float]  # per rank: first micro-batch start to last micro-batch end
    microbatches: list[int]  # per rank
    ring_wait_s: list[float] = field(default_factory=list)  # per rank: blocked in ring hops
    p2p_bytes: list[int] = field(default_factory=list)  # per rank: ring bytes sent
    rank_p2p_bytes: int = 0  # this rank's ring bytes sent
    rank_comm_s: float = 0.0  # this rank's time in ring waits and the all-reduce
    reduce_bytes: int = 0  # payload of the coalesced all-reduce
    # per rank, with an activation manager (offload or checkpointing; else empty): bytes moved to
    # host, and the accounted peak of saved-activation bytes on the device (trainer.offload)
    offload_bytes: list[int] = field(default_factory=list)
    act_peak_bytes: list[int] = field(default_factory=list)


class HDPExecutor:
    """Runs steps of StepPlans on one rank of an island.

    `model` computes (its dtype is the compute dtype); `master` holds the weights the optimizer
    updates (the same module for float32/float64; a float32 copy for bfloat16, copied back into
    `model` after each step). `activations` (trainer.offload) runs each micro-batch's forward and
    backward with its plan's offload ratio and the checkpointing policy; None: plain.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Communicator,
        *,
        master: nn.Module | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        grad_clip: float = 0.0,
        device: torch.device | str = "cpu",
        check_agreement: bool = True,
        activations: ActivationManager | None = None,
    ) -> None:
        self.model = model
        self.master = master if master is not None else model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.comm = comm if isinstance(comm, CountingComm) else CountingComm(comm)
        self.grad_clip = float(grad_clip)
        self.device = torch.device(device)
        self.check_agreement = check_agreement
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master_params = [p for p in self.master.parameters() if p.requires_grad]
        if len(self.params) != len(self.master_params):
            raise ValueError("model and master have different parameters")
        self.compute_dtype = self.params[0].dtype
        self.acc_dtype = accum_dtype(self.compute_dtype)
        # low-precision compute: drain gradients into a float32 buffer after every micro-batch
        self.drain = self.compute_dtype not in (torch.float32, torch.float64)
        self.numel = sum(p.numel() for p in self.params)
        # (slot, wall s, this thread's CPU s) of each micro-batch of the last step, for benchmarks
        self.mb_log: list[tuple[int, float, float]] = []
        self.activations = activations
        self.act_stats: list[MicrobatchStats] = []  # this rank's micro-batches of the last step
        self.plan_offload: PlanOffload | None = None  # every rank's, of the last checked plan

    @property
    def rank(self) -> int:
        return self.comm.rank

    # -- checks ------------------------------------------------------------------------------------

    def check_plan(self, plan: StepPlan, step: int) -> None:
        """All-gather the plan digest and stop on mismatch (first, so that every rank takes part
        before any rank can refuse), then refuse plans this executor cannot run."""
        if self.check_agreement and self.comm.size > 1:
            d = np.frombuffer(plan.digest(), dtype="<i8").astype(np.int64)
            mine = torch.tensor([step, int(d[0]), int(d[1])], dtype=torch.int64, device=self.device)
            got = self.comm.all_gather(mine)
            bad = [r for r, t in enumerate(got) if not torch.equal(t, mine)]
            if bad:
                raise MixlenError(
                    f"step {step}: rank {self.rank} disagrees with rank(s) {bad} about the plan "
                    "(different dataset, config, cost file or code version across ranks?)"
                )
        if plan.num_ranks != self.comm.size:
            raise MixlenError(
                f"step {step}: plan for {plan.num_ranks} ranks, but the island has {self.comm.size}"
            )
        if self.activations is not None:  # host budget of every rank's micro-batches
            self.plan_offload = self.activations.check_plan(plan, step)
        elif plan.mb_offload.size and float(plan.mb_offload.max()) > 0.0:
            raise MixlenError(
                f"step {step}: the plan offloads activations (offload_ratio up to "
                f"{float(plan.mb_offload.max()):.2f}) but offload.enabled = false"
            )

    # -- micro-batches -----------------------------------------------------------------------------

    def _run_microbatch(
        self,
        pm: PlannedMicroBatch,
        mb: PackedMicroBatch,
        lengths_by_id: dict[int, int],
        grad: bool,
    ) -> torch.Tensor:
        """Forward (and backward if grad) of one micro-batch; returns the detached loss sum."""
        dev = self.device
        ids = torch.from_numpy(mb.input_ids).to(dev)
        pos = torch.from_numpy(mb.position_ids).to(dev)
        labels = torch.from_numpy(mb.labels).to(dev)
        k = len(pm.group)
        if k == 1:
            for sid, s, e in pm.pieces:
                if s != 0 or e != lengths_by_id[sid]:
                    raise MixlenError(
                        f"slot {pm.slot}: local piece ({sid}, {s}, {e}) is not a whole sample"
                    )
            attn = LocalAttention(mb.cu_seqlens.tolist())
        else:
            lens = []
            for sid, s, e in pm.group_pieces:
                if s != 0 or e != lengths_by_id[sid]:
                    raise MixlenError(
                        f"slot {pm.slot}: group piece ({sid}, {s}, {e}) is not a whole sample; "
                        "ring attention needs whole samples"
                    )
                lens.append(e - s)
            attn = RingAttention(self.comm, pm.group, pm.group_index, lens, device=dev)
            if not np.array_equal(attn.layout.position_ids(pm.group_index), mb.position_ids):
                raise MixlenError(
                    f"slot {pm.slot}: the fetched positions are not this member's zigzag share "
                    "(the fetcher and the plan disagree)"
                )
        # offload / checkpointing of the blocks (a context yielding None: plain)
        acts: contextlib.AbstractContextManager[MicrobatchStats | None] = contextlib.nullcontext()
        if grad and self.activations is not None:
            acts = self.activations.microbatch(self.model, pm.offload_ratio)
        with torch.set_grad_enabled(grad), acts as stats:
            loss_sum, _ = self.model(ids, pos, labels=labels, attn=attn)
            if grad:
                loss_sum.backward()
        if stats is not None:
            self.act_stats.append(stats)
        return loss_sum.detach().to(self.acc_dtype)

    def _drain(self, buf: torch.Tensor) -> None:
        off = 0
        for p in self.params:
            n = p.numel()
            if p.grad is not None:
                buf[off : off + n] += p.grad.reshape(-1).to(buf.dtype)
                p.grad = None
            off += n

    def _flat_grads(self, buf: torch.Tensor) -> None:
        off = 0
        for p in self.params:
            n = p.numel()
            if p.grad is not None:
                buf[off : off + n].copy_(p.grad.reshape(-1))
            off += n

    def _run_rank(
        self, plan: StepPlan, fetched: Sequence[PackedMicroBatch], grad: bool, buf: torch.Tensor
    ) -> tuple[torch.Tensor, float, int]:
        """This rank's micro-batches in slot order: (loss sum, busy seconds, count)."""
        mine = plan.microbatches(self.rank)
        if len(mine) != len(fetched):
            raise ValueError(f"{len(fetched)} fetched micro-batches for {len(mine)} in the plan")
        lengths_by_id = dict(zip(plan.sample_ids.tolist(), plan.lengths.tolist()))
        loss = torch.zeros((), dtype=self.acc_dtype, device=self.device)
        t0 = time.perf_counter()
        self.mb_log = []
        self.act_stats = []
        for pm, mb in zip(mine, fetched):
            w0, c0 = time.perf_counter(), time.thread_time()
            loss += self._run_microbatch(pm, mb, lengths_by_id, grad)
            if grad and self.drain:
                self._drain(buf[: self.numel])
            self.mb_log.append((pm.slot, time.perf_counter() - w0, time.thread_time() - c0))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # timings measure work, not kernel launches
        busy = time.perf_counter() - t0 if mine else 0.0
        return loss, busy, len(mine)

    # -- steps -------------------------------------------------------------------------------------

    def accumulate(
        self, plan: StepPlan, fetched: Sequence[PackedMicroBatch], step: int
    ) -> StepResult:
        """Forward/backward of this rank's micro-batches, then the coalesced all-reduce: leaves the
        step's gradient (divided by its labelled positions) in the master parameters' .grad."""
        self.comm.reset()
        self.check_plan(plan, step)
        n, size = self.numel, self.comm.size
        # [grads | loss sum | per rank: busy seconds, micro-batches, ring wait s, ring bytes sent,
        #  offload bytes moved, activation peak bytes]
        buf = torch.zeros(n + 1 + 6 * size, dtype=self.acc_dtype, device=self.device)
        for p in self.params:
            p.grad = None
        loss, busy, count = self._run_rank(plan, fetched, True, buf)
        if not self.drain:
            self._flat_grads(buf)
        buf[n] = loss
        buf[n + 1 + self.rank] = busy
        buf[n + 1 + size + self.rank] = count
        buf[n + 1 + 2 * size + self.rank] = self.comm.wait_s
        buf[n + 1 + 3 * size + self.rank] = self.comm.p2p_bytes
        buf[n + 1 + 4 * size + self.rank] = sum(s.moved_bytes for s in self.act_stats)
        buf[n + 1 + 5 * size + self.rank] = max((s.peak_bytes for s in self.act_stats), default=0)
        t0 = time.perf_counter()
        self.comm.all_reduce(buf)
        reduce_s = time.perf_counter() - t0
        n_labels = labelled_positions(plan.lengths)
        scale = 1.0 / max(n_labels, 1)
        buf[:n].mul_(scale)
        off = 0
        for p in self.master_params:  # the master's gradients are views of the reduced buffer
            assert p.dtype == buf.dtype, "master weights are kept in the accumulation dtype"
            k = p.numel()
            p.grad = buf[off : off + k].view_as(p)
            off += k
        if self.master is not self.model:
            for p in self.params:
                p.grad = None
        stats = buf[n:].tolist()
        managed = self.activations is not None
        return StepResult(
            loss=stats[0] * scale,
            n_labels=n_labels,
            tokens=int(plan.lengths.sum()),
            grad_norm=float("nan"),
            compute_s=stats[1 : 1 + size],
            microbatches=[int(x) for x in stats[1 + size : 1 + 2 * size]],
            ring_wait_s=stats[1 + 2 * size : 1 + 3 * size],
            p2p_bytes=[int(x) for x in stats[1 + 3 * size : 1 + 4 * size]],
            rank_p2p_bytes=self.comm.p2p_bytes,
            rank_comm_s=self.comm.wait_s + reduce_s,
            reduce_bytes=buf.numel() * buf.element_size(),
            offload_bytes=[int(x) for x in stats[1 + 4 * size : 1 + 5 * size]] if managed else [],
            act_peak_bytes=[int(x) for x in stats[1 + 5 * size :]] if managed else [],
        )

    def update(self, result: StepResult) -> None:
        """Clip the accumulated gradient, step AdamW and the schedule (records the norm)."""
        if self.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.master_params, self.grad_clip)
        else:
            norm = torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in self.master_params])
            )
        result.grad_norm = float(norm)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not self.model:
            with torch.no_grad():
                for p, m in zip(self.params, self.master_params):
                    p.copy_(m)

    def step(self, plan: StepPlan, fetched: Sequence[PackedMicroBatch], step: int) -> StepResult:
        """One optimizer step of `plan`; `fetched` are this rank's micro-batches in slot order."""
        result = self.accumulate(plan, fetched, step)
        self.update(result)
        return result

    @torch.no_grad()
    def evaluate(self, plan: StepPlan, fetched: Sequence[PackedMicroBatch]) -> tuple[float, int]:
        """Forward only: (sum of token losses over the island, labelled positions)."""
        self.check_plan(plan, -1)
        loss, _, _ = self._run_rank(plan, fetched, False, torch.zeros(0))
        t = loss.reshape(1).clone()
        self.comm.all_reduce(t)
        return float(t.item()), labelled_positions(plan.lengths)
