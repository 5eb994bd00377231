"""One job per `checkpoint.dir`: a lock file (`.mixlen-lock`) with the job id, host, pid, the
process's start time, PID namespace and boot id, taken by rank 0 before the run's first save and
released when the run ends. It is written whole to a temporary file and hard-linked into place (a
reader never sees it half-written, a crash never leaves an empty one), and starters judge and
replace a lock one at a time (`flock` on the directory).

Who may take a lock that is there:
- on this host (the same host name, PID namespace and boot), a lock whose process is running
  (the pid alive with the recorded start time) is never taken, whatever its job id says: a
  torchrun restart stops the old workers before it starts the new ones, so a live holder is
  another job (or one launched with the same `--rdzv-id`);
- on this host, a lock whose process is gone (or whose pid now belongs to a later process) is
  stale: it is taken over and said so;
- on another host, or in another PID namespace or boot of one (whose processes cannot be checked
  from here), only the same job takes it back: a torchrun restart that moved rank 0, recognised
  by the same real run id. torchrun's `--rdzv-id` defaults to "none" for every job, so "none"
  (or no id) identifies nothing: such a job's lock names host:pid, and such a lock is refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import socket
import time
from collections.abc import Iterator
from typing import NoReturn

from datapipe.errors import ConfigError
from datapipe.files import pid_alive
from trainer.parallel.runtime import job_id

__all__ = ["LOCK_FILE", "DirLock", "this_job"]

LOCK_FILE = ".mixlen-lock"
STALE_TMP_S = 3600.0  # a lock's temporary file older than this was left by a killed starter


def this_job() -> str:
    """This job's id: torchrun's real run id (the same across its restarts), else host:pid."""
    return job_id() or f"{socket.gethostname()}:{os.getpid()}"


def started(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat field 22); None where
    unknown (no /proc, or no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name may hold spaces and ")"
        return int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def namespace_ids() -> dict[str, str | None]:
    """This process's PID namespace (/proc/self/ns/pid) and the kernel's boot id: pids and start
    times are comparable only between processes that share both (None where unknown)."""
    try:
        pidns: str | None = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {"pidns": pidns, "boot": _read_text("/proc/sys/kernel/random/boot_id")}


def same_host(other: dict, mine: dict) -> bool:
    """Was lock `other` written where this process (`mine`) can check its pid: the same host name
    and, where both recorded them, the same PID namespace and boot?"""
    if other.get("host") != mine["host"]:
        return False
    return all(
        other.get(k) is None or mine.get(k) is None or other.get(k) == mine.get(k)
        for k in ("pidns", "boot")
    )


def running(pid: int, start: object) -> bool:
    """Is the process that wrote a lock (`pid`, started at `start`) still running on this host?
    A live pid with another start time is a later process that reused the id."""
    if not pid_alive(pid):
        return False
    now = started(pid)
    return not (isinstance(start, int) and now is not None and now != start)


class DirLock:
    """The lock of one checkpoint directory, held by this process once `acquire()` returned."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = os.path.join(root, LOCK_FILE)
        self.held = False
        self.took_over: dict | None = None  # the lock replaced, if it was another process's
        self.reason = ""  # why it could be taken over

    def _mine(self) -> dict:
        pid = os.getpid()
        return {
            "job": this_job(),
            "host": socket.gethostname(),
            "pid": pid,
            "started": started(pid),
            **namespace_ids(),
        }

    def _read(self) -> dict | None:
        try:
            with open(self.path) as f:
                d = json.load(f)
            return d if isinstance(d, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable: treated as another job's (never silently taken)

    def acquire(self) -> None:
        """Take the lock, or raise ConfigError naming the job that holds it."""
        os.makedirs(self.root, exist_ok=True)
        mine = self._mine()
        tmp = f"{self.path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            with open(tmp, "w") as f:  # whole before it is linked into place
                json.dump(mine, f)
                f.flush()
                os.fsync(f.fileno())
            with self._guard():
                for _ in range(3):
                    if self._create(tmp):
                        self.held = True
                        self._sweep_temps()
                        return
                    self._clear_if_stale(self._read(), mine)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise ConfigError(f"checkpoint.dir {self.root}: cannot take the lock {self.path}")

    def _sweep_temps(self) -> None:
        """Remove lock temporary files (`.mixlen-lock.PID.HEX.tmp`) older than STALE_TMP_S: a
        starter killed between writing one and removing it (kill -9) leaves it behind."""
        now = time.time()
        for name in os.listdir(self.root):
            if name.startswith(LOCK_FILE + ".") and name.endswith(".tmp"):
                path = os.path.join(self.root, name)
                with contextlib.suppress(FileNotFoundError):
                    if now - os.stat(path).st_mtime > STALE_TMP_S:
                        os.unlink(path)

    def _create(self, tmp: str) -> bool:
        """Put the written lock `tmp` in place unless a lock is there (False then)."""
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError as exc:  # no hard links on this file system: create, then write
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with open(tmp) as src, os.fdopen(fd, "w") as f:
            f.write(src.read())
        return True

    @contextlib.contextmanager
    def _guard(self, wait: float = 30.0) -> Iterator[None]:
        """One starter at a time judges, removes and replaces the lock: `flock` on the directory
        (unguarded where the file system has none); ConfigError after `wait` seconds."""
        fd = os.open(self.root, os.O_RDONLY)
        try:
            deadline = time.monotonic() + wait
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise ConfigError(
                            f"checkpoint.dir {self.root}: another process kept its lock "
                            f"{self.path} busy for {wait:.0f} s"
                        ) from None
                    time.sleep(0.05)
                except OSError:
                    break  # no flock here (some network file systems)
            yield
        finally:
            os.close(fd)  # releases the flock

    def _why_free(self, other: dict, mine: dict) -> str | None:
        """Why this process may take `other`'s lock ("" for its own), or None: it may not."""
        pid = other.get("pid")
        if type(pid) is not int:
            return None
        if same_host(other, mine):
            start = other.get("started")
            if pid == mine["pid"] and (not isinstance(start, int) or start == mine["started"]):
                return ""
            if running(pid, start):
                return None
            same = job_id() is not None and other.get("job") == job_id()
            return "no longer running" + (": this job, restarted" if same else "")
        if job_id() is not None and other.get("job") == job_id():
            return f"on host {other.get('host')}: this job, restarted with the same torchrun run id"
        return None

    def check_free(self) -> None:
        """ConfigError naming the job that holds the lock if this process could not take it over;
        changes nothing (a check before reading the directory's checkpoints)."""
        other, mine = self._read(), self._mine()
        if other is not None and self._why_free(other, mine) is None:
            self._refuse(other, mine)

    def _clear_if_stale(self, other: dict | None, mine: dict) -> None:
        """Remove a lock this process may take over; ConfigError naming the holder otherwise."""
        if other is None:
            return  # released meanwhile
        why = self._why_free(other, mine)
        if why is None:
            self._refuse(other, mine)
        if why:
            self.took_over, self.reason = other, why
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _refuse(self, other: dict, mine: dict) -> NoReturn:
        """ConfigError naming the job holding the lock, where it runs, and what to do."""
        here = same_host(other, mine)
        where = "on this host" if here else f"on host {other.get('host', '?')}"
        if not here and other.get("host") == mine["host"]:
            where += " (in another PID namespace or boot)"
        hint = ""
        if not here:
            hint = (
                "; a job restarted on another host is recognised only by its torchrun run "
                'id (--rdzv-id other than "none")'
            )
        raise ConfigError(
            f"checkpoint.dir {self.root}: another job is using it (job "
            f"{other.get('job', '?')}, pid {other.get('pid')} {where}; lock {self.path}); use "
            "another checkpoint.dir, or wait for that job to end (remove the lock file only if "
            f"you know it is not running){hint}"
        )

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        if self.held:
            self.held = False
            if (self._read() or {}).get("pid") == os.getpid():
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
