"""`[parallel]`: the island's planner (datapipe.plan.planner's settings, in this section), its
cost model, the ZeRO level and the number of islands."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from datapipe.errors import ConfigError, MixlenError
from datapipe.plan.cost import CostModel, load, preset
from datapipe.plan.planner import PlannerConfig
from datapipe.settings import Names, setting
from datapipe.shapes import ModelConfig
from trainer.islands.config import ranks_per_island

__all__ = ["ParallelConfig"]


@dataclass
class ParallelConfig:
    """`[parallel]`: the planner's settings (policy, capacity, max_context, widen, ...), the cost
    model, the sharded optimizer's level and the islands."""

    planner: PlannerConfig = setting(help="", factory=PlannerConfig, inline=True)
    cost: str = setting(
        "debug",
        help="a cost file from `mixlen calibrate` (*.json) or a preset name "
        "(datapipe/plan/cost.py)",
        free_on_resume=True,
    )
    zero: int | None = setting(
        None,
        help="0: every rank keeps the whole optimizer state; 1: each rank of an island its slice "
        "of the master weights and AdamW moments; 2: also only its slice of the gradient between "
        "steps (default: 1 with more than one rank per island, else 0)",
        choices=(0, 1, 2),
        free_on_resume=True,
    )
    islands: int = setting(
        1,
        help="the world is islands x ranks per island; islands train together as [co2] says",
        lo=1,
        hi=1 << 16,
    )

    def validate(self, names: Names) -> None:
        self.cost_model(names)

    def ranks_per_island(self, world: int) -> int:
        """N of a run of `world` ranks (ConfigError unless `islands` divides it)."""
        return ranks_per_island(self.islands, world)

    def zero_level(self, ranks: int) -> int:
        """The ZeRO level of an island of `ranks` ranks (`zero`, default 1 if ranks > 1)."""
        if self.zero is not None:
            return self.zero
        return 1 if ranks > 1 else 0

    def timed_shape_differences(self, shape: ModelConfig) -> list[str]:
        """`field: timed -> now` for each shape field where the model `mixlen calibrate` timed
        for the cost file differs from `shape` (empty for presets and files without a record)."""
        if not self.cost.endswith(".json"):
            return []
        try:
            with open(self.cost) as f:
                timed = json.load(f).get("calibration", {}).get("shape")
        except (OSError, ValueError, AttributeError):
            return []
        if not isinstance(timed, dict):
            return []
        now = dataclasses.asdict(shape)
        return [f"{k} {timed[k]!r} -> {now[k]!r}" for k in now if k in timed and timed[k] != now[k]]

    def cost_model(self, names: Names | None = None) -> CostModel:
        """The planner's cost model: a `mixlen calibrate` file (*.json) or a preset name."""
        names = names or Names("parallel")
        try:
            return load(self.cost) if self.cost.endswith(".json") else preset(self.cost)
        except (MixlenError, OSError) as exc:
            raise ConfigError(f"{names('cost')}: {exc}") from None
