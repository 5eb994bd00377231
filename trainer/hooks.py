"""Points where code outside the trainer may act during a run (tests inject faults there), and
how a run stops early: SIGTERM (a scheduler's stop) or SIGINT ends training with a message naming
the step it stopped at and the last complete checkpoint, and so does the first step whose loss or
gradient norm is NaN or infinite (`check_finite_step`, before that step is checkpointed).

`MIXLEN_HOOKS=module:factory` names a callable `factory(global_rank) -> Hooks`, imported when the
Trainer is built (e.g. `trainer.testing.faults:FaultInjector`, which kills ranks at chosen steps
to test restarts). Unset, every hook does nothing.

A step's loss and gradient norm are already reduced over the island (identical on its ranks), so
an island's ranks stop together without a word. Islands that train apart (co2, diloco) see
different losses: one small all-reduce over every rank (`run_comm`) tells each which islands went
bad, so every rank of the run stops at the same step and none waits forever in a collective.
Global rank 0 raises `NonFiniteStep` (the command line prints it, exit 2), the others `PeerError`.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from datapipe.errors import ConfigError, MixlenError, PeerError

__all__ = [
    "HOOKS_ENV",
    "Hooks",
    "Interrupted",
    "NonFiniteStep",
    "TrainingInterrupted",
    "check_finite_step",
    "load_hooks",
    "signals_as_interrupts",
]

HOOKS_ENV = "MIXLEN_HOOKS"


class Hooks:
    """No-op hooks; a factory named by MIXLEN_HOOKS returns an object with these methods."""

    def attach(self, model: nn.Module) -> None:
        """The model is built (a hook may register module hooks on it)."""

    def begin_step(self, step: int) -> None:
        """The trainer is starting optimizer step `step`."""

    def point(self, at: str, step: int) -> None:
        """A named point of step `step` is reached (`save`: a checkpoint's files are written,
        before it is marked complete)."""


def load_hooks(rank: int) -> Hooks:
    """This rank's hooks: MIXLEN_HOOKS's factory, else no-op hooks."""
    spec = os.environ.get(HOOKS_ENV, "")
    if not spec:
        return Hooks()
    module, _, name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{HOOKS_ENV}={spec!r}: expected module:factory ({exc})") from None
    return factory(rank)


class Interrupted(BaseException):
    """A signal arrived (raised in the main thread by `signals_as_interrupts`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class TrainingInterrupted(BaseException):
    """Training stopped on a signal during `step`; `checkpoint` is the run's last complete one
    (None: none yet). The command line says so on rank 0 and exits with 128 + the signal."""

    def __init__(self, signum: int, step: int, checkpoint: str | None) -> None:
        super().__init__(f"interrupted at step {step}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def signals_as_interrupts() -> Iterator[None]:
    """Within: SIGTERM and SIGINT raise Interrupted in the main thread (elsewhere: unchanged)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    old = {s: signal.signal(s, raise_) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class NonFiniteStep(MixlenError):
    """The loss or the gradient norm of a training step is NaN or infinite."""


def _island_values(step_loss: float, grad_norm: float, rt: Any) -> list[tuple[float, float]]:
    """(loss, gradient norm) of every island: this island's alone, or all of them gathered by
    one all-reduce of 2 x islands numbers over the run's ranks."""
    if rt.islands == 1:
        return [(step_loss, grad_norm)]
    mine = torch.zeros(rt.islands, 2, dtype=torch.float64, device=rt.device)
    mine[rt.island, 0], mine[rt.island, 1] = step_loss / rt.world, grad_norm / rt.world
    rt.run_comm.all_reduce(mine)
    return [(float(a), float(b)) for a, b in mine.tolist()]


def check_finite_step(
    step: int, step_loss: float, grad_norm: float, rt: Any, checkpoint: Callable[[], str | None]
) -> None:
    """Stop the run (NonFiniteStep on global rank 0, PeerError elsewhere) if step `step`'s loss or
    gradient norm is NaN or infinite on any island; `rt` is the trainer's Runtime, `checkpoint()`
    the last complete checkpoint (None: none). Collective when the run has several islands."""
    values = _island_values(step_loss, grad_norm, rt)
    bad = [i for i, (a, b) in enumerate(values) if not (math.isfinite(a) and math.isfinite(b))]
    if not bad:
        return
    loss, norm = values[bad[0]]
    where = f" on island {bad[0]}" if rt.islands > 1 else ""
    message = (
        f"step {step}: the loss is {loss:g} and the gradient norm {norm:g}{where}, not finite: "
        f"stopped before saving step {step} (last complete checkpoint: {checkpoint() or 'none'}). "
        "Lower train.lr or set train.grad_clip, check the data and the model's weights, and "
        "resume from that checkpoint"
    )
    if rt.global_rank == 0:
        raise NonFiniteStep(message)
    raise PeerError(message)
