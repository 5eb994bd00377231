"""Small units of activation offload against hand counts: the run summary's per-ratio host bytes
and per-rank Eq. 3 peaks over several steps (trainer.offload.plan.OffloadSummary), and the
copy-in of a storage that an offloaded block and a later block both save
(trainer.offload.manager)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from trainer.offload.config import OffloadConfig
from trainer.offload.manager import ActivationPolicy
from trainer.offload.plan import OffloadSummary, PlanOffload

F64 = torch.float64


def _po(rank, positions, ratio, blocks, host_bytes) -> PlanOffload:
    n = len(rank)
    return PlanOffload(
        mb=np.arange(n, dtype=np.int64),
        rank=np.asarray(rank, dtype=np.int64),
        positions=np.asarray(positions, dtype=np.int64),
        ratio=np.asarray(ratio, dtype=np.float64),
        blocks=np.asarray(blocks, dtype=np.int64),
        host_bytes=np.asarray(host_bytes, dtype=np.int64),
    )


def test_summary_host_bytes_per_ratio_are_totals_over_the_run() -> None:
    """Per ratio, the summary holds [blocks, rank-micro-batches, positions, host bytes] summed
    over every micro-batch of every step (not the largest one), and renders the host bytes as
    the total in MiB."""
    summary = OffloadSummary(6, 1.0)
    # step 1: two micro-batches at 0.5 (1 MiB and 3 MiB), one at 0; step 2: one more at 0.5
    summary.add(_po([0, 1, 1], [10, 30, 5], [0.5, 0.5, 0.0], [2, 2, 0],
                    [1 << 20, 3 << 20, 0]), [0, 0], [0, 0])  # fmt: skip
    summary.add(_po([0], [20], [0.5], [2], [2 << 20]), [0, 0], [0, 0])
    assert summary.by_ratio == {0.5: [2, 3, 60, 6 << 20], 0.0: [0, 1, 5, 0]}
    assert "| 0.500 | 2 | 3 | 60 | 6.00 |" in summary.render()


def test_summary_eq3_peak_is_the_largest_over_steps_per_rank() -> None:
    """Per rank, the Eq. 3 peak over the run is the largest step's ((2 + (1-r)(l-2)) * Act *
    positions, written out here), not a sum over steps; bytes moved add up, measured peaks take
    the maximum."""
    act = 10.0
    summary = OffloadSummary(4, act)  # l = 4: 2 + (1 - r) * 2 blocks
    summary.add(_po([0, 1], [100, 50], [0.0, 1.0], [0, 2], [0, 0]), [7, 1], [30, 5])
    summary.add(_po([0, 1], [60, 80], [0.5, 0.0], [1, 0], [0, 0]), [2, 3], [10, 9])
    step1 = [4 * act * 100, 2 * act * 50]
    step2 = [3 * act * 60, 4 * act * 80]
    assert summary.planned_peak.tolist() == [max(a, b) for a, b in zip(step1, step2)]
    assert summary.moved.tolist() == [9, 4] and summary.peak.tolist() == [30, 9]
    mib = float(1 << 20)
    assert f"| 1 | {4 / mib:.2f} | {9 / mib:.2f} | {3200 / mib:.2f} |" in summary.render()


class _TanhBlock(nn.Module):
    """tanh(x W) [* extra]: tanh saves its output, mm its input; `extra` is saved by mul."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        return y if extra is None else y * extra


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_storage_saved_again_by_a_later_block_is_copied_in_ahead_of_it(ratio) -> None:
    """Block 0 (offloaded at r = 0.5 of 4 blocks) saves its tanh output; block 2 saves the same
    storage again (it multiplies by it). The copy-in is issued one block ahead of block 2's
    backward (no late fetch), the storage moves once, and the gradients are bitwise those of
    the plain forward and backward."""
    d, n = 16, 128
    torch.manual_seed(0)
    blocks = nn.ModuleList(_TanhBlock(d) for _ in range(4)).double()
    x0 = torch.randn(n, d, dtype=F64, requires_grad=True)

    def forward():
        h0 = blocks[0](x0)
        h1 = blocks[1](h0)
        h2 = blocks[2](h1, extra=h0)
        return blocks[3](h2).square().sum()

    forward().backward()
    want = [p.grad.clone() for p in blocks.parameters()]
    blocks.zero_grad(set_to_none=True)
    mgr = ActivationPolicy("none", OffloadConfig(enabled=True, min_bytes=1024)).build("cpu")
    with mgr.microbatch(blocks, ratio, blocks=list(blocks)) as stats:
        forward().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(blocks.parameters(), want))
    assert stats.offloaded_blocks == (1 if ratio else 0)
    # block 0 saves x0 (its mm) and its tanh output: both n x d float64, moved once each
    assert stats.moved_bytes == (2 * n * d * 8 if ratio else 0)
    assert stats.late_fetches == 0
