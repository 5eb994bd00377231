"""hdp's schedule of fixed micro-batches (datapipe.plan.balance): the load it keeps for each rank
against a recomputation from its micro-batches, and the improvement pass's budget."""

from __future__ import annotations

import numpy as np

from datapipe.plan import cost as C
from datapipe.plan.balance import Schedule, fill_idle
from datapipe.plan.common import Layout
from datapipe.plan.planner import PlannerConfig
from datapipe.shapes import MODEL_CONFIGS


def test_fill_idle_moves_a_micro_batch_and_its_load() -> None:
    """A schedule whose rank 0 runs two tail micro-batches while rank 2 runs none (as one kept
    over rebalance_tail's may be): fill_idle gives rank 2 the longer one, and the schedule's
    load (what hdp and widen compare candidates by) is each rank's sum of micro-batch times
    again, recomputed here; the makespan its maximum."""
    none = np.zeros(0, dtype=np.int64)
    layout = Layout(none, none, np.zeros(1, np.int64), none, none, np.array([0, 2, 3, 5]),
                    np.arange(5), np.array([500, 300, 400]))  # fmt: skip
    sched = Schedule(900, none, none, np.array([0, 1, 0]), np.array([0, 1, 0]), 0, 0,
                     np.array([900, 300, 0]), (0, False))  # fmt: skip
    lengths = np.full(5, 100, dtype=np.int64)
    _, got = fill_idle(layout, sched, lengths, C.preset("debug"))
    assert got.b_rank.tolist() == [2, 1, 0]
    want = np.bincount(got.b_rank, weights=layout.b_time, minlength=3).astype(np.int64)
    assert got.load.tolist() == want.tolist() == [400, 300, 500] and got.makespan == 500


def test_the_improvement_budget_is_rounds_times_ranks() -> None:
    """`improve_rounds` buys that many moves per rank in each improvement pass (the schedule's,
    then the tail's): none at 0; at 1 on 16 ranks, up to 16 a pass, and this batch takes 17 in
    all (a budget of `improve_rounds` alone would stop at 2)."""
    lengths = np.clip(np.random.default_rng(16).lognormal(np.log(600), 1.0, 400), 1, 16000)
    # the 7B on fixed rates (the h100 preset's assumed ones before it was measured), so that
    # retuning the preset does not move this batch's count
    rates = C.DeviceRates(
        "fixed", 4.5e14, 2.25e14, 5.0e10, 3.2e10, 2e-3, hop_latency_s=2e-5, attn_n_half=512.0,
        overlap=0.9, ranks_per_node=8, node_link_bytes_per_s=3.0e11,
    )  # fmt: skip
    cost = C.build_cost_model("llama-7b", MODEL_CONFIGS["llama-7b"], rates)
    moves = [
        PlannerConfig(policy="hdp", capacity=4096, widen=False, improve_rounds=r)
        .build(cost, 16)
        .plan(lengths.astype(np.int64))
        .meta["improve_moves"]
        for r in (0, 1, 50)
    ]
    assert moves == [0, 17, 17]
