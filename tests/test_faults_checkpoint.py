"""Checkpoints under faults, in one process: damaged, truncated, half-written and hostile
checkpoints, resuming what is not there, a full disk while saving, every generator restored
(the generators' state alone: tests/test_rng_state.py).
The reference is always an uninterrupted run of the same config (bitwise equal losses)."""

from __future__ import annotations

import ast
import json
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from _faults import Payload, cli_error, dead_pid, file_size_limit, flip_byte, truncate
from _train_worker import make_dataset, train_config

import trainer.checkpoint.checkpointer as ckpt
from datapipe.errors import ConfigError, MixlenError
from trainer.checkpoint.files import CHECKSUMS_FILE, SafePlanner, SafeReader, write_checksums
from trainer.checkpoint.rng import seed_all
from trainer.train import run_training

ROOT = Path(__file__).resolve().parent.parent
STEPS = 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("data") / "ds"))


def cfg(data: str, run: Path, **sections: dict):
    """8 steps of `single` policy, checkpoints every 2 steps, no validation (fast)."""
    base = {
        "parallel": {"policy": "single"},
        "train": {"steps": STEPS, "eval_interval": 0},
        "checkpoint": {"dir": str(run / "ckpt"), "interval": 2, "keep": 3},
    }
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return train_config(data, str(run), **base)


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory) -> list[float]:
    """The uninterrupted run's loss curve."""
    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("ref")
    return run_training(cfg(dataset, run, checkpoint={"dir": None}))["losses"]


def _first_part(dataset: str, run: Path, stop: int = 6) -> None:
    run_training(cfg(dataset, run, train={"stop_after": stop}))


def test_checkpoint_files_and_rng_per_rank(dataset, tmp_path) -> None:
    """The checkpoint's files, and loading it puts every generator where the saving process had
    it (the reference: what that process draws next, the save being the run's last act)."""
    run = tmp_path / "r"
    _first_part(dataset, run, stop=2)
    want = (torch.rand(6), np.random.rand(6), [random.random() for _ in range(6)])
    seed_all(4321)
    c = cfg(dataset, run)
    from trainer.checkpoint.state import ModelState
    from trainer.model.transformer import build_model, torch_dtype
    from trainer.parallel.comm import SoloComm
    from trainer.parallel.zero import ZeroOptimizer

    model, master = build_model(c.model.shape(), torch_dtype(c.train.dtype), "cpu", seed=5)
    state = ModelState(model, ZeroOptimizer.for_model(model, SoloComm(), master=master, level=0))
    ckpt.load_checkpoint(
        str(run / "ckpt" / "step-00000002"), state, None, SoloComm(), torch.device("cpu")
    )
    got = (torch.rand(6), np.random.rand(6), [random.random() for _ in range(6)])
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2] == want[2]
    d = run / "ckpt" / "step-00000002"
    names = sorted(os.listdir(d))
    assert names == sorted(
        [".metadata", "__0_0.distcp", "run.json", "rng-00000.json", CHECKSUMS_FILE]
    )
    listed = json.loads((d / CHECKSUMS_FILE).read_text())["files"]
    assert sorted(listed) == sorted(n for n in names if n != CHECKSUMS_FILE)
    saved = json.loads((d / "run.json").read_text())
    assert saved["step"] == 2 and saved["world"] == 1 and saved["stream"]["step"] == 2
    assert saved["config"]["train"]["steps"] == STEPS and saved["scheduler"]["last_epoch"] == 2
    rng = json.loads((d / "rng-00000.json").read_text())
    assert set(rng) >= {"torch", "numpy", "python"}


def test_damaged_newest_checkpoint_falls_back(dataset, reference, tmp_path, capsys) -> None:
    """A flipped byte in the newest .distcp, then a truncated one: reported naming the file and
    the previous complete checkpoint is used; the curve continues exactly."""
    run = tmp_path / "r"
    _first_part(dataset, run)
    flip_byte(run / "ckpt" / "step-00000006" / "__0_0.distcp")
    capsys.readouterr()
    out = run_training(cfg(dataset, run, checkpoint={"resume": True}, train={"stop_after": 6}))
    err = capsys.readouterr().err
    assert "step-00000006 is damaged: __0_0.distcp: XXH3-64 checksum differs" in err
    assert "previous complete checkpoint" in err and "step-00000004" in err
    assert out["start_step"] == 4 and out["losses"] == reference[4:6]
    # the run saved a new step 6; now truncate it and its metadata
    truncate(run / "ckpt" / "step-00000006" / "__0_0.distcp")
    truncate(run / "ckpt" / "step-00000006" / ".metadata", 0.1)
    out = run_training(cfg(dataset, run, checkpoint={"resume": True}))
    err = capsys.readouterr().err
    assert "step-00000006 is damaged" in err and "truncated?" in err and "Traceback" not in err
    assert out["start_step"] == 4 and out["losses"] == reference[4:]
    recs = [json.loads(x) for x in open(run / "metrics.jsonl")]
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in recs] == reference


def test_explicitly_named_damaged_checkpoint_is_refused(dataset, tmp_path) -> None:
    run = tmp_path / "r"
    _first_part(dataset, run, stop=4)
    step4 = run / "ckpt" / "step-00000004"
    flip_byte(step4 / "rng-00000.json", 2)
    with pytest.raises(
        ConfigError, match=f"checkpoint.resume: {step4} is damaged \\(rng-00000.json"
    ):
        run_training(cfg(dataset, run, checkpoint={"resume": str(step4)}))
    (step4 / CHECKSUMS_FILE).unlink()
    with pytest.raises(
        ConfigError, match="checksums.json is missing: the checkpoint is incomplete"
    ):
        run_training(cfg(dataset, run, checkpoint={"resume": str(step4)}))


def test_incomplete_checkpoints_are_never_chosen(dataset, reference, tmp_path, capsys) -> None:
    """A `.tmp` directory (a save killed mid-way) and a step directory without checksums.json
    (renamed by hand, or from an older mixlen) are not resumed from; the newest complete is."""
    run = tmp_path / "r"
    _first_part(dataset, run, stop=4)
    root = run / "ckpt"
    shutil.copytree(root / "step-00000004", root / "step-00000008.tmp")
    shutil.copytree(root / "step-00000004", root / "step-00000006")
    (root / "step-00000006" / CHECKSUMS_FILE).unlink()
    assert ckpt.complete_checkpoints(str(root)) == [str(root / f"step-0000000{k}") for k in (4, 2)]
    capsys.readouterr()
    out = run_training(cfg(dataset, run, checkpoint={"resume": True}))
    assert out["start_step"] == 4 and out["losses"] == reference[4:]
    assert "damaged" not in capsys.readouterr().err  # never considered, so never "damaged"
    assert sorted(os.listdir(root)) == ["step-00000004", "step-00000006", "step-00000008"]


def test_resume_from_nothing_is_an_error(dataset, tmp_path, capsys, monkeypatch) -> None:
    """`checkpoint.resume = true` with a mistyped or empty checkpoint.dir: an error naming it,
    not a quiet start from step 0. After a torchrun restart with no checkpoint yet: step 0."""
    run = tmp_path / "r"
    for dir_, phrase in [
        (str(tmp_path / "typo"), "does not exist"),
        (str(tmp_path), "holds no complete"),
    ]:
        with pytest.raises(
            ConfigError, match=f"checkpoint.resume = true, but checkpoint.dir '{dir_}' {phrase}"
        ):
            run_training(cfg(dataset, run, checkpoint={"resume": True, "dir": dir_}))
    with pytest.raises(ConfigError, match="checkpoint.resume: .*nope.* is not a directory"):
        run_training(cfg(dataset, run, checkpoint={"resume": str(tmp_path / "nope")}))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    out = run_training(cfg(dataset, run, train={"stop_after": 2}))
    assert out["start_step"] == 0 and "restart 1: no checkpoint yet" in capsys.readouterr().err


def test_restart_resumes_by_itself(dataset, reference, tmp_path, monkeypatch) -> None:
    """torchrun restarts every worker with the same arguments: the restarted run continues from
    the newest complete checkpoint this job wrote, even over an explicitly named older one."""
    run = tmp_path / "r"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    _first_part(dataset, run)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    step2 = str(run / "ckpt" / "step-00000002")
    out = run_training(cfg(dataset, run, checkpoint={"resume": step2}, train={"stop_after": 7}))
    assert out["start_step"] == 6 and out["losses"] == reference[6:7]
    # another job's checkpoints are not this one's to continue, nor may a fresh run restarted
    # before its first save start from step 0 there (its first save would remove them)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-job")
    with pytest.raises(
        ConfigError, match="holds an earlier run's checkpoints .newest step-0000000"
    ):
        run_training(cfg(dataset, run, train={"stop_after": 1}))
    # torchrun's default run id "none" (every such job's) proves nothing: a restart that finds
    # checkpoints stops (it started again from step 0, its first save removing steps 4 and 6),
    # and continues the newest with checkpoint.resume = true
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    _first_part(dataset, tmp_path / "r2", stop=6)
    root, r2 = tmp_path / "r2" / "ckpt", tmp_path / "r2"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(ConfigError, match="newest step-00000006.*--rdzv-id") as exc:
        run_training(cfg(dataset, r2, train={"stop_after": 2}))
    assert f"checkpoint.dir {root}: torchrun restarted this job (restart 1)" in str(exc.value)
    assert "checkpoint.resume = true" in str(exc.value) and len(os.listdir(root)) == 3
    out = run_training(cfg(dataset, r2, checkpoint={"resume": True}, train={"stop_after": 7}))
    assert out["start_step"] == 6 and out["losses"] == reference[6:7]


def test_resume_refuses_what_changes_the_run(dataset, tmp_path) -> None:
    """A changed global batch is refused naming train.global_batch_tokens; another dataset naming
    data.path; the planner's settings (how a step is computed, not what) may change."""
    run = tmp_path / "r"
    _first_part(dataset, run, stop=2)
    with pytest.raises(ConfigError, match="train.global_batch_tokens: 1024 -> 2048"):
        run_training(
            cfg(dataset, run, checkpoint={"resume": True}, train={"global_batch_tokens": 2048})
        )
    other = make_dataset(str(tmp_path / "other"), n_docs=50, seed=7)
    with pytest.raises(ConfigError, match="saved on another dataset \\(data.path"):
        run_training(cfg(other, run, checkpoint={"resume": True}))
    out = run_training(
        cfg(
            dataset,
            run,
            checkpoint={"resume": True},
            train={"stop_after": 3},
            parallel={"policy": "hdp", "capacity": 600},
        )
    )
    assert out["start_step"] == 2 and len(out["losses"]) == 1


def test_full_disk_while_saving(dataset, reference, tmp_path, monkeypatch, capsys) -> None:
    """The checkpoint of step 4 cannot be written (RLIMIT_FSIZE): the run stops with a message
    naming checkpoint.dir and the intact step 2; nothing of step 4 is left; resuming continues
    the reference curve exactly."""
    run = tmp_path / "r"
    real = ckpt.Checkpointer.save

    def save(self, step, stream_state):
        if step != 4:
            return real(self, step, stream_state)
        with file_size_limit(4096):
            return real(self, step, stream_state)

    monkeypatch.setattr(ckpt.Checkpointer, "save", save)
    with pytest.raises(MixlenError) as exc:
        run_training(cfg(dataset, run))
    msg = str(exc.value)
    assert f"checkpoint.dir {run / 'ckpt'}: saving the checkpoint of step 4 failed" in msg
    assert "File too large" in msg and "step-00000002 of this run is intact" in msg
    assert "Free space" in msg
    assert sorted(os.listdir(run / "ckpt")) == ["step-00000002"]
    monkeypatch.setattr(ckpt.Checkpointer, "save", real)
    out = run_training(cfg(dataset, run, checkpoint={"resume": True}))
    assert out["start_step"] == 2 and out["losses"] == reference[2:]


def test_one_job_per_checkpoint_dir(dataset, tmp_path, capsys) -> None:
    """Issue: two runs started into one checkpoint.dir replaced each other's checkpoints. A live
    job's lock is refused naming that job, before anything is written; a dead process's stale
    lock is taken over and said so; the lock is gone when the run ends."""
    import socket
    import subprocess

    from trainer.checkpoint.lock import LOCK_FILE

    run = tmp_path / "r"
    (run / "ckpt").mkdir(parents=True)
    lock = run / "ckpt" / LOCK_FILE
    other = subprocess.Popen(["sleep", "60"])  # another job, alive on this host
    try:
        lock.write_text(
            json.dumps({"job": "job-A", "host": socket.gethostname(), "pid": other.pid})
        )
        with pytest.raises(ConfigError) as exc:
            run_training(cfg(dataset, run, train={"stop_after": 2}))
        msg = str(exc.value)
        assert f"checkpoint.dir {run / 'ckpt'}: another job is using it (job job-A" in msg
        assert f"pid {other.pid} on this host" in msg
        assert sorted(os.listdir(run / "ckpt")) == [LOCK_FILE]  # nothing written, lock kept
        assert json.loads(lock.read_text())["job"] == "job-A"
    finally:
        other.kill()
        other.wait()
    stale = dead_pid()
    lock.write_text(json.dumps({"job": "job-B", "host": socket.gethostname(), "pid": stale}))
    capsys.readouterr()
    run_training(cfg(dataset, run, train={"stop_after": 2}))
    err = capsys.readouterr().err  # logged on stderr (trainer.logs)
    assert f"took over the lock of job job-B (pid {stale}, no longer running)" in err
    assert sorted(os.listdir(run / "ckpt")) == ["step-00000002"]  # released at the end


@pytest.mark.parametrize("where", ["dcp", "checksums", "fsync", "prune"])
def test_a_signal_during_a_save_is_an_interruption(dataset, tmp_path, monkeypatch, where) -> None:
    """SIGTERM during step 4's save, inside DCP (which wraps whatever its steps raise: it was
    reported as a failed save, exit 2), before the rename (its .tmp was left), after it, or
    while step 2 is pruned (half of it was left, looking complete): an interruption (exit 143)
    naming the last complete checkpoint, nothing partial left."""
    import signal
    import types

    from torch.distributed.checkpoint import DefaultSavePlanner

    import trainer.checkpoint.save as save
    from trainer.hooks import Interrupted, TrainingInterrupted

    class Stop(DefaultSavePlanner):
        def create_local_plan(self):
            raise Interrupted(signal.SIGTERM)  # what the signal handler raises

    owner, attr = {"dcp": (save.dcp, "save"), "prune": (save, "shutil")}.get(
        where, (save, {"checksums": "write_checksums", "fsync": "fsync_dir"}.get(where))
    )
    real, calls = getattr(owner, attr), []

    def second_interrupted(*args, **kw):
        calls.append(1)
        if len(calls) == 2 and where == "dcp":
            kw["planner"] = Stop()
        elif len(calls) == 2:
            real(*args, **kw)
            raise Interrupted(signal.SIGTERM)
        return real(*args, **kw)

    def rmtree(path, ignore_errors=False):
        if "step-00000002" in path and not calls and os.path.isdir(path):
            calls.append(1)
            os.remove(os.path.join(path, "__0_0.distcp"))  # the removal has begun
            raise Interrupted(signal.SIGTERM)
        shutil.rmtree(path, ignore_errors=ignore_errors)

    fake = types.SimpleNamespace(rmtree=rmtree) if where == "prune" else second_interrupted
    monkeypatch.setattr(owner, attr, fake)
    run = tmp_path / "r"
    with pytest.raises(TrainingInterrupted) as exc:
        run_training(cfg(dataset, run, checkpoint={"keep": 1 if where == "prune" else 3}))
    last = 2 if where in ("dcp", "checksums") else 4  # fsync_dir and prune: after the rename
    assert (exc.value.step, exc.value.exit_code) == (4, 143)
    assert exc.value.checkpoint == str(run / "ckpt" / f"step-{last:08d}")
    kept = range(4 if where == "prune" else 2, last + 1, 2)
    assert sorted(os.listdir(run / "ckpt")) == [f"step-{k:08d}" for k in kept]


def test_a_copy_a_save_replaced_is_removed(tmp_path, monkeypatch) -> None:
    """A step saved again keeps its old copy as step-N.old until the new one is in place; a signal
    after the rename left it (the next save failed). Now it goes after the signal and pre-rename."""
    import signal

    import trainer.checkpoint.save as save
    from trainer.hooks import Interrupted
    from trainer.parallel.comm import SoloComm

    w, root = torch.ones(3), tmp_path / "ckpt"
    owner = type("Owner", (), {"state_dict": lambda s: {"w": w}, "load_state_dict": print})()

    def again(*seen: str) -> None:
        save.save_checkpoint(str(root), 2, owner, {}, SoloComm(), torch.device("cpu"))
        assert sorted(os.listdir(root)) == ["step-00000002", *seen]

    def stop(path: str) -> None:
        raise Interrupted(signal.SIGTERM)

    again()
    with monkeypatch.context() as m:
        m.setattr(save, "fsync_dir", stop)  # the signal after the rename
        with pytest.raises(Interrupted):
            again()
    assert sorted(os.listdir(root)) == ["step-00000002"]  # the replaced copy went after the signal
    shutil.copytree(root / "step-00000002", root / "step-00000002.old")  # a kill -9 left it
    with monkeypatch.context() as m:
        m.setattr(save, "_prune", lambda *a: None)  # (pruning removes it too)
        again("step-00000002.old")  # replaced by the copy just saved, not refused
    again()


def test_a_failed_save_blames_the_disk_only_when_the_disk_is_the_cause(
    dataset, tmp_path, monkeypatch
) -> None:
    """An I/O error that is not a full disk is named as such (no advice to free space), and a
    run with no checkpoint of its own yet says so."""
    import errno

    import trainer.checkpoint.save as save

    run, real = tmp_path / "r", save.write_json

    def failing(path, obj):
        if os.path.basename(path).startswith("rng-"):
            raise OSError(errno.EIO, "Input/output error", path)
        return real(path, obj)

    monkeypatch.setattr(save, "write_json", failing)
    with pytest.raises(MixlenError) as exc:
        run_training(cfg(dataset, run, train={"stop_after": 2}))  # a new run (resume = false)
    msg = str(exc.value)
    assert "saving the checkpoint of step 2 failed (Input/output error" in msg
    assert "this run has no earlier checkpoint" in msg and "Fix the cause" in msg
    assert "Free space" not in msg and "is intact" not in msg


def test_hostile_pickles_in_a_checkpoint_are_refused(dataset, tmp_path) -> None:
    """A .metadata rewritten to run code (with checksums recomputed, as an attacker would) and a
    non-tensor value that would run code: refused by the restricted reader and weights_only."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    marker = tmp_path / "pwned"
    run = tmp_path / "r"
    _first_part(dataset, run, stop=2)
    step2 = run / "ckpt" / "step-00000002"
    (step2 / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    write_checksums(str(step2))
    with pytest.raises(
        ConfigError, match="cannot be loaded \\(UnpicklingError: refusing to unpickle io.open"
    ):
        run_training(cfg(dataset, run, checkpoint={"resume": True}))
    assert not marker.exists()
    # a non-tensor value: plain DCP would unpickle it (weights_only=False); ours refuses
    d = tmp_path / "dcp"
    dcp.save({"x": Payload(str(marker)), "t": torch.ones(2)}, checkpoint_id=str(d))
    state = {"x": None, "t": torch.zeros(2)}
    with pytest.raises(CheckpointException, match="Weights only load failed"):
        dcp.load(state, storage_reader=SafeReader(str(d)), planner=SafePlanner())
    assert not marker.exists()


def test_no_unsafe_unpickling_in_the_code() -> None:
    """Every torch.load passes weights_only=True; pickle.load(s) appears only in the restricted
    metadata reader (a source scan of datapipe/, trainer/, tools/)."""
    offenders = []
    for pkg in ("datapipe", "trainer", "tools"):
        for path in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                    continue
                owner = node.func.value
                name = f"{getattr(owner, 'id', '?')}.{node.func.attr}"
                if name == "torch.load":
                    ok = any(
                        k.arg == "weights_only" and getattr(k.value, "value", None) is True
                        for k in node.keywords
                    )
                    if not ok:
                        offenders.append(f"{path}:{node.lineno} {name}")
                if name in ("pickle.load", "pickle.loads", "np.load", "numpy.load"):
                    ok = name.endswith("np.load") and any(
                        k.arg == "allow_pickle" and getattr(k.value, "value", None) is False
                        for k in node.keywords
                    )
                    if not ok:
                        offenders.append(f"{path}:{node.lineno} {name}")
    assert offenders == []


def test_resume_refuses_another_dataset_with_the_same_lengths(tmp_path, capsys) -> None:
    """Issue case 7 (resume): a checkpoint saved on dataset A, resumed on B whose samples have
    the same lengths and other tokens, was accepted; now refused naming both fingerprints, and
    accepted with data.allow_other_dataset = true."""
    from datapipe.index import dataset_fingerprint
    from datapipe.ingest.preprocess import PreprocessConfig, preprocess
    from trainer.config.toml import to_toml

    roots = []
    for name, letter in (("a", "x"), ("b", "y")):
        src = tmp_path / f"src-{name}"
        src.mkdir()
        for i in range(30):
            (src / f"{i:02d}.txt").write_text(f"document {i} " + letter * (20 + i * 9))
        preprocess(PreprocessConfig([str(src)], str(tmp_path / name), progress=False))
        roots.append(str(tmp_path / name))
    fa, fb = (dataset_fingerprint(r) for r in roots)
    assert fa != fb
    run = tmp_path / "r"
    first = cfg(roots[0], run, train={"stop_after": 2, "global_batch_tokens": 512})
    first.parallel.planner = first.parallel.planner.__class__(policy="single", capacity=600)
    run_training(first)
    saved = json.loads((run / "ckpt" / "step-00000002" / "run.json").read_text())
    assert saved["dataset_fingerprint"] == fa
    again = cfg(
        roots[1],
        run,
        checkpoint={"resume": True},
        train={"stop_after": 3, "global_batch_tokens": 512},
    )
    again.parallel.planner = first.parallel.planner
    again.metrics.progress = False
    (tmp_path / "again.toml").write_text(to_toml(again))
    capsys.readouterr()
    err = cli_error(["train", str(tmp_path / "again.toml")], capsys)  # through the command line
    assert f"saved on dataset {fa} and data.path {roots[1]!r} is dataset {fb}" in err
    again.data.allow_other_dataset = True
    assert run_training(again)["start_step"] == 2
