"""Islands training together (trainer.islands.cross): co2, diloco and sync through the executor and the
sharded optimizer against plain-torch references (fake ranks in threads, then 2 islands x 2 gloo
processes with the Trainer: resume mid-round and at a boundary with a round in flight)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _co2_worker import (
    GLOO_SCENARIOS,
    ISLANDS,
    RANKS,
    SCENARIOS,
    STEPS,
    main,
    reference,
    run_mode,
)
from _train_worker import make_dataset

from datapipe.plan.memory import model_state_bytes, outer_state_bytes
from datapipe.shapes import get_config
from trainer.checkpoint.state import ModelState
from trainer.islands.config import CO2Config
from trainer.islands.cross import CrossIsland
from trainer.model.transformer import build_model
from trainer.parallel.comm import free_port, spawn
from trainer.parallel.zero import ZeroOptimizer
from trainer.testing.threads import run_islands

SC = {name: (mode, c) for name, mode, c in SCENARIOS}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("data") / "ds"))


def check(name: str, losses: list[list[float]], weights_err: float, want: dict) -> None:
    """Every island's loss curve within 1e-9 of the reference's (float64), final weights 1e-9."""
    for j in range(ISLANDS):
        got, ref = np.array(losses[j]), np.array(want["losses"][j])
        assert got.shape == (STEPS,)
        assert np.all(np.abs(got - ref) <= 1e-9 * np.abs(ref)), (name, j, got, ref)
    assert weights_err <= 1e-9, (name, weights_err)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", [s[0] for s in SCENARIOS])
def test_modes_equal_plain_references_threads(name):
    """2 islands x 2 fake ranks: co2 without overlap, penalty or clipping and diloco equal DiLoCo
    with torch's heavy-ball SGD; tau 1, momentum 0, outer lr 1 equals averaging the weights every
    step; co2 with overlap, penalty, clipping and Nesterov equals the contract's rule one round
    stale; sync equals one process on the union of the islands' batches."""
    mode, c = SC[name]
    out = run_islands(ISLANDS, RANKS, lambda isl, cross: run_mode(isl, None, cross, mode, c), 200)
    want = reference(mode, c)
    assert out[0]["groups"] == [1, 2]  # a ring beside local work
    losses = [out[j * RANKS]["losses"] for j in range(ISLANDS)]
    for j in range(ISLANDS):  # the ranks of an island agree bitwise
        assert all(out[j * RANKS + r]["losses"] == losses[j] for r in range(RANKS))
        assert all(torch.equal(out[j * RANKS + r]["weights"], out[0]["weights"])
                   for r in range(RANKS))  # fmt: skip
    w = want["weights"]
    err = float((out[0]["weights"] - w).abs().max() / w.abs().max())
    check(name, losses, err, want)
    if mode == "sync":  # the same loss everywhere; every step waits on the cross-island sums
        assert losses[0] == losses[1]
        assert all(t > 0 for t in out[0]["cross_wait_s"])
    else:
        assert all(t == 0 for t in out[0]["cross_wait_s"])
    if name == "co2":  # the first boundary applies nothing; clipping and the penalty act
        recs = [r for r in out[0]["records"] if "co2_applied" in r]
        assert [r["co2_applied"] for r in recs] == [False, True, True]
        assert all(0 < r["co2_clipped_fraction"] < 1 for r in recs[1:])
        assert recs[2]["co2_penalty"] > 1.01
    if name == "co2-warmup":  # the first round waits for its own average, the second overlaps
        recs = [r for r in out[0]["records"] if "co2_applied" in r]
        assert [r["co2_applied"] for r in recs] == [True, False, True]
    if name == "diloco":
        assert [r.get("co2_applied") for r in out[0]["records"]] == [None, None, True] * 2


@pytest.mark.parametrize("mixture,sequence", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("summed", [False, True])
def test_metrics_records_cover_every_island(summed, mixture, sequence):
    """A step's metrics cover the whole run (trainer.metrics.world_figures): 2 islands x 2 ranks
    x tp 2 (8 fake processes), each island's figures drawn at random. Every process ends with the
    plain sums over the islands of tokens, samples, tokens by source and boosted tokens; the
    labelled-weighted loss (with each island's) unless sync already summed loss and labels; the
    slowest island's step time and data wait, and the run's tokens over that time; an island's
    own figures (its ranks, its gradient norm: global rank 0 writes island 0's) untouched. Under
    loss_normalization "sequence" the islands' losses weigh by their own denominators (samples
    with a trained position), not by labelled positions."""
    from types import SimpleNamespace

    from trainer.metrics import world_figures
    from trainer.testing.threads import run_threads

    isl, ranks, tp = 2, 2, 2
    rng = np.random.default_rng(11)
    made = []
    for _ in range(isl):
        rec = {
            "tokens": int(rng.integers(100, 5000)),
            "samples": int(rng.integers(1, 50)),
            "labelled": int(rng.integers(50, 4000)),
            "loss": float(rng.uniform(1, 5)),
            "step_time_s": float(rng.uniform(0.1, 2)),
            "data_wait_s": float(rng.uniform(0, 0.2)),
            "compute_time_s_per_rank": rng.uniform(0, 1, ranks).tolist(),
            "grad_norm": float(rng.uniform(0, 1)),
        }
        if sequence:
            rec["loss_divisor"] = int(rng.integers(1, 40))
        above = None
        if mixture:
            rec["tokens_by_source"] = {n: int(rng.integers(0, 900)) for n in ("web", "code", "x")}
            above = {"code": {1024: int(rng.integers(0, 99)), 4096: int(rng.integers(0, 9))}}
        made.append((rec, above))
    if summed:  # sync: the executor's loss and labelled positions are already the run's
        for rec, _ in made:
            rec["loss"], rec["labelled"] = made[0][0]["loss"], made[0][0]["labelled"]

    def body(comm):
        j, rest = divmod(comm.rank, ranks * tp)
        rt = SimpleNamespace(islands=isl, island=j, rank=rest // tp, tp_rank=rest % tp,
                             run_comm=comm, device=torch.device("cpu"))  # fmt: skip
        rec, above = json.loads(json.dumps(made[j]))  # a copy (JSON makes int keys strings)
        above = {k: {int(t): n for t, n in v.items()} for k, v in above.items()} if above else None
        return rec, world_figures(rec, above, rt, summed)

    recs = [r for r, _ in made]
    want = {k: sum(r[k] for r in recs) for k in ("tokens", "samples")}
    step_s = max(r["step_time_s"] for r in recs)
    labels = sum(r["labelled"] for r in recs)
    for g, (rec, above) in enumerate(run_threads(isl * ranks * tp, body)):
        own = recs[g // (ranks * tp)]  # its island's own figures stay its island's
        assert {k: rec[k] for k in want} == want
        assert rec["step_time_s"] == step_s
        assert rec["data_wait_s"] == max(r["data_wait_s"] for r in recs)
        assert rec["tokens_per_s"] == pytest.approx(want["tokens"] / step_s, rel=1e-12)
        assert rec["compute_time_s_per_rank"] == own["compute_time_s_per_rank"]
        assert rec["grad_norm"] == own["grad_norm"]
        if summed:
            assert (rec["loss"], rec["labelled"]) == (recs[0]["loss"], recs[0]["labelled"])
            assert "loss_by_island" not in rec
        else:
            assert rec["labelled"] == labels
            weight = [r.get("loss_divisor", r["labelled"]) for r in recs]
            mean = sum(r["loss"] * w for r, w in zip(recs, weight)) / sum(weight)
            assert rec["loss"] == pytest.approx(mean, rel=1e-12)
            assert rec["loss_by_island"] == pytest.approx([r["loss"] for r in recs], rel=1e-12)
        if mixture:
            assert rec["tokens_by_source"] == {
                n: sum(r["tokens_by_source"][n] for r in recs) for n in ("web", "code", "x")
            }
            assert above == {"code": {t: sum(a["code"][t] for _, a in made) for t in (1024, 4096)}}
        else:
            assert "tokens_by_source" not in rec and above is None


def test_model_state_prefixes_islands_and_shares_outer_state():
    """co2/diloco checkpoints keep each island's weights and optimizer under its prefix and the
    outer state once (same keys on every island); sync keeps one unprefixed copy."""

    def body(isl, cross):
        model, _ = build_model(get_config("debug", dim=32, ffn_dim=64), torch.float32)
        zero = ZeroOptimizer.for_model(model, isl, level=1)
        rounds = CrossIsland(CO2Config(tau=2), zero, isl, cross)
        co2 = ModelState(model, zero, rounds, cross.rank, prefixed=True).state_dict()
        sync = ModelState(model, zero, None, cross.rank).state_dict()
        return sorted(co2), sorted(co2[f"island{cross.rank}"]), sorted(co2["outer"]), sorted(sync)

    out = run_islands(2, 2, body)
    assert out[0][0] == ["island0", "outer"] and out[2][0] == ["island1", "outer"]
    assert out[0][1] == ["model", "optim"]
    assert out[0][2] == out[3][2] == ["anchor", "counters", "d_prev", "inflight", "momentum"]
    assert out[0][3] == out[3][3] == ["model", "optim"]


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_islands_gloo_processes(dataset, tmp_path):
    """2 islands x 2 gloo processes (island, gradient and cross-island groups from the runtime):
    one scenario above of each communication pattern (GLOO_SCENARIOS) against its reference; the
    Trainer with co2 (one warm-up round) stopped mid-round (step 3) or at a round boundary with a
    round in flight (step 4) and resumed equals the straight run bitwise (loss curve and final
    weights, checked on every rank), every island ends at the same anchor; diloco and sync runs;
    metrics report rounds and memory per the formulas."""
    spawn(main, ISLANDS * RANKS, (ISLANDS * RANKS, free_port(), dataset, str(tmp_path)), 460)
    res = json.loads((tmp_path / "co2.json").read_text())
    assert set(GLOO_SCENARIOS) <= {name for name, *_ in SCENARIOS}
    for name in GLOO_SCENARIOS:
        r = res[name]
        check(name, r["losses"], r["weights_err"], {"losses": r["want_losses"]})
        assert r["groups"] == [1, 2]
    tr = res["trainer"]
    assert len(tr["straight"]) == 6 and tr["stop3"][0] == tr["straight"][:3]
    assert len(tr["diloco"]) == 5 and len(tr["sync"]) == 3
    recs = [json.loads(x) for x in open(tmp_path / "straight" / "metrics.jsonl")]
    # each record covers both islands: tokens, samples and labelled positions summed over what
    # each island's stream gave it, the loss over both islands' labelled positions
    per_island = np.array(tr["island_batches"])  # [island, step, (tokens, samples, labelled)]
    want = per_island.sum(axis=0)
    assert [[r["tokens"], r["samples"], r["labelled"]] for r in recs] == want.tolist()
    for r, rows in zip(recs, per_island.transpose(1, 0, 2)):
        mean = sum(lo * n for lo, n in zip(r["loss_by_island"], rows[:, 2])) / rows[:, 2].sum()
        assert r["loss"] == pytest.approx(mean, rel=1e-12)
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_time_s"], rel=1e-12)
    head = (tmp_path / "straight" / "balance.md").read_text().splitlines()[0]
    assert f"6 steps, {int(want[:, 0].sum())} tokens" in head and "2 islands" in head
    # diloco, 5 steps of tau 2: the partial last round (step 5) is averaged and applied too
    dl = [json.loads(x) for x in open(tmp_path / "diloco" / "metrics.jsonl")]
    assert [r["step"] for r in dl if r.get("co2_applied")] == [2, 4, 5]
    assert dl[-1]["co2_final"] is True and dl[-1]["co2_round"] == 3
    boundary = [r for r in recs if "co2_applied" in r]
    assert [r["step"] for r in boundary] == [2, 4, 6]
    # warmup_rounds 1: round 1 applies its own average, round 2 travels during round 3
    assert [r["co2_applied"] for r in boundary] == [True, False, True]
    assert recs[-1]["co2_final"] is True and recs[-1]["co2_round"] == 3
    # step 6 ends round 3 (applying round 2's average), then the run's end applies round 3's:
    # two updates, each recorded (the second had overwritten the first)
    assert recs[-1]["co2_final_update_norm"] > 0 and recs[-1]["co2_final_wait_s"] >= 0
    assert recs[-1]["co2_update_norm"] != recs[-1]["co2_final_update_norm"]
    assert "co2_final_update_norm" not in dl[-1]  # diloco: the partial round's own, nothing stale
    applied = [r for r in boundary if r["co2_applied"]]
    assert all(r["co2_wait_s"] >= 0 and r["co2_update_norm"] > 0 for r in applied)
    numel = get_config("debug", dim=32, ffn_dim=64).num_params()
    want = model_state_bytes(numel, RANKS, 1, "float32")
    for r in recs:
        assert r["zero"] == 1
        assert (
            r["mem_weights_bytes"],
            r["mem_master_bytes"],
            r["mem_moments_bytes"],
            r["mem_grads_bytes"],
        ) == (want.weights, want.master, want.moments, want.grads)
        assert r["mem_outer_bytes"] == outer_state_bytes(numel, RANKS, "float32")  # fmt: skip


# --- [co2]: each mode's defaults, and what diloco refuses -------------------------------------------


def co2_section(*keys: str) -> CO2Config:
    """The [co2] section built and validated as `mixlen train` does (`--set co2.KEY=VALUE`)."""
    import tomllib

    from datapipe.settings import Names, check, from_mapping

    table = tomllib.loads("\n".join(k.split(".", 1)[1] for k in keys))
    cfg = from_mapping(CO2Config, table, Names("co2"))
    check(cfg, Names("co2"))
    return cfg


def test_each_mode_has_its_own_defaults():
    """An unset key takes its mode's value: diloco as published (Nesterov 0.9, outer lr 0.7, no
    penalty, no clipping), co2 its benchmarked values; a key the user writes wins; the section
    (what a checkpoint records and a resume compares) holds the values the run uses, and
    OuterConfig has no defaults of its own to drift from them."""
    from datapipe.settings import Names, values
    from trainer.islands.co2 import OuterConfig

    d = co2_section('co2.mode="diloco"')
    assert (d.outer_lr, d.outer_momentum, d.nesterov) == (0.7, 0.9, True)
    assert (d.staleness_lambda, d.clip, d.warmup_rounds) == (0.0, "none", 0)
    c = co2_section()
    assert (c.outer_lr, c.outer_momentum, c.nesterov, c.staleness_lambda) == (0.5, 0.0, False, 0.5)
    assert (c.staleness_rule, c.clip, c.clip_value, c.warmup_rounds) == (
        "adaptive",
        "value",
        0.1,
        10,
    )
    assert c.warmup_outer_lr == 0.5
    mine = co2_section('co2.mode="diloco"', "co2.outer_lr=0.3", "co2.nesterov=false")
    assert (mine.outer_lr, mine.nesterov, mine.outer_momentum) == (0.3, False, 0.9)
    assert values(d, Names("co2"))["co2.outer_momentum"] == 0.9  # what a checkpoint records
    with pytest.raises(TypeError):
        OuterConfig()  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "keys, key, reason",
    [
        (["co2.staleness_lambda=0.5"], "co2.staleness_lambda", "nothing is stale"),
        (['co2.clip="value"'], "co2.clip", "does not clip"),
        (['co2.clip="norm"', "co2.clip_value=1.0"], "co2.clip", "does not clip"),
        (["co2.warmup_rounds=3"], "co2.warmup_rounds", "no warm-up"),
        (["co2.warmup_outer_lr=1.0"], "co2.warmup_outer_lr", "no warm-up"),
        (["co2.overlap=true"], "co2.overlap", "awaits every average"),
    ],
)
def test_diloco_refuses_what_is_not_diloco(keys, key, reason):
    """mode = "diloco" with a staleness penalty, clipping, a warm-up or overlap: ConfigError
    naming the key as written and why; the neutral values are accepted."""
    from datapipe.errors import ConfigError

    with pytest.raises(ConfigError, match=f"^{key}: .*{reason}"):
        co2_section('co2.mode="diloco"', *keys)
    ok = ["co2.staleness_lambda=0.0", 'co2.clip="none"', "co2.warmup_rounds=0"]
    assert co2_section('co2.mode="diloco"', *ok).clip == "none"


@pytest.mark.parametrize("mode", ["sync", "diloco"])
def test_only_co2_overlaps(mode):
    """`co2.overlap = true` with mode sync (no rounds) or diloco (every average awaited) is a
    ConfigError naming co2.overlap and the mode; overlap = false is accepted there, and
    overlap = true in co2 mode too."""
    from datapipe.errors import ConfigError

    with pytest.raises(
        ConfigError, match=f"^co2.overlap: only co2.mode = \"co2\" overlaps \\(mode is '{mode}'"
    ):
        co2_section(f'co2.mode="{mode}"', "co2.overlap=true")
    assert co2_section(f'co2.mode="{mode}"', "co2.overlap=false").overlapped is False
    assert co2_section("co2.overlap=true").overlapped is True


def test_resume_compares_the_values_the_run_used():
    """A resumed run that writes a mode's default out (co2.outer_lr = 0.5) changes nothing; one
    that switches co2 to diloco is refused with every outer key that changes, as values."""
    from trainer.config.job import from_dict
    from trainer.config.resume import resume_conflicts

    base = {"data": {"path": "x"}, "parallel": {"islands": 2}}
    saved = from_dict(base).to_dict()
    same = {**base, "co2": {"outer_lr": 0.5, "warmup_rounds": 10}}
    assert resume_conflicts(saved, from_dict(same)) == []
    other = resume_conflicts(saved, from_dict({**base, "co2": {"mode": "diloco"}}))
    assert "co2.outer_lr: 0.5 -> 0.7" in other and "co2.nesterov: False -> True" in other


@pytest.mark.parametrize(("islands", "n", "tp"), [(1, 4, 2), (2, 2, 2), (3, 2, 4), (2, 3, 1)])
def test_global_rank_with_islands_and_tp_is_the_process_number(islands, n, tp) -> None:
    """Processes are numbered island by island, HDP rank by rank, TP member by member (the
    launch layout: TP members adjacent on one node): each one's `global_rank` is its number, so
    exactly one process (the first) is global rank 0 and writes the run's files."""
    from trainer.parallel.comm import SoloComm
    from trainer.parallel.runtime import Runtime

    seen = []
    for island in range(islands):
        for rank in range(n):
            for member in range(tp):
                rt = Runtime(rank=rank, world=n, local_rank=0, device=torch.device("cpu"),
                             comm=SoloComm(), owns_group=False, island=island, islands=islands,
                             tp=tp, tp_rank=member)  # fmt: skip
                assert rt.global_world == islands * n * tp
                seen.append(rt.global_rank)
    assert seen == list(range(islands * n * tp))
