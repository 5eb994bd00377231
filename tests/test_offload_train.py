"""Offload and activation checkpointing wired into the trainer: the plan-level figures
(trainer.offload.plan) against plain loops over `StepPlan.microbatches`, the host budget refusal,
the `[offload]` / `train.activation_checkpoint` config, the executor on 4 thread-ranks (bitwise
against the plain executor, planned offload against one process), and `mixlen train` end to end."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from _train_worker import (
    CAPACITY,
    OFFLOAD_COST,
    STEPS,
    WORLD,
    compare,
    compare_offload,
    make_dataset,
    offload_model_config,
    run_offload,
    scenario_data,
    train_config,
)
from test_reference_trainer import offload_reference

from datapipe.errors import ConfigError, MixlenError
from datapipe.plan.cost import DEVICES, build_cost_model
from datapipe.plan.planner import PlannerConfig
from trainer.config.job import from_dict
from trainer.config.resume import resume_conflicts
from trainer.config.toml import apply_overrides
from trainer.offload.config import OffloadConfig
from trainer.offload.manager import ActivationPolicy
from trainer.offload.plan import (
    HostNeed,
    OffloadSummary,
    eq3_peak_bytes,
    member_positions,
    offload_blocks,
    plan_offload,
)
from trainer.testing.threads import run_threads

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


# --- plan-level figures -----------------------------------------------------------------------------


def test_offload_blocks_keep_the_device_within_eq3():
    """j blocks offloaded leave l - j on the device, Eq. 3 budgets 2 + (1-r)(l-2): equal on the
    ratios k/(l-2); on the planner's ratios j/l never above the budget, less than a block under."""
    for n_layers in range(3, 40):
        for k in range(n_layers - 1):
            r = k / (n_layers - 2)
            kept = n_layers - offload_blocks(r, n_layers)
            assert abs(kept - (2 + (1 - r) * (n_layers - 2))) < 1e-9
        for j in range(n_layers + 1):
            r = j / n_layers
            budget = 2 + (1 - r) * (n_layers - 2)
            kept = n_layers - offload_blocks(r, n_layers)
            assert budget - 1 < kept <= budget + 1e-9, (n_layers, j, kept, budget)
    assert offload_blocks(1.0, 2) == 0 and offload_blocks(0.7, 1) == 0
    assert offload_blocks(np.array([0.0, 0.5, 1.0]), 6).tolist() == [0, 2, 4]
    with pytest.raises(ValueError):
        offload_blocks(1.5, 8)


def _plans():
    rng = np.random.default_rng(5)
    for policy, n, offload in [
        ("hdp", 4, True),
        ("naive-hdp", 5, True),
        ("hdp", 7, False),
        ("static", 4, False),
    ]:
        lengths = np.concatenate([rng.integers(0, 60, 30), rng.integers(100, 240, 3)])
        config = PlannerConfig(policy, capacity=CAPACITY)
        yield config.build(OFFLOAD_COST, n, offload=offload).plan(lengths)


def test_member_positions_and_host_bytes_match_plain_loops():
    """Every rank's positions per micro-batch and its host bytes (blocks 0 and 2 checkpointed:
    their inputs) against a loop over each rank's own zigzag pieces."""
    shape = offload_model_config()
    need = HostNeed.of(shape, 8, [True, False, True, False])
    act, hidden = shape.act_bytes_per_token_layer(8), shape.dim * 8
    per_block = [hidden, act, hidden, act]
    seen_ratios = set()
    for plan in _plans():
        po = plan_offload(plan, need)
        pos = member_positions(plan)
        got = {
            (int(r), int(m)): (int(n), int(b))
            for r, m, n, b in zip(po.rank, po.mb, pos, po.host_bytes)
        }
        want = {}
        for rank in range(plan.num_ranks):
            for mb in plan.microbatches(rank):
                n = sum(e - s for _, s, e in mb.pieces)
                j = math.ceil(mb.offload_ratio * (shape.n_layers - 2) - 1e-9)
                want[(rank, mb.slot)] = (n, math.ceil(sum(per_block[:j]) * n))
                seen_ratios.add(mb.offload_ratio)
        assert got == want
        assert np.array_equal(po.positions, pos)
        # force_ratio replaces every micro-batch's ratio
        forced = plan_offload(plan, need, force_ratio=1.0)
        assert np.all(forced.blocks == 2)
        assert forced.host_bytes.tolist() == [math.ceil((hidden + act) * n) for n in pos]
    assert {0.0, 0.5, 0.75} <= seen_ratios  # the offload plans really hold ratios > 0


def test_eq3_peak_formula():
    n = np.array([100, 100, 50])
    r = np.array([0.0, 1.0, 0.5])
    assert eq3_peak_bytes(n, r, 6, 10.0).tolist() == [6 * 1000.0, 2 * 1000.0, 4 * 500.0]
    assert eq3_peak_bytes(n, r, 2, 10.0).tolist() == [2000.0, 2000.0, 1000.0]


def test_offload_summary_tables_and_record():
    """The balance report's offload tables and the metrics fields against plain loops: per ratio
    the rank-micro-batches, positions and host bytes over the run; per rank the bytes moved (sum),
    measured peak (max) and Eq. 3's peak (max of (2 + (1-r)(l-2)) * Act * positions)."""
    shape = offload_model_config()
    need = HostNeed.of(shape, 8, [False] * 4)
    plan = next(iter(_plans()))  # an offload plan on 4 ranks, run twice
    summary = OffloadSummary(4, 10.0)
    po = plan_offload(plan, need)
    rec1 = summary.add(po, [1, 2, 3, 4], [10, 20, 30, 40])
    rec2 = summary.add(po, [5, 0, 0, 0], [5, 50, 0, 41])
    eq3 = [0.0] * 4
    rows: dict = {}
    for rank in range(4):
        for mb in plan.microbatches(rank):
            n = sum(e - s for _, s, e in mb.pieces)
            r = mb.offload_ratio
            eq3[rank] = max(eq3[rank], (2 + (1 - r) * 2) * 10.0 * n)
            row = rows.setdefault(r, [0, 0])
            row[0] += 2
            row[1] += 2 * n
    assert rec1["activation_peak_eq3_bytes_per_rank"] == [round(x) for x in eq3]
    assert rec2["offload_bytes_per_rank"] == [5, 0, 0, 0]
    assert rec1["offload_ratio_max"] == max(rows)
    assert summary.moved.tolist() == [6, 2, 3, 4] and summary.peak.tolist() == [10, 50, 30, 41]
    assert {r: v[1:3] for r, v in summary.by_ratio.items()} == rows
    text = summary.render()
    top = max(rows)
    assert top > 0 and f"| {top:.3f} | {math.ceil(top * 2 - 1e-9)} | {rows[top][0]} |" in text
    assert "| rank | MiB moved to host |" in text


# --- the host budget -------------------------------------------------------------------------------


def test_host_budget_refused_by_every_rank_before_the_step():
    """A budget one byte under the largest micro-batch's need (any rank's): every rank refuses
    before running anything, naming offload.host_budget_bytes and the bytes needed."""
    tokens, batches = scenario_data()
    ids = batches[0]
    lengths = np.array([len(tokens[i]) for i in ids], dtype=np.int64)
    plan = PlannerConfig("hdp", capacity=CAPACITY)
    plan = plan.build(OFFLOAD_COST, WORLD, offload=True).plan(lengths, ids)
    shape = offload_model_config()
    act = shape.act_bytes_per_token_layer(8)
    need = max(  # plain loop: blocks to host x positions x Act
        math.ceil(
            math.ceil(mb.offload_ratio * 2 - 1e-9) * act * sum(e - s for _, s, e in mb.pieces)
        )
        for rank in range(WORLD)
        for mb in plan.microbatches(rank)
    )
    assert need > 0
    fine = run_threads(WORLD, lambda c: run_offload(c, planned=True, budget=need, steps=1))
    assert all(r["results"][0].loss > 0 for r in fine)  # exactly the need: runs

    def refused(comm):
        try:
            run_offload(comm, planned=True, budget=need - 1, steps=1)
        except ConfigError as exc:
            return str(exc)
        return None

    msgs = run_threads(WORLD, refused, timeout=60)
    assert all(m == msgs[0] for m in msgs) and msgs[0] is not None
    assert "offload.host_budget_bytes" in msgs[0] and f"needs {need} bytes" in msgs[0]
    assert "step 0" in msgs[0]


# --- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sets,key",
    [
        (['train.activation_checkpoint="some"'], "train.activation_checkpoint"),
        (['train.activation_checkpoint="every:0"'], "train.activation_checkpoint"),
        (['train.activation_checkpoint="every:x"'], "train.activation_checkpoint"),
        (['train.activation_checkpoint="selective"', "train.compile=true"], "train.compile"),
        (['train.activation_checkpoint="selective"', "offload.enabled=true"], "offload.enabled"),
        (["offload.force_ratio=0.5"], "offload.force_ratio"),  # needs enabled
        (["offload.enabled=true", "offload.force_ratio=1.5"], "offload.force_ratio"),
        (["offload.host_bytes_per_s=0"], "offload.host_bytes_per_s"),
        (["offload.host_budget_bytes=-1"], "offload.host_budget_bytes"),
        (["offload.host_budget_bytes=1.5"], "offload.host_budget_bytes"),
        (["offload.min_bytes=-4"], "offload.min_bytes"),
        (["offload.pool_bytes=-1"], "offload.pool_bytes"),
        (["offload.enabled=1"], "offload.enabled"),
        (["offload.enabled=true", 'parallel.policy="static"'], "offload.enabled"),
        # the debug preset plans 2 layers, the model has 4: Eq. 3 would be wrong
        (["offload.enabled=true", "model.n_layers=4"], "parallel.cost"),
    ],
)
def test_offload_config_errors_name_the_key(sets, key):
    with pytest.raises(ConfigError) as exc:
        from_dict(apply_overrides({"data": {"path": "x"}}, sets))
    assert key in str(exc.value)


def test_offload_config_builds_the_planner_and_manager(tmp_path):
    cost = tmp_path / "c.json"
    shape = offload_model_config()
    cost.write_text(build_cost_model("t", shape, DEVICES["cpu"], dtype_bytes=8).to_json())
    base = {"data": {"path": "x"}, "model": {"n_layers": 4}, "parallel": {"cost": str(cost)}}
    cfg = from_dict({**base, "offload": {"enabled": True, "host_bytes_per_s": 123.0}})
    assert cfg.planner_spec(4).offload and cfg.cost_model().offload_bytes_per_s == 123.0
    forced = from_dict({**base, "offload": {"enabled": True, "force_ratio": 0.5}})
    assert not forced.planner_spec(4).offload  # force_ratio: plans without offload
    assert forced.offload.ratio(0.0) == 0.5
    assert ActivationPolicy("every:3").checkpointed(7) == [1, 0, 0, 1, 0, 0, 1]
    assert OffloadConfig(host_budget_bytes=10).pool_bound == 20
    with pytest.raises(MixlenError, match="offload.enabled"):
        OffloadConfig().ratio(0.5)
    # memory-only settings may change on resume, the ones that decide the plans may not
    saved = cfg.to_dict()
    again = from_dict(
        {
            **base,
            "train": {"activation_checkpoint": "full"},
            "offload": {"enabled": True, "host_bytes_per_s": 123.0, "host_budget_bytes": 1 << 30},
        }
    )
    assert resume_conflicts(saved, again) == []
    changed = from_dict({**base, "offload": {"enabled": True, "host_bytes_per_s": 5.0}})
    assert resume_conflicts(saved, changed) == ["offload.host_bytes_per_s: 123.0 -> 5.0"]
    # the planner's too-long error names the key that would make room
    with pytest.raises(MixlenError, match="offload.enabled"):
        spec = from_dict(base).planner_spec(1)._replace(cost=OFFLOAD_COST)
        spec.build(100, 0).plan(np.array([5000]))


# --- the executor on 4 thread-ranks ----------------------------------------------------------------


@pytest.mark.timeout(240)
def test_executor_offload_and_checkpointing_threads():
    """hdp steps (rings of 3 and 2 beside local work) with offload r = 0, 0.5, 1: gradients and
    losses bitwise those of the plain executor; checkpointing full and every:2 (with r = 0.5)
    within float64 1e-12. Each rank's measured bytes moved equal the plan's host bytes of its
    micro-batches (min_bytes 0: everything moves), and StepResult carries them per rank.
    Selective checkpointing (rings replayed from the attention tape) within float64 1e-12."""
    plain = run_threads(WORLD, lambda c: run_offload(c, managed=False), timeout=120)
    assert sorted({int(k) for k in plain[0]["plans"][0].group_sizes}) == [1, 2, 3]
    for name, kw in [
        ("r=0", {"force": 0.0}),
        ("r=0.5", {"force": 0.5}),
        ("r=1", {"force": 1.0}),
        ("full", {"checkpoint": "full"}),
        ("every:2+r=0.5", {"checkpoint": "every:2", "force": 0.5}),
        ("selective", {"checkpoint": "selective"}),
    ]:
        got = run_threads(WORLD, lambda c, kw=kw: run_offload(c, **kw), timeout=120)
        for rank, (ref, res) in enumerate(zip(plain, got)):
            compare_offload(ref, res, name)
            for step, mbs in enumerate(res["mbs"]):
                for _, ratio, host_bytes, stats in mbs:
                    assert stats.offload_ratio == kw.get("force", 0.0) == ratio
                    assert stats.moved_bytes == host_bytes
                    assert stats.late_fetches == 0
                result = res["results"][step]
                assert result.offload_bytes[rank] == sum(st.moved_bytes for *_, st in mbs)
                assert result.act_peak_bytes[rank] == max(
                    (st.peak_bytes for *_, st in mbs), default=0
                )
        moved = sum(got[0]["results"][0].offload_bytes)
        assert (moved > 0) == (kw.get("force", 0.0) > 0)


@pytest.mark.timeout(240)
def test_executor_follows_planned_offload_threads():
    """Plans made with offload (a local micro-batch at r = 1, a ring of 2 at r = 0.5): each
    micro-batch runs with its plan's ratio, and the run equals the reference trainer's
    (tests/test_reference_trainer.py) on the 4-layer model within the float64 bounds."""
    got = run_threads(WORLD, lambda c: run_offload(c, planned=True, steps=STEPS), timeout=200)
    compare(offload_reference(), got[0], torch.float64)
    plan = got[0]["plans"][0]
    assert sorted(set(plan.mb_offload.tolist())) == [0.0, 0.5, 1.0]
    for res in got:
        for mb, ratio, host_bytes, stats in res["mbs"][0]:
            assert ratio == plan.mb_offload[mb] == stats.offload_ratio
            assert stats.moved_bytes == host_bytes and (host_bytes > 0) == (ratio > 0)
    assert any(r["results"][0].offload_bytes[i] > 0 for i, r in enumerate(got))


# --- mixlen train end to end -------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_mixlen_train_offload_and_checkpointing(tmp_path):
    """`mixlen train` in one process, hdp on one rank of capacity 256 with offload enabled (a
    4-layer model: samples of 257..512 tokens only fit with r > 0) and checkpointing every:2:
    trains, writes the offload fields to metrics.jsonl and the offload tables to balance.md."""
    from tools.cli import main
    from trainer.config.toml import to_toml

    data = make_dataset(str(tmp_path / "ds"), n_docs=80)
    run = tmp_path / "run"
    shape = dataclasses.replace(train_config(data, str(run)).model.shape(), n_layers=4)
    cost = tmp_path / "cost.json"
    cost.write_text(build_cost_model("t", shape, DEVICES["cpu"], dtype_bytes=4).to_json())
    cfg = train_config(
        data,
        str(run),
        model={"n_layers": 4},
        train={"steps": 8, "eval_interval": 4, "activation_checkpoint": "every:2"},
        parallel={"policy": "hdp", "capacity": 256, "cost": str(cost)},
        offload={"enabled": True, "host_bytes_per_s": 1e12},
        checkpoint={"dir": None},
    )
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert main(["train", str(path)]) == 0
    recs = [json.loads(x) for x in open(run / "metrics.jsonl")]
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert recs[-1]["loss"] < recs[0]["loss"]
    for r in recs:
        assert len(r["offload_bytes_per_rank"]) == len(r["activation_peak_bytes_per_rank"]) == 1
        assert r["activation_peak_bytes_per_rank"][0] > 0
        assert (r["offload_bytes_per_rank"][0] > 0) == (r["offload_ratio_max"] > 0)
    assert any(r["offload_ratio_max"] > 0 for r in recs)  # some steps offloaded
    report = (run / "balance.md").read_text()
    assert "activation offload" in report and "| offload ratio r |" in report
    assert "MiB moved to host" in report
