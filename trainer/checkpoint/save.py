"""A checkpoint directory's layout (`<dir>/step-NNNNNNNN/`, complete once its checksums.json is
there) and saving one: every rank's part through DCP into a temporary directory, the JSON files,
checksums last, one rename; a failure on any rank stops every rank, keeps nothing of the failed
checkpoint and says why (trainer.checkpoint.checkpointer has the policy: when, what, resume)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from datapipe.errors import MixlenError, PeerError
from datapipe.files import FULL_ERRNOS
from trainer.checkpoint.files import CHECKSUMS_FILE, fsync_dir, write_checksums, write_json
from trainer.checkpoint.rng import capture_rng
from trainer.hooks import Interrupted
from trainer.parallel.comm import Communicator
from trainer.parallel.runtime import job_id

__all__ = [
    "RUN_FILE",
    "StateOwner",
    "any_rank",
    "complete_checkpoints",
    "describe",
    "latest_checkpoint",
    "list_steps",
    "quiet_dcp",
    "rng_file",
    "save_checkpoint",
    "step_dir",
]

_STEP_DIR = re.compile(r"^step-(\d{8})$")
RUN_FILE = "run.json"


def step_dir(root: str, step: int) -> str:
    """The directory of the checkpoint of `step`."""
    return os.path.join(root, f"step-{step:08d}")


def list_steps(root: str) -> list[int]:
    """The steps of the `step-NNNNNNNN` directories under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for n in os.listdir(root) if (m := _STEP_DIR.match(n)))


def complete_checkpoints(root: str) -> list[str]:
    """Step directories under `root` that have their checksums.json, newest first (damage inside
    them is found by verification, not here)."""
    dirs = [step_dir(root, k) for k in reversed(list_steps(root))]
    return [d for d in dirs if os.path.isfile(os.path.join(d, CHECKSUMS_FILE))]


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under `root`, or None."""
    found = complete_checkpoints(root)
    return found[0] if found else None


class StateOwner(Protocol):
    """What DCP saves of the model (trainer.checkpoint.state.ModelState): `state_dict()` returns the live
    tensors, which dcp.load fills in place before `load_state_dict` runs."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any]) -> None: ...


def rng_file(rank: int) -> str:
    """The file of rank `rank`'s generator states."""
    return f"rng-{rank:05d}.json"


def any_rank(comm: Communicator, flag: bool, device: torch.device) -> bool:
    """Collective: True if `flag` is set on any rank (also a barrier)."""
    if comm.size == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    comm.all_reduce(t)
    return bool(t.item() > 0)


def describe(exc: BaseException) -> str:
    """One line for an exception, its root cause first (DCP wraps every rank's failure)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, first = next(iter(failures.items()))
        inner = first[0] if isinstance(first, tuple) else first
        return f"rank {rank}: {describe(inner)}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename}" if exc.filename else "")
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def _short_write_cause(tmp: str, exc: BaseException) -> OSError | None:
    """The OS error behind a short write that torch's zip writer reports only as a position
    mismatch ("unexpected pos": a full disk or a file size limit): appending one byte to the
    files written so far (temporary, removed anyway) raises it again."""
    if "unexpected pos" not in str(exc) and "unexpected pos" not in describe(exc):
        return None
    for name in sorted(os.listdir(tmp)) if os.path.isdir(tmp) else []:
        try:
            with open(os.path.join(tmp, name), "ab") as f:
                f.write(b"\0")
                f.flush()
                os.fsync(f.fileno())
        except OSError as cause:
            return cause
    return None


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    """DCP warns when one process runs without a process group: intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


class _SaveFailure:
    """Stops every rank together when one fails to save, with one message that names the cause
    and only this run's own checkpoints as intact."""

    def __init__(
        self, comm: Communicator, device: torch.device, root: str, step: int, ours: list[int]
    ) -> None:
        self.comm, self.device, self.root, self.step = comm, device, root, step
        self.tmp = step_dir(root, step) + ".tmp"
        self.ours = ours

    def check(self, err: BaseException | None, shared: bool) -> None:
        """Collective: if a rank failed, remove the temporary directory and stop every rank
        (the failing one, or rank 0 for a failure every rank saw, says why)."""
        if not any_rank(self.comm, err is not None, self.device):
            return
        stop = _root(err, Interrupted)
        if isinstance(stop, Interrupted):  # a signal, which DCP wrapped: not a failure
            raise Interrupted(stop.signum) from None  # (save_checkpoint cleans up)
        if self.comm.rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if err is None or (shared and self.comm.rank != 0):
            raise PeerError(f"saving the checkpoint of step {self.step} failed on another rank")
        intact = [k for k in self.ours if k < self.step and k in list_steps(self.root)]
        kept = (
            f"step-{intact[-1]:08d} of this run is intact"
            if intact
            else "this run has no earlier checkpoint"
        )
        cause = _root(err, OSError)
        disk = isinstance(cause, OSError) and cause.errno in FULL_ERRNOS
        fix = "Free space (or raise the file size limit)" if disk else "Fix the cause"
        raise MixlenError(
            f"checkpoint.dir {self.root}: saving the checkpoint of step {self.step} failed "
            f"({describe(err)}); nothing of it was kept, {kept}. {fix}, then continue with "
            "checkpoint.resume = true"
        ) from None


def _root(exc: BaseException | None, kind: type[BaseException]) -> BaseException | None:
    """The exception of type `kind` behind `exc` (DCP wraps every rank's failure), if any."""
    if exc is None:
        return None
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return _root(first[0] if isinstance(first, tuple) else first, kind)
    if isinstance(exc, kind):
        return exc
    return _root(exc.__cause__ or exc.__context__, kind)


def save_checkpoint(
    root: str,
    step: int,
    state: StateOwner,
    run: dict[str, Any],
    comm: Communicator,
    device: torch.device,
    keep: int = 2,
    before_commit: Callable[[], None] | None = None,
    ours: list[int] | None = None,
) -> str:
    """Write the checkpoint of `step` (collective); `run` is run.json's content. Keeps the newest
    `keep` up to `step`; checkpoints of later steps (an abandoned run this one resumed before)
    are removed, so `resume = true` continues this run. `ours`: the steps of this run's own
    checkpoints (what a failure may call intact), `step` appended once it is complete, also when
    a signal (Interrupted) arrives after the rename. MixlenError if it cannot be written; on a
    signal before the rename nothing of it is kept."""
    ours = ours if ours is not None else []
    begun: list[bool] = []  # rank 0: the temporary directory was made (so `final` is this save's)
    try:
        final = _save(root, step, state, run, comm, device, keep, before_commit, ours, begun)
    except Interrupted:
        if comm.rank == 0 and _committed(root, step, bool(begun)):
            ours.append(step)
        raise
    ours.append(step)
    return final


def _committed(root: str, step: int, begun: bool) -> bool:
    """After a signal during the save of `step` (rank 0): was it renamed into place complete?
    If not, its temporary directory is removed and a copy it was replacing put back."""
    final = step_dir(root, step)
    for name in os.listdir(root) if os.path.isdir(root) else []:  # removals it cut short
        if name.startswith("step-") and name.endswith(".del"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    if begun and not os.path.isdir(final + ".tmp"):
        done = os.path.isfile(os.path.join(final, CHECKSUMS_FILE))
        if done:  # the copy it replaced is no longer needed
            shutil.rmtree(final + ".old", ignore_errors=True)
        return done
    shutil.rmtree(final + ".tmp", ignore_errors=True)
    if not os.path.isdir(final) and os.path.isdir(final + ".old"):
        os.replace(final + ".old", final)
    return False


def _save(
    root: str,
    step: int,
    state: StateOwner,
    run: dict[str, Any],
    comm: Communicator,
    device: torch.device,
    keep: int,
    before_commit: Callable[[], None] | None,
    ours: list[int],
    begun: list[bool],
) -> str:
    """save_checkpoint's steps; `begun` gets True once rank 0 made the temporary directory."""
    final = step_dir(root, step)
    fail = _SaveFailure(comm, device, root, step, ours)
    tmp, rank, group = fail.tmp, comm.rank, getattr(comm, "group", None)
    err: BaseException | None = None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            begun.append(True)
        except OSError as exc:
            err = exc
    fail.check(err, shared=False)
    # model and optimizer (DCP, collective: a failure on one rank raises on all)
    try:
        with quiet_dcp():
            dcp.save(state.state_dict(), checkpoint_id=tmp, process_group=group)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported below
        err = _short_write_cause(tmp, exc) or exc
    fail.check(err, shared=True)
    # this rank's generators, rank 0 the run's state
    try:
        write_json(os.path.join(tmp, rng_file(rank)), capture_rng(device))
        if rank == 0:
            info = {**run, "step": step, "world": comm.size, "job": job_id()}
            write_json(os.path.join(tmp, RUN_FILE), info)
    except OSError as exc:
        err = exc
    fail.check(err, shared=False)
    if before_commit is not None:
        before_commit()
    any_rank(comm, False, device)  # every rank's files are written
    # rank 0: checksums last, rename into place, prune
    if rank == 0:
        try:
            write_checksums(tmp)
            if os.path.isdir(final):  # the same step again: the old copy goes after the rename
                shutil.rmtree(final + ".old", ignore_errors=True)  # a cut-short save's leftover
                os.replace(final, final + ".old")
            os.replace(tmp, final)
            fsync_dir(root)
        except OSError as exc:
            err = exc
    fail.check(err, shared=False)
    if rank == 0:
        _prune(root, step, keep)
    any_rank(comm, False, device)
    return final


def _prune(root: str, step: int, keep: int) -> None:
    """Keep the newest `keep` checkpoints up to `step`; remove later ones, the temporaries of
    crashed saves and a replaced copy."""
    steps = list_steps(root)
    kept = [k for k in steps if k <= step]
    for k in [k for k in steps if k > step] + kept[: max(len(kept) - keep, 0)]:
        gone = step_dir(root, k) + ".del"  # renamed first: a removal cut short (a signal)
        shutil.rmtree(gone, ignore_errors=True)  # never leaves a complete-looking half
        try:
            os.replace(step_dir(root, k), gone)
        except OSError:
            gone = step_dir(root, k)
        shutil.rmtree(gone, ignore_errors=True)
    for name in os.listdir(root):
        if name.startswith("step-") and name.endswith((".tmp", ".old", ".del")):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
