"""Attention outputs kept from a block's forward for its recomputation in backward.

Under selective activation checkpointing (trainer.offload.selective) a block's forward runs
twice: once in the forward, once in the backward to rebuild what its backward needs. The
attention kernels' outputs (out and log-sum-exp) are kept from the first run and handed back in
the second, so neither a kernel nor a ring's K/V exchange runs again. Each call of `taped` is one
attention call of the block (local, or a whole ring); the recomputation makes the same calls in
the same order. While the kernel runs in the first run, Python dispatch modes are set aside, so
that selective checkpointing's caching mode neither counts nor keeps the kernel's inner ops (the
recomputation does not run them).

A tape belongs to one thread: recording is a thread-local setting (threaded ranks, and CUDA's
backward thread, each see only their own).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["AttentionTape", "taped"]

_state = threading.local()


class AttentionTape:
    """The (out, lse) of each attention call of one block's forward, in call order."""

    def __init__(self) -> None:
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.replaying = False
        self.next = 0

    @contextlib.contextmanager
    def running(self, replay: bool) -> Iterator[AttentionTape]:
        """Record (first run) or replay (recomputation) this thread's attention calls."""
        prev = getattr(_state, "tape", None)
        _state.tape, self.replaying, self.next = self, replay, 0
        try:
            yield self
        finally:
            _state.tape = prev

    def nbytes(self) -> int:
        """Bytes the kept outputs hold."""
        return sum(t.untyped_storage().nbytes() for pair in self.kept for t in pair)


def taped(
    compute: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`compute()` (an attention kernel's (out, lse)), kept for the recomputation or, while one
    replays, the kept result of the same call."""
    tape: AttentionTape | None = getattr(_state, "tape", None)
    if tape is None:
        return compute()
    if tape.replaying:
        if tape.next >= len(tape.kept):
            raise RuntimeError(
                "a block's recomputation called attention more often than its forward did"
            )
        out, lse = tape.kept[tape.next]
        tape.next += 1
        return out.detach(), lse.detach()
    with _disable_current_modes():
        out, lse = compute()
    tape.kept.append((out.detach(), lse.detach()))
    return out, lse
