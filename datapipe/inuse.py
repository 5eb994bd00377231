"""A local dataset in use: its readers hold a shared `flock` on `.readers.lock` inside it, and
`mixlen preprocess --overwrite` refuses to replace a dataset whose lock it cannot take alone.

- A reader (datapipe.fetch's Fetcher, for its whole life: shards are opened as they are needed)
  takes the shared lock before it reads the index, making the file if the folder is writable; a
  folder it cannot write and that has no lock file is read unguarded, and so is one on a file
  system without `flock` (the lock is advice between mixlen's own processes). Forked workers
  share their parent's lock; the kernel drops it when the last of them exits or is killed.
- The writer checks before any tokenizing (fail fast), then takes the lock alone for the swap
  itself: a reader opening the dataset at that moment waits the few milliseconds of the renames,
  then finds the lock file replaced and reads the new dataset.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

from datapipe.errors import InputError

READERS_FILE = ".readers.lock"


class ReadersLock:
    """This process's shared lock on a local dataset folder (`close` releases it)."""

    def __init__(self, root: str) -> None:
        self.fd: int | None = None
        path = os.path.join(root, READERS_FILE)
        for _ in range(5):  # a writer may replace the dataset while we wait for the lock
            fd = _open(path, os.O_RDONLY)
            if fd is None:
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a writer swaps the folders
            except OSError:  # no flock on this file system: unguarded
                os.close(fd)
                return
            if _same_file(path, fd):
                self.fd = fd
                return
            os.close(fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _open(path: str, mode: int) -> int | None:
    try:
        return os.open(path, mode | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        try:  # a folder this user cannot write: its lock file, if the owner's run made one
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None


def _same_file(path: str, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _holders(fd: int) -> list[str]:
    """Process ids holding a lock on `fd`'s file (Linux's /proc/locks; else empty)."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    with contextlib.suppress(OSError):
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == ident:
                    pids.append(parts[4])
    return sorted(set(pids) - {str(os.getpid())}, key=int)


@contextlib.contextmanager
def no_readers(out: str, out_arg: str) -> Iterator[None]:
    """Hold the lock of the dataset at `out` alone while the body runs (replacing it), or raise
    InputError naming `--out` and the processes reading it. A folder without the lock file (no
    mixlen reader ever opened it) or a file system without `flock`: the body runs unguarded."""
    path = os.path.join(out, READERS_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pids = _holders(fd)
            who = f" (pid {', '.join(pids)})" if pids else ""
            raise InputError(
                f"--out {out_arg}: the dataset there is being read{who}, by a training or "
                "another mixlen command; --overwrite would delete its shards under it: wait for "
                "it to finish, or write to another --out"
            ) from None
        except OSError:  # no flock here
            pass
        yield
    finally:
        os.close(fd)
