"""A full disk (or a quota, a file size limit, a read-only file system) met by a command: exit 2
naming the file, never a traceback; nothing half-written left beside what was there."""

from __future__ import annotations

import errno
import os

import pytest

from tools.cli import main as cli_main


def test_a_full_disk_is_named_not_a_traceback(tmp_path, capsys, monkeypatch) -> None:
    """Exit 2 naming the file (before: a traceback, exit 1); another OSError stays a traceback
    (a bug, not the user's disk). `--plot` that cannot be written leaves the old plot and no
    half-written temporary beside it (before: `p.png.tmp-PID` stayed)."""
    import tools.cmd_simulate

    real = tools.cmd_simulate.run
    for code, text in ((errno.ENOSPC, "No space left on device"), (errno.EROFS, "Read-only")):

        def full(args, code=code, text=text) -> int:
            raise OSError(code, text, str(tmp_path / "s.html"))

        monkeypatch.setattr(tools.cmd_simulate, "run", full)
        assert cli_main(["simulate"]) == 2
        err = capsys.readouterr().err
        assert err == f"mixlen simulate: error: cannot write {tmp_path / 's.html'}: {text}\n"
    monkeypatch.setattr(tools.cmd_simulate, "run", lambda args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cli_main(["simulate"])
    monkeypatch.setattr(tools.cmd_simulate, "run", real)
    png = tmp_path / "p.png"
    png.write_bytes(b"old")
    replace = os.replace

    def no_room(src, dst):
        if str(dst) == str(png):
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", no_room)
    argv = ["simulate", "--ranks", "2", "--capacity", "4096", "--context", "8192",
            "--global-batch-tokens", "16384", "--steps", "1", "--plot", str(png)]  # fmt: skip
    assert cli_main(argv) == 2
    assert f"cannot write {png}: No space left on device" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["p.png"] and png.read_bytes() == b"old"


_KERNELS = """
from datapipe.jit import njit

@njit(cache=True)
def twice(x):
    return 2 * x

@njit(cache=True)
def square(x):
    return x * x
"""


def test_a_numba_cache_that_cannot_be_written_is_warned_of_once(tmp_path, capsys, monkeypatch):
    """mixlen's numba kernels keep a cache on disk: on a full disk (or a quota, a read-only
    folder) the first compile warned nothing and stopped the command with `cannot write No space
    left on device` naming no file (a traceback in a rank). Now the kernels run, compiled in
    memory, and one warning per process names the cache's folder; another OSError is raised."""
    import importlib.util

    from numba.core import caching

    import datapipe.jit

    path = tmp_path / "kernels_on_full_disk.py"
    path.write_text(_KERNELS)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    code = errno.ENOSPC

    def full(self, key, data) -> None:
        raise OSError(code, os.strerror(code), str(tmp_path / "__pycache__" / "x.nbi"))

    monkeypatch.setattr(caching.IndexDataCacheFile, "save", full)
    monkeypatch.setattr(datapipe.jit, "_warned", False)
    assert mod.twice(21) == 42 and mod.square(5) == 25 and mod.twice(1.5) == 3.0
    err = capsys.readouterr().err
    assert err.count("warning: numba's kernel cache in ") == 1, err
    where = mod.twice._cache._cache_path  # __pycache__ beside it, or under NUMBA_CACHE_DIR
    assert f"{where} could not be written (No space left on device)" in err
    assert not [n for n in os.listdir(where) if n.startswith(path.stem) and n.endswith(".nbi")]
    code = errno.EIO  # not the disk's room: a fault to see
    with pytest.raises(OSError, match="Input/output error"):
        mod.square(2.5)


_CALLEE = """
from datapipe.jit import njit

@njit(cache=True)
def step(x):
    return x + {inc}
"""
_CALLER = """
from datapipe.jit import njit
from callee import step

@njit(cache=True)
def twice_step(x):
    return 2 * step(x)
"""
_RUN = """
import sys
import datapipe.jit
datapipe.jit._PACKAGE = sys.argv[1]  # the temporary folder stands for the package
sys.path.insert(0, sys.argv[1])
from caller import twice_step
print(twice_step(1), sum(twice_step.stats.cache_hits.values()))
"""


def test_a_kernel_recompiles_when_a_kernel_it_calls_changes_in_another_file(tmp_path) -> None:
    """numba keys a kernel's cache on its own file: a caller whose file did not change kept the
    compiled code of a callee edited in another file (a bug planted there went unseen by a test
    run on a warm cache). The cache is now kept for every kernel module's source: the caller is
    compiled again, and read from the cache once nothing changed."""
    import subprocess
    import sys

    from conftest import ROOT

    (tmp_path / "caller.py").write_text(_CALLER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(tmp_path / "cache")}

    def run() -> list[str]:
        cmd = [sys.executable, "-c", _RUN, str(tmp_path)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()

    (tmp_path / "callee.py").write_text(_CALLEE.format(inc=1))
    assert run() == ["4", "0"]  # compiled
    assert run() == ["4", "1"]  # read from the cache
    (tmp_path / "callee.py").write_text(_CALLEE.format(inc=2))
    assert run() == ["6", "0"]  # 2 x (1 + 2), compiled again (numba's own rule: 4, cached)
    assert run() == ["6", "1"]


def test_a_numba_without_the_patched_internals_keeps_its_own_rules() -> None:
    """On a numba whose caching module lacks the two internals datapipe.jit patches, importing it
    patches nothing and its kernels still compile and run (numba's own cache rules)."""
    import subprocess
    import sys

    from conftest import ROOT

    code = (
        "from numba.core import caching\n"
        "del caching._SourceFileBackedLocatorMixin\n"
        "before = caching.Cache.save_overload\n"
        "from datapipe.jit import njit\n"
        "assert caching.Cache.save_overload is before\n"
        "print(njit(lambda x: 2 * x)(21))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=100)  # fmt: skip
    assert done.returncode == 0 and done.stdout.split() == ["42"], done.stderr[-2000:]
