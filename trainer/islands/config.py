"""`[co2]`: how islands train together; applies whenever `[parallel] islands > 1`.

Torch-free (the config is validated before torch loads); `trainer.islands.co2.OuterConfig` is what the
outer update runs with, built from this section by `trainer.islands.cross`. The rule and its symbols
(tau, alpha, beta, lambda, c) are in docs/ARCHITECTURE.md, "CO2 across islands".
"""

from __future__ import annotations

from dataclasses import dataclass

from datapipe.errors import ConfigError

__all__ = ["CLIPS", "MODES", "CO2Config", "ranks_per_island"]

MODES = ("co2", "diloco", "sync")
CLIPS = ("none", "value", "norm")


@dataclass
class CO2Config:
    """`[co2]`: `mode` co2 (rounds of `tau` local steps, the average of round t applied at the end
    of round t+1 while the next round computes), diloco (the same rounds, each average awaited
    and applied at once) or sync (gradients averaged over every island every step). Outer SGD:
    `outer_lr` alpha, `outer_momentum` beta (heavy-ball; `nesterov` for Nesterov's form),
    `staleness_lambda` the staleness gap penalty's lambda (0: off), `clip` of the outer momentum
    (none, element-wise `value` to [-clip_value, clip_value], or global `norm` clip_value).
    `overlap` (co2 only, default true): false waits for each round's own average. `link_gbps` > 0
    emulates a cross-island link of that bandwidth (Gbit/s) on one machine (0: the real links).

    Defaults: the best of `benchmarks/bench_co2.py --sweep` on the standard-library corpus
    (benchmarks/RESULTS.md): with a round of staleness and few rounds, outer momentum overshoots and
    tau 4 beats 8 and 16; the staleness penalty helped every setting tried; value clipping at 0.1
    is a guard that never acted there (at 0.01 it clipped up to 39% of a round's elements and
    cost loss)."""

    mode: str = "co2"
    tau: int = 4
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    nesterov: bool = False
    staleness_lambda: float = 0.5
    clip: str = "value"
    clip_value: float = 0.1
    overlap: bool | None = None
    link_gbps: float = 0.0

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"co2.mode: {self.mode!r} is not one of {', '.join(MODES)}")
        if not self.tau >= 1:
            raise ConfigError(f"co2.tau: must be >= 1 local step per round, got {self.tau!r}")
        if not self.outer_lr > 0:
            raise ConfigError(f"co2.outer_lr: must be > 0, got {self.outer_lr!r}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ConfigError(f"co2.outer_momentum: must be in [0, 1), got {self.outer_momentum!r}")
        if not self.staleness_lambda >= 0:
            raise ConfigError(f"co2.staleness_lambda: must be >= 0, got {self.staleness_lambda!r}")
        if self.clip not in CLIPS:
            raise ConfigError(f"co2.clip: {self.clip!r} is not one of {', '.join(CLIPS)}")
        if not self.clip_value > 0:
            raise ConfigError(f"co2.clip_value: must be > 0, got {self.clip_value!r}")
        if self.overlap and self.mode != "co2":
            raise ConfigError(
                f'co2.overlap: only co2.mode = "co2" overlaps (mode is {self.mode!r}; diloco '
                "awaits every average, sync has no rounds)"
            )
        if not self.link_gbps >= 0:
            raise ConfigError(
                f"co2.link_gbps: must be >= 0 (0: no emulation), got {self.link_gbps!r}"
            )

    @property
    def overlapped(self) -> bool:
        """Does a round's average travel during the next round (co2 unless overlap = false)?"""
        return self.mode == "co2" and self.overlap is not False


def ranks_per_island(islands: int, world: int) -> int:
    """Ranks per island of a run of `world` ranks in `islands` islands; ConfigError naming
    `parallel.islands` unless it divides the world."""
    if islands < 1 or world % islands:
        raise ConfigError(
            f"parallel.islands: {islands} islands do not divide the {world} ranks of the run "
            "(world = islands x ranks per island; change the number of ranks or the islands)"
        )
    return world // islands
