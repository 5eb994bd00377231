"""Hostile input, round four (issue 29): `mixlen export` and the checkpoint it reads. An output
over the checkpoint being read (which deleted every checkpoint, or replaced a step), over the run's
pretrained folder, under a file or over the current directory is refused before a byte is read;
each case exits 2 with one message naming `--hf` and leaves the checkpoint byte-identical."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from _faults import cli_error, tree_digest
from _train_worker import make_dataset, train_config

from trainer.checkpoint.checkpointer import latest_checkpoint

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]  # conftest.py

STEP3 = "step-00000003"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 3-step run of the debug model (a checkpoint after every step, all three kept)."""
    from trainer.train import run_training

    root = tmp_path_factory.mktemp("trained")
    data = make_dataset(str(root / "ds"), n_docs=40)
    c = train_config(data, str(root / "run"), train={"steps": 3, "eval_interval": 0},
                     checkpoint={"interval": 1, "keep": 3},
                     parallel={"policy": "single", "capacity": 4096})  # fmt: skip
    run_training(c)
    return root / "run"


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run this test may damage."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def test_export_never_writes_over_the_checkpoint_it_reads(run, capsys) -> None:
    """`export CKPT --hf CKPT --overwrite` deleted every checkpoint (and the lock), `export
    CKPT/step-3 --hf CKPT/step-3 --overwrite` replaced step 3 with the HF folder (a resume then fell
    back to step 2): both refused, as is an output inside the step or holding the checkpoint."""
    ckpt = run / "ckpt"
    step = ckpt / STEP3
    before = tree_digest(run)
    cases = [
        (ckpt, ckpt, "is the checkpoint"),
        (step, step, "is the checkpoint"),
        (step, ckpt, "holds the checkpoint"),
        (ckpt, run, "holds the checkpoint"),
        (step, step / "hf", "is inside the checkpoint"),
        (ckpt, ckpt / STEP3 / "hf", "is inside the checkpoint"),
    ]
    for src, out, what in cases:
        err = cli_error(["export", str(src), "--hf", str(out), "--overwrite"], capsys)
        assert f"--hf {out}: {what}" in err, err
    assert tree_digest(run) == before
    assert latest_checkpoint(str(ckpt)) == str(step)


def test_export_output_under_a_file_or_over_the_current_directory(run, capsys, monkeypatch):
    """`--hf metrics.jsonl/sub` (FileExistsError after the weights were read) and `--hf .
    --overwrite` (EBUSY) are refused before the checkpoint is read."""
    ckpt = str(run / "ckpt")
    err = cli_error(["export", ckpt, "--hf", str(run / "metrics.jsonl" / "sub")], capsys)
    assert f"--hf {run / 'metrics.jsonl' / 'sub'}: {run / 'metrics.jsonl'} is a file" in err
    elsewhere = run.parent / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    err = cli_error(["export", ckpt, "--hf", ".", "--overwrite"], capsys)
    assert "--hf .: is the current directory" in err
    err = cli_error(["export", ckpt, "--hf", "..", "--overwrite"], capsys)
    assert "--hf ..: holds the current directory" in err
    assert os.listdir(elsewhere) == []
