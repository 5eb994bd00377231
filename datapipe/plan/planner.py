"""The planner: `PlannerConfig.build(cost)` returns a Planner that turns a global batch's lengths
into a StepPlan with one of the policies below (one module each, chosen through `POLICIES`):

- `hdp` (datapipe.plan.hdp): dynamic groups balanced by estimated time (mixlen's balance
  scheduler after ByteScale's; docs/PLAN.md says where it departs from the paper's Algorithm 2),
  with `widen` (on by default);
- `naive-hdp` (datapipe.plan.naive_hdp): dynamic groups, token waves, no balancing;
- `static` (datapipe.plan.static): a fixed DP x CP mesh;
- `single` (datapipe.plan.single): one rank, whole samples (plain single-process training).

Shared rules (docs/ARCHITECTURE.md, docs/PLAN.md): a sample of length S goes on the smallest group
k whose largest zigzag chunk pair, ceil(S/k), fits the capacity (hdp with widen may then give it
more); with offload, Eq. 3 picks the offload ratio. Zero-length samples get no micro-batch. A sample that no group of N ranks can hold
is an error naming the sample. Times are int64 nanoseconds from datapipe.plan.cost.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from datapipe.errors import ConfigError, MixlenError
from datapipe.plan import hdp, naive_hdp, single, static
from datapipe.plan.cost import CostModel
from datapipe.plan.setup import MAX_CAPACITY, MAX_CONTEXT, MAX_RANKS, PlanSetup
from datapipe.plan.stepplan import StepPlan
from datapipe.settings import Names, check, setting

# policy name -> module with plan(config, cost, lengths, ids), fits(config, cost, lengths) and
# DESCRIPTION; a new policy is one module and one entry here
POLICIES: dict[str, ModuleType] = {
    "hdp": hdp,
    "naive-hdp": naive_hdp,
    "static": static,
    "single": single,
}


@dataclass(frozen=True)
class PlannerConfig:
    """The planner's settings (in a training config: `[parallel]`); the island's ranks, the seed
    and whether to plan offload are `build()` arguments."""

    policy: str = setting(
        "hdp",
        help="hdp (dynamic groups balanced by estimated time, after ByteScale), naive-hdp "
        "(dynamic groups, no balancing), "
        "static (a fixed DP x CP mesh) or single (one rank)",
        choices=tuple(POLICIES),
        free_on_resume=True,
    )
    capacity: int = setting(
        4096,
        help="positions one rank computes in one micro-batch without offload",
        lo=1,
        hi=MAX_CAPACITY,
        free_on_resume=True,
    )
    max_context: int | None = setting(
        None,
        help="the static mesh's context, which fixes its CP degree (default: the longest "
        "sample); with widen, hdp also tries that mesh",
        lo=1,
        hi=MAX_CONTEXT,
        free_on_resume=True,
    )
    widen: bool = setting(
        True,
        help="hdp may give a sample more ranks than its smallest group, or take a static mesh for "
        "a batch, when that is estimated faster (false: ByteScale's smallest-group rule; other "
        "policies ignore it)",
        free_on_resume=True,
    )
    improve_rounds: int = setting(
        4,
        help="hdp's improvement pass budget, in multiples of N moves",
        lo=0,
        hi=1 << 10,
        free_on_resume=True,
    )

    @property
    def widens(self) -> bool:
        """Does the plan widen? `widen` counts for hdp only (other policies ignore it)."""
        return self.widen and self.policy == "hdp"

    def setup(
        self, num_ranks: int, seed: int = 0, offload: bool = False, names: Names | None = None
    ) -> PlanSetup:
        """The settings with an island's runtime values, validated (what a policy plans with)."""
        names = names or Names()
        check(self, names)
        if not (isinstance(num_ranks, int) and 1 <= num_ranks <= MAX_RANKS):
            raise ConfigError(
                f"{names('num_ranks')}: must be an int in [1, {MAX_RANKS}], got {num_ranks!r}"
            )
        if self.policy == "single" and num_ranks != 1:
            raise ConfigError(
                f"{names('num_ranks')}: the single policy plans one rank, got {num_ranks}"
            )
        return PlanSetup(
            self.policy, num_ranks, self.capacity, bool(offload), self.max_context, int(seed),
            self.improve_rounds, self.widens, names,
        )  # fmt: skip

    def build(
        self,
        cost: CostModel,
        num_ranks: int,
        seed: int = 0,
        offload: bool = False,
        names: Names | None = None,
    ) -> Planner:
        """The Planner of an island of `num_ranks` ranks (`offload`: plan with Eq. 3)."""
        return Planner(self.setup(num_ranks, seed, offload, names), cost)


class Planner:
    """Plans steps for one configuration and cost model."""

    def __init__(self, config: PlanSetup, cost: CostModel) -> None:
        self.config = config
        self.cost = cost.for_island(config.num_ranks)
        self._policy = POLICIES[config.policy]
        self._plan: Callable[..., StepPlan] = self._policy.plan

    def plan(self, lengths: np.ndarray, sample_ids: np.ndarray | None = None) -> StepPlan:
        """Plan one global batch (lengths in batch order; ids default to 0..n-1)."""
        lengths = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
        if sample_ids is None:
            sample_ids = np.arange(lengths.shape[0], dtype=np.int64)
        sample_ids = np.ascontiguousarray(sample_ids, dtype=np.int64).reshape(-1)
        if sample_ids.shape != lengths.shape:
            raise MixlenError("sample_ids and lengths must have the same size")
        if lengths.size and lengths.min() < 0:
            raise MixlenError("sample lengths must be >= 0")
        return self._plan(self.config, self.cost, lengths, sample_ids)

    def fits(self, lengths: np.ndarray) -> np.ndarray:
        """Per sample: can some plan of this configuration hold it (bool array)?"""
        s = np.asarray(lengths, dtype=np.int64)
        return s <= self._policy.fits(self.config, self.cost, s)

    def check_fits(self, lengths: np.ndarray, what: str) -> None:
        """MixlenError naming the longest sample of `what` (e.g. a dataset) no plan can hold."""
        s = np.asarray(lengths, dtype=np.int64)
        bad = np.flatnonzero(~self.fits(s))
        if bad.size:
            i = int(bad[np.argmax(s[bad])])
            k = self.config.key
            raise MixlenError(
                f"{what}: sample {i} has {int(s[i])} tokens, more than {self.config.policy} on "
                f"{self.config.num_ranks} ranks of capacity {self.config.capacity} can hold; "
                f"raise {k('capacity')} or {k('num_ranks')}, or cap sample length at "
                "preprocess time (--max-len)"
            )


def describe_policy(policy: str) -> str:
    """One line per policy for reports."""
    return POLICIES[policy].DESCRIPTION
