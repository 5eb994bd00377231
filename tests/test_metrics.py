"""metrics.jsonl across runs: a fresh run starts it anew, a resumed run continues it."""

from __future__ import annotations

import io
import json
from pathlib import Path

from trainer.metrics import MetricsWriter


def _run(out: Path, steps: range, resume_step: int | None) -> None:
    w = MetricsWriter(
        str(out),
        10,
        progress=False,
        console_interval=1000,  # no console lines: only the file is under test
        stream=io.StringIO(),
        resume_step=resume_step,
    )
    for k in steps:
        w.log({"step": k, "loss": float(k)})
    w.close()


def _steps(out: Path) -> list[int]:
    return [json.loads(x)["step"] for x in open(out / "metrics.jsonl")]


def test_fresh_run_truncates_and_resume_drops_later_steps(tmp_path: Path) -> None:
    _run(tmp_path, range(1, 6), None)
    assert _steps(tmp_path) == [1, 2, 3, 4, 5]
    _run(tmp_path, range(1, 3), None)  # a new run in the same directory
    assert _steps(tmp_path) == [1, 2]
    _run(tmp_path, range(1, 6), None)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # a line cut short by a kill
    _run(tmp_path, range(4, 8), resume_step=3)  # resumed from the checkpoint of step 3
    assert _steps(tmp_path) == [1, 2, 3, 4, 5, 6, 7]
