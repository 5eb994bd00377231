"""Checkpoints: model and optimizer through torch.distributed.checkpoint (DCP), the rest as JSON,
in `<dir>/step-NNNNNNNN/`:

    .metadata, __R_0.distcp   DCP: model and optimizer (every rank writes its part)
    run.json                  step, rank count, schedule, data-stream position, the run's config
    rng-RRRRR.json            each rank's generators (torch, numpy, python; CUDA on GPUs)
    checksums.json            size and XXH3-64 of every file above; written last

Everything is written into `step-NNNNNNNN.tmp` and renamed once every rank has finished and
checksums.json is in place, so a `step-*` directory is complete; a save that fails (a full disk)
removes its temporary directory, leaves the earlier checkpoints as they were and stops the run.

Resuming verifies a checkpoint's files against checksums.json first (the ranks share the work)
and loads nothing pickled except DCP's own metadata classes (trainer.checkpoint.files). With
`checkpoint.resume = true`, or after torchrun restarted the job, a damaged newest checkpoint is
reported and the previous complete one is used; a checkpoint named explicitly is used or
refused. `Checkpointer` owns the policy: when to save, how many to keep, which checkpoint to
resume from, and refusing one of a run with other settings.

The DCP part is a `trainer.islands.cross.ModelState`: the weights, the sharded optimizer state as chunks
of global tensors at their offsets (so a checkpoint of N ranks resumes on any other number, at any
ZeRO level) and CO2's outer state. Every rank of every island takes part: the communicator given
here spans the whole run (its rank numbers the rng files).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from datapipe.errors import ConfigError, MixlenError, PeerError
from datapipe.stream import LengthAwareStream
from trainer.checkpoint.config import CheckpointConfig
from trainer.checkpoint.files import (
    CHECKPOINT_FORMAT,
    CHECKSUMS_FILE,
    SafePlanner,
    SafeReader,
    fsync_dir,
    read_checksums,
    read_json,
    verify_files,
    write_checksums,
    write_json,
)
from trainer.checkpoint.rng import capture_rng, restore_rng
from trainer.config.job import TrainerConfig
from trainer.config.resume import resume_conflicts
from trainer.hooks import Hooks
from trainer.logs import get_logger
from trainer.parallel.comm import Communicator, SoloComm
from trainer.parallel.runtime import job_id, restart_count

__all__ = [
    "Checkpointer",
    "check_run_matches",
    "complete_checkpoints",
    "latest_checkpoint",
    "load_checkpoint",
    "resume_candidates",
    "save_checkpoint",
    "step_dir",
]

_STEP_DIR = re.compile(r"^step-(\d{8})$")
RUN_FILE = "run.json"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def _steps(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for n in os.listdir(root) if (m := _STEP_DIR.match(n)))


def complete_checkpoints(root: str) -> list[str]:
    """Step directories under `root` that have their checksums.json, newest first (damage inside
    them is found by verification, not here)."""
    dirs = [step_dir(root, k) for k in reversed(_steps(root))]
    return [d for d in dirs if os.path.isfile(os.path.join(d, CHECKSUMS_FILE))]


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under `root`, or None."""
    found = complete_checkpoints(root)
    return found[0] if found else None


class StateOwner(Protocol):
    """What DCP saves of the model (trainer.islands.cross.ModelState): `state_dict()` returns the live
    tensors, which dcp.load fills in place before `load_state_dict` runs."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any]) -> None: ...


def _rng_file(rank: int) -> str:
    return f"rng-{rank:05d}.json"


def _any(comm: Communicator, flag: bool, device: torch.device) -> bool:
    """Collective: True if `flag` is set on any rank (also a barrier)."""
    if comm.size == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    comm.all_reduce(t)
    return bool(t.item() > 0)


def _describe(exc: BaseException) -> str:
    """One line for an exception, its root cause first (DCP wraps every rank's failure)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, first = next(iter(failures.items()))
        inner = first[0] if isinstance(first, tuple) else first
        return f"rank {rank}: {_describe(inner)}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename}" if exc.filename else "")
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def _short_write_cause(tmp: str, exc: BaseException) -> OSError | None:
    """The OS error behind a short write that torch's zip writer reports only as a position
    mismatch ("unexpected pos": a full disk or a file size limit): appending one byte to the
    files written so far (temporary, removed anyway) raises it again."""
    if "unexpected pos" not in str(exc) and "unexpected pos" not in _describe(exc):
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
def _quiet_dcp() -> Iterator[None]:
    """DCP warns when one process runs without a process group: intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def save_checkpoint(
    root: str,
    step: int,
    state: StateOwner,
    run: dict[str, Any],
    comm: Communicator,
    device: torch.device,
    keep: int = 2,
    before_commit: Callable[[], None] | None = None,
) -> str:
    """Write the checkpoint of `step` (collective); `run` is run.json's content. Keeps the newest
    `keep` up to `step`; checkpoints of later steps (an abandoned run this one resumed before)
    are removed, so `resume = true` continues this run. MixlenError if it cannot be written."""
    final = step_dir(root, step)
    tmp = final + ".tmp"
    rank = comm.rank
    group = getattr(comm, "group", None)

    def stop_if_failed(err: BaseException | None, shared: bool) -> None:
        """Collective: if a rank failed, remove the temporary directory and stop every rank
        (the failing one, or rank 0 for a failure every rank saw, says why)."""
        if not _any(comm, err is not None, device):
            return
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if err is None or (shared and rank != 0):
            raise PeerError(f"saving the checkpoint of step {step} failed on another rank")
        earlier = [k for k in _steps(root) if k < step]
        kept = f"step-{earlier[-1]:08d} is intact" if earlier else "there is no earlier one"
        raise MixlenError(
            f"checkpoint.dir {root}: saving the checkpoint of step {step} failed "
            f"({_describe(err)}); nothing of it was kept, {kept}. Free space (or fix the "
            "directory), then continue with checkpoint.resume = true"
        ) from None

    err: BaseException | None = None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as exc:
            err = exc
    stop_if_failed(err, shared=False)
    # model and optimizer (DCP, collective: a failure on one rank raises on all)
    try:
        with _quiet_dcp():
            dcp.save(state.state_dict(), checkpoint_id=tmp, process_group=group)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported below
        err = _short_write_cause(tmp, exc) or exc
    stop_if_failed(err, shared=True)
    # this rank's generators, rank 0 the run's state
    try:
        write_json(os.path.join(tmp, _rng_file(rank)), capture_rng(device))
        if rank == 0:
            info = {**run, "step": step, "world": comm.size, "job": job_id()}
            write_json(os.path.join(tmp, RUN_FILE), info)
    except OSError as exc:
        err = exc
    stop_if_failed(err, shared=False)
    if before_commit is not None:
        before_commit()
    _any(comm, False, device)  # every rank's files are written
    # rank 0: checksums last, rename into place, prune
    if rank == 0:
        try:
            write_checksums(tmp)
            if os.path.isdir(final):  # the same step again: the old copy goes after the rename
                os.replace(final, final + ".old")
            os.replace(tmp, final)
            fsync_dir(root)
        except OSError as exc:
            err = exc
    stop_if_failed(err, shared=False)
    if rank == 0:
        steps = _steps(root)
        kept = [k for k in steps if k <= step]
        for k in [k for k in steps if k > step] + kept[: max(len(kept) - keep, 0)]:
            shutil.rmtree(step_dir(root, k), ignore_errors=True)
        for name in os.listdir(root):  # temporaries of crashed saves, and the replaced copy
            if name.startswith("step-") and name.endswith((".tmp", ".old")):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    _any(comm, False, device)
    return final


def load_checkpoint(
    path: str,
    state: StateOwner,
    scheduler: Any,
    comm: Communicator,
    device: torch.device,
) -> dict[str, Any]:
    """Restore the model state, schedule and this rank's generators in place from the (verified)
    checkpoint `path` (collective); returns run.json's content."""
    run = read_json(os.path.join(path, RUN_FILE))
    sd = state.state_dict()
    group = getattr(comm, "group", None)
    with _quiet_dcp():
        dcp.load(sd, storage_reader=SafeReader(path), planner=SafePlanner(), process_group=group)
    state.load_state_dict(sd)
    if scheduler is not None:
        scheduler.load_state_dict(run["scheduler"])
        # the optimizer's learning rate is the schedule's, not the one it was built with
        for g, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
            g["lr"] = lr
    own = os.path.join(path, _rng_file(comm.rank))
    # a rank the saved run did not have (more ranks now) takes rank 0's generators
    restore_rng(read_json(own if os.path.isfile(own) else os.path.join(path, _rng_file(0))), device)
    return run


def resume_candidates(cfg: CheckpointConfig) -> tuple[list[str], bool]:
    """The checkpoints to try, newest first, and whether one was named explicitly (no fallback
    then): after a torchrun restart the newest complete ones this job wrote in checkpoint.dir;
    else (and before this job saved any) what `checkpoint.resume` names. ConfigError if it asks
    for one that is not there."""
    auto = complete_checkpoints(cfg.dir) if cfg.dir else []
    if restart_count() > 0:  # torchrun restarted us: continue what this job saved, if anything
        mine = [p for p in auto if _job_of(p) == job_id()]
        if mine:
            return mine, False
    if isinstance(cfg.resume, str):
        if not os.path.isdir(cfg.resume):
            raise ConfigError(f"checkpoint.resume: {cfg.resume!r} is not a directory")
        return [cfg.resume], True
    if cfg.resume is True:
        if not cfg.dir or not os.path.isdir(cfg.dir):
            raise ConfigError(
                f"checkpoint.resume = true, but checkpoint.dir {cfg.dir!r} does not exist "
                "(mistyped?); set checkpoint.resume = false to start a new run"
            )
        if not auto:
            names = sorted(os.listdir(cfg.dir))[:5]
            raise ConfigError(
                f"checkpoint.resume = true, but checkpoint.dir {cfg.dir!r} holds no complete "
                f"checkpoint (step-NNNNNNNN with {CHECKSUMS_FILE}; found: "
                f"{', '.join(names) or 'nothing'}); set checkpoint.resume = false to start "
                "a new run"
            )
        return auto, False
    return [], False


def _job_of(path: str) -> str | None:
    try:
        return read_json(os.path.join(path, RUN_FILE)).get("job")
    except (ValueError, AttributeError):
        return None


def check_run_matches(path: str, cfg: TrainerConfig, stream: LengthAwareStream) -> dict[str, Any]:
    """ConfigError if checkpoint `path` belongs to a run with other settings (naming the keys)
    or another dataset; returns its saved stream state."""
    try:
        saved = read_json(os.path.join(path, RUN_FILE))
        config, stream_state = saved["config"], saved["stream"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"checkpoint {path}: run.json is unusable ({exc})") from None
    conflicts = resume_conflicts(config, cfg)
    if conflicts:
        raise ConfigError(
            f"checkpoint.resume: {path} belongs to a run with other settings ("
            + "; ".join(conflicts)
            + "); resume with its settings, or start a new run (checkpoint.resume = false)"
        )
    if stream_state.get("lengths_digest") != stream.lengths_digest():
        raise ConfigError(
            f"checkpoint.resume: {path} was saved on another dataset (data.path "
            f"{config.get('data', {}).get('path')!r} then, {cfg.data.path!r} now: the sample "
            "lengths differ)"
        )
    return stream_state


class Checkpointer:
    """When to save, how many to keep, and resuming, for one run's model state, schedule and
    stream (collective: every rank of every island calls every method; `comm` spans the run)."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        run: TrainerConfig,
        state: StateOwner,
        scheduler: Any,
        comm: Communicator | None = None,
        device: torch.device | str = "cpu",
        hooks: Hooks | None = None,
    ) -> None:
        self.cfg, self.run = cfg, run
        self.state, self.scheduler = state, scheduler
        self.comm = comm if comm is not None else SoloComm()
        self.device = torch.device(device)
        self.hooks = hooks
        self.resumed = False  # set by resume(): this run continues a checkpoint
        self._run_dict = run.to_dict()

    @property
    def rank(self) -> int:
        return self.comm.rank

    def _say(self, msg: str, all_ranks: bool = False) -> None:
        """Log `msg` (trainer.logs): from every rank as a warning, else rank 0's information."""
        if all_ranks:
            get_logger("checkpoint").warning(msg)
        elif self.rank == 0:
            get_logger("checkpoint").info(msg)

    def candidates(self) -> tuple[list[str], bool]:
        """See `resume_candidates`; a torchrun restart without a checkpoint yet is reported."""
        paths, explicit = resume_candidates(self.cfg)
        if not paths and restart_count() > 0:
            self._say(f"restart {restart_count()}: no checkpoint yet; starting again from step 0")
        return paths, explicit

    def check(self, path: str) -> tuple[list[str], bool]:
        """Verify `path` against its checksums.json, this rank's share of the files; returns the
        problems found and whether every rank finds the same ones (then rank 0 reports them)."""
        try:
            files = read_checksums(path)
        except ValueError as exc:
            return [str(exc)], True
        missing = [n for n in (RUN_FILE, _rng_file(0), ".metadata") if n not in files]
        if missing:
            return [f"{', '.join(missing)} not listed in {CHECKSUMS_FILE}"], True
        return verify_files(path, files, self.rank, self.comm.size), False

    def resume(self, stream: LengthAwareStream) -> int:
        """Restore the checkpoint that `checkpoint.resume` (or a torchrun restart) asks for;
        returns the step to continue after (0: a fresh run)."""
        paths, explicit = self.candidates()
        for i, path in enumerate(paths):
            problems, shared = self.check(path)
            if not _any(self.comm, bool(problems), self.device):
                return self._load(path, stream)
            mine = problems if not shared or self.rank == 0 else []
            if explicit:
                if mine:
                    raise ConfigError(
                        f"checkpoint.resume: {path} is damaged ({'; '.join(mine)}); resume "
                        "from another checkpoint, or set checkpoint.resume = true for the newest "
                        "intact one"
                    )
                raise PeerError(f"checkpoint {path} is damaged (reported by another rank)")
            if mine:
                self._say(f"checkpoint {path} is damaged: {'; '.join(mine)}", all_ranks=True)
            if i + 1 < len(paths):
                self._say(f"resuming from the previous complete checkpoint {paths[i + 1]} instead")
        if not paths:
            return 0
        if self.rank == 0:
            raise ConfigError(
                f"checkpoint.dir {self.cfg.dir}: every checkpoint is damaged (see above); "
                "set checkpoint.resume = false to start a new run"
            )
        raise PeerError("no intact checkpoint (reported by rank 0)")

    def _load(self, path: str, stream: LengthAwareStream) -> int:
        """Load the verified checkpoint `path` after checking it belongs to this run."""
        stream_state = check_run_matches(path, self.run, stream)
        try:
            SafeReader(path).read_metadata()  # refused here, before DCP logs its own traceback
            run = load_checkpoint(path, self.state, self.scheduler, self.comm, self.device)
        except MixlenError:
            raise
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP cannot read it
            raise ConfigError(f"checkpoint {path}: cannot be loaded ({_describe(exc)})") from None
        # islands take one batch each per step, so one island's position is every island's
        stream.load_state_dict({**stream_state, "island": stream.island})
        self.resumed = True
        step = int(run["step"])
        world = int(run.get("world", self.comm.size))
        more = f" (saved by {world} ranks, now {self.comm.size})" if world != self.comm.size else ""
        self._say(f"resumed from {path} at step {step}{more}")
        return step

    def due(self, step: int, last: int) -> bool:
        """Is a checkpoint due after `step` (every `interval` steps and after the last)?"""
        if not self.cfg.dir:
            return False
        return bool(self.cfg.interval and step % self.cfg.interval == 0) or step == last

    def save(self, step: int, stream_state: dict[str, Any]) -> str:
        """Write the checkpoint of `step`; `stream_state` is the stream's state after it."""
        assert self.cfg.dir is not None
        hooks = self.hooks
        run = {
            "format": CHECKPOINT_FORMAT,
            "config": json.loads(json.dumps(self._run_dict)),
            "stream": stream_state,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
        }
        return save_checkpoint(
            self.cfg.dir,
            step,
            self.state,
            run,
            self.comm,
            self.device,
            keep=self.cfg.keep,
            before_commit=(lambda: hooks.point("save", step)) if hooks is not None else None,
        )
