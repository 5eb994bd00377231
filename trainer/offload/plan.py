"""What a StepPlan asks of activation offload, from the plan alone (numpy, no torch: every rank
computes the same figures for every rank): the blocks a ratio sends to host, the positions each
member computes, the host bytes each micro-batch keeps, the host budget check, ByteScale's Eq. 3
peak, and the balance report's offload tables.

Blocks. A rank keeps at most two blocks' saved activations in flight whatever it offloads: the
block computing and the one whose copy is in transit. Eq. 3 budgets ``2 + (1-r)(l-2)`` blocks of
Act(s) on the device, so r is a fraction of the other l - 2 blocks: ratio r offloads the first
``ceil(r*(l-2))`` blocks (none for l <= 2). Rounding up keeps the device at or under Eq. 3's
budget for every r the planner picks (r = j/l is rarely a multiple of 1/(l-2)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from datapipe.errors import ConfigError

if TYPE_CHECKING:
    from datapipe.plan.stepplan import StepPlan
    from datapipe.shapes import ModelConfig

__all__ = [
    "HostNeed",
    "OffloadSummary",
    "PlanOffload",
    "check_host_budget",
    "eq3_peak_bytes",
    "member_positions",
    "offload_blocks",
    "plan_offload",
]

_EPS = 1e-9  # r*(l-2) within this of an integer counts as that integer (float ratios j/l)


def offload_blocks(ratio: float | np.ndarray, n_layers: int) -> Any:
    """Blocks whose saved activations go to host at ratio r: ceil(r*(l-2)), 0 for l <= 2 (an int
    for a scalar ratio, an int64 array for an array)."""
    r = np.asarray(ratio, dtype=np.float64)
    if np.any((r < 0) | (r > 1)):
        raise ValueError(f"offload_ratio must be in [0, 1], got {ratio}")
    movable = max(int(n_layers) - 2, 0)
    j = np.clip(np.ceil(r * movable - _EPS), 0, movable).astype(np.int64)
    return int(j) if j.ndim == 0 else j


def eq3_peak_bytes(
    positions: np.ndarray, ratio: np.ndarray, n_layers: int, act_bytes_per_token_layer: float
) -> np.ndarray:
    """ByteScale's Eq. 3: saved-activation bytes on the device, (2 + (1-r)(l-2)) * Act(n) with
    Act(n) = act * n (l * Act(n) for l <= 2, where nothing can move)."""
    n = np.asarray(positions, dtype=np.float64)
    r = np.asarray(ratio, dtype=np.float64)
    blocks = 2 + (1 - r) * (n_layers - 2) if n_layers > 2 else np.full_like(r, float(n_layers))
    return blocks * float(act_bytes_per_token_layer) * n


def member_positions(plan: StepPlan) -> np.ndarray:
    """Positions each member computes in each micro-batch, int64 aligned with `plan.group_ranks`
    (membership i: rank group_ranks[i] in the micro-batch whose group holds position i): the
    zigzag share of every piece (chunks p and 2k-1-p of 2k, the first S mod 2k one longer)."""
    k = plan.group_sizes
    m = plan.num_microbatches
    piece_mb = np.repeat(np.arange(m, dtype=np.int64), np.diff(plan.mb_piece_offsets))
    length = (plan.piece_end - plan.piece_start).astype(np.int64)
    kp = k[piece_mb]
    # every piece once per member p of its group
    rep = np.repeat(np.arange(length.shape[0], dtype=np.int64), kp)
    first = np.repeat(np.cumsum(kp) - kp, kp)
    p = np.arange(rep.shape[0], dtype=np.int64) - first
    kk = kp[rep]
    base, extra = np.divmod(length[rep], 2 * kk)
    share = 2 * base + (p < extra) + (2 * kk - 1 - p < extra)
    member = plan.mb_group_offsets[piece_mb[rep]] + p
    out = np.zeros(plan.group_ranks.shape[0], dtype=np.int64)
    np.add.at(out, member, share)
    return out


@dataclass(frozen=True)
class HostNeed:
    """Host bytes per position each block keeps between forward and backward when it offloads:
    its saved activations (Act), or its input if it is checkpointed (recomputed in backward)."""

    block_bytes: tuple[float, ...]

    @classmethod
    def of(cls, shape: ModelConfig, dtype_bytes: int, checkpointed: Sequence[bool]) -> HostNeed:
        act = shape.act_bytes_per_token_layer(dtype_bytes)
        block_input = float(shape.dim * dtype_bytes)
        return cls(tuple(block_input if c else act for c in checkpointed))

    @property
    def n_layers(self) -> int:
        return len(self.block_bytes)

    def bytes(self, positions: np.ndarray, ratio: np.ndarray) -> np.ndarray:
        """Host bytes of micro-batches of `positions` at `ratio` (int64, elementwise)."""
        cum = np.concatenate([[0.0], np.cumsum(self.block_bytes)])
        j = np.asarray(offload_blocks(np.asarray(ratio, dtype=np.float64), self.n_layers))
        return np.ceil(cum[j] * np.asarray(positions, dtype=np.float64)).astype(np.int64)


@dataclass(frozen=True)
class PlanOffload:
    """One step's offload per membership (rank x micro-batch) of every rank, in plan order."""

    mb: np.ndarray  # micro-batch (slot) of each membership
    rank: np.ndarray
    positions: np.ndarray
    ratio: np.ndarray  # the ratio it runs with (force_ratio or the plan's)
    blocks: np.ndarray  # blocks sent to host
    host_bytes: np.ndarray  # host store bytes it needs


def plan_offload(plan: StepPlan, need: HostNeed, force_ratio: float | None = None) -> PlanOffload:
    """Every rank's micro-batches of `plan` as they will run (`force_ratio` overrides the plan)."""
    mb = np.repeat(np.arange(plan.num_microbatches, dtype=np.int64), plan.group_sizes)
    ratio = plan.mb_offload[mb].astype(np.float64)
    if force_ratio is not None:
        ratio = np.full(mb.shape[0], float(force_ratio))
    pos = member_positions(plan)
    return PlanOffload(
        mb=mb,
        rank=plan.group_ranks.astype(np.int64),
        positions=pos,
        ratio=ratio,
        blocks=np.asarray(offload_blocks(ratio, need.n_layers), dtype=np.int64).reshape(-1),
        host_bytes=need.bytes(pos, ratio),
    )


def check_host_budget(po: PlanOffload, budget: int, n_layers: int, where: str) -> int:
    """The most host memory any micro-batch of any rank needs; ConfigError naming
    `offload.host_budget_bytes` and the bytes needed if that exceeds `budget` (0: no limit).
    Micro-batches run one at a time and each backward empties the store, so the need of a rank is
    its largest micro-batch's; every rank checks every rank's, so all refuse together."""
    if po.host_bytes.size == 0:
        return 0
    i = int(np.argmax(po.host_bytes))
    most = int(po.host_bytes[i])
    if budget > 0 and most > budget:
        raise ConfigError(
            f"offload.host_budget_bytes = {budget} is too small for {where}: rank "
            f"{int(po.rank[i])}'s micro-batch at slot {int(po.mb[i])} ({int(po.positions[i])} "
            f"positions, offload_ratio {float(po.ratio[i]):g}: {int(po.blocks[i])} of {n_layers} "
            f"blocks to host) needs {most} bytes of host memory (raise offload.host_budget_bytes "
            "or lower parallel.capacity)"
        )
    return most


@dataclass
class OffloadSummary:
    """Offload over a run for the balance report and metrics.jsonl: per ratio (from the plans,
    every rank's micro-batches) and per rank (measured bytes moved and accounted peak of saved
    activations on the device, beside Eq. 3's peak with the cost model's Act)."""

    n_layers: int
    act_bytes_per_token_layer: float  # the planner's Act(s) per position and layer
    by_ratio: dict[float, list[int]] = field(default_factory=dict)  # r -> [blocks, mbs, pos, bytes]
    moved: np.ndarray | None = None  # per rank, summed over steps
    peak: np.ndarray | None = None  # per rank, max over steps
    planned_peak: np.ndarray | None = None  # per rank, max over steps (Eq. 3)

    def add(self, po: PlanOffload, moved: Sequence[int], peak: Sequence[int]) -> dict[str, Any]:
        """Add one step (`moved`, `peak`: measured, per rank); returns its metrics.jsonl fields."""
        eq3 = eq3_peak_bytes(po.positions, po.ratio, self.n_layers, self.act_bytes_per_token_layer)
        planned = np.zeros(len(moved))
        np.maximum.at(planned, po.rank, eq3)
        for r in np.unique(po.ratio):
            sel = po.ratio == r
            row = self.by_ratio.setdefault(float(r), [int(po.blocks[sel][0]), 0, 0, 0])
            row[1] += int(sel.sum())
            row[2] += int(po.positions[sel].sum())
            row[3] += int(po.host_bytes[sel].sum())
        m, p = np.asarray(moved, dtype=np.int64), np.asarray(peak, dtype=np.int64)
        if self.moved is None or self.peak is None or self.planned_peak is None:
            self.moved, self.peak, self.planned_peak = m, p, planned
        else:
            self.moved = self.moved + m
            self.peak = np.maximum(self.peak, p)
            self.planned_peak = np.maximum(self.planned_peak, planned)
        return {
            "offload_ratio_max": float(po.ratio.max()) if po.ratio.size else 0.0,
            "offload_bytes_per_rank": m.tolist(),
            "activation_peak_bytes_per_rank": p.tolist(),
            "activation_peak_eq3_bytes_per_rank": np.rint(planned).astype(np.int64).tolist(),
        }

    def render(self) -> str:
        """Markdown: micro-batches by offload ratio, then bytes moved and peaks by rank."""
        if self.moved is None or self.peak is None or self.planned_peak is None:
            return ""
        mib = float(1 << 20)
        lines = [
            "",
            f"activation offload ({self.n_layers} blocks; r offloads the first ceil(r*(l-2)); "
            "host bytes planned from the model shape, moved and peak measured; Eq. 3 with the "
            "cost model's Act and no checkpointing):",
            "",
            "| offload ratio r | blocks to host | micro-batches | positions | host MiB planned, total |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r, (blocks, count, pos, nbytes) in sorted(self.by_ratio.items()):
            lines.append(f"| {r:.3f} | {blocks} | {count} | {pos} | {nbytes / mib:.2f} |")
        lines += [
            "",
            "| rank | MiB moved to host | peak activation MiB on device | Eq. 3 peak MiB |",
            "| --- | --- | --- | --- |",
        ]
        for rank in range(self.moved.shape[0]):
            lines.append(
                f"| {rank} | {self.moved[rank] / mib:.2f} | {self.peak[rank] / mib:.2f} | "
                f"{self.planned_peak[rank] / mib:.2f} |"
            )
        return "\n".join(lines) + "\n"
