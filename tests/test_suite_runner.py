"""How `make test` runs the suite (tests/conftest.py under pytest-xdist): a `serial` test runs
while no other test of the run is in progress, module fixtures included, and the run's lock
files are gone afterwards. A small suite of sleeping tests, run with this conftest on 2 workers,
records when each test and fixture ran; no test starts before the controller's numba warm-up has
ended, and a failed warm-up fails the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

TEST_FILE = """
import json, os, time
import pytest

def _rec(log, name, t0):
    with open(log, "a") as f:
        f.write(json.dumps([name, t0, time.time(), os.getpid()]) + "\\n")

@pytest.fixture(scope="module")
def slow_setup():
    t0 = time.time()
    time.sleep(0.3)
    _rec(os.environ["RUNNER_LOG"], "fixture-{name}", t0)

@pytest.mark.parametrize("i", range(3))
def test_plain(slow_setup, i):
    t0 = time.time()
    time.sleep(0.2)
    _rec(os.environ["RUNNER_LOG"], "plain-{name}", t0)

@pytest.mark.serial
def test_alone():
    t0 = time.time()
    time.sleep(0.4)
    _rec(os.environ["RUNNER_LOG"], "serial-{name}", t0)
"""


WARM_FILE = """
import json, os, sys, time
t0 = time.time()
time.sleep(1.0)
with open(os.environ["RUNNER_LOG"], "a") as f:
    f.write(json.dumps(["warm", t0, time.time(), os.getpid()]) + "\\n")
sys.exit(3)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_serial_tests_run_alone_under_xdist(tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    suite = tmp_path / "suite"
    suite.mkdir()
    for name in ("conftest.py", "_s3.py"):  # (the conftest loads _s3's fixtures as a plugin)
        (suite / name).write_text((HERE / name).read_text())
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: s\n    serial: s\n")
    # the controller's numba warm-up (`python -m datapipe.plan.warm` run in the conftest's
    # parent folder, which comes first on its path): here one that takes a second and fails
    warm = tmp_path / "datapipe" / "plan"
    warm.mkdir(parents=True)
    for init in (tmp_path / "datapipe", warm):
        (init / "__init__.py").write_text("")
    (warm / "warm.py").write_text(WARM_FILE)
    for name in "abcd":
        (suite / f"test_{name}.py").write_text(TEST_FILE.replace("{name}", name))
    log = tmp_path / "log.jsonl"
    uid = uuid.uuid4().hex  # names the run's lock files
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
         "--dist", "loadfile", "--no-loadscope-reorder", f"--testrunuid={uid}", str(suite)],
        cwd=suite, env={**os.environ, "RUNNER_LOG": str(log)},
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    # every test passed, and the run failed on the warm-up's exit code alone
    assert proc.returncode == 1 and "16 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr
    assert "python -m datapipe.plan.warm failed (exit code 3)" in proc.stderr, proc.stderr
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    (warmed,) = [r for r in runs if r[0] == "warm"]
    runs.remove(warmed)
    assert all(r[1] >= warmed[2] for r in runs), "a test started before the warm-up had ended"
    assert len(runs) == 4 * (1 + 3 + 1) and len({r[3] for r in runs}) == 2  # both workers ran
    for name, start, end, _ in runs:
        if name.startswith("serial"):
            beside = [r[0] for r in runs if r[0] != name and r[1] < end and r[2] > start]
            assert not beside, (name, beside)
    for ext in (".gate", ".lock", ".warm"):  # the run's files, removed by the controller
        assert not os.path.exists(os.path.join(tempfile.gettempdir(), f"pytest-mixlen-{uid}{ext}"))
