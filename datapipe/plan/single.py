"""`single`: one rank, whole samples, no splitting: the layout of plain single-process training and
the policy the others are compared with. Samples are packed in batch order into micro-batches of
at most `capacity` positions; a longer sample gets a micro-batch of its own (its capacity is its
length). Times come from the cost model like every other policy's.
"""

from __future__ import annotations

import numpy as np

from datapipe.plan.common import assemble, local_times
from datapipe.plan.cost import CostModel
from datapipe.plan.setup import PlanSetup
from datapipe.plan.stepplan import StepPlan
from datapipe.stream import greedy_boundaries

DESCRIPTION = "one rank, whole samples in batch order (the single-process layout)"


def fits(config: PlanSetup, cost: CostModel, lengths: np.ndarray) -> np.ndarray:
    """Any sample fits: a long one gets a micro-batch of its own."""
    return np.full(np.shape(lengths), np.iinfo(np.int64).max, dtype=np.int64)


def plan(
    config: PlanSetup, cost: CostModel, lengths: np.ndarray, sample_ids: np.ndarray
) -> StepPlan:
    """Plan one global batch on one rank."""
    cap = config.capacity
    live = np.flatnonzero(lengths > 0)
    bounds = greedy_boundaries(lengths[live], cap) if live.size else np.zeros(1, np.int64)
    n_mb = bounds.shape[0] - 1
    tokens = np.add.reduceat(lengths[live], bounds[:-1]) if n_mb else np.zeros(0, np.int64)
    times = local_times(cost, lengths, bounds, live)
    # lower bound: all work, plus c per micro-batch a plan needs at least (a sample longer than C
    # alone, the rest at most C positions each)
    long_ = lengths[live] > cap
    short_tokens = int(lengths[live][~long_].sum())
    n_min = int(long_.sum()) + -(-short_tokens // cap)
    lb = int(cost.work_ns(lengths[live], 1).sum()) + cost.c_ns * n_min
    return assemble(
        "single",
        config,
        cost,
        lengths,
        sample_ids,
        np.arange(n_mb, dtype=np.int64),
        np.ones(n_mb, dtype=np.int64),
        np.zeros(n_mb, dtype=np.int64),
        np.maximum(tokens, cap).astype(np.int64),
        np.zeros(n_mb, dtype=np.int64),
        bounds.astype(np.int64),
        live.astype(np.int64),
        times,
        {"offload": False},
        lb,
    )
