"""Hostile input, round four (issue 29): what training and calibration refuse. A run stops at its
first non-finite loss or gradient norm, naming the step, before that step is checkpointed (it
trained on and saved NaN, exit 0), also when only one island of a co2 run goes bad (no rank waits
in a collective); a model whose weights alone exceed the machine's memory is refused naming the
key before anything is allocated; a declared context shorter than the dataset's samples is
refused; calibrate refuses more processes than the cores can time, and an unwritable `--out`
before timing anything; a checkpoint of flat optimizer offsets (older mixlen) is refused on resume
saying what to do."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _faults import cli_error
from _train_worker import make_dataset, train_config

from datapipe.errors import PeerError
from trainer.config.toml import to_toml
from trainer.hooks import NonFiniteStep

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]  # conftest.py

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("data") / "ds"), n_docs=40)


def test_a_nan_loss_stops_the_run_before_its_checkpoint(dataset, tmp_path, monkeypatch) -> None:
    """A NaN weight at step 2 (`MIXLEN_FAULT=nan:rank=0:step=2`, a checkpoint after every step):
    the run stops with an error naming step 2 and the last complete checkpoint, step 1; no
    checkpoint and no metrics record of step 2 (it trained on, saved NaN and exited 0)."""
    from trainer.train import run_training

    monkeypatch.setenv("MIXLEN_HOOKS", "trainer.testing.faults:FaultInjector")
    monkeypatch.setenv("MIXLEN_FAULT", "nan:rank=0:step=2")
    run = tmp_path / "run"
    c = train_config(dataset, str(run), train={"steps": 3, "eval_interval": 0},
                     checkpoint={"interval": 1}, parallel={"policy": "single", "capacity": 4096})  # fmt: skip
    with pytest.raises(NonFiniteStep) as info:
        run_training(c)
    msg = str(info.value)
    assert msg.startswith("step 2: the loss is nan") and "not finite" in msg, msg
    assert f"last complete checkpoint: {run / 'ckpt' / 'step-00000001'}" in msg, msg
    assert sorted(os.listdir(run / "ckpt")) == ["step-00000001"]
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]


@pytest.mark.parametrize("bad_island", [None, 0, 1])
def test_every_rank_of_every_island_stops_together(bad_island) -> None:
    """2 islands of 2 fake ranks (co2 islands see different losses): when one island's loss is
    NaN, every rank stops at the same step (global rank 0 reports, naming the island; the others
    stop quietly), none left waiting in a collective; with finite losses none stops."""
    from trainer.hooks import check_finite_step
    from trainer.testing.threads import run_threads

    def rank(comm) -> str:
        island = comm.rank // 2
        rt = SimpleNamespace(islands=2, island=island, world=2, device=torch.device("cpu"),
                             run_comm=comm, global_rank=comm.rank)  # fmt: skip
        loss = float("nan") if island == bad_island else 2.5 + island
        try:
            check_finite_step(7, loss, 0.5, rt, lambda: "ckpt/step-00000006")
        except NonFiniteStep as exc:
            return f"reported: {exc}"
        except PeerError:
            return "peer"
        return "ran on"

    got = run_threads(4, rank)
    if bad_island is None:
        assert got == ["ran on"] * 4
        return
    assert got[1:] == ["peer"] * 3
    assert got[0].startswith(f"reported: step 7: the loss is nan and the gradient norm 0.5 on "
                             f"island {bad_island}, not finite")  # fmt: skip
    assert "(last complete checkpoint: ckpt/step-00000006)" in got[0]


def test_a_model_beyond_the_machines_memory_is_refused_by_key(dataset, tmp_path, capsys):
    """`model.dim = 2^20` (4.4 TB of weights) was a traceback from the allocator in train and
    calibrate; refused before anything is allocated, naming the key and both sizes."""
    cfg = tmp_path / "big.toml"
    c = train_config(dataset, str(tmp_path / "run"))
    cfg.write_text(to_toml(c))
    big = ["--set", "model.dim=1048576"]
    err = cli_error(["train", str(cfg), *big], capsys)
    assert "model.dim = 1,048,576" in err and "more than this machine's" in err, err
    assert not (tmp_path / "run").exists()
    err = cli_error(["calibrate", str(cfg), *big, "--out", str(tmp_path / "c.json")], capsys)
    assert "model.dim = 1,048,576" in err and "more than this machine's" in err, err
    err = cli_error(["calibrate", "--vocab-size", str(1 << 32), "--out", str(tmp_path / "c.json")],
                    capsys)  # fmt: skip
    assert (
        "--vocab-size = 4,294,967,296 and --model debug's dim = 128" in err
        and "more than this machine's" in err
    ), err


def test_a_declared_context_shorter_than_the_samples_is_refused(dataset, tmp_path, capsys):
    """`model.max_position_embeddings = 128` over samples up to ~500 tokens trained without a word
    (the export would declare 128)."""
    from datapipe.index import read_lengths

    longest = int(read_lengths(dataset).max())
    assert longest > 128
    cfg = tmp_path / "ctx.toml"
    c = train_config(dataset, str(tmp_path / "run"), parallel={"policy": "single",
                                                               "capacity": 4096})  # fmt: skip
    cfg.write_text(to_toml(c))
    err = cli_error(["train", str(cfg), "--set", "model.max_position_embeddings=128"], capsys)
    assert f"model.max_position_embeddings = 128, but {dataset} holds samples of up to " in err
    assert f"{longest:,} tokens" in err, err


def test_a_held_out_dataset_of_another_tokenizer_is_refused_by_key(dataset, tmp_path, capsys):
    """`data.val_path` tokenized with a BPE beside a byte-level training set: its ids beyond the
    model's vocabulary ended the run with an IndexError at the first evaluation; a model that
    covers both would have measured another encoding's loss."""
    from datapipe.ingest.preprocess import PreprocessConfig, preprocess

    src = tmp_path / "v.jsonl"
    src.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x\n" * 20}) + "\n"
                           for i in range(8)))  # fmt: skip
    val = tmp_path / "val"
    bpe = str(ROOT / "tests" / "assets" / "bpe-stdlib.json")
    vocab = preprocess(PreprocessConfig([str(src)], str(val), tokenizer=bpe, progress=False))
    vocab = vocab.manifest["vocab_size"]
    cfg = tmp_path / "v.toml"
    c = train_config(dataset, str(tmp_path / "run"), parallel={"policy": "single",
                                                               "capacity": 4096})  # fmt: skip
    cfg.write_text(to_toml(c))
    base = ["train", str(cfg), "--set", f"data.val_path={json.dumps(str(val))}"]
    err = cli_error(base, capsys)
    assert f"model: vocab_size 258 < the dataset's {vocab} ({val}/manifest.json vocab_size)" in err
    err = cli_error([*base, "--set", f"model.vocab_size={vocab}"], capsys)
    assert f"data.val_path: tokenized differently from data.path (vocab_size {vocab} vs 258;" in err
    assert "tokenizer {'kind': 'hf'" in err and "'kind': 'bytes'" in err, err


def test_calibrate_refuses_more_processes_than_the_cores_can_time(tmp_path, capsys):
    """`--nproc 1000` on 2 cores started spawning 1,000 torch processes."""
    cores = len(os.sched_getaffinity(0))
    out = str(tmp_path / "c.json")
    err = cli_error(["calibrate", "--nproc", "1000", "--out", out], capsys)
    assert f"--nproc 1000: more processes than this machine's {cores} cores" in err, err
    err = cli_error(["calibrate", "--nproc", str(4 * cores + 1), "--clock", "cpu", "--out", out],
                    capsys)  # fmt: skip
    assert f"{4 * cores} with --clock cpu" in err, err


def test_calibrate_refuses_an_unwritable_out_before_timing(tmp_path, capsys):
    """An --out under a file, or a directory, failed after the whole calibration, naming a
    temporary file."""
    (tmp_path / "file").write_text("x")
    bad = str(tmp_path / "file" / "c.json")
    err = cli_error(["calibrate", "--out", bad, "--lengths", "8,16,32", "--packs", "2x8"], capsys)
    assert f"--out {bad}: {tmp_path / 'file'} is a file, not a directory" in err, err
    err = cli_error(["calibrate", "--out", str(tmp_path), "--lengths", "8,16,32"], capsys)
    assert f"--out {tmp_path}: is a directory" in err, err


def test_calibrate_names_out_when_the_write_fails(tmp_path, capsys, monkeypatch):
    """A cost file that cannot be written after the timings (made unwritable meanwhile) is named
    by --out, not by its temporary file."""
    import tools.cmd_calibrate

    out = str(tmp_path / "c.json")

    def denied(path, text):
        raise PermissionError(13, "Permission denied", f"{path}.tmp-1234")

    monkeypatch.setattr(tools.cmd_calibrate, "write_text_atomic", denied)
    err = cli_error(["calibrate", "--out", out, "--lengths", "8,16,32", "--packs", "2x8",
                     "--repeats", "1", "--min-seconds", "0"], capsys)  # fmt: skip
    assert f"--out {out}: cannot write the cost file (Permission denied)" in err, err
    assert ".tmp-" not in err


def test_a_checkpoint_of_flat_optimizer_offsets_is_refused_naming_why(dataset, tmp_path) -> None:
    """A checkpoint from before checkpoints named parameters (its optimizer state one flat
    tensor, `optim.exp_avg`) is refused with what to do, not DCP's missing-key error."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from datapipe.errors import ConfigError
    from trainer.checkpoint.files import write_checksums
    from trainer.train import run_training

    run = tmp_path / "r"
    sections = {"parallel": {"policy": "single"}, "train": {"steps": 4, "eval_interval": 0}}
    run_training(train_config(dataset, str(run), **sections, checkpoint={"interval": 2}))
    step = run / "ckpt" / "step-00000004"
    for f in step.iterdir():
        if f.name == ".metadata" or f.suffix == ".distcp":
            f.unlink()
    old = {"model": {"w": torch.ones(3)}, "optim": {"exp_avg": torch.zeros(3)}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(old, checkpoint_id=str(step))
    write_checksums(str(step))
    sections["train"]["steps"] = 6  # steps left after step 4
    resumed = train_config(dataset, str(run), **sections, checkpoint={"resume": str(step)})
    with pytest.raises(ConfigError, match="optimizer state is saved by flat offsets"):
        run_training(resumed)


def test_runs_that_would_lose_or_never_make_a_checkpoint_are_refused(
    dataset, tmp_path, monkeypatch
) -> None:
    """A new run (checkpoint.resume = false) into a checkpoint.dir of an earlier run's
    checkpoints is refused before writing anything, by the ranks and by the launcher's check (its
    first save removed them all, silently); a job still holding the directory's lock is named
    instead. A resume at or past train.steps / train.stop_after (it ran nothing and exited 0) is
    refused naming that key, except in a torchrun restart of a job that had finished. And
    train.stop_after without checkpoint.dir (it stopped with nothing saved) names both keys."""
    from datapipe.errors import ConfigError
    from trainer.checkpoint.lock import LOCK_FILE, DirLock, started
    from trainer.train import preflight, run_training

    run, ckpt = tmp_path / "r", tmp_path / "r" / "ckpt"

    def config(checkpoint: dict | None = None, **train: int):
        sections = {"parallel": {"policy": "single"}, "metrics": {"dir": str(tmp_path / "m")}}
        return train_config(dataset, str(run), **sections, train={"steps": 2, "eval_interval": 0,
                            **train}, checkpoint={"interval": 1, **(checkpoint or {})})  # fmt: skip

    run_training(config())
    saved = sorted(os.listdir(ckpt))
    assert saved == ["step-00000001", "step-00000002"]
    for check in (lambda: run_training(config(steps=3)), lambda: preflight(config(steps=3), 1)):
        with pytest.raises(ConfigError, match=f"checkpoint.dir {ckpt} holds an earlier run's "
                           "checkpoints \\(newest step-00000002\\).*checkpoint.resume = true"):  # fmt: skip
            check()
        assert sorted(os.listdir(ckpt)) == saved
    other = {**DirLock(str(ckpt))._mine(), "pid": os.getppid(), "started": started(os.getppid())}
    (ckpt / LOCK_FILE).write_text(json.dumps(other))  # a live job of this host holds it
    with pytest.raises(ConfigError, match=f"another job is using it .job .*pid {os.getppid()} "):
        run_training(config(steps=3))
    (ckpt / LOCK_FILE).unlink()
    for train, key in (({}, "train.steps = 2"), ({"steps": 4, "stop_after": 2}, "stop_after = 2")):
        resumed = config({"resume": True}, **train)
        for check in (run_training, lambda c: preflight(c, 1)):
            with pytest.raises(ConfigError, match=f"{key}, but the checkpoint resumed .*step-0+2"):
                check(resumed)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a finished job restarted: no step
    report = (tmp_path / "m" / "balance.md").read_text()
    assert report.startswith("balance report: policy single, 2 steps")
    out = run_training(config({"resume": True}))
    assert out["start_step"] == 2 and out["losses"] == []
    assert (tmp_path / "m" / "balance.md").read_text() == report  # the run's report stays
    with pytest.raises(ConfigError, match="train.stop_after = 1 ends the run checkpointed, but "
                       "checkpoint.dir is not set"):  # fmt: skip
        config({"dir": None}, stop_after=1).validate()


def test_the_written_config_reads_back_whatever_its_strings_hold(tmp_path) -> None:
    """The config.toml a run writes (`to_toml`) holds any string: backslashes, quotes, tabs, new
    lines and other control characters read back as they were (tomllib, and `load_config`)."""
    import tomllib

    from trainer.config.job import from_dict
    from trainer.config.toml import load_config

    odd = 'C:\\data\\"q"\ttab\nline\r\x00\x1f\x7f é✓ \\u0041'
    cfg = from_dict(
        {"data": {"path": odd}, "model": {"name": "debug"}, "checkpoint": {"dir": "c\\k\n"}}
    )
    text = to_toml(cfg)
    assert tomllib.loads(text)["data"]["path"] == odd
    (tmp_path / "c.toml").write_text(text, encoding="utf-8")
    assert load_config(tmp_path / "c.toml") == cfg


def test_set_values_are_stripped_around_the_equals_sign() -> None:
    from trainer.config.toml import apply_overrides

    got = apply_overrides({}, ["data.path = /x ", "train.lr= 1e-3"])
    assert got == {"data": {"path": "/x"}, "train": {"lr": 1e-3}}


@pytest.mark.parametrize(
    "loss, norm", [(float("nan"), 0.5), (2.5, float("inf")), (2.5, float("nan"))]
)
def test_a_finite_loss_with_a_non_finite_gradient_norm_stops_the_step(loss, norm) -> None:
    """Either figure not finite stops the step before it is applied (a finite loss whose
    gradients overflowed would otherwise be stepped and checkpointed)."""
    from trainer.hooks import check_finite_step

    rt = SimpleNamespace(islands=1, island=0, world=1, device=torch.device("cpu"),
                         run_comm=None, global_rank=0)  # fmt: skip
    check_finite_step(7, 2.5, 0.5, rt, lambda: None)
    with pytest.raises(NonFiniteStep):
        check_finite_step(7, loss, norm, rt, lambda: None)
