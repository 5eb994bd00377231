"""One job per `checkpoint.dir`: a lock file (`.mixlen-lock`) with the job id, host and pid, taken
by rank 0 before the run's first save and released when the run ends.

A lock of a dead process on this host is stale: it is taken over (and said so). A lock of a live
process, or of another host (whose processes cannot be checked from here), is refused naming that
job; a job restarted by torchrun (the same job id) takes its own lock back.
"""

from __future__ import annotations

import json
import os
import socket

from datapipe.errors import ConfigError
from datapipe.files import pid_alive
from trainer.parallel.runtime import job_id

__all__ = ["LOCK_FILE", "DirLock", "this_job"]

LOCK_FILE = ".mixlen-lock"


def this_job() -> str:
    """This job's id: torchrun's run id (the same across its restarts), else host:pid."""
    return job_id() or f"{socket.gethostname()}:{os.getpid()}"


class DirLock:
    """The lock of one checkpoint directory, held by this process once `acquire()` returned."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = os.path.join(root, LOCK_FILE)
        self.held = False
        self.took_over: dict | None = None  # the stale lock replaced, if any

    def _mine(self) -> dict:
        return {"job": this_job(), "host": socket.gethostname(), "pid": os.getpid()}

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
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._clear_if_stale(self._read(), mine)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(mine, f)
            self.held = True
            return
        raise ConfigError(f"checkpoint.dir {self.root}: cannot take the lock {self.path}")

    def _clear_if_stale(self, other: dict | None, mine: dict) -> None:
        """Remove a lock this job may take over (its own after a restart, or a dead local
        process's); ConfigError naming the holder otherwise."""
        if other is None:
            return  # released meanwhile
        same_host = other.get("host") == mine["host"]
        pid = other.get("pid")
        ours = other.get("job") == mine["job"] and other.get("job") != f"{mine['host']}:{pid}"
        dead = same_host and isinstance(pid, int) and not pid_alive(pid)
        if not (ours or dead or (same_host and pid == mine["pid"])):
            where = "on this host" if same_host else f"on host {other.get('host', '?')}"
            raise ConfigError(
                f"checkpoint.dir {self.root}: another job is using it (job "
                f"{other.get('job', '?')}, pid {pid} {where}; lock {self.path}); use another "
                "checkpoint.dir, or wait for that job to end (remove the lock file only if you "
                "know it is not running)"
            )
        self.took_over = other
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        if self.held:
            self.held = False
            if (self._read() or {}).get("pid") == os.getpid():
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
