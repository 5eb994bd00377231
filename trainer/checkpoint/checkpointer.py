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
resume from, refusing one of a run with other settings, and one job per directory
(trainer.checkpoint.lock). Saving: trainer.checkpoint.save.

The DCP part is a `trainer.checkpoint.state.ModelState`: the weights, the sharded optimizer state as chunks
of global tensors at their offsets (so a checkpoint of N ranks resumes on any other number, at any
ZeRO level) and CO2's outer state. Every rank of every island takes part: the communicator given
here spans the whole run (its rank numbers the rng files).
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from datapipe.errors import ConfigError, MixlenError, PeerError
from datapipe.mix.stream import MixtureStream
from datapipe.stream import LengthAwareStream
from trainer.checkpoint.config import CheckpointConfig
from trainer.checkpoint.files import (
    CHECKPOINT_FORMAT,
    CHECKSUMS_FILE,
    SafePlanner,
    SafeReader,
    read_checksums,
    read_json,
    verify_files,
)
from trainer.checkpoint.lock import DirLock
from trainer.checkpoint.rng import restore_rng
from trainer.checkpoint.save import (
    RUN_FILE,
    StateOwner,
    any_rank,
    complete_checkpoints,
    describe,
    latest_checkpoint,
    quiet_dcp,
    rng_file,
    save_checkpoint,
    step_dir,
)
from trainer.config.job import TrainerConfig
from trainer.config.resume import resume_conflicts
from trainer.hooks import Hooks
from trainer.logs import get_logger
from trainer.parallel.comm import Communicator, SoloComm
from trainer.parallel.runtime import job_id, restart_count

__all__ = [
    "Checkpointer",
    "check_run_matches",
    "check_steps_left",
    "complete_checkpoints",
    "latest_checkpoint",
    "load_checkpoint",
    "resume_candidates",
    "save_checkpoint",
    "step_dir",
]


def load_checkpoint(
    path: str,
    state: StateOwner,
    scheduler: Any,
    comm: Communicator,
    device: torch.device,
) -> dict[str, Any]:
    """Restore the model state, schedule and this rank's generators in place from the (verified)
    checkpoint `path` (collective); returns run.json's content."""
    run = _checked_run(read_json(os.path.join(path, RUN_FILE)), os.path.join(path, RUN_FILE))
    sd = state.state_dict()
    group = getattr(comm, "group", None)
    with quiet_dcp():
        dcp.load(sd, storage_reader=SafeReader(path), planner=SafePlanner(), process_group=group)
    state.load_state_dict(sd)
    if scheduler is not None:
        try:
            scheduler.load_state_dict(run["scheduler"])
            scheduler.get_last_lr()
        except (TypeError, ValueError, KeyError, OverflowError, AttributeError) as exc:
            raise MixlenError(f"{path}/{RUN_FILE}: field scheduler is not usable ({exc})") from None
        # the optimizer's learning rate is this run's schedule at the saved step (a resume may
        # change train.steps, which re-spans the decay: the saved last LR is the old schedule's)
        lrs = [base * lam(scheduler.last_epoch) for base, lam in zip(
            scheduler.base_lrs, scheduler.lr_lambdas)]  # fmt: skip
        scheduler._last_lr = lrs
        for g, lr in zip(scheduler.optimizer.param_groups, lrs):
            g["lr"] = lr
    own = os.path.join(path, rng_file(comm.rank))
    # a rank the saved run did not have (more ranks now) takes rank 0's generators
    rng = own if os.path.isfile(own) else os.path.join(path, rng_file(0))
    restore_rng(read_json(rng), device, rng)
    return run


def _checked_run(run: Any, source: str) -> dict[str, Any]:
    """run.json's fields this module reads, checked: MixlenError naming the file and field."""
    if not isinstance(run, dict):
        raise MixlenError(f"{source}: expected a JSON object")
    sched = run.get("scheduler", {})
    if not isinstance(sched, dict):
        raise MixlenError(f"{source}: field scheduler: expected an object")
    fields = {"step": run.get("step", 0), "world": run.get("world", 1)}
    if "last_epoch" in sched:
        fields["scheduler.last_epoch"] = sched["last_epoch"]
    for key, v in fields.items():
        if not (type(v) is int and -1 <= v <= 1 << 40):
            shown = f"a {len(str(v))}-digit integer" if type(v) is int else repr(v)[:40]
            raise MixlenError(
                f"{source}: field {key}: expected an integer in [0, 2^40], got {shown}"
            )
    return run


def resume_candidates(cfg: CheckpointConfig) -> tuple[list[str], bool]:
    """The checkpoints to try, newest first, and whether one was named explicitly (no fallback
    then). After a torchrun restart: the newest complete ones this job wrote in checkpoint.dir
    (a job known by a real run id: `--standalone`'s, or a `--rdzv-id` other than "none"). Else
    (and before this job saved any) what `checkpoint.resume` names. ConfigError if it asks for
    one that is not there, or if a run starting from step 0 finds checkpoints that are not its
    own in checkpoint.dir (its first save would prune them)."""
    auto = complete_checkpoints(cfg.dir) if cfg.dir else []
    if restart_count() > 0 and job_id():  # torchrun restarted us: continue what this job saved
        mine = [p for p in auto if _job_of(p) == job_id()]
        if mine:
            return mine, False
    elif restart_count() > 0 and auto and not cfg.resume:
        raise ConfigError(
            f"checkpoint.dir {cfg.dir}: torchrun restarted this job (restart {restart_count()}) "
            f"and the directory holds checkpoints (newest {os.path.basename(auto[0])}), but its "
            'run id "none" (no --rdzv-id) cannot tell whether they are this job\'s, and '
            "starting again from step 0 would remove the later ones; launch with a unique "
            "--rdzv-id (or --standalone), or set checkpoint.resume = true to continue the newest"
        )
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
    if auto:  # a new run's first save would remove these (it keeps no step after its own)
        DirLock(cfg.dir).check_free()  # a job still writing them is named first
        raise ConfigError(
            f"checkpoint.dir {cfg.dir} holds an earlier run's checkpoints (newest "
            f"{os.path.basename(auto[0])}), and checkpoint.resume = false starts a new run from "
            "step 0, whose first save would remove them; set checkpoint.resume = true to "
            "continue that run, or give the new one another checkpoint.dir"
        )
    return [], False


def check_steps_left(cfg: TrainerConfig, path: str) -> None:
    """ConfigError when checkpoint `path`'s step leaves this invocation no step to run (it is at
    or past train.steps, or train.stop_after), naming the key; a torchrun restart of a job that
    had finished is let through (it has nothing left to do)."""
    source = os.path.join(path, RUN_FILE)
    step = int(_checked_run(read_json(source), source)["step"])
    stop = cfg.train.stop_after
    name = "stop_after" if stop and stop < cfg.train.steps else "steps"
    last = getattr(cfg.train, name)
    if step < last or restart_count() > 0:
        return
    raise ConfigError(
        f"{cfg.key(cfg.train, name)} = {last}, but the checkpoint resumed ({path}) is at step "
        f"{step}: this run has no step left; raise {cfg.key(cfg.train, name)}"
    )


def _job_of(path: str) -> str | None:
    try:
        return read_json(os.path.join(path, RUN_FILE)).get("job")
    except (ValueError, AttributeError):
        return None


def check_run_matches(
    path: str,
    cfg: TrainerConfig,
    stream: LengthAwareStream | MixtureStream,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """ConfigError if checkpoint `path` belongs to a run with other settings (naming the keys)
    or another dataset (other sample lengths; or, unless `data.allow_other_dataset`, another
    dataset fingerprint than `fingerprint`); returns its saved stream state."""
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
    if isinstance(stream, MixtureStream):  # each source checked, and named, by the stream
        stream.check_state(stream_state, cfg.data.allow_other_dataset)
        if stream_state.get("kind") == "mixture":
            return stream_state
    elif stream_state.get("kind") == "mixture":
        stream.load_state_dict(stream_state)  # refused: a mixture's state, one dataset now
    elif stream_state.get("lengths_digest") != stream.lengths_digest():
        raise ConfigError(
            f"checkpoint.resume: {path} was saved on another dataset (data.path "
            f"{config.get('data', {}).get('path')!r} then, {cfg.data.path!r} now: the sample "
            "lengths differ)"
        )
    then = saved.get("dataset_fingerprint")
    if then and fingerprint and then != fingerprint and not cfg.data.allow_other_dataset:
        raise ConfigError(
            f"checkpoint.resume: {path} was saved on dataset {then} and data.path "
            f"{cfg.data.path!r} is dataset {fingerprint} (the same sample lengths, other "
            "contents: `mixlen verify` prints a dataset's fingerprint); resume on the dataset it "
            "was saved on, or set data.allow_other_dataset = true for a re-sharded copy of it"
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
        # the run's identity, kept by its checkpoints and its metrics records (a resume takes the
        # checkpoint's; "" for one saved before runs had it): rank 0's is the one saved
        self.run_id = uuid.uuid4().hex[:12]
        self._run_dict = run.to_dict()
        self.ours: list[int] = []  # steps of the checkpoints this run resumed from or saved
        self.fingerprint: str | None = None  # the dataset's, recorded and checked on resume
        self._lock: DirLock | None = None

    def lock(self) -> None:
        """Take `checkpoint.dir`'s lock on rank 0 (collective): one job per directory."""
        err: ConfigError | None = None
        if self.cfg.dir and self.rank == 0:
            self._lock = DirLock(self.cfg.dir)
            try:
                self._lock.acquire()
            except ConfigError as exc:
                err = exc
            else:
                if self._lock.took_over is not None:
                    stale = self._lock.took_over
                    self._say(
                        f"checkpoint.dir {self.cfg.dir}: took over the lock of job "
                        f"{stale.get('job', '?')} (pid {stale.get('pid', '?')}, {self._lock.reason})"
                    )
        if any_rank(self.comm, err is not None, self.device):
            if err is not None:
                raise err
            raise PeerError("checkpoint.dir is locked by another job (reported by rank 0)")

    def last_path(self) -> str | None:
        """The newest complete checkpoint this run resumed from or saved (None: none)."""
        if not self.cfg.dir or not self.ours:
            return None
        return step_dir(self.cfg.dir, max(self.ours))

    def unlock(self) -> None:
        """Release the lock (rank 0, when it holds it)."""
        if self._lock is not None:
            self._lock.release()

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
            yet = (
                f"no checkpoint of this job (run id {job_id()}) yet"
                if job_id()
                else "no checkpoint yet"
            )
            self._say(f"restart {restart_count()}: {yet}; starting again from step 0")
        return paths, explicit

    def check(self, path: str) -> tuple[list[str], bool]:
        """Verify `path` against its checksums.json, this rank's share of the files; returns the
        problems found and whether every rank finds the same ones (then rank 0 reports them)."""
        try:
            files = read_checksums(path)
        except ValueError as exc:
            return [str(exc)], True
        missing = [n for n in (RUN_FILE, rng_file(0), ".metadata") if n not in files]
        if missing:
            return [f"{', '.join(missing)} not listed in {CHECKSUMS_FILE}"], True
        return verify_files(path, files, self.rank, self.comm.size), False

    def resume(self, stream: LengthAwareStream | MixtureStream) -> int:
        """Restore the checkpoint that `checkpoint.resume` (or a torchrun restart) asks for;
        returns the step to continue after (0: a fresh run)."""
        paths, explicit = self.candidates()
        for i, path in enumerate(paths):
            problems, shared = self.check(path)
            if not any_rank(self.comm, bool(problems), self.device):
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

    def _load(self, path: str, stream: LengthAwareStream | MixtureStream) -> int:
        """Load the verified checkpoint `path` after checking it belongs to this run."""
        stream_state = check_run_matches(path, self.run, stream, self.fingerprint)
        check_steps_left(self.run, path)
        try:
            meta = SafeReader(path).read_metadata()  # refused here, before DCP's own traceback
            if any(k.endswith("optim.exp_avg") for k in meta.state_dict_metadata):
                raise ConfigError(
                    f"checkpoint {path}: its optimizer state is saved by flat offsets (a mixlen "
                    "from before checkpoints named parameters); resume it with that mixlen, or "
                    "start a new run from its weights (`mixlen export`, then [model] pretrained)"
                )
            run = load_checkpoint(path, self.state, self.scheduler, self.comm, self.device)
        except MixlenError:
            raise
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP cannot read it
            raise ConfigError(f"checkpoint {path}: cannot be loaded ({describe(exc)})") from None
        # islands take one batch each per step, so one island's position is every island's
        stream.load_state_dict({**stream_state, "island": stream.island})
        self.resumed = True
        self.run_id = run.get("run_id", "") if isinstance(run.get("run_id", ""), str) else ""
        step = int(run["step"])
        self.ours.append(step)
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
            "run_id": self.run_id,
            "config": json.loads(json.dumps(self._run_dict)),
            "stream": stream_state,
            "dataset_fingerprint": self.fingerprint,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
        }
        path = save_checkpoint(
            self.cfg.dir,
            step,
            self.state,
            run,
            self.comm,
            self.device,
            keep=self.cfg.keep,
            before_commit=(lambda: hooks.point("save", step)) if hooks is not None else None,
            ours=self.ours,  # the step appended once complete
        )
        return path
