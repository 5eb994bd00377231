"""Statistics of a step: those one small island all-reduce gathers after the micro-batches: the
summed loss and, per rank, its busy time, micro-batch count, ring waits and bytes, offloaded bytes
and activation peak (`RANK_FIELDS` is the layout, packed and unpacked here only); and this rank's
gradient reduction (`ReduceStats`, from the sharded optimizer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from trainer.attention.varlen import to_device

__all__ = ["RANK_FIELDS", "ReduceStats", "StepStats"]

RANK_FIELDS = (  # one row of `size` values each, after the loss sum
    "busy_s",
    "microbatches",
    "ring_wait_s",
    "p2p_bytes",
    "offload_bytes",
    "act_peak_bytes",
)
_INTS = frozenset({"microbatches", "p2p_bytes", "offload_bytes", "act_peak_bytes"})


@dataclass(frozen=True)
class StepStats:
    """A step's summed loss and every rank's figures (lists in rank order)."""

    loss_sum: float
    busy_s: list[float]
    microbatches: list[int]
    ring_wait_s: list[float]
    p2p_bytes: list[int]
    offload_bytes: list[int]
    act_peak_bytes: list[int]

    @staticmethod
    def pack(
        loss_sum: torch.Tensor, rank: int, size: int, mine: dict[str, float], device: torch.device
    ) -> torch.Tensor:
        """The float64 buffer this rank contributes to the all-reduce (zeros in other rows). Made
        on the host and sent in one copy (`to_device`, pinned on a GPU): each scalar written into
        a device tensor would be a blocking copy (seen on an H200: 6 of a step's 9 host waits)."""
        host = np.zeros(1 + len(RANK_FIELDS) * size, dtype=np.float64)
        for j, name in enumerate(RANK_FIELDS):
            host[1 + j * size + rank] = float(mine[name])
        buf = to_device(host, device)
        buf[0] = loss_sum
        return buf

    @classmethod
    def unpack(cls, values: list[float], size: int) -> StepStats:
        """The reduced buffer (as a list) read back."""
        rows = {}
        for j, name in enumerate(RANK_FIELDS):
            row = values[1 + j * size : 1 + (j + 1) * size]
            rows[name] = [int(x) for x in row] if name in _INTS else list(row)
        return cls(values[0], **rows)

    @staticmethod
    def nbytes(size: int) -> int:
        """Bytes of the buffer."""
        return (1 + len(RANK_FIELDS) * size) * 8


class ReduceStats(NamedTuple):
    """The gradient reduction of the last step on this rank (for metrics)."""

    buckets: int  # reductions issued (1 without hooks at zero 0/1: one collective)
    early: int  # of them, launched from hooks before the backward ended
    wait_s: float  # time reduce() blocked waiting for them (the exposed communication)
    bytes: int  # gradient payload this rank contributed
    span_s: float = 0.0  # first launch to the end of that wait
    cross_s: float = 0.0  # sync mode: the cross-island all-reduce of the slice

    @property
    def hidden_fraction(self) -> float:
        """Share of the reduction's span that overlapped other work: 1 - wait / span (an upper
        bound on the hidden share of the communication when the link idles between launches)."""
        return 1.0 - self.wait_s / self.span_s if self.span_s > 0 else 0.0
