"""`naive-hdp`: dynamic groups without balancing (ByteScale Alg. 1). Groups and local micro-batches
as hdp forms them (smallest group, Eq. 3's offload ratio as is), then micro-batches by decreasing
tokens, first fit into waves of N ranks (one micro-batch per rank per wave).
"""

from __future__ import annotations

import numpy as np

from datapipe.plan.common import (
    assemble_dynamic,
    dynamic_layout,
    dynamic_limit,
    gather,
    plan_lower_bound_ns,
)
from datapipe.plan.cost import CostModel
from datapipe.plan.schedule import place_waves
from datapipe.plan.setup import PlanSetup
from datapipe.plan.stepplan import StepPlan

DESCRIPTION = "dynamic groups, token waves, no balancing (ByteScale Alg. 1)"
fits = dynamic_limit


def plan(
    config: PlanSetup, cost: CostModel, lengths: np.ndarray, sample_ids: np.ndarray
) -> StepPlan:
    """Plan one global batch with naive-hdp."""
    n_ranks = config.num_ranks
    lb = plan_lower_bound_ns(cost, lengths, n_ranks, config.capacity)
    # local samples over enough micro-batches that, with the rings, every rank gets one
    layout, caps = dynamic_layout(config, cost, lengths, sample_ids, None, spread_over=n_ranks)
    # waves: micro-batches by decreasing tokens, first fit, one per rank per wave
    b_off, b_items = layout.b_off, layout.b_items
    n_bins = b_off.shape[0] - 1
    mb_k = np.concatenate([layout.kg, np.ones(n_bins, dtype=np.int64)])
    b_tokens = np.add.reduceat(lengths[b_items], b_off[:-1]) if n_bins else np.zeros(0, np.int64)
    tokens = np.concatenate([lengths[layout.g_items], b_tokens]).astype(np.int64)
    order = np.lexsort((np.arange(mb_k.shape[0]), -tokens)).astype(np.int64)
    ranks_sorted, wave = place_waves(mb_k[order], n_ranks)
    src_off = np.zeros(mb_k.shape[0] + 1, dtype=np.int64)
    np.cumsum(mb_k, out=src_off[1:])
    sorted_off = np.zeros(mb_k.shape[0] + 1, dtype=np.int64)
    np.cumsum(mb_k[order], out=sorted_off[1:])
    mb_ranks = ranks_sorted[gather(sorted_off, np.argsort(order), src_off)]
    w = np.empty(mb_k.shape[0], dtype=np.int64)
    w[order] = wave
    mb_key = w * n_ranks + mb_ranks[src_off[:-1]]
    meta = {"waves": int(wave.max()) + 1 if wave.size else 0}
    return assemble_dynamic(
        "naive-hdp", config, cost, lengths, sample_ids, layout, caps, mb_key, mb_ranks, meta, lb
    )
