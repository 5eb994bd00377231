"""`[parallel]`: the island's planner (datapipe.plan.planner's settings, in this section), its
cost model, the ZeRO level and the number of islands."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from datapipe.errors import ConfigError, MixlenError
from datapipe.plan.cost import CostModel, load, preset
from datapipe.plan.costcheck import timed_model
from datapipe.plan.memory import zero_level
from datapipe.plan.planner import PlannerConfig
from datapipe.settings import Names, setting
from datapipe.shapes import COST_FREE_FIELDS, TP_DEGREES, ModelConfig
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
    tp: int = setting(
        1,
        help="tensor-parallel processes per rank (adjacent processes; the world is islands x "
        "ranks per island x tp): they split the model's heads, SwiGLU units and vocabulary and "
        "run the same micro-batches, one rank to the planner (docs/training.md, Tensor "
        "parallelism)",
        choices=TP_DEGREES,
        free_on_resume=True,
    )

    def validate(self, names: Names) -> None:
        self.cost_model(names)

    def ranks_per_island(self, world: int) -> int:
        """N of a run of `world` processes: its HDP ranks per island (ConfigError unless `tp`
        and then `islands` divide it)."""
        return ranks_per_island(self.islands, world, self.tp)

    def zero_level(self, ranks: int) -> int:
        """The ZeRO level of an island of `ranks` ranks (`zero`, default 1 if ranks > 1)."""
        return zero_level(self.zero, ranks)

    def _timed_differences(self, shape: ModelConfig, dtype: str | None) -> list[tuple]:
        """(field, timed, now) where the model timed for the cost file differs from `shape` (and
        the compute `dtype`, if given, and `tp`), in the shape's field order; [] for presets and
        files without a record (of a field: older files)."""
        if not self.cost.endswith(".json"):
            return []
        timed = timed_model(self.cost)
        have = {**timed.get("shape", {}), **({"dtype": timed["dtype"]} if "dtype" in timed else {})}
        have.update({"tp": timed["tp"]} if "tp" in timed else {})
        now = {**dataclasses.asdict(shape), **({"dtype": dtype} if dtype is not None else {})}
        now["tp"] = self.tp
        return [(k, have[k], now[k]) for k in now if k in have and have[k] != now[k]]

    def timed_shape_differences(self, shape: ModelConfig, dtype: str | None = None) -> list[str]:
        """`field timed -> now` for each difference between the model `mixlen calibrate` timed
        for the cost file and `shape` (and the compute `dtype`, if given)."""
        return [f"{k} {a!r} -> {b!r}" for k, a, b in self._timed_differences(shape, dtype)]

    def timed_cost_differences(self, shape: ModelConfig, dtype: str) -> list[str]:
        """timed_shape_differences less the fields that leave a step's work as it is
        (datapipe.shapes.COST_FREE_FIELDS): with any of these, the cost file predicts another
        model's times (another vocabulary, width, depth or dtype)."""
        diff = self._timed_differences(shape, dtype)
        return [f"{k} {a!r} -> {b!r}" for k, a, b in diff if k not in COST_FREE_FIELDS]

    def cost_model(self, names: Names | None = None) -> CostModel:
        """The planner's cost model: a `mixlen calibrate` file (*.json) or a preset name."""
        names = names or Names("parallel")
        try:
            return load(self.cost) if self.cost.endswith(".json") else preset(self.cost)
        except (MixlenError, OSError) as exc:
            raise ConfigError(f"{names('cost')}: {exc}") from None
