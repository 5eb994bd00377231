"""What a policy plans with (`PlanSetup`): the planner's settings (datapipe.plan.planner's
PlannerConfig) and an island's runtime values, with the names to spell them in errors; and the
bounds on sizes that keep the planner's int64 arithmetic exact."""

from __future__ import annotations

from dataclasses import dataclass

from datapipe.settings import Names

__all__ = ["MAX_CAPACITY", "MAX_CONTEXT", "MAX_RANKS", "PlanSetup"]

# N x C, sums of lengths and costs in nanoseconds must fit int64 with room to spare
MAX_RANKS = 1 << 20
MAX_CAPACITY = 1 << 32
MAX_CONTEXT = 1 << 36


@dataclass(frozen=True)
class PlanSetup:
    """A validated planner configuration for one island."""

    policy: str
    num_ranks: int
    capacity: int
    offload: bool
    max_context: int | None
    seed: int
    improve_rounds: int
    widen: bool
    names: Names

    def key(self, name: str) -> str:
        """How the user wrote setting `name`."""
        return self.names(name)
