"""What a checkpoint holds of the model: the compute weights, the optimizer's slice state and
the outer state (`ModelState`, saved and restored through DCP by trainer.checkpoint.checkpointer).

Checkpoints with several islands: in co2 and diloco mode the islands' weights and inner AdamW
state differ within a round, so they are saved under an island prefix (`island1.model...`), one
copy per island, and a resume continues every island exactly where it was (a resume mid-round is
bitwise the uninterrupted run); the outer state (anchor, momentum, D_prev, counters, the round in
flight, received before saving) is identical on every island and saved once. In sync mode every
island holds the same weights and state: saved once, without prefix. `parallel.islands` cannot
change on resume; the ranks per island and the ZeRO level can (the slices reshard).

With tensor parallelism the weights are DTensors (DCP saves each TP member's shard as a piece of
the whole tensor) and each TP index's optimizer slices are saved under its own key
(`optim_tp1`): they are slices of that index's shards. `parallel.tp` cannot change on resume.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainer.islands.cross import CrossIsland
from trainer.parallel.zero import ZeroOptimizer

__all__ = ["ModelState"]


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
        tp_rank: int | None = None,
    ) -> None:
        self.model, self.zero, self.cross = model, zero, cross
        self.prefix = f"island{island}" if prefixed else ""
        self.optim_key = "optim" if tp_rank is None else f"optim_tp{tp_rank}"

    def state_dict(self) -> dict[str, Any]:
        """The live tensors (dcp.load fills them in place); the weights are waited for first."""
        self.zero.wait_weights()
        own: dict[str, Any] = {
            "model": self.model.state_dict(),
            self.optim_key: self.zero.state_dict(),
        }
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
        self.zero.load_state_dict(own[self.optim_key])
        if self.cross is not None:
            self.cross.outer.load_state_dict(sd["outer"])
