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
