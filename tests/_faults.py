"""Fault injection helpers shared by the tests/test_faults_*.py files."""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """A full disk, as far as this process is concerned: no file it writes may grow beyond
    `nbytes` (RLIMIT_FSIZE; SIGXFSZ ignored so the write fails with EFBIG instead of killing)."""
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


def flip_byte(path: str | Path, offset: int | None = None) -> None:
    """Invert one byte of a file (the middle one by default)."""
    size = os.path.getsize(path)
    at = size // 2 if offset is None else offset
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def truncate(path: str | Path, keep: float = 0.5) -> None:
    """Cut a file to a fraction of its size."""
    os.truncate(path, int(os.path.getsize(path) * keep))


def tree_digest(root: str | Path) -> dict[str, str]:
    """sha256 of every file under `root` by relative path (to show a directory is untouched)."""
    root = Path(root)
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def dead_pid() -> int:
    """The id of a process that has exited (for stale lock and temporary names)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def cli_error(argv: list[str], capsys) -> str:
    """`mixlen ARGV` in this process: exit 2, one error message, no traceback; the message."""
    from tools.cli import main as cli_main

    rc = cli_main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("error:") == 1 and "Traceback" not in err, err[-2000:]
    return err


class Payload:
    """What a hostile checkpoint would carry: unpickling it creates the file it names."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
