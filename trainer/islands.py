"""How a rank's island trains with the others, and what a checkpoint holds of the model.

`build_optimizer` makes the island's sharded optimizer (trainer.zero) from `[parallel] zero` and
`[train]`; in `sync` mode it also sums gradients across islands. `CrossIsland` runs CO2's or
DiLoCo's rounds (trainer.co2.OuterSync on the rank's slice of the optimizer's flat weights): the
trainer calls `after_step()` after every optimizer step and `finish()` after the last one.
`ModelState` is what DCP saves of the model: the compute weights, the optimizer's slice state
and the outer state.

Checkpoints with several islands: in co2 and diloco mode the islands' weights and inner AdamW
state differ within a round, so they are saved under an island prefix (`island1.model...`), one
copy per island, and a resume continues every island exactly where it was (a resume mid-round is
bitwise the uninterrupted run); the outer state (anchor, momentum, D_prev, counters, the round in
flight, received before saving) is identical on every island and saved once. In sync mode every
island holds the same weights and state: saved once, without prefix. `parallel.islands` cannot
change on resume; the ranks per island and the ZeRO level can (the slices reshard).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainer.co2 import LinkEmulator, OuterConfig, OuterStats, OuterSync
from trainer.comm import Communicator
from trainer.config import TrainerConfig
from trainer.config_co2 import CO2Config
from trainer.zero import ZeroOptimizer

__all__ = ["CrossIsland", "ModelState", "build_optimizer", "cross_link"]


def cross_link(cfg: CO2Config, cross: Communicator) -> Communicator:
    """The cross-island communicator, behind the emulated link when `co2.link_gbps` > 0."""
    if cfg.link_gbps > 0 and cross.size > 1:
        return LinkEmulator(cross, cfg.link_gbps)
    return cross


def build_optimizer(
    cfg: TrainerConfig,
    model: nn.Module,
    master: nn.Module,
    comm: Communicator,
    grad_comm: Communicator,
    cross: Communicator | None,
) -> ZeroOptimizer:
    """The island's AdamW at level `parallel.zero` (`cross`: sum gradients across islands, sync
    mode). The weight all-gather of a step is left in flight until the next step needs it."""
    t = cfg.train
    return ZeroOptimizer.for_model(
        model,
        comm,
        master=master,
        level=cfg.parallel.zero_level(comm.size),
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        grad_comm=grad_comm,
        cross_comm=cross,
        async_gather=True,
    )


class CrossIsland:
    """CO2 / DiLoCo rounds of one rank (`[co2]` mode co2 or diloco)."""

    def __init__(
        self,
        c: CO2Config,
        zero: ZeroOptimizer,
        island: Communicator,
        cross: Communicator,
    ) -> None:
        assert c.mode in ("co2", "diloco")
        self.settings = OuterConfig(
            tau=c.tau,
            outer_lr=c.outer_lr,
            momentum=c.outer_momentum,
            nesterov=c.nesterov,
            staleness_lambda=c.staleness_lambda,
            clip=c.clip,
            clip_value=c.clip_value,
            overlap=c.overlapped,
        )
        self.zero = zero
        self.outer = OuterSync(
            self.settings,
            zero.layout,
            island,
            cross,
            dtype=zero.acc_dtype,
            device=zero.flat_params.device,
        )
        self.outer.start(zero.outer_slice())  # the first anchor (a checkpoint may replace it)

    def after_step(self) -> dict[str, Any]:
        """Count a local step; at a round's end average, apply and start the next round from the
        new anchor. Returns the step's metrics."""
        if self.outer.local_steps + 1 >= self.settings.tau:
            self.zero.wait_weights()  # the boundary rewrites the slice the gather still sends
        s = self.outer.after_step(self.zero.outer_slice())
        if s is not None:
            self.zero.publish_outer_slice()
        return self._record(s)

    def finish(self) -> dict[str, Any]:
        """After the last step: end the current round if it has local steps, apply every average
        still pending, and leave every island at the final anchor."""
        self.zero.wait_weights()
        s = self.outer.finish(self.zero.outer_slice())
        if s is not None:
            self.zero.publish_outer_slice()
        return {**self._record(s), "co2_final": True}

    def _record(self, s: OuterStats | None) -> dict[str, Any]:
        rec: dict[str, Any] = {"co2_round": self.outer.round}
        if s is not None:
            rec.update(
                co2_applied=s.applied,
                co2_update_norm=s.update_norm,
                co2_penalty=s.penalty,
                co2_clipped_fraction=s.clipped_fraction,
                co2_wait_s=s.wait_s,
            )
        return rec

    def memory_bytes(self) -> int:
        return self.outer.memory_bytes()


class ModelState:
    """What DCP saves and restores of the model: compute weights (the parameters, views of the
    optimizer's flat buffer), the optimizer's slice state, and the outer state (see the module
    docstring for the island prefix)."""

    def __init__(
        self,
        model: nn.Module,
        zero: ZeroOptimizer,
        cross: CrossIsland | None = None,
        island: int = 0,
        prefixed: bool = False,
    ) -> None:
        self.model, self.zero, self.cross = model, zero, cross
        self.prefix = f"island{island}" if prefixed else ""

    def state_dict(self) -> dict[str, Any]:
        """The live tensors (dcp.load fills them in place); the weights are waited for first."""
        self.zero.wait_weights()
        own: dict[str, Any] = {"model": self.model.state_dict(), "optim": self.zero.state_dict()}
        sd: dict[str, Any] = {self.prefix: own} if self.prefix else dict(own)
        if self.cross is not None:
            sd["outer"] = self.cross.outer.state_dict()
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore after dcp.load filled `sd` (a `state_dict()` of this object)."""
        own = sd[self.prefix] if self.prefix else sd
        mine = self.model.state_dict()
        for k, t in own["model"].items():
            if t.data_ptr() != mine[k].data_ptr():
                mine[k].copy_(t)
        self.zero.load_state_dict(own["optim"])
        if self.cross is not None:
            self.cross.outer.load_state_dict(sd["outer"])
