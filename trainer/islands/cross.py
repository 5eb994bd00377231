"""How a rank's island trains with the others.

In `sync` mode the island's sharded optimizer (trainer.parallel.zero) sums gradients across
islands through `cross_link`'s communicator. `CrossIsland` runs
CO2's or DiLoCo's rounds (trainer.islands.co2.OuterSync on the rank's slice of the optimizer's
flat weights): the trainer calls `after_step()` after every optimizer step and `finish()` after
the last one. What a checkpoint holds of islands: trainer.checkpoint.state.
"""

from __future__ import annotations

from typing import Any

from trainer.islands.co2 import LinkEmulator, OuterConfig, OuterStats, OuterSync
from trainer.islands.config import CO2Config
from trainer.parallel.comm import Communicator
from trainer.parallel.zero import ZeroOptimizer

__all__ = ["CrossIsland", "cross_link"]

# what the last pending average's application records, as co2_final_<name>
FINAL_KEYS = ("co2_update_norm", "co2_penalty", "co2_clipped_fraction", "co2_wait_s")


def cross_link(cfg: CO2Config, cross: Communicator) -> Communicator:
    """The cross-island communicator, behind the emulated link when `co2.link_gbps` > 0."""
    if cfg.link_gbps > 0 and cross.size > 1:
        return LinkEmulator(cross, cfg.link_gbps)
    return cross


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
            staleness_rule=c.staleness_rule,
            clip=c.clip,
            clip_value=c.clip_value,
            overlap=c.overlapped,
            warmup_rounds=c.warmup_rounds,
            warmup_outer_lr=c.warmup_outer_lr if c.warmup_outer_lr is not None else c.outer_lr,
        )
        self.zero = zero
        self.outer = OuterSync(
            self.settings,
            zero.layout,
            island,
            cross,
            dtype=zero.acc_dtype,
            device=zero.flat_params.device,
            places=zero.places,
            tp=zero.tp_comm,
            replicated=zero.replicated,
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
        still pending, and leave every island at the final anchor. Returns the metrics: a round
        ended here under the round-end keys (the step's `after_step` ended none then), the
        pending average applied last under `co2_final_*`."""
        self.zero.wait_weights()
        ended, flushed = self.outer.finish(self.zero.outer_slice())
        if ended is not None or flushed is not None:
            self.zero.publish_outer_slice()
        rec = {**self._record(ended), "co2_final": True}
        if flushed is not None:
            last = self._record(flushed)
            rec.update({k.replace("co2_", "co2_final_", 1): last[k] for k in FINAL_KEYS})
        return rec

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
