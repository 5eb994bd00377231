"""The HDP step executor: runs one rank's share of a StepPlan and updates the model.

Each rank runs its micro-batches in slot order (forward, backward), with ring attention over the
micro-batch's group for group micro-batches and document-masked local attention otherwise. The
island's sharded optimizer (trainer.parallel.zero, `[parallel] zero`) takes every gradient from
post-accumulate-grad hooks into its buckets; during the rank's LAST micro-batch's backward it
launches each bucket's SUM reduction (to the bucket's owner; an all-reduce at zero 0) as soon as
the bucket is final, in one fixed order on every rank, on the island's gradient communicator, so
the reduction overlaps the rest of that backward and no rank ever waits on a peer still in an
earlier micro-batch. After the last micro-batch one small all-reduce sums the loss and the ranks'
timings; the gradient is divided by the step's denominator (`loss_normalization` "token": its
labelled positions, the sum of L-1 over its samples or, with a loss mask, of their `loss_tokens`;
"sequence": each position weighs 1 / its sample's loss_tokens and the divisor is the step's
samples with a labelled position; in `sync` mode over every island's), clipped by its global
norm, and AdamW steps each rank's slice, whose weights the island then all-gathers. No process group per step: rings talk
point-to-point inside the island's communicator.

The same code runs every policy's plans (datapipe.plan.planner): hdp, naive-hdp, static and single.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from datapipe.errors import MixlenError
from datapipe.fetch import PackedMicroBatch
from datapipe.plan.loss import (
    IGNORE_INDEX,
    LOSS_NORMALIZATIONS,
    sequence_divisor,
)
from datapipe.plan.stepplan import PlannedMicroBatch, StepPlan
from trainer.attention.local import LocalAttention, accum_dtype
from trainer.attention.ring import RingAttention
from trainer.attention.varlen import to_device
from trainer.offload.manager import ActivationManager, MicrobatchStats
from trainer.offload.plan import PlanOffload
from trainer.parallel.comm import Communicator, CountingComm
from trainer.parallel.stats import StepStats
from trainer.parallel.zero import ZeroOptimizer

__all__ = ["HDPExecutor", "StepResult", "TokenLosses"]


class TokenLosses(NamedTuple):
    """A micro-batch's labelled positions on this rank (HDPExecutor.token_losses)."""

    loss: np.ndarray  # float64, each position's cross-entropy
    correct: np.ndarray  # bool, greedy prediction == label
    position: np.ndarray  # int64, the position within its sample
    sample: np.ndarray  # int64, the sample id


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
    rank_comm_s: float = 0.0  # this rank's time in ring waits and the reductions
    reduce_bytes: int = 0  # this rank's gradient payload plus the statistics all-reduce
    grad_wait_s: float = 0.0  # this rank: blocked on the gradient reduction after the backward
    grad_hidden: float = 0.0  # this rank: share of the reduction's span hidden behind work
    cross_wait_s: float = 0.0  # sync mode, this rank: in the cross-island all-reduces
    # per rank, with an activation manager (offload or checkpointing; else empty): bytes moved to
    # host, and the accounted peak of saved-activation bytes on the device (trainer.offload.manager)
    offload_bytes: list[int] = field(default_factory=list)
    act_peak_bytes: list[int] = field(default_factory=list)
    loss_divisor: int = 0  # what the loss sum was divided by (loss_normalization's denominator)


class HDPExecutor:
    """Runs steps of StepPlans on one rank of an island.

    `model` computes (its dtype is the compute dtype); `zero` (trainer.parallel.zero.ZeroOptimizer over
    the model's trainable parameters, on this island) reduces the gradients and steps AdamW;
    `scheduler` is an LR schedule of `zero.optimizer`. `cross_comm` (sync mode: rank i of every
    island) sums the loss and its denominator across islands; `zero` then needs the same
    communicator to sum the gradients. `activations` (trainer.offload.manager) runs each micro-batch's
    forward and backward with its plan's offload ratio and the checkpointing policy; None: plain.
    `loss_normalization` ("token" or "sequence", datapipe.plan.loss) is the step's loss rule.
    """

    def __init__(
        self,
        model: nn.Module,
        zero: ZeroOptimizer | None,
        comm: Communicator,
        *,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        device: torch.device | str = "cpu",
        check_agreement: bool = True,
        activations: ActivationManager | None = None,
        cross_comm: Communicator | None = None,
        loss_normalization: str = "token",
    ) -> None:
        if loss_normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(
                f"loss_normalization {loss_normalization!r}: not one of {LOSS_NORMALIZATIONS}"
            )
        self.loss_normalization = loss_normalization
        self.model = model
        self.zero = zero
        self.scheduler = scheduler
        self.comm = comm if isinstance(comm, CountingComm) else CountingComm(comm)
        self.cross_comm = cross_comm if cross_comm is not None and cross_comm.size > 1 else None
        self.device = torch.device(device)
        self.check_agreement = check_agreement
        from trainer.parallel.tensor import local_tensor

        # the tensors this process computes with (a DTensor parameter's local shard under TP)
        self.params = [local_tensor(p) for p in model.parameters() if p.requires_grad]
        self.compute_dtype = next(model.parameters()).dtype
        self.acc_dtype = accum_dtype(self.compute_dtype)
        self.numel = sum(p.numel() for p in self.params)
        if zero is not None:  # None: forward-only (evaluation)
            shapes = [p.shape for p in self.params]
            if shapes != zero.layout.shapes or zero.comm.size != comm.size:
                raise ValueError("the optimizer is not over this model's parameters on this island")
            zero.install_hooks()  # gradients go into its buckets as soon as they are final
        # (slot, this thread's CPU s) of each micro-batch of the last step, for the CPU clock's
        # replay (trainer/compare.py, calibrate, benchmarks); no wall time: on a GPU a micro-batch's
        # own wall time is its kernels' launches (the rank's synchronised busy time is in StepStats)
        self.mb_log: list[tuple[int, float]] = []
        self.activations = activations
        self.act_stats: list[MicrobatchStats] = []  # this rank's micro-batches of the last step
        self.plan_offload: PlanOffload | None = None  # every rank's, of the last checked plan
        self._cross_s = 0.0  # the last step's cross-island statistics all-reduce (sync mode)

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

    def _attention(
        self, pm: PlannedMicroBatch, mb: PackedMicroBatch, lengths_by_id: dict[int, int]
    ) -> LocalAttention | RingAttention:
        """The attention context of a planned micro-batch: document-masked local attention, or
        ring attention over its group (whole samples only, positions as the plan says)."""
        dev = self.device
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
        return attn

    def _run_microbatch(
        self,
        pm: PlannedMicroBatch,
        mb: PackedMicroBatch,
        lengths_by_id: dict[int, int],
        grad: bool,
        weight_by_id: dict[int, float] | None = None,
    ) -> torch.Tensor:
        """Forward (and backward if grad) of one micro-batch; returns the detached loss sum.
        `weight_by_id`: each sample's label weight (the "sequence" rule; None: 1)."""
        dev = self.device
        # pinned, non-blocking host-to-device copies on CUDA: the host goes on to the layers
        ids, pos, labels = (to_device(a, dev) for a in (mb.input_ids, mb.position_ids, mb.labels))
        kw = {}
        if weight_by_id is not None:  # each position weighs its sample's weight
            pieces = np.asarray(mb.pieces, dtype=np.int64).reshape(-1, 3)
            per_piece = np.array([weight_by_id[int(s)] for s in pieces[:, 0]], np.float64)
            w = np.repeat(per_piece, pieces[:, 2] - pieces[:, 1])
            kw["label_weights"] = to_device(
                w.astype(np.float32 if self.acc_dtype == torch.float32 else np.float64), dev
            )
        attn = self._attention(pm, mb, lengths_by_id)
        # offload / checkpointing of the blocks (a context yielding None: plain)
        acts: contextlib.AbstractContextManager[MicrobatchStats | None] = contextlib.nullcontext()
        if grad and self.activations is not None:
            acts = self.activations.microbatch(self.model, pm.offload_ratio)
        with torch.set_grad_enabled(grad), acts as stats:
            loss_sum, _ = self.model(ids, pos, labels=labels, attn=attn, **kw)
            if grad:
                loss_sum.backward()
        if stats is not None:
            self.act_stats.append(stats)
        return loss_sum.detach().to(self.acc_dtype)

    def _run_rank(
        self,
        plan: StepPlan,
        fetched: Sequence[PackedMicroBatch],
        grad: bool,
        weight_by_id: dict[int, float] | None = None,
    ) -> tuple[torch.Tensor, float, int]:
        """This rank's micro-batches in slot order: (loss sum, busy seconds, count). With `grad`,
        the optimizer's hooks collect the gradients; the last backward launches the reduction."""
        mine = plan.microbatches(self.rank)
        if len(mine) != len(fetched):
            raise ValueError(f"{len(fetched)} fetched micro-batches for {len(mine)} in the plan")
        lengths_by_id = dict(zip(plan.sample_ids.tolist(), plan.lengths.tolist()))
        loss = torch.zeros((), dtype=self.acc_dtype, device=self.device)
        t0 = time.perf_counter()
        self.mb_log = []
        self.act_stats = []
        for j, (pm, mb) in enumerate(zip(mine, fetched)):
            c0 = time.thread_time()
            if grad:
                self.zero.begin_microbatch(last=j == len(mine) - 1)
            loss += self._run_microbatch(pm, mb, lengths_by_id, grad, weight_by_id)
            self.mb_log.append((pm.slot, time.thread_time() - c0))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # timings measure work, not kernel launches
        busy = time.perf_counter() - t0 if mine else 0.0
        return loss, busy, len(mine)

    # -- steps -------------------------------------------------------------------------------------

    def accumulate(
        self,
        plan: StepPlan,
        fetched: Sequence[PackedMicroBatch],
        step: int,
        loss_tokens: np.ndarray | None = None,
    ) -> StepResult:
        """Forward/backward of this rank's micro-batches, the gradient reduction and the step's
        statistics: leaves the step's gradient (divided by its denominator, module docstring)
        in the optimizer (`zero.gather_grad()` shows it whole) and its norm in the result.
        `loss_tokens`: each of `plan.sample_ids`' labelled positions, from the index (a loss
        mask's; None: L - 1 each)."""
        assert self.zero is not None, "a forward-only executor (no optimizer) cannot train"
        self.comm.reset()
        self.check_plan(plan, step)
        lt = self._loss_tokens(plan, loss_tokens)
        weights = None
        if self.loss_normalization == "sequence":  # each sample's mean over its own positions
            ids = plan.sample_ids.tolist()
            weights = {s: 1.0 / n if n > 0 else 0.0 for s, n in zip(ids, lt.tolist())}
        self.zero.begin_step()  # the previous step's weights are all here
        loss, busy, count = self._run_rank(plan, fetched, True, weights)
        self.zero.finish_backward()  # ranks without micro-batches launch their share here
        t0 = time.perf_counter()
        stats, n_labels, divisor = self._step_stats(plan, loss, busy, count, lt)
        norm = self.zero.reduce(1.0 / max(divisor, 1))
        reduce_s = time.perf_counter() - t0
        red = self.zero.last_reduce
        managed = self.activations is not None
        return StepResult(
            loss=stats.loss_sum / max(divisor, 1),
            n_labels=n_labels,
            tokens=int(plan.lengths.sum()),
            grad_norm=norm,
            compute_s=stats.busy_s,
            microbatches=stats.microbatches,
            ring_wait_s=stats.ring_wait_s,
            p2p_bytes=stats.p2p_bytes,
            rank_p2p_bytes=self.comm.p2p_bytes,
            rank_comm_s=self.comm.wait_s + reduce_s,
            reduce_bytes=red.bytes + StepStats.nbytes(self.comm.size) + 16,
            grad_wait_s=red.wait_s,
            grad_hidden=red.hidden_fraction,
            cross_wait_s=self._cross_s + red.cross_s,
            offload_bytes=stats.offload_bytes if managed else [],
            act_peak_bytes=stats.act_peak_bytes if managed else [],
            loss_divisor=divisor,
        )

    def _loss_tokens(self, plan: StepPlan, loss_tokens: np.ndarray | None) -> np.ndarray:
        """Each plan sample's labelled positions (int64, L - 1 without a mask)."""
        if loss_tokens is None:
            return np.maximum(np.asarray(plan.lengths, np.int64) - 1, 0)
        lt = np.asarray(loss_tokens, np.int64)
        if lt.shape != plan.sample_ids.shape:
            raise ValueError(
                f"loss_tokens has {lt.shape[0]} entries for {plan.sample_ids.size} samples"
            )
        return lt

    def _step_stats(
        self, plan: StepPlan, loss: torch.Tensor, busy: float, count: int, loss_tokens: np.ndarray
    ) -> tuple[StepStats, int, int]:
        """One small island all-reduce of the step's statistics (trainer.parallel.stats); in
        sync mode the loss sum, the labelled positions and the divisor are also summed across
        islands. Returns them, the step's labelled positions and its divisor."""
        mine = {
            "busy_s": busy,
            "microbatches": count,
            "ring_wait_s": self.comm.wait_s,
            "p2p_bytes": self.comm.p2p_bytes,
            "offload_bytes": sum(s.moved_bytes for s in self.act_stats),
            "act_peak_bytes": max((s.peak_bytes for s in self.act_stats), default=0),
        }
        buf = StepStats.pack(loss, self.rank, self.comm.size, mine, self.device)
        self.comm.all_reduce(buf)
        n_labels = int(loss_tokens.sum())
        divisor = n_labels if self.loss_normalization == "token" else sequence_divisor(loss_tokens)
        self._cross_s = 0.0
        if self.cross_comm is not None:
            total = torch.stack(
                [buf[0], buf.new_tensor(float(n_labels)), buf.new_tensor(float(divisor))]
            )
            t0 = time.perf_counter()
            self.cross_comm.all_reduce(total)
            self._cross_s = time.perf_counter() - t0
            buf[0] = total[0]
            n_labels, divisor = int(round(float(total[1]))), int(round(float(total[2])))
        return StepStats.unpack(buf.tolist(), self.comm.size), n_labels, divisor

    def update(self, result: StepResult) -> None:
        """Clip the reduced gradient by its norm, step AdamW on this rank's slice, all-gather the
        weights, step the LR schedule."""
        self.zero.apply(result.grad_norm)
        if self.scheduler is not None:
            self.scheduler.step()

    def step(
        self,
        plan: StepPlan,
        fetched: Sequence[PackedMicroBatch],
        step: int,
        loss_tokens: np.ndarray | None = None,
    ) -> StepResult:
        """One optimizer step of `plan`; `fetched` are this rank's micro-batches in slot order;
        `loss_tokens` as `accumulate` takes them."""
        result = self.accumulate(plan, fetched, step, loss_tokens)
        self.update(result)
        return result

    @torch.no_grad()
    def token_losses(
        self, plan: StepPlan, fetched: Sequence[PackedMicroBatch]
    ) -> list[TokenLosses]:
        """Forward only, this rank's micro-batches: each labelled position's loss, whether its
        greedy prediction is its label, its position in its sample and the sample's id."""
        self.check_plan(plan, -1)
        if self.zero is not None:
            self.zero.wait_weights()
        mine = plan.microbatches(self.rank)
        if len(mine) != len(fetched):
            raise ValueError(f"{len(fetched)} fetched micro-batches for {len(mine)} in the plan")
        lengths_by_id = dict(zip(plan.sample_ids.tolist(), plan.lengths.tolist()))
        out = []
        for pm, mb in zip(mine, fetched):
            ids, pos, lab = (
                to_device(a, self.device) for a in (mb.input_ids, mb.position_ids, mb.labels)
            )
            attn = self._attention(pm, mb, lengths_by_id)
            # the logits chunk by chunk: a long sample's whole logits are never held
            loss, correct = self.model.token_losses(ids, pos, lab, attn)
            keep = np.asarray(mb.labels) != IGNORE_INDEX
            pieces = np.asarray(mb.pieces, dtype=np.int64).reshape(-1, 3)
            sample = np.repeat(pieces[:, 0], pieces[:, 2] - pieces[:, 1])
            out.append(
                TokenLosses(
                    loss.double().cpu().numpy()[keep],
                    correct.cpu().numpy()[keep],
                    np.asarray(mb.position_ids, dtype=np.int64)[keep],
                    sample[keep],
                )
            )
        return out
