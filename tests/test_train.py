"""`mixlen train`: config, training loop, metrics, validation, checkpoint/resume, launch."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch
from _train_worker import make_dataset, train_config, train_main
from test_reference_trainer import reference_run

from datapipe.errors import ConfigError
from datapipe.fetch import Fetcher
from trainer.config.job import from_dict
from trainer.config.toml import apply_overrides, load_config, to_toml
from trainer.data import held_out_mask
from trainer.parallel.comm import free_port, spawn
from trainer.train import run_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("data") / "ds"))


# --- config --------------------------------------------------------------------------------------


def test_config_defaults_overrides_and_roundtrip(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[data]\npath = "x"\n[train]\nlr = 1e-2\n[parallel]\npolicy = "static"\n')
    cfg = load_config(path, ["train.steps=7", "train.dtype=float64", 'metrics.dir="m"'])
    assert (cfg.train.lr, cfg.train.steps, cfg.train.dtype) == (1e-2, 7, "float64")
    assert cfg.parallel.planner.policy == "static" and cfg.metrics.dir == "m"
    assert cfg.parallel.planner.widen is True  # the default; a static run ignores it
    assert cfg.parallel.planner.setup(4).widen is False
    assert cfg.train.warmup == 10 and cfg.checkpoint.dir is None  # defaults
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))
    assert load_config(again) == cfg  # --print-config output is itself a valid config


@pytest.mark.parametrize(
    "sets,key",
    [
        (["train.bogus=1"], "train.bogus"),
        (["nosuch.x=1"], "nosuch"),
        (["train.steps=1.5"], "train.steps"),
        (["train.steps=0"], "train.steps"),
        (["train.lr=true"], "train.lr"),
        (['train.dtype="float16"'], "train.dtype"),
        (['parallel.policy="ring"'], "parallel.policy"),
        (["parallel.islands=0"], "parallel.islands"),
        (["parallel.zero=3"], "parallel.zero"),
        (["parallel.zero=-1"], "parallel.zero"),
        (["parallel.widen=1"], "parallel.widen"),
        (["co2.tau=0"], "co2.tau"),
        (["co2.outer_momentum=1.0"], "co2.outer_momentum"),
        (["co2.outer_momentum=-0.1"], "co2.outer_momentum"),
        (["co2.clip_value=0"], "co2.clip_value"),
        (["co2.clip_value=-1"], "co2.clip_value"),
        (['co2.mode="slowmo"'], "co2.mode"),
        (['co2.clip="l2"'], "co2.clip"),
        (["co2.outer_lr=0"], "co2.outer_lr"),
        (["co2.staleness_lambda=-1"], "co2.staleness_lambda"),
        (['co2.mode="diloco"', "co2.overlap=true"], "co2.overlap"),
        (['metrics.compare_clock="gpu"'], "metrics.compare_clock"),
        (["co2.link_gbps=-1"], "co2.link_gbps"),
        (["co2.bogus=1"], "co2.bogus"),
        (["offload.bogus=1"], "offload.bogus"),
        (["train.global_batch_tokens=0"], "train.global_batch_tokens"),  # the stream's check
        (['data.oversize="drop"'], "data.oversize"),
        (["data.seed=-1"], "data.seed"),
        (["data.prefetch_depth=0"], "data.prefetch_depth"),  # the fetch's check
        (['model.name="huge"'], "model.name"),
        (["model.dim=30"], "model.dim"),
        (["model.n_heads=0"], "model.n_heads"),
        (["model.n_layers=-1"], "model.n_layers"),
        (['parallel.cost="nope"'], "parallel.cost"),
        (["parallel.capacity=0"], "parallel.capacity"),
        (['parallel.cost="nope.json"'], "parallel.cost"),
        (["data.val_fraction=1.0"], "data.val_fraction"),
        (["data.lookahead=-1"], "data.lookahead"),
        (["noequals"], "noequals"),
    ],
)
def test_config_errors_name_the_key(sets, key):
    with pytest.raises(ConfigError) as exc:
        from_dict(apply_overrides({"data": {"path": "x"}}, sets))
    assert key in str(exc.value)


@pytest.mark.parametrize("islands,world", [(2, 1), (2, 3), (3, 4), (4, 2)])
def test_islands_must_divide_the_world(islands, world):
    from trainer.islands.config import ranks_per_island

    with pytest.raises(ConfigError, match="parallel.islands"):
        ranks_per_island(islands, world)
    assert ranks_per_island(world, world) == 1 and ranks_per_island(1, world) == world


def test_islands_not_dividing_the_world_stop_the_run(dataset, tmp_path, capsys):
    """One process cannot be 2 islands: refused before training, naming the key, also by the CLI
    before it launches any rank."""
    from tools.cli import main

    cfg = train_config(dataset, str(tmp_path), parallel={"islands": 2})
    with pytest.raises(ConfigError, match="parallel.islands: 2 islands do not divide the 1"):
        run_training(cfg)
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert main(["train", str(path), "--nproc", "3"]) == 2
    assert "parallel.islands: 2 islands do not divide the 3" in capsys.readouterr().err


def test_resume_may_change_how_but_not_what():
    """policy, capacity, widen, cost and zero may change on resume; islands, the global batch and
    CO2's rule may not (the conflict names the key); [co2] is ignored with one island."""
    from trainer.config.resume import resume_conflicts

    base = {"data": {"path": "x"}, "parallel": {"islands": 2}}
    saved = from_dict(base).to_dict()
    how = apply_overrides(
        base,
        ['parallel.policy="static"', "parallel.capacity=128", "parallel.widen=false",
         'parallel.cost="llama-7b"', "parallel.zero=2", "co2.link_gbps=10"],
    )  # fmt: skip
    assert resume_conflicts(saved, from_dict(how)) == []
    for key, value, shown in [
        ("parallel.islands", "4", "parallel.islands: 2 -> 4"),
        ("train.global_batch_tokens", "1024", "train.global_batch_tokens: 65536 -> 1024"),
        ("co2.tau", "3", "co2.tau: 4 -> 3"),
    ]:
        got = resume_conflicts(saved, from_dict(apply_overrides(base, [f"{key}={value}"])))
        assert got == [shown]
    one = from_dict({"data": {"path": "x"}}).to_dict()
    assert resume_conflicts(one, from_dict(apply_overrides(base, ["parallel.islands=1",
                                                                  "co2.tau=3"]))) == []  # fmt: skip


def test_example_configs_load():
    """configs/*.toml are valid configs; co2.toml describes 2 islands of 2 ranks."""
    for name in ("debug", "demo", "co2"):
        # demo.toml reads the cost file `make demo-data` calibrates; a preset stands in for it
        sets = ['parallel.cost="debug"'] if name == "demo" else []
        cfg = load_config(os.path.join(ROOT, "configs", f"{name}.toml"), sets)
        assert cfg.data.path == ".demo/stdlib"
    co2 = load_config(os.path.join(ROOT, "configs", "co2.toml"))
    assert (co2.parallel.islands, co2.parallel.ranks_per_island(4), co2.co2.mode) == (2, 2, "co2")


def test_config_needs_data_path():
    with pytest.raises(ConfigError, match="data.path"):
        from_dict({})


def _splitmix_ref(x: int) -> int:
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_held_out_mask_matches_reference():
    ids = np.arange(2000, dtype=np.int64)
    mask = held_out_mask(ids, seed=7, fraction=0.1)
    ref = [(_splitmix_ref(int(i) ^ 7) >> 11) / float(1 << 53) < 0.1 for i in ids]
    assert mask.tolist() == ref
    assert 150 < mask.sum() < 250


def test_a_fraction_that_holds_out_nothing_is_said(dataset):
    """val_fraction > 0 that hashes none of the samples out (and eval_interval > 0): no
    validation runs, and the run says so naming the key; a fraction that holds some out, or
    validation off, says nothing."""
    from contextlib import ExitStack

    def config(fraction: float):
        return from_dict({"model": {"name": "debug"}, "train": {"eval_interval": 3},
                          "data": {"path": dataset, "val_fraction": fraction}})  # fmt: skip

    with ExitStack() as stack:
        got = config(1e-9).train_data(0, 1, stack)
        assert got.validation is None and got.val_ids.size == 0
        assert got.notice == (
            f"data.val_fraction = 1e-09 holds out none of the {got.train_ids.size:,} samples of "
            f"{dataset}: no validation runs (no val_loss); raise it or set data.val_path"
        )
        assert config(1e-9).train_data(0, 1, stack, validation=False).notice is None
        assert config(0.0).train_data(0, 1, stack).notice is None  # no held-out set asked for
        some = config(0.3).train_data(0, 1, stack)
        assert some.val_ids.size > 0 and some.validation is not None and some.notice is None


# --- training in one process ---------------------------------------------------------------------


def test_train_single_process_resume_metrics(dataset, tmp_path):
    """`single` policy in-process, float64: the loss curve, learning rates, gradient norms and
    validation losses equal the reference trainer's (tests/test_reference_trainer.py) on the same
    batches; 6 steps straight == 3 (stop_after) + resume + 3, bit for bit; metrics.jsonl has the
    required fields, val_loss at eval steps, and the checkpoint dir."""
    torch.set_num_threads(1)

    def config(run: str, train: dict | None = None, **sections: dict):
        train = {"dtype": "float64", **(train or {})}
        return train_config(dataset, run, parallel={"policy": "single"}, train=train, **sections)

    straight = run_training(config(str(tmp_path / "a")))
    part = str(tmp_path / "b")
    first = run_training(config(part, {"stop_after": 3}))
    second = run_training(config(part, checkpoint={"resume": True}))
    assert len(straight["losses"]) == 6 and second["start_step"] == 3
    assert first["losses"] + second["losses"] == straight["losses"]
    # the resumed run is the first one: its records and checkpoints carry one run id
    parted = [json.loads(x) for x in open(second["metrics"])]
    assert [r["step"] for r in parted] == [1, 2, 3, 4, 5, 6]
    saved = json.loads((tmp_path / "b" / "ckpt" / "step-00000006" / "run.json").read_text())
    assert {r["run"] for r in parted} == {saved["run_id"]} and len(saved["run_id"]) == 12
    recs = [json.loads(x) for x in open(straight["metrics"])]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    for r in recs:
        for key in (
            "loss",
            "tokens",
            "step_time_s",
            "tokens_per_s",
            "data_wait_s",
            "compute_time_s_per_rank",
            "planned_time_s_per_rank",
            "comm_time_s",
            "imbalance_measured",
            "imbalance_planned",
        ):
            assert key in r
        assert len(r["compute_time_s_per_rank"]) == len(r["planned_time_s_per_rank"]) == 1
    assert [r["step"] for r in recs if "val_loss" in r] == [3, 6]
    # the absolute check: the reference trainer on the same batches
    ref = reference_run(config(str(tmp_path / "unused")))
    np.testing.assert_allclose(straight["losses"], ref["losses"], rtol=1e-9, atol=0)
    np.testing.assert_allclose([r["lr"] for r in recs], ref["lrs"], rtol=1e-12, atol=0)
    np.testing.assert_allclose([r["grad_norm"] for r in recs], ref["grad_norms"], rtol=1e-9)
    assert [s for s, _ in straight["val_losses"]] == [s for s, _ in ref["val_losses"]] == [3, 6]
    np.testing.assert_allclose(
        [v for _, v in straight["val_losses"]], [v for _, v in ref["val_losses"]], rtol=1e-9
    )
    assert [r["tokens"] for r in recs] == ref["tokens"]
    for r in recs:  # throughput: every token (not only the trained ones) over the step's time
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_time_s"], rel=1e-12)
    val = [r["val_tokens"] for r in recs if "val_loss" in r]
    assert val == [ref["val_tokens"]] * 2 and ref["val_tokens"] <= 1024  # data.val_tokens
    assert os.path.isfile(straight["balance_report"])
    head = open(second["balance_report"]).readline()  # the resumed run's own steps, named
    assert head.startswith("balance report: policy single, 3 steps (steps 4-6: this run resumed")
    assert "(steps" not in open(straight["balance_report"]).readline()
    assert sorted(os.listdir(tmp_path / "a" / "ckpt")) == ["step-00000003", "step-00000006"]
    assert [json.loads(x)["step"] for x in open(second["metrics"])] == [1, 2, 3, 4, 5, 6]
    # resuming with another learning rate would silently keep the saved one: refused
    with pytest.raises(ConfigError, match="train.lr: 0.003 -> 0.01"):
        run_training(config(part, {"lr": 1e-2}, checkpoint={"resume": True}))
    # resuming from an earlier checkpoint: the abandoned run's later one is not "latest" after it
    step3 = os.path.join(part, "ckpt", "step-00000003")
    again = run_training(config(part, {"stop_after": 4}, checkpoint={"resume": step3}))
    assert again["losses"] == straight["losses"][3:4]
    assert sorted(os.listdir(os.path.join(part, "ckpt"))) == ["step-00000003", "step-00000004"]
    # a resume that lengthens the run: its first step already takes the new schedule's rate
    from trainer.trainer import lr_lambda

    longer = config(part, {"steps": 9, "stop_after": 5}, checkpoint={"resume": step3})
    run_training(longer)
    lrs = {r["step"]: r["lr"] for r in map(json.loads, open(os.path.join(part, "metrics.jsonl")))}
    lam = lr_lambda(longer.train)
    assert [lrs[4], lrs[5]] == pytest.approx([longer.train.lr * lam(k) for k in (3, 4)], rel=1e-12)
    assert lrs[4] != pytest.approx(recs[3]["lr"])  # not the 6-step schedule's


# --- multi-process -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_train_two_gloo_ranks(dataset, tmp_path):
    """2 gloo ranks: the hdp loss curve and validation losses equal the reference trainer's
    (float32, same batches, through stream, plan, fetch and executor); resume continues the curve
    exactly; static's curve equals it too."""
    torch.set_num_threads(1)
    ref = reference_run(train_config(dataset, str(tmp_path / "ref")))
    spawn(train_main, 2, (2, free_port(), dataset, str(tmp_path)), timeout=140)
    got = json.loads((tmp_path / "losses.json").read_text())
    assert got["second_start"] == 3
    assert got["first"] + got["second"] == got["straight"]
    np.testing.assert_allclose(got["straight"], ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["static"], ref["losses"][:3], rtol=1e-5)
    assert [s for s, _ in got["val"]] == [s for s, _ in ref["val_losses"]] == [3, 6]
    np.testing.assert_allclose(
        [v for _, v in got["val"]], [v for _, v in ref["val_losses"]], rtol=1e-5
    )
    # the straight run compared hdp with static on steps 2, 4, 6 (a second pass, no update)
    recs = [json.loads(x) for x in open(tmp_path / "straight" / "metrics.jsonl")]
    rows = [r["compare"] for r in recs if "compare" in r]
    assert [r["step"] for r in recs if "compare" in r] == [2, 4, 6]
    assert all(r["other_policy"] == "static" and r["other_groups"] == [2] for r in rows)
    assert all(r["predicted_s"] > 0 and r["other_measured_s"] > 0 for r in rows)
    report = (tmp_path / "straight" / "balance.md").read_text()
    total = sum(r["other_predicted_s"] for r in rows)
    assert f"| static | {total:.2f} |" in report and "on the same 3 global batches" in report


def test_print_config_and_tensorboard_message(tmp_path, capsys):
    from tools.cli import main
    from trainer.metrics import MetricsWriter

    cfg = tmp_path / "c.toml"
    cfg.write_text('[data]\npath = "somewhere"\n')
    assert main(["train", str(cfg), "--print-config", "--set", "train.steps=3"]) == 0
    out = capsys.readouterr().out
    assert 'path = "somewhere"' in out and "steps = 3" in out and "[parallel]" in out
    assert main(["train", str(cfg), "--set", "train.nope=1"]) == 2
    assert "train.nope" in capsys.readouterr().err
    w = MetricsWriter(str(tmp_path / "m"), 1, tensorboard=True, progress=False)
    w.close()
    out = capsys.readouterr().err  # logged (trainer.logs: stderr)
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert "tensorboard package is not installed" in out
    else:
        assert os.path.isdir(tmp_path / "m" / "tb")


def test_compare_pass_leaves_training_unchanged(dataset, tmp_path, monkeypatch):
    """`[metrics] compare`: the second policy's pass over every 2nd batch updates nothing (the
    loss curve equals the run without it bit for bit) and the report has both policies'
    predicted and measured times for the compared steps."""
    torch.set_num_threads(1)

    def config(run: str, **metrics: object):
        return train_config(
            dataset,
            run,
            parallel={"policy": "hdp", "capacity": 1024},
            train={"dtype": "float64", "steps": 4},
            metrics={"dir": run, **metrics},
        )

    plain = run_training(config(str(tmp_path / "plain")))
    # every compare pass moves the trainer's clock by 100 s: its time is compare_s, not the step's
    import types

    import trainer.trainer as T
    from trainer.compare import PolicyComparison

    shift, real, orig = [0.0], T.time.perf_counter, PolicyComparison._pass
    monkeypatch.setattr(T, "time", types.SimpleNamespace(perf_counter=lambda: real() + shift[0]))

    def slow_pass(self, *args):
        shift[0] += 100.0
        return orig(self, *args)

    monkeypatch.setattr(PolicyComparison, "_pass", slow_pass)
    both = run_training(config(str(tmp_path / "both"), compare="static", compare_interval=2))
    monkeypatch.undo()
    assert both["losses"] == plain["losses"]
    recs = [json.loads(x) for x in open(both["metrics"])]
    assert [int(r.get("compare_s", 0) // 100) for r in recs] == [0, 4, 0, 2]  # warm-up on the 1st
    assert all(r["step_time_s"] < 100 for r in recs)
    rows = [r["compare"] for r in recs if "compare" in r]
    assert [r["step"] for r in recs if "compare" in r] == [2, 4]
    for row in rows:
        assert row["predicted_s"] > 0 and row["other_predicted_s"] > 0
        assert row["measured_s"] == row["measured_wall_s"] > 0  # the default clock
        assert row["other_measured_s"] == row["other_measured_wall_s"] > 0
        # one rank: the replay is the sum of its micro-batches' CPU times, within its wall span
        for who in ("", "other_"):
            assert 0 < row[f"{who}measured_cpu_s"] <= row[f"{who}measured_wall_s"] * 1.05 + 1e-3
    report = open(both["balance_report"]).read()
    assert "hdp+widen vs static on the same 2 global batches" in report  # widen: the default
    assert "measured s, CPU replayed" in report
    cpu = run_training(
        config(str(tmp_path / "cpu"), compare="static", compare_interval=2, compare_clock="cpu")
    )
    assert cpu["losses"] == plain["losses"]
    rows = [json.loads(x)["compare"] for x in open(cpu["metrics"]) if '"compare"' in x]
    assert all(r["measured_s"] == r["measured_cpu_s"] for r in rows)
    assert "CPU time replayed" in open(cpu["balance_report"]).read()


def test_a_slow_fetch_is_the_steps_data_wait(dataset, tmp_path, monkeypatch):
    """A fetch sleeping 0.8 s, far longer than a step's compute: each step waits for it
    (data_wait_s), and step_time_s, the step's wall time, counts that wait."""
    torch.set_num_threads(1)
    orig = Fetcher.fetch_step

    def slow(self, mbs):
        time.sleep(0.8)
        return orig(self, mbs)

    monkeypatch.setattr(Fetcher, "fetch_step", slow)
    run = str(tmp_path / "slow")
    out = run_training(train_config(dataset, run, parallel={"capacity": 1024}, train={"steps": 2}))
    for r in [json.loads(x) for x in open(out["metrics"])]:
        assert 0.3 < r["data_wait_s"] < r["step_time_s"], r
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_time_s"], rel=1e-9)


def test_widen_plans_with_the_static_mesh_context():
    """With widen (the default), the trainer's hdp planner knows static's mesh (the dataset's
    longest sample, or [parallel] max_context), so it may take that mesh for a batch; without widen
    hdp ignores it."""
    base = {"data": {"path": "unused"}}
    widen = from_dict({**base, "parallel": {"widen": True}})
    assert widen.planner_spec(4).build(300, 0).config.max_context == 300
    fixed = from_dict({**base, "parallel": {"widen": True, "max_context": 512}})
    assert fixed.planner_spec(4).build(300, 0).config.max_context == 512
    plain = from_dict({**base, "parallel": {"widen": False}})
    assert plain.planner_spec(4).build(300, 0).config.max_context is None
    assert from_dict(base).planner_spec(4).build(300, 0).config.max_context == 300  # the default


def test_readme_key_tables_come_from_the_config_classes():
    """docs/config.md's key tables are `python -m trainer.config.reference`'s output, and every
    key the classes declare is there with its default (a key added, renamed or re-defaulted in a
    class without regenerating the page fails here)."""
    from datapipe.settings import rows
    from trainer.config.job import TrainerConfig
    from trainer.config.reference import BEGIN, END, markdown

    readme = open(os.path.join(ROOT, "docs", "config.md")).read()
    assert readme.split(BEGIN, 1)[1].split(END, 1)[0].strip() == markdown().strip()
    keys = [r.key for r in rows(TrainerConfig)]
    assert len(keys) == len(set(keys))  # one definition per key
    for key in keys:
        section, name = key.split(".", 1)
        assert f"| `{name}` |" in readme.split(f"`[{section}]`", 1)[1], key


@pytest.mark.parametrize(
    ("steps", "warmup", "floor"), [(10, 2, 0.1), (7, 0, 0.0), (3, 2, 0.5), (1, 0, 0.2)]
)
def test_cosine_schedule_reaches_its_floor_on_the_last_step(steps, warmup, floor):
    """The LR of each optimizer step, through torch's LambdaLR as the trainer drives it, equals
    the documented formula: (k + 1) / warmup for k < warmup, then floor + (1 - floor) x
    (1 + cos(pi x (k - warmup) / (steps - 1 - warmup))) / 2, which is the floor on the last step
    (a single step after warmup keeps the peak)."""
    import math

    from trainer.config.job import TrainConfig
    from trainer.trainer import lr_lambda

    t = TrainConfig(steps=steps, warmup=warmup, min_lr_ratio=floor, lr=2.0)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=t.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t))
    got = []
    for _ in range(steps):
        got.append(opt.param_groups[0]["lr"])  # the LR this optimizer step uses
        opt.step()
        sched.step()
    want = []
    for k in range(steps):
        if k < warmup:
            want.append(t.lr * (k + 1) / warmup)
            continue
        frac = (k - warmup) / (steps - 1 - warmup) if steps - 1 > warmup else 0.0
        want.append(t.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))))
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    if steps - 1 > warmup:
        assert got[-1] == pytest.approx(t.lr * floor, rel=1e-12, abs=1e-15)


def test_tensorboard_events_read_back(tmp_path):
    """`metrics.tensorboard = true` writes every scalar of every step record as an event that
    TensorBoard's own reader returns (tensorboard is in the dev and `tb` extras); each run has
    its own TensorBoard run, `tb/RUN_ID` (before: a second run in the folder drew over the
    first's curves)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer.metrics import MetricsWriter

    line = dict(lr=1e-3, tokens_per_s=1.0, step_time_s=1.0, data_wait_s=0.0, comm_time_s=0.0)
    line.update(imbalance_measured=1.0, imbalance_planned=1.0)
    runs = {"first": (1, 2, 3), "second": (1, 2)}
    for run, steps in runs.items():
        w = MetricsWriter(str(tmp_path / "m"), 3, tensorboard=True, progress=False, run_id=run)
        for s in steps:
            w.log({"step": s, "loss": len(run) / s, "tokens": 100 * s, "note": "x", **line})
        w.close()
    assert sorted(os.listdir(tmp_path / "m" / "tb")) == sorted(runs)
    for run, steps in runs.items():
        acc = EventAccumulator(str(tmp_path / "m" / "tb" / run))
        acc.Reload()
        assert set(acc.Tags()["scalars"]) == {"loss", "tokens", *line}  # every number, no string
        loss = [(e.step, e.value) for e in acc.Scalars("loss")]
        assert loss == [(s, pytest.approx(len(run) / s, rel=1e-6)) for s in steps]
        assert [e.value for e in acc.Scalars("tokens")] == [100.0 * s for s in steps]
