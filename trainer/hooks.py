"""Points where code outside the trainer may act during a run: tests inject faults there.

`MIXLEN_HOOKS=module:factory` names a callable `factory(global_rank) -> Hooks`, imported when the
Trainer is built (e.g. `trainer.testing.faults:FaultInjector`, which kills ranks at chosen steps
to test restarts). Unset, every hook does nothing.
"""

from __future__ import annotations

import importlib
import os

from torch import nn

from datapipe.errors import ConfigError

__all__ = ["HOOKS_ENV", "Hooks", "load_hooks"]

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
