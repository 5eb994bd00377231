"""`[co2]`: how islands train together; applies whenever `[parallel] islands > 1`.

Torch-free (the config is validated before torch loads); `trainer.islands.co2.OuterConfig` is what the
outer update runs with, built from this section by `trainer.islands.cross`. The rule and its symbols
(tau, alpha, beta, lambda, c) are in docs/ARCHITECTURE.md, "CO2 across islands".
"""

from __future__ import annotations

from dataclasses import dataclass

from datapipe.errors import ConfigError
from datapipe.settings import Names, setting

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
    `overlap` (co2 only, default true): false waits for each round's own average;
    `warmup_rounds`: the first rounds of overlapped co2 wait for theirs (trainer/islands/README.md).
    `link_gbps` > 0 emulates a cross-island link of that bandwidth (Gbit/s) on one machine (0: the
    real links).

    Defaults: `benchmarks/bench_co2.py --converge` (benchmarks/RESULTS.md, "CO2 across islands"):
    400 steps on the demo corpus and on the same files as bytes. An average applied one round late
    is a delayed update: at outer_lr 1.0 it overshoots and co2 ended 11-17% above sync; 0.5 and 10
    warm-up rounds (the first 40 steps wait as diloco, while the loss falls fastest) end +0.9% and
    -3.9%. Outer momentum overshoots a stale average; value clipping at 0.1 is a guard that never
    acted there."""

    mode: str = setting(
        "co2",
        help="co2 (rounds of tau local steps, each average applied one round late while the "
        "next round computes), diloco (each average awaited) or sync (gradients every step)",
        choices=MODES,
    )
    tau: int = setting(4, help="local steps per round", lo=1, hi=1 << 20)
    outer_lr: float = setting(0.5, help="outer learning rate alpha (> 0)")
    outer_momentum: float = setting(0.0, help="outer momentum beta, in [0, 1)", lo=0.0)
    nesterov: bool = setting(False, help="Nesterov's form of the outer momentum")
    staleness_lambda: float = setting(
        0.5, help="lambda of the staleness gap penalty (0: off)", lo=0.0
    )
    clip: str = setting(
        "value",
        help="outer momentum clipping: none, value (element-wise to [-clip_value, clip_value]) "
        "or norm (global norm clip_value)",
        choices=CLIPS,
    )
    clip_value: float = setting(0.1, help="the clipping bound (> 0)")
    overlap: bool | None = setting(
        None, help="co2 only (default true): false waits for each round's own average"
    )
    warmup_rounds: int = setting(
        10,
        help="overlapped co2 only: the first this many rounds wait for their own average "
        "(as diloco), the later ones overlap",
        lo=0,
        hi=1 << 30,
    )
    link_gbps: float = setting(
        0.0,
        help="emulate a cross-island link of this many Gbit/s on one machine (0: the real links)",
        lo=0.0,
        free_on_resume=True,
    )

    def validate(self, names: Names) -> None:
        for key in ("outer_lr", "clip_value"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{names(key)}: must be > 0, got {getattr(self, key)!r}")
        if not self.outer_momentum < 1.0:
            raise ConfigError(
                f"{names('outer_momentum')}: must be in [0, 1), got {self.outer_momentum!r}"
            )
        if self.overlap and self.mode != "co2":
            raise ConfigError(
                f'{names("overlap")}: only {names("mode")} = "co2" overlaps (mode is '
                f"{self.mode!r}; diloco awaits every average, sync has no rounds)"
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
