"""Multi-process faults (slow: each process pays ~9 s of imports, so launches are few):

- a rank SIGKILLed while a checkpoint is being written, and another mid-step after the restart,
  under `mixlen train --nproc 2 --max-restarts 2`: the job resumes by itself each time (never from
  the half-written checkpoint) and its loss curve and final parameters equal an uninterrupted
  2-rank run's bit for bit (float32);
- elastic resume: a run checkpointed on 4 ranks continues on 2, and one from 2 on 4, along the
  single-process reference's loss curve (float64, 1e-9), planned for the new rank count;
- a config error under --nproc is printed once, before any rank starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _faults_worker import CRASH_STEPS, crash_config, elastic_config, faults_main
from _train_worker import make_dataset

from tools.cli import main as cli_main
from trainer.config.toml import to_toml
from trainer.parallel.comm import free_port, spawn
from trainer.train import run_training

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    # parquet: the 12 torchrun ranks of the crash test leave the streaming library unimported
    return make_dataset(str(tmp_path_factory.mktemp("data") / "ds"), fmt="parquet")


@pytest.fixture(scope="module")
def four_ranks(dataset, tmp_path_factory) -> tuple[Path, dict]:
    """One spawn of 4 gloo processes: the uninterrupted 2-rank run and the elastic resumes."""
    out = tmp_path_factory.mktemp("four")
    spawn(faults_main, 4, (4, free_port(), dataset, str(out)), timeout=280)
    return out, json.loads((out / "faults.json").read_text())


def _state(path: Path) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of a checkpoint, loaded the way a resume loads them."""
    from trainer.checkpoint.checkpointer import load_checkpoint
    from trainer.checkpoint.state import ModelState
    from trainer.config.job import from_dict
    from trainer.model.transformer import build_model, torch_dtype
    from trainer.parallel.comm import SoloComm
    from trainer.parallel.zero import ZeroOptimizer

    cfg = from_dict(json.loads((path / "run.json").read_text())["config"])
    model, master = build_model(cfg.model.shape(), torch_dtype(cfg.train.dtype), "cpu", seed=123)
    zero = ZeroOptimizer.for_model(model, SoloComm(), master=master, level=0)
    load_checkpoint(str(path), ModelState(model, zero), None, SoloComm(), torch.device("cpu"))
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for k, v in zero.state_dict().items():  # by parameter name, or the step count
        items = v.items() if isinstance(v, dict) else [("", v)]
        out.update({f"optim.{k}.{name}": t.clone() for name, t in items})
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_ranks_restart_and_continue_the_same_run(dataset, four_ranks, tmp_path) -> None:
    out, got = four_ranks
    run = tmp_path / "faulty"
    cfg = tmp_path / "faulty.toml"
    cfg.write_text(to_toml(crash_config(dataset, str(run))))
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MIXLEN_DIST_TIMEOUT": "60",
        # first run: rank 1 dies while step 4's checkpoint is written; first restart: rank 0 dies
        # inside step 5; the second restart runs through (2 ranks: 6 fresh processes in all)
        "MIXLEN_FAULT": "kill:rank=1:step=4:at=save,kill:rank=0:step=5:attempt=1",
        "MIXLEN_HOOKS": "trainer.testing.faults:FaultInjector",
    }
    cmd = [
        sys.executable,
        "-m",
        "tools.cli",
        "train",
        str(cfg),
        "--nproc",
        "2",
        "--max-restarts",
        "2",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank
        stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    ckpt = run / "ckpt"
    # the half-written step 4 was never chosen: the first restart went back to step 2
    resumes = [line for line in stderr.splitlines() if "resumed from" in line]
    assert [line.split("ckpt/")[1].split(" ")[0] for line in resumes] == [
        "step-00000002",
        "step-00000004",
    ], resumes
    # the loss curve (metrics.jsonl keeps one record per step) equals the uninterrupted run's
    recs = [json.loads(x) for x in open(run / "metrics.jsonl")]
    assert [r["step"] for r in recs] == list(range(1, CRASH_STEPS + 1))
    assert [r["loss"] for r in recs] == got["ref2"]
    # and so do the final parameters and optimizer state, bit for bit
    mine, ref = _state(ckpt / "step-00000006"), _state(out / "ref2" / "ckpt" / "step-00000006")
    assert mine.keys() == ref.keys() and len(mine) > 10
    for k in ref:
        assert torch.equal(mine[k], ref[k]), k
    assert sorted(os.listdir(ckpt)) == ["step-00000002", "step-00000004", "step-00000006"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_elastic_resume_on_another_rank_count(dataset, four_ranks, tmp_path) -> None:
    out, got = four_ranks
    ref = run_training(_single_reference(dataset, tmp_path))["losses"]
    assert len(ref) == 6
    for name, before, after in (("e42", 4, 2), ("e24", 2, 4)):
        curve = got[f"{name}_first"] + got[f"{name}_second"]
        assert got[f"{name}_start"] == 3
        np.testing.assert_allclose(curve, ref, rtol=1e-9, atol=0)
        ranks = {int(k): v for k, v in got[f"{name}_ranks"].items()}
        assert ranks == {1: before, 2: before, 3: before, 4: after, 5: after, 6: after}


def _single_reference(dataset: str, tmp_path: Path):
    """The same run in one process on whole samples (`single` policy), no checkpoints."""
    cfg = elastic_config(dataset, str(tmp_path / "single"))
    cfg.parallel.planner = dataclasses.replace(cfg.parallel.planner, policy="single")
    cfg.checkpoint.dir = None
    return cfg


def test_config_errors_under_nproc_are_printed_once_before_launch(
    dataset, tmp_path, capsys
) -> None:
    """Errors the ranks would find are found by the launcher: one message, exit 2, no rank
    started (this test launches nothing: it takes a second)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(to_toml(crash_config(dataset, str(tmp_path / "run"))))
    cases = [
        (
            ['data.path="/no/such/dataset"'],
            "data.path: dataset directory '/no/such/dataset' not found",
        ),
        (["checkpoint.resume=true"], "checkpoint.resume = true, but checkpoint.dir"),
        (["parallel.capacity=64"], "the number of ranks (--nproc)"),
        (["train.lr=-1"], "train.lr: must be > 0"),
    ]
    for sets, phrase in cases:
        argv = ["train", str(cfg), "--nproc", "2"] + [a for s in sets for a in ("--set", s)]
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert err.count(phrase) == 1 and err.count("error:") == 1, err
        assert "ChildFailedError" not in err and "Traceback" not in err
