"""What a checkpoint holds of the model: the compute weights, the optimizer's slice state and
the outer state (`ModelState`, saved and restored through DCP by trainer.checkpoint.checkpointer).

Checkpoints with several islands: in co2 and diloco mode the islands' weights and inner AdamW
state differ within a round, so they are saved under an island prefix (`island1.model...`), one
copy per island, and a resume continues every island exactly where it was (a resume mid-round is
bitwise the uninterrupted run); the outer state (anchor, momentum, D_prev, counters, the round in
flight, received before saving) is identical on every island and saved once. In sync mode every
island holds the same weights and state: saved once, without prefix. `parallel.islands` cannot
change on resume; the ranks per island and the ZeRO level can (the slices reshard).

The optimizer and outer state are saved by whole parameter (trainer.parallel.slices.ParamChunks:
each rank's slice as boxes of the parameters it covers), like the weights. With tensor
parallelism the weights are DTensors (DCP saves each TP member's shard as a piece of the whole
tensor) and the slices of a TP member are boxes of its shards placed in the whole parameters, so
a checkpoint resumes at another `parallel.tp` (2 -> 1, 1 -> 2) as at another rank count.
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
    ) -> None:
        self.model, self.zero, self.cross = model, zero, cross
        self.prefix = f"island{island}" if prefixed else ""

    def state_dict(self) -> dict[str, Any]:
        """The live tensors (dcp.load fills them in place); the weights are waited for first."""
        self.zero.wait_weights()
        own: dict[str, Any] = {
            "model": self.model.state_dict(),
            "optim": self.zero.state_dict(),
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
        self.zero.load_state_dict(own["optim"])
        if self.cross is not None:
            self.cross.outer.load_state_dict(sd["outer"])
