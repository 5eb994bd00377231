"""trainer.compare's CPU-time measure against a plain-Python replay of the same plan."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from datapipe.plan.cost import preset
from datapipe.plan.planner import PlannerConfig
from trainer.compare import replayed_cpu_s


class _TwoRanks:
    """Rank `rank` of 2: all_reduce adds the other rank's tensor (given up front)."""

    size = 2

    def __init__(self, other: torch.Tensor) -> None:
        self.other = other

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> None:
        tensor += self.other


def _reference(plan, cpu: np.ndarray) -> float:
    """Micro-batches in slot order; each starts when all its members are free and lasts its
    slowest member's CPU time; the result is the last rank's finish (seconds)."""
    free = [0.0, 0.0]
    for m in range(plan.num_microbatches):
        members = plan.group_ranks[plan.mb_group_offsets[m] : plan.mb_group_offsets[m + 1]]
        start = max(free[r] for r in members)
        for r in members:
            free[r] = start + max(cpu[q, m] for q in members)
    return max(free)


@pytest.mark.parametrize("rank", [0, 1])
def test_replayed_cpu_time_equals_a_plain_replay(rank):
    lengths = np.array([900, 300, 200, 120, 80, 40], dtype=np.int64)  # 900: a ring of 2 at C 512
    cfg = PlannerConfig(policy="hdp", capacity=512, widen=False)  # a ring and local micro-batches
    plan = cfg.build(preset("debug"), num_ranks=2)
    plan = plan.plan(lengths, np.arange(lengths.shape[0]))
    assert 2 in set(plan.group_sizes.tolist()) and plan.num_microbatches >= 3
    rng = np.random.default_rng(0)
    cpu = np.zeros((2, plan.num_microbatches))  # each rank's logged CPU s per slot it runs
    for r in range(2):
        for pm in plan.microbatches(r):
            cpu[r, pm.slot] = rng.uniform(0.01, 0.5)
    other = torch.zeros(2, plan.num_microbatches, dtype=torch.float64)
    other[1 - rank] = torch.from_numpy(cpu[1 - rank])  # what the other rank contributes
    mb_log = [(pm.slot, cpu[rank, pm.slot]) for pm in plan.microbatches(rank)]
    got = replayed_cpu_s(_TwoRanks(other), mb_log, plan, rank)
    assert got == pytest.approx(_reference(plan, cpu), abs=2e-9)


@pytest.mark.parametrize(("max_context", "cp"), [(None, 2), (1024, 4)])
def test_compare_mode_sizes_the_static_mesh_for_max_context(max_context, cp):
    """The compare mode's static mesh is sized for parallel.max_context whatever the run's policy
    (it was dropped unless the run was static or widened: an hdp run compared with the mesh of
    its dataset's longest sample, 300 tokens here, CP 2 at capacity 256)."""
    from types import SimpleNamespace

    from trainer.compare import PolicyComparison
    from trainer.config.job import from_dict

    par = {"policy": "hdp", "capacity": 256, "max_context": max_context}
    cfg = from_dict({"data": {"path": "unused"}, "parallel": par})
    spec = cfg.planner_spec(4)
    data = SimpleNamespace(planner_spec=spec, planner=spec.build(300, 0), longest=300)
    other = PolicyComparison("static", 1, data, executor=None, rank=0).planners["other"]
    assert other.plan(np.array([100, 100, 100, 100])).meta["cp"] == cp


# --- datapipe.plan.compare: the policy-comparison service ---------------------------------------


class _Clock:
    """A fake clock for datapipe.plan.compare (its `time`): it moves only when a planner plans."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def thread_time(self) -> float:
        return self.now / 2  # CPU time: half the wall time, to tell the two apart


class _Timed:
    """A real planner whose plan() advances the fake clock and logs (label, batch) calls: 1000 s
    for each call of the untimed warm-up pass (the first over the batches), then a distinct,
    known duration per (label, batch, pass)."""

    def __init__(self, label: str, planner, clock: _Clock, log: list, n_batches: int) -> None:
        self.label, self.planner, self.clock, self.log = label, planner, clock, log
        self.cost, self.n_batches, self.calls = planner.cost, n_batches, 0

    def duration(self, call: int) -> float:
        if call < self.n_batches:
            return 1000.0
        return 0.001 * (1 + call) * (2 if self.label == "static" else 1)

    def plan(self, lengths, ids):
        self.log.append((self.label, self.calls % self.n_batches))
        self.clock.now += self.duration(self.calls)
        self.calls += 1
        return self.planner.plan(lengths, ids)


def _batches() -> list:
    rng = np.random.default_rng(5)
    out = []
    for _ in range(3):
        lengths = np.concatenate([[1500], rng.integers(16, 400, size=20)]).astype(np.int64)
        out.append((lengths, np.arange(lengths.shape[0], dtype=np.int64) + 100 * len(out)))
    return out


def _service_planners():
    from datapipe.plan.compare import Variant, variant_planners

    base = PlannerConfig(capacity=512, max_context=2048)
    variants = [Variant("hdp"), Variant("static")]
    return variant_planners(variants, base, preset("debug"), 4), preset("debug")


def _replay_makespan(plan) -> int:
    """Plain-Python slot-order replay of the plan's micro-batch times (ns)."""
    free = [0] * plan.num_ranks
    for m in range(plan.num_microbatches):
        members = plan.group_ranks[plan.mb_group_offsets[m] : plan.mb_group_offsets[m + 1]]
        start = max(free[r] for r in members)
        for r in members:
            free[r] = start + int(plan.mb_time_ns[m])
    return max(free)


def test_compare_service_times_only_the_second_pass_in_rotating_order(monkeypatch):
    """compare(): every planner plans every batch once first (the warm-up, in no per-plan time),
    then each timed plan is timed alone (its own clock reads, nothing of the warm-up), and the
    order of the planners rotates, so that neither is always first on a batch."""
    import datapipe.plan.compare as service

    clock, log = _Clock(), []
    monkeypatch.setattr(service, "time", clock)
    batches = _batches()
    real, cost = _service_planners()
    timed = {lb: _Timed(lb, p, clock, log, len(batches)) for lb, p in real.items()}
    res = service.compare(timed, batches, cost, passes=2)
    n = len(batches)
    warm, rounds = log[: 2 * n], [log[2 * n + 2 * j : 2 * n + 2 * j + 2] for j in range(2 * n)]
    assert warm == [("hdp", i) for i in range(n)] + [("static", i) for i in range(n)]
    assert all({lb for lb, _ in r} == {"hdp", "static"} and r[0][1] == r[1][1] for r in rounds)
    assert [r[0][1] for r in rounds] == [0, 1, 2] * 2  # batch by batch, pass by pass
    firsts = [r[0][0] for r in rounds]
    assert firsts.count("hdp") == firsts.count("static") == n  # 6 rounds: 3 each
    for lb, t in timed.items():
        assert res[lb].warmup_ms == pytest.approx(1000.0 * n * 1e3)
        want = [[t.duration(n + p * n + i) * 1e3 for p in range(2)] for i in range(n)]
        assert np.allclose(res[lb].pass_ms, want, rtol=1e-9, atol=0)
        assert np.allclose(res[lb].pass_cpu_ms, np.array(want) / 2, rtol=1e-9, atol=0)
        assert res[lb].plan_ms == pytest.approx([float(np.median(w)) for w in want])


def test_compare_service_metrics_from_the_plans():
    """compare()'s metrics against an independent reading of its own plans: the makespan by a
    plain-Python replay, the bounds, ratios, fill, micro-batch counts, rings and ring bytes; the
    plans equal a direct plan() of each batch, and a second call gives the same results."""
    from collections import Counter

    from datapipe.plan.compare import compare

    batches = _batches()
    planners, cost = _service_planners()
    res = compare(planners, batches, cost)
    again = compare(planners, batches, cost)
    for label, planner in planners.items():
        r = res[label]
        assert len(r.plans) == len(r.metrics) == len(r.plan_ms) == len(batches)
        assert [p.digest() for p in again[label].plans] == [p.digest() for p in r.plans]
        assert [m.to_dict() | {"plan_ms": 0} for m in again[label].metrics] == [
            m.to_dict() | {"plan_ms": 0} for m in r.metrics
        ]
        for (lengths, ids), plan, m, ms in zip(batches, r.plans, r.metrics, r.plan_ms):
            assert plan.digest() == planner.plan(lengths, ids).digest()
            makespan = _replay_makespan(plan)
            rank_s = [x / 1e9 for x in plan.rank_time_ns]
            assert makespan == plan.makespan_ns
            assert m.est_step_time_s == pytest.approx((makespan + cost.step_ns) / 1e9)
            assert m.makespan_s == makespan / 1e9
            assert m.imbalance == pytest.approx(max(rank_s) / (sum(rank_s) / len(rank_s)))
            assert m.mean_rank_time_s == pytest.approx(sum(rank_s) / len(rank_s))
            assert m.lower_bound_s == pytest.approx(plan.lower_bound_ns / 1e9)
            assert m.max_over_lower_bound == pytest.approx(makespan / plan.lower_bound_ns)
            mbs = [plan.microbatches(rank) for rank in range(plan.num_ranks)]
            counts = [len(x) for x in mbs]
            assert (m.mb_per_rank_min, m.mb_per_rank_max) == (min(counts), max(counts))
            seen = {mb.slot: mb for x in mbs for mb in x}  # one entry per micro-batch
            capacity = sum(mb.capacity * len(mb.group) for mb in seen.values())
            assert m.token_fill == pytest.approx(int(lengths.sum()) / capacity)
            rings = Counter(len(mb.group) for mb in seen.values() if len(mb.group) > 1)
            assert m.groups_by_size == dict(rings)
            ring_bytes = 0.0  # every member sends passes*(k-1)*its positions*kv bytes
            for mb in seen.values():
                k, tokens = len(mb.group), sum(e - s for _, s, e in mb.group_pieces)
                ring_bytes += k * cost.comm_passes * (k - 1) * tokens / k * cost.kv_bytes_per_token
            assert m.comm_bytes == pytest.approx(ring_bytes)
            assert m.plan_ms == ms and m.policy == plan.label
    assert any(m.groups_by_size for m in res["hdp"].metrics)  # the 1500 sample: a ring
    assert res["static"].plans[0].meta["cp"] >= 2


# --- trainer.compare: the trainer's compare mode, its per-step order and report ----------------


def _comparison(interval: int = 1):
    """A PolicyComparison of hdp against static on 4 ranks, with a fake executor: `_pass` is
    replaced by the caller."""
    from types import SimpleNamespace

    from trainer.compare import PolicyComparison
    from trainer.config.job import from_dict

    par = {"policy": "hdp", "capacity": 256, "max_context": 1024}
    spec = from_dict({"data": {"path": "unused"}, "parallel": par}).planner_spec(4)
    data = SimpleNamespace(planner_spec=spec, planner=spec.build(1024, 0), longest=1024)
    return PolicyComparison("static", interval, data, executor=None, rank=0)


def _quantiles(xs: list[float]) -> tuple[float, float, float, float, float]:
    """min, lower quartile, median, upper quartile, max (linear between order statistics)."""
    import statistics

    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return min(xs), q1, q2, q3, max(xs)


def test_compare_mode_alternates_the_order_and_reports_each_step_s_ratio():
    """The trainer's compare mode: both plans warmed up untimed on the first compared step, then
    the other policy timed first on odd comparisons and second on even ones; the report's
    per-step table holds each step's measured and predicted ratios, and its spread line their
    median, quartiles and range, as computed here from the numbers fed in."""
    from datapipe.stream import GlobalBatch

    cmp = _comparison()
    log: list[tuple[int, str]] = []
    measured = {}  # (step, policy) -> (wall s, CPU s) fed in as the pass's measurement
    rng = np.random.default_rng(3)

    def fake_pass(plan, batch, step):
        log.append((step, plan.policy))
        if len(log) <= 2:  # the warm-up passes: a value no row may show
            return 1000.0, 1000.0
        fed = (rng.uniform(0.5, 2.0), rng.uniform(0.2, 1.0))
        return measured.setdefault((step, plan.policy), fed)

    cmp._pass = fake_pass
    plans = {}
    for step in range(1, 8):
        lengths = np.concatenate([[700], rng.integers(10, 200, size=12)]).astype(np.int64)
        batch = GlobalBatch(step, 0, np.arange(13, dtype=np.int64) + 13 * step, lengths)
        plan = cmp.planners["run"].plan(batch.lengths, batch.sample_ids)
        plans[step] = (plan, cmp.planners["other"].plan(batch.lengths, batch.sample_ids))
        cmp.before_step(step, batch, plan)
        assert cmp.after_step(step, None)["step"] == step
    # order: warm-up (run, static), then static first on steps 1, 3, 5, 7
    want = [(1, "hdp"), (1, "static")]
    for step in range(1, 8):
        want += [(step, "static"), (step, "hdp")] if step % 2 else [(step, "hdp"), (step, "static")]
    assert log == want
    assert [r["other_first"] for r in cmp.rows] == [s % 2 == 1 for s in range(1, 8)]
    # the per-step table and the spread line, from the numbers fed in
    text = cmp.render()
    table = [line for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    ratios = []
    for step, line in zip(range(1, 8), table):
        mine, other = measured[step, "hdp"][0], measured[step, "static"][0]
        ratios.append(other / mine)
        pm, po = (p.makespan_ns / 1e9 for p in plans[step])
        when = "first" if step % 2 else "second"
        assert line == (
            f"| {step} | {when} | {mine:.3f} | {other:.3f} | {other / mine:.2f} | {po / pm:.2f} |"
        )
    assert len(table) == 7
    lo, q1, med, q3, hi = _quantiles(ratios)
    assert (
        f"per-step measured ratio: median {med:.2f}x, quartiles {q1:.2f}-{q3:.2f}x, "
        f"range {lo:.2f}-{hi:.2f}x over 7 steps"
    ) in text
    total = sum(measured[s, "static"][0] for s in range(1, 8))
    total /= sum(measured[s, "hdp"][0] for s in range(1, 8))
    label = plans[1][0].label  # hdp, or hdp+widen where that is the default
    assert f"{label} is {total:.2f}x as fast as static on these batches" in text
    assert "1000" not in text  # the warm-up's passes are in no row


def test_a_resumed_comparison_keeps_the_order_and_each_policy_is_described_as_itself():
    """Comparisons counted from the step (a run resumed after step 3, interval 1: step 4 is the
    4th comparison, the other policy second); a static run compared with hdp names its own
    mesh (CP 1: no sample split) and hdp its local share; no compared step says so."""
    from datapipe.stream import GlobalBatch
    from trainer.compare_report import render_comparison

    cmp = _comparison()
    cmp._pass = lambda plan, batch, step: (1.0, 0.5)
    rng = np.random.default_rng(4)
    for step in (4, 5, 6):
        lengths = rng.integers(10, 200, size=12).astype(np.int64)
        batch = GlobalBatch(step, 0, np.arange(12, dtype=np.int64), lengths)
        cmp.before_step(step, batch, cmp.planners["run"].plan(batch.lengths, batch.sample_ids))
        cmp.after_step(step, None)
    assert [r["other_first"] for r in cmp.rows] == [False, True, False]
    every2 = _comparison(interval=2)  # comparisons counted, not steps: steps 2, 4, 6 are 1, 2, 3
    every2._pass = cmp._pass
    for step in (2, 4, 6):
        lengths = rng.integers(10, 200, size=12).astype(np.int64)
        batch = GlobalBatch(step, 0, np.arange(12, dtype=np.int64), lengths)
        plan = every2.planners["run"].plan(batch.lengths, batch.sample_ids)
        every2.before_step(step, batch, plan)
        every2.after_step(step, None)
    assert [r["other_first"] for r in every2.rows] == [True, False, True]
    swapped = [
        {**r, "policy": r["other_policy"], "other_policy": r["policy"], "meta": r["other_meta"],
         "other_meta": r["meta"], "local_samples": r["other_local_samples"],
         "other_local_samples": r["local_samples"]}
        for r in cmp.rows
    ]  # fmt: skip
    cp = swapped[0]["meta"]["cp"]
    text = render_comparison(swapped, 1, "wall")
    lines = text.splitlines()
    local = np.mean([r["local_samples"] for r in cmp.rows])
    assert lines[1] == f"  static: CP {cp} x DP {4 // cp}: every sample split over {cp} ranks"
    assert lines[2].startswith(f"  {cmp.rows[0]['policy']}: each sample on as few ranks")
    assert f"({local:.0%} of the samples computed whole" in lines[2]
    one = [{**r, "meta": {"cp": 1, "dp": 4}} for r in swapped]
    assert render_comparison(one, 1, "wall").splitlines()[1] == (
        "  static: CP 1 x DP 4: every sample on one rank"
    )
    assert render_comparison([], 4, "wall") == (
        "compare: no step was compared (every 4th step; the run ended before one)\n"
    )
