"""Points where code outside the trainer may act during a run (tests inject faults there), and
signals: SIGTERM (a scheduler's stop) or SIGINT ends training with a message naming the step it
stopped at and the last complete checkpoint.

`MIXLEN_HOOKS=module:factory` names a callable `factory(global_rank) -> Hooks`, imported when the
Trainer is built (e.g. `trainer.testing.faults:FaultInjector`, which kills ranks at chosen steps
to test restarts). Unset, every hook does nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import threading
from collections.abc import Iterator

from torch import nn

from datapipe.errors import ConfigError

__all__ = [
    "HOOKS_ENV",
    "Hooks",
    "Interrupted",
    "TrainingInterrupted",
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
