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
import weakref
from collections.abc import Iterator

from datapipe.errors import InputError
from datapipe.files import open_lock_file

READERS_FILE = ".readers.lock"


class DatasetInUse(InputError):
    """`--overwrite` of a dataset that is being read."""


class ReadersLock:
    """This process's shared lock on a local dataset folder: `close` releases it, and so does
    the garbage collector for a reader dropped unclosed."""

    def __init__(self, root: str) -> None:
        self.fd: int | None = None
        self._closer: weakref.finalize | None = None
        path = os.path.join(root, READERS_FILE)
        for _ in range(5):  # a writer may replace the dataset while we wait for the lock
            fd = open_lock_file(path)
            if fd is None:
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a writer swaps the folders
            except OSError:  # no flock on this file system: unguarded
                os.close(fd)
                return
            if _same_file(path, fd):
                self.fd = fd
                self._closer = weakref.finalize(self, os.close, fd)
                return
            os.close(fd)

    def close(self) -> None:
        if self._closer is not None:
            self._closer()  # closes the fd once
        self.fd = self._closer = None

    def __getstate__(self) -> dict:  # a copy in another process holds nothing
        return {"fd": None, "_closer": None}


def _same_file(path: str, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _holders(fd: int) -> list[str]:
    """Process ids holding a flock on `fd`'s file (Linux's /proc/locks; else empty; NFS lists
    its emulated flocks as POSIX locks, so none there)."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    with contextlib.suppress(OSError):
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == ident:
                    pids.append(parts[4])
    return sorted(set(pids), key=int)


@contextlib.contextmanager
def no_readers(out: str, out_arg: str, make: bool = True) -> Iterator[None]:
    """Hold the lock of the dataset at `out` alone while the body runs (replacing it), or raise
    DatasetInUse naming `--out` and the processes reading it. The lock file is made if missing
    (`make`), so that a reader opening the dataset meanwhile waits; without it (`make` False:
    a check that must not touch the folder), or on a file system without `flock`, the body
    runs unguarded."""
    if not os.path.isdir(out):
        yield
        return
    # made if missing, so that a reader opening it now waits for us; read-write where we may
    # (NFS's emulated flock takes an exclusive lock on a writable descriptor only)
    path = os.path.join(out, READERS_FILE)
    fd = open_lock_file(path, os.O_RDWR) if make or os.path.exists(path) else None
    if fd is None:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pids, mine = _holders(fd), str(os.getpid())
            parts = [f"pid {', '.join(p for p in pids if p != mine)}"] if set(pids) - {mine} else []
            if mine in pids:
                parts.append(f"this process, pid {mine}: a reader of it not closed?")
            who = f" ({'; '.join(parts)})" if parts else ""
            raise DatasetInUse(
                f"--out {out_arg}: the dataset there is being read{who}, by a training or "
                "another mixlen reader; --overwrite would delete its shards under it: wait for "
                "it to finish, or write to another --out"
            ) from None
        except OSError:  # no flock here
            pass
        yield
    finally:
        os.close(fd)
