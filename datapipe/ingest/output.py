"""Where `mixlen preprocess` writes: checks of `--out` before any work, one writer per output at a
time, and the final rename.

- `check_out_path`: `--out` must not sit under a file, be or hold the current directory, or
  overlap an input (equal to an input directory, inside one, or holding an input): `--overwrite`
  would delete the corpus, and a rerun would read its own output. `mixlen export` checks `--hf`
  with it against the checkpoint and the pretrained folder it reads.
- `OutputLock`: an exclusive `flock` on `.NAME.lock` next to `--out`, held for the whole run; a
  second run into the same `--out` fails at once naming the first one's process id. The kernel
  drops the lock when a process dies, so a killed run never blocks the next one.
- `commit`: renames the temporary directory into place, re-checking under the lock that nothing
  appeared at `--out` meanwhile (without `--overwrite`); an old output (directory or file) is
  moved aside and deleted only once the new one is in place.
- `clean_stale`: temporaries of killed runs are removed; an old output a killed run had moved
  aside but not yet replaced is put back.
- `SigtermAsInterrupt`: SIGTERM (a scheduler's stop) raises KeyboardInterrupt, so that the
  cleanup Ctrl-C runs also runs.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
from pathlib import Path

from datapipe.errors import InputError
from datapipe.files import dead_pid_paths, is_inside, take_flock

__all__ = [
    "OutputLock",
    "SigtermAsInterrupt",
    "check_out_path",
    "clean_stale",
    "commit",
    "partial_dir",
]


def check_out_path(
    out: Path,
    out_arg: str,
    inputs: list[str],
    flag: str = "--out",
    noun: str = "input",
    why: str = "--overwrite would delete it, and a rerun would read the output",
) -> None:
    """InputError naming `flag` if the output `out` lies under a file, is or holds the current
    directory, or overlaps one of `inputs` (equal to one, inside one, or holding one); `noun`
    names what the inputs are in the message, `why` what the overlap would do."""
    anc = out.parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if anc.exists() and not anc.is_dir():
        raise InputError(f"{flag} {out_arg}: {anc} is a file, not a directory")
    real_out = os.path.realpath(out)
    cwd = os.path.realpath(os.getcwd())
    if is_inside(cwd, real_out):
        where = "is" if cwd == real_out else "holds"
        raise InputError(
            f"{flag} {out_arg}: {where} the current directory ({cwd}); choose an output "
            "elsewhere (replacing it would pull the directory from under this shell)"
        )
    for item in inputs:
        real_in = os.path.realpath(item)
        if os.path.isdir(real_in) and is_inside(real_out, real_in):
            where = "is" if real_out == real_in else "is inside"
            raise InputError(
                f"{flag} {out_arg}: {where} the {noun} {item}; choose an output outside it ({why})"
            )
        if is_inside(real_in, real_out):
            raise InputError(
                f"{flag} {out_arg}: holds the {noun} {item}; choose an output that holds no "
                f"{noun} ({why})"
            )


def partial_dir(out: Path, tag: str = "") -> Path:
    """This process's temporary directory for `out` (`tag`: before the pid, e.g. the host)."""
    return out.parent / f".{out.name}.partial-{tag}{os.getpid()}"


def _dead_runs(parent: Path, prefix: str) -> list[Path]:
    return [Path(p) for p in dead_pid_paths(str(parent), prefix)]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def clean_stale(out: Path, warn, tag: str = "") -> None:
    """Remove killed runs' temporaries; put back an old output a killed run had moved aside
    (call with the lock held, or with `tag` naming this host: see partial_dir)."""
    for p in _dead_runs(out.parent, f".{out.name}.partial-{tag}"):
        shutil.rmtree(p, ignore_errors=True)
    for p in _dead_runs(out.parent, f".{out.name}.old-{tag}"):
        if not out.exists() and not out.is_symlink():
            os.rename(p, out)
            warn(f"restored {out} from {p.name} (a killed run had moved it aside)")
        else:
            _remove(p)


class OutputLock:
    """Exclusive lock on `.NAME.lock` next to `out` (see the module docstring)."""

    def __init__(self, out: Path, out_arg: str) -> None:
        self.path = out.parent / f".{out.name}.lock"
        self.out_arg = out_arg
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            holder = take_flock(fd, str(os.getpid()))
            if holder is not None:
                os.close(fd)
                raise InputError(
                    f"--out {self.out_arg}: another mixlen preprocess (pid {holder}) is writing "
                    "it; wait for it to finish or choose another --out"
                )
            # the holder before us may have unlinked the file after we opened it: retry then
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            try:
                os.unlink(self.path)  # while still holding it: see __enter__'s inode check
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None


def commit(tmp: Path, out: Path, out_arg: str, overwrite: bool) -> None:
    """Rename `tmp` to `out` (with the lock held); see the module docstring."""
    exists = out.exists() or out.is_symlink()
    if exists and not overwrite:
        raise InputError(
            f"--out {out_arg}: appeared while this run was writing (made by another program?); "
            "left as it is, nothing written; pass --overwrite to replace it"
        )
    if not exists:
        os.rename(tmp, out)
        return
    aside = out.parent / f".{out.name}.old-{os.getpid()}"
    os.rename(out, aside)
    os.rename(tmp, out)
    _remove(aside)


class SigtermAsInterrupt:
    """Turn SIGTERM into KeyboardInterrupt so the temporary directory is cleaned up."""

    def __enter__(self) -> None:
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._raise)

    @staticmethod
    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
