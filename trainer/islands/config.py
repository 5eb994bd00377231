"""`[co2]`: how islands train together; applies whenever `[parallel] islands > 1`.

Torch-free (the config is validated before torch loads); `trainer.islands.co2.OuterConfig` is what the
outer update runs with, built from this section by `trainer.islands.cross`. The rule and its symbols
(tau, alpha, beta, lambda, c) are in docs/ARCHITECTURE.md, "CO2 across islands".

Each mode's outer-update defaults are declared once, in `MODE_DEFAULTS`: a key left unset takes its
mode's value when the section is built, so the section (and a checkpoint's record of it) holds the
values the run uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from datapipe.errors import ConfigError
from datapipe.settings import Names, setting

__all__ = ["CLIPS", "MODES", "MODE_DEFAULTS", "STALENESS_RULES", "CO2Config", "ranks_per_island"]

MODES = ("co2", "diloco", "sync")
CLIPS = ("none", "value", "norm")
STALENESS_RULES = ("adaptive", "constant")

# The outer update's defaults per mode (sync has no outer update). co2: chosen with
# `benchmarks/bench_co2.py --converge` (benchmarks/RESULTS.md, "CO2 across islands"). diloco: as
# published (Douillard et al., arXiv 2311.08105): Nesterov outer momentum 0.9, outer lr 0.7, every
# average awaited and applied at once, no staleness penalty, no clipping.
MODE_DEFAULTS: dict[str, dict[str, Any]] = {
    "co2": {
        "outer_lr": 0.5,
        "outer_momentum": 0.0,
        "nesterov": False,
        "staleness_lambda": 0.5,
        "staleness_rule": "adaptive",
        "clip": "value",
        "warmup_rounds": 10,
        "warmup_outer_lr": 0.5,
    },
    "diloco": {
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "nesterov": True,
        "staleness_lambda": 0.0,
        "clip": "none",
        "warmup_rounds": 0,
    },
}


def _defaults(key: str) -> str:
    """`co2: 0.5, diloco: 0.7` for a key's help text (from MODE_DEFAULTS, the one copy)."""

    def show(v: Any) -> str:
        return ("true" if v else "false") if isinstance(v, bool) else str(v)

    return "unset: " + ", ".join(
        f"{m} {show(d[key])}" for m, d in MODE_DEFAULTS.items() if key in d
    )


@dataclass
class CO2Config:
    """`[co2]`: `mode` co2 (rounds of `tau` local steps, the average of round t applied at the end
    of round t+1 while the next round computes), diloco (the same rounds, each average awaited
    and applied at once: DiLoCo as published) or sync (gradients averaged over every island every
    step). Outer SGD: `outer_lr` alpha, `outer_momentum` beta (heavy-ball; `nesterov` for
    Nesterov's form). co2 only: the staleness penalty on a one-round-stale average
    (`staleness_lambda`, 0: off; `staleness_rule` adaptive, mixlen's 1 + lambda ||D - D_prev|| /
    ||D||, or constant, the CO2 code's fixed factor 1 + lambda), `clip` of the outer momentum
    (none, element-wise `value` to [-clip_value, clip_value], or global `norm` clip_value),
    `overlap` (default true: false waits for each round's own average) and `warmup_rounds` (the
    first rounds wait for their own average; trainer/islands/README.md). `link_gbps` > 0 emulates
    a cross-island link of that bandwidth (Gbit/s) on one machine (0: the real links).

    The outer-update keys default per mode (`MODE_DEFAULTS`); diloco refuses a staleness penalty,
    clipping, overlap and warm-up rounds, which are not DiLoCo's."""

    mode: str = setting(
        "co2",
        help="co2 (rounds of tau local steps, each average applied one round late while the "
        "next round computes), diloco (each average awaited: DiLoCo as published) or sync "
        "(gradients every step)",
        choices=MODES,
    )
    tau: int = setting(4, help="local steps per round", lo=1, hi=1 << 20)
    outer_lr: float | None = setting(
        None, help=f"outer learning rate alpha (> 0; {_defaults('outer_lr')})"
    )
    outer_momentum: float | None = setting(
        None, help=f"outer momentum beta, in [0, 1) ({_defaults('outer_momentum')})", lo=0.0
    )
    nesterov: bool | None = setting(
        None, help=f"Nesterov's form of the outer momentum ({_defaults('nesterov')})"
    )
    staleness_lambda: float | None = setting(
        None,
        help="co2: lambda of the staleness gap penalty on a one-round-stale average (0: off; "
        f"{_defaults('staleness_lambda')})",
        lo=0.0,
    )
    staleness_rule: str | None = setting(
        None,
        help="co2: the penalty, adaptive (mixlen's: 1 + lambda ||D - D_prev|| / ||D||) or "
        f"constant (the CO2 code's fixed factor: 1 + lambda) ({_defaults('staleness_rule')})",
        choices=STALENESS_RULES,
    )
    clip: str | None = setting(
        None,
        help="co2: outer momentum clipping, none, value (element-wise to [-clip_value, "
        f"clip_value]) or norm (global norm clip_value) ({_defaults('clip')})",
        choices=CLIPS,
    )
    clip_value: float = setting(0.1, help="the clipping bound (> 0)")
    overlap: bool | None = setting(
        None, help="co2 only (default true): false waits for each round's own average"
    )
    warmup_rounds: int | None = setting(
        None,
        help="overlapped co2: the first this many rounds wait for their own average, the later "
        f"ones overlap ({_defaults('warmup_rounds')})",
        lo=0,
        hi=1 << 30,
    )
    warmup_outer_lr: float | None = setting(
        None,
        help="overlapped co2: the outer learning rate of the warm-up rounds, each applying its "
        f"own average, nothing stale (> 0; {_defaults('warmup_outer_lr')})",
    )
    link_gbps: float = setting(
        0.0,
        help="emulate a cross-island link of this many Gbit/s on one machine (0: the real links)",
        lo=0.0,
        free_on_resume=True,
    )

    def __post_init__(self) -> None:
        # the keys left unset take the mode's defaults (none for sync, or an unknown mode)
        for key, value in MODE_DEFAULTS.get(self.mode, {}).items():
            if getattr(self, key) is None:
                setattr(self, key, value)

    def validate(self, names: Names) -> None:
        for key in ("outer_lr", "clip_value", "warmup_outer_lr"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ConfigError(f"{names(key)}: must be > 0, got {value!r}")
        if self.outer_momentum is not None and not self.outer_momentum < 1.0:
            raise ConfigError(
                f"{names('outer_momentum')}: must be in [0, 1), got {self.outer_momentum!r}"
            )
        if self.overlap and self.mode != "co2":
            raise ConfigError(
                f'{names("overlap")}: only {names("mode")} = "co2" overlaps (mode is '
                f"{self.mode!r}; diloco awaits every average, sync has no rounds)"
            )
        if self.mode == "diloco":
            self._refuse_for_diloco(names)

    def _refuse_for_diloco(self, names: Names) -> None:
        """DiLoCo applies each average at once: nothing is stale, and it neither penalises nor
        clips; a key that would make it something else is refused, with the reason."""
        mode = f'{names("mode")} = "diloco"'
        if self.staleness_lambda:
            raise ConfigError(
                f"{names('staleness_lambda')}: {mode} applies every average in the round that "
                f"made it, so nothing is stale to penalise (got {self.staleness_lambda!r}; the "
                'penalty is co2\'s: use mode = "co2", or remove the key)'
            )
        if self.clip != "none":
            raise ConfigError(
                f"{names('clip')}: {mode} does not clip its outer momentum (DiLoCo as published; "
                f'got {self.clip!r}): use mode = "co2" to clip, or remove the key'
            )
        for key in ("warmup_rounds", "warmup_outer_lr"):
            if getattr(self, key):
                raise ConfigError(
                    f"{names(key)}: {mode} awaits every average, so it has no warm-up "
                    f"(got {getattr(self, key)!r}); remove the key"
                )

    @property
    def overlapped(self) -> bool:
        """Does a round's average travel during the next round (co2 unless overlap = false)?"""
        return self.mode == "co2" and self.overlap is not False


def ranks_per_island(islands: int, world: int, tp: int = 1) -> int:
    """(HDP) ranks per island of a run of `world` processes in `islands` islands of ranks of `tp`
    processes; ConfigError naming `parallel.tp`, then `parallel.islands`, unless it divides."""
    if world % tp:
        raise ConfigError(
            f"parallel.tp: {tp} tensor-parallel processes per rank do not divide the {world} "
            "processes of the run (world = islands x ranks per island x tp)"
        )
    world //= tp
    if islands < 1 or world % islands:
        raise ConfigError(
            f"parallel.islands: {islands} islands do not divide the {world} ranks of the run "
            "(world = islands x ranks per island; change the number of ranks or the islands)"
        )
    return world // islands
