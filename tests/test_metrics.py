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


def _record(step: int) -> dict:
    return dict(step=step, loss=1.0, tokens=10, tokens_per_s=1.0, step_time_s=1.0,
                data_wait_s=0.0, comm_time_s=0.0, imbalance_measured=1.0,
                imbalance_planned=1.0)  # fmt: skip


def test_console_lines_every_interval_and_the_last_step(tmp_path: Path) -> None:
    """`metrics.console_interval = 4` over 6 steps prints steps 4 and 6 (the last); 1, every."""
    for interval, want in ((4, [4, 6]), (1, [1, 2, 3, 4, 5, 6]), (10, [6])):
        out = io.StringIO()
        w = MetricsWriter(str(tmp_path / str(interval)), 6, progress=False,
                          console_interval=interval, stream=out)  # fmt: skip
        for k in range(1, 7):
            w.log(_record(k))
        w.close()
        assert [int(line.split()[1]) for line in out.getvalue().splitlines()] == want


def test_balance_table_by_hand() -> None:
    """The balance report's rank table: run totals, and each rank's share of the measured and of
    the planned totals (each column summing to 1), from two steps' figures added by hand."""
    from trainer.metrics import BalanceSummary

    b = BalanceSummary()
    b.add([0.5, 1.0], [1.0, 1.5], [2, 1], 2.0, 100)
    b.add([0.5, 2.0], [1.0, 4.5], [1, 3], 3.0, 50)
    rows = [line for line in b.render("hdp").splitlines() if line.startswith("| 0") or
            line.startswith("| 1")]  # fmt: skip
    cells = [[float(x) for x in row.strip("|").split("|")] for row in rows]
    assert cells == [[0, 3, 1.0, 2.0, 0.25, 0.25], [1, 4, 3.0, 6.0, 0.75, 0.75]]
    assert b.render("hdp").startswith("balance report: policy hdp, 2 steps, 150 tokens, 5.00 s")


def test_tensorboard_of_a_resumed_run_keeps_its_steps_before_the_resume(tmp_path: Path) -> None:
    """A run writes steps 1-5, stops, resumes from its checkpoint of step 3 and writes 4-6: the
    TensorBoard reader returns steps 1-3 of the first part and 4-6 of the second (events past
    the resume step are purged, the ones at it kept)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def part(steps: range, resume: int | None, offset: float) -> None:
        w = MetricsWriter(str(tmp_path), 6, tensorboard=True, progress=False, run_id="R",
                          console_interval=1000, stream=io.StringIO(), resume_step=resume)  # fmt: skip
        for k in steps:
            w.log({**_record(k), "loss": offset + k})
        w.close()

    part(range(1, 6), None, 0.0)
    part(range(4, 7), 3, 10.0)
    acc = EventAccumulator(str(tmp_path / "tb" / "R"))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert got == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0), (6, 16.0)]
