"""metrics.jsonl across runs: a fresh run starts it anew (another run's file moved aside, never
written over), a resumed run continues its own."""

from __future__ import annotations

import io
import json
from pathlib import Path

from trainer.metrics import MetricsWriter


def _run(out: Path, steps: range, resume_step: int | None, run_id: str = "") -> None:
    w = MetricsWriter(
        str(out),
        10,
        progress=False,
        console_interval=1000,  # no console lines: only the file is under test
        stream=io.StringIO(),
        resume_step=resume_step,
        run_id=run_id,
    )
    for k in steps:
        w.log({"step": k, "loss": float(k) + (resume_step or 0) / 100})
    w.close()


def _steps(out: Path, name: str = "metrics.jsonl") -> list[int]:
    return [json.loads(x)["step"] for x in open(out / name)]


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


def test_another_runs_metrics_are_moved_aside_and_a_resume_takes_back_its_own(tmp_path) -> None:
    """Run A stops after step 5 (checkpoint at 3); run B, another experiment, writes into the
    same metrics.dir; A resumes from step 3. A's file is never written over: B's start moves it to
    metrics-A.jsonl; A's resume moves B's to metrics-B.jsonl, takes its own back and continues it
    from step 3. A file of records without a run (before runs had one) is moved to
    metrics-earlier.jsonl by a fresh run and continued by a resume, as before."""
    _run(tmp_path, range(1, 6), None, "A")
    _run(tmp_path, range(1, 4), None, "B")
    assert _steps(tmp_path, "metrics-A.jsonl") == [1, 2, 3, 4, 5]
    assert _steps(tmp_path) == [1, 2, 3]
    _run(tmp_path, range(4, 7), resume_step=3, run_id="A")
    recs = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [(r["step"], r["loss"], r["run"]) for r in recs] == [
        (1, 1.0, "A"), (2, 2.0, "A"), (3, 3.0, "A"), (4, 4.03, "A"), (5, 5.03, "A"), (6, 6.03, "A")
    ]  # fmt: skip
    assert _steps(tmp_path, "metrics-B.jsonl") == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".metrics.lock", "metrics-B.jsonl", "metrics.jsonl"
    ]  # fmt: skip
    _run(tmp_path, range(1, 3), None, "C")  # a third run: A's file aside beside B's
    assert _steps(tmp_path, "metrics-A.jsonl") == [1, 2, 3, 4, 5, 6]
    old = tmp_path / "old"
    _run(old, range(1, 4), None)  # no run id
    _run(old, range(3, 5), resume_step=2)
    assert _steps(old) == [1, 2, 3, 4]
    _run(old, range(1, 3), None, "D")
    assert _steps(old, "metrics-earlier.jsonl") == [1, 2, 3, 4] and _steps(old) == [1, 2]
    _run(old, range(1, 2), None, "E")  # a second file of one run: a free name
    assert _steps(old, "metrics-D.jsonl") == [1, 2]
    _run(old, range(1, 2), None, "F")
    _run(old, range(1, 3), None, "E")  # metrics-E.jsonl taken: E's second file goes to .1
    _run(old, range(1, 2), None, "G")
    assert _steps(old, "metrics-E.jsonl") == [1] and _steps(old, "metrics-F.jsonl") == [1]
    assert _steps(old, "metrics-E.1.jsonl") == [1, 2]


def test_two_runs_at_once_in_one_folder_and_a_full_disk(tmp_path, caplog) -> None:
    """A second run writing into a metrics.dir while another run writes there is refused naming
    the folder and the first (before: both wrote one metrics.jsonl, torn lines, exit 0); once the
    first closes, the folder is free. A full disk under metrics.jsonl stops the metrics, logged
    once as an error, and never the run (before: an OSError ended training before the checkpoint
    that was due, and close() raised it again)."""
    import errno

    import pytest

    from datapipe.errors import ConfigError

    def writer(run_id: str) -> MetricsWriter:
        return MetricsWriter(str(tmp_path), 10, progress=False, console_interval=1000,
                             stream=io.StringIO(), run_id=run_id)  # fmt: skip

    first = writer("A")
    with pytest.raises(ConfigError, match=f"metrics.dir {tmp_path}: another run \\(pid \\d+ on"):
        writer("B")
    first.log({"step": 1, "loss": 1.0})

    class Full(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    first._jsonl.close()
    first._jsonl = Full()
    for k in (2, 3):
        first.log({"step": k, "loss": float(k)})  # no exception
    first.close()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "metrics.jsonl: cannot write (No space left on device)" in errors[0]
    assert _steps(tmp_path) == [1]
    second = writer("B")  # free again
    second.close()
