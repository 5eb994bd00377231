"""How a rank leaves (trainer.parallel.procexit, comm.spawn): atexit handlers run and buffered
output is flushed before os._exit skips interpreter finalization; a spawned worker's error still
reaches the parent with its message, and a worker that returns exits 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_exit_now_runs_atexit_and_flushes_then_skips_finalization(tmp_path) -> None:
    marker = tmp_path / "finalized"
    code = (
        "import atexit, sys\n"
        "from trainer.parallel.procexit import exit_now\n"
        "atexit.register(lambda: print('-atexit', end=''))\n"
        "class Late:\n"
        f"    def __del__(self): open({str(marker)!r}, 'w').close()\n"
        "keep = Late()  # a module global: finalized only by interpreter teardown\n"
        "print('buffered', end='')\n"
        "sys.stderr.write('err')\n"
        "exit_now(3)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3
    assert proc.stdout == "buffered-atexit" and proc.stderr == "err"
    assert not marker.exists()  # teardown (where gloo can abort) did not run


def _ok(rank: int, path: str) -> None:
    with open(f"{path}.{rank}", "w") as f:
        f.write("done")


def _fails(rank: int, path: str) -> None:
    raise ValueError(f"rank {rank} refuses")


@pytest.mark.slow
def test_spawned_workers_exit_zero_or_report_their_error(tmp_path) -> None:
    import torch.multiprocessing as mp

    from trainer.parallel.comm import spawn

    spawn(_ok, 2, (str(tmp_path / "out"),), timeout=60)
    assert [(tmp_path / f"out.{r}").read_text() for r in range(2)] == ["done", "done"]
    with pytest.raises(mp.ProcessRaisedException, match="rank 0 refuses|rank 1 refuses"):
        spawn(_fails, 2, (str(tmp_path / "x"),), timeout=60)


def _env_and_cwd(rank: int, path: str, name: str) -> None:
    with open(f"{path}.{rank}", "w") as f:
        f.write(f"{os.environ.get(name)}|{os.getcwd()}|{sys.path[0]}")


@pytest.mark.slow
def test_spawned_workers_see_the_parent_as_it_is_at_spawn(tmp_path, monkeypatch) -> None:
    """comm.spawn forks its workers from a server started at the first spawn (its modules
    imported once): a later worker still gets the parent's environment, working directory and
    sys.path of the moment it is spawned, as a freshly started interpreter would."""
    from trainer.parallel.comm import spawn

    name = "MIXLEN_TEST_SPAWN_ENV"
    monkeypatch.delenv(name, raising=False)
    spawn(_env_and_cwd, 1, (str(tmp_path / "first"), name), timeout=60)  # the server runs now
    assert (tmp_path / "first.0").read_text().split("|")[0] == "None"
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.setenv(name, "set after the server started")
    monkeypatch.chdir(here)
    monkeypatch.syspath_prepend(str(here))
    spawn(_env_and_cwd, 2, (str(tmp_path / "later"), name), timeout=60)
    for r in range(2):
        env, cwd, first = (tmp_path / f"later.{r}").read_text().split("|")
        assert (env, cwd, first) == ("set after the server started", str(here), str(here))
