"""The planner's settings: every key, its default and its check, in one place. The policy modules
read them (typed as `PlannerSettings`); `datapipe.plan.planner.PlannerConfig` adds the policy
registry check and `build()`. Keeping the settings here, below the policies, means no policy
module imports the planner that imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from datapipe.errors import ConfigError, UserKeys


@dataclass(frozen=True)
class PlannerSettings(UserKeys):
    """Planner settings as the policies read them (errors name the key as the user wrote it)."""

    policy: str = "hdp"
    num_ranks: int = 8
    capacity: int = 8192
    offload: bool = False
    max_context: int | None = None  # static: the run's longest context (default: batch maximum)
    seed: int = 0
    improve_rounds: int = 4  # hdp: improvement pass budget, in multiples of N moves
    widen: bool = False  # hdp: also try groups wider than the smallest (docs/PLAN.md, "Widen")
    keys: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def validate(self) -> None:
        """Raise ConfigError naming the first bad setting (the policy name is checked against
        the registry by PlannerConfig.validate, before this)."""
        k = self.key
        if not (isinstance(self.num_ranks, int) and self.num_ranks >= 1):
            raise ConfigError(f"{k('num_ranks')}: must be an int >= 1, got {self.num_ranks!r}")
        if not (isinstance(self.capacity, int) and self.capacity >= 1):
            raise ConfigError(f"{k('capacity')}: must be an int >= 1, got {self.capacity!r}")
        if self.max_context is not None and self.max_context < 1:
            raise ConfigError(f"{k('max_context')}: must be >= 1, got {self.max_context!r}")
        if not isinstance(self.widen, bool):
            raise ConfigError(f"{k('widen')}: must be a bool, got {self.widen!r}")
        if self.widen and self.policy != "hdp":
            raise ConfigError(
                f"{k('widen')}: only the hdp policy widens groups, not '{self.policy}' "
                "(unset widen)"
            )
        if self.policy == "single" and self.num_ranks != 1:
            raise ConfigError(
                f"{k('num_ranks')}: the single policy plans one rank, got {self.num_ranks}"
            )
