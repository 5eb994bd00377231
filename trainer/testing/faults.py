"""Test support: fault injection. A run loads it through the trainer's hooks
(`MIXLEN_HOOKS=trainer.testing.faults:FaultInjector`, trainer.hooks); production code never
imports this module.

`MIXLEN_FAULT` (TEST ONLY; never set it in a real run) makes a rank SIGKILL itself, to test
recovery from crashes (torchrun's restarts, trainer.parallel.runtime.restart_count), or poisons
its weights, to test that a run stops at its first non-finite loss: a comma-separated list of

    kill:rank=R:step=S[:at=step|save][:attempt=A]
    nan:rank=R:step=S[:attempt=A]

`at=step` (default) kills rank R inside step S, at its first micro-batch's forward (the other
ranks are then inside step S too, waiting for it); `at=save` kills it while the checkpoint of
step S is being written (after its files, before the checkpoint is complete). `nan` sets one
weight of rank R's model to NaN at its first forward of step S. A fault fires only in restart
`attempt` A (default 0, the first run), so the restarted job runs through.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

import torch
from torch import nn

from datapipe.errors import ConfigError
from trainer.hooks import Hooks
from trainer.parallel.runtime import restart_count

__all__ = ["FAULT_ENV", "Fault", "FaultInjector", "parse_faults"]

FAULT_ENV = "MIXLEN_FAULT"
_AT = ("step", "save")


@dataclass(frozen=True)
class Fault:
    """Kill `rank` at `step` (`at` = step or save) in restart `attempt`; `action` nan: poison
    a weight instead."""

    rank: int
    step: int
    at: str = "step"
    attempt: int = 0
    action: str = "kill"


def parse_faults(text: str) -> list[Fault]:
    """Faults from a MIXLEN_FAULT value; ConfigError naming the variable if malformed."""
    faults = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        action, *fields = item.split(":")
        try:
            kv = dict(f.split("=", 1) for f in fields)
            allowed = {"rank", "step", "attempt"} | ({"at"} if action == "kill" else set())
            if action not in ("kill", "nan") or not {"rank", "step"} <= set(kv) <= allowed:
                raise ValueError
            fault = Fault(
                int(kv["rank"]),
                int(kv["step"]),
                kv.get("at", "step"),
                int(kv.get("attempt", 0)),
                action,
            )
            if fault.at not in _AT:
                raise ValueError
        except ValueError:
            raise ConfigError(
                f"{FAULT_ENV}={text!r}: expected kill:rank=R:step=S[:at=step|save][:attempt=A] "
                "or nan:rank=R:step=S[:attempt=A], comma-separated (a test-only setting)"
            ) from None
        faults.append(fault)
    return faults


class FaultInjector(Hooks):
    """This rank's faults of MIXLEN_FAULT for this restart attempt (none in a normal run)."""

    def __init__(self, rank: int, text: str | None = None, attempt: int | None = None) -> None:
        text = os.environ.get(FAULT_ENV, "") if text is None else text
        attempt = restart_count() if attempt is None else attempt
        self.faults = [f for f in parse_faults(text) if f.rank == rank and f.attempt == attempt]
        self.step = 0

    def attach(self, model: nn.Module) -> None:
        """Arm the `at=step` faults: a forward pre-hook fires inside the step."""
        self.model = model
        if any(f.at == "step" for f in self.faults):
            model.register_forward_pre_hook(lambda module, args: self.point("step", self.step))

    def begin_step(self, step: int) -> None:
        """The trainer is starting optimizer step `step`."""
        self.step = step

    def point(self, at: str, step: int) -> None:
        """Fire if a fault is set for (`at`, `step`) on this rank."""
        due = [f for f in self.faults if f.at == at and f.step == step]
        if due and all(f.action == "nan" for f in due):
            with torch.no_grad():
                next(self.model.parameters()).view(-1)[0] = float("nan")
        elif due:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
