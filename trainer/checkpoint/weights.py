"""The model's whole weights from a mixlen checkpoint, read in one process (export, eval).

A checkpoint saves the compute weights under `model.<parameter>` (`island<i>.model.<parameter>`
when the islands' weights differ: trainer.checkpoint.state), whole tensors whatever the rank count
and ZeRO level it was saved under. They are read through DCP with the project's safe reader
(trainer.checkpoint.files: nothing untrusted is unpickled), after the checkpoint's files are
verified against its checksums.json.

`read_checkpoint` reads what a tool needs in a safe order: the files verified first, then run.json
(the run's settings), then the weights, each checked finite. A running training may remove the
checkpoint meanwhile (it keeps `checkpoint.keep`): given a checkpoint.dir, the newest complete one
is read instead; a named step directory is said to be gone. `check_weights` compares the weights
with the shape the run's settings give now (a pretrained folder replaced since training).
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from datapipe.errors import InputError
from datapipe.shapes import ModelConfig
from trainer.checkpoint.checkpointer import latest_checkpoint
from trainer.checkpoint.files import (
    CHECKSUMS_FILE,
    SafePlanner,
    SafeReader,
    read_checksums,
    read_json,
    verify_files,
)
from trainer.checkpoint.save import RUN_FILE
from trainer.model.pretrained import non_finite
from trainer.model.transformer import parameter_shapes
from trainer.parallel.tensor import local_tensor

__all__ = [
    "CheckpointRead",
    "check_weights",
    "checkpoint_step_dir",
    "read_checkpoint",
    "read_model_weights",
]

_METADATA = ".metadata"


def checkpoint_step_dir(path: str) -> str:
    """`path` if it is one checkpoint (a `step-NNNNNNNN` directory), else the newest complete
    checkpoint under it; InputError if there is none."""
    if os.path.isfile(os.path.join(path, _METADATA)):
        return path
    step = latest_checkpoint(path)
    if step is None:
        raise InputError(f"{path}: neither a checkpoint nor a directory holding a complete one")
    return step


def _model_keys(meta_keys: list[str], island: int, path: str) -> str:
    """The key prefix of the model's weights: `model.`, or `island<i>.model.`."""
    if any(k.startswith("model.") for k in meta_keys):
        return "model."
    prefix = f"island{island}.model."
    if any(k.startswith(prefix) for k in meta_keys):
        return prefix
    islands = sorted({k.split(".", 1)[0] for k in meta_keys if k.startswith("island")})
    raise InputError(
        f"{path}: no model weights under 'model.' or '{prefix}' (islands saved: {islands or 'none'})"
    )


def read_model_weights(
    path: str,
    island: int = 0,
    verify: bool = True,
    into: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Parameter name -> whole tensor (the saved dtype) of the checkpoint at `path` (a step
    directory, or a checkpoint root: its newest complete checkpoint); with islands saved apart,
    island `island`'s. `verify`: check the files against checksums.json first. `into`: tensors
    to load in place by name (a tensor-parallel model's DTensor parameters: each process reads
    only its shards' chunks, cast to their dtype). InputError naming the checkpoint for a
    damaged, incomplete or unreadable one."""
    step = checkpoint_step_dir(path)
    if verify:
        _verify(step)
    try:
        meta = SafeReader(step).read_metadata()
    except (OSError, pickle.UnpicklingError, EOFError) as exc:
        raise InputError(f"{step}: unreadable DCP metadata ({exc})") from None
    keys = list(meta.state_dict_metadata)
    prefix = _model_keys(keys, island, step)
    sd = {}
    into = into or {}
    for key in keys:
        md = meta.state_dict_metadata[key]
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata):
            mine = into.get(key[len(prefix) :])
            fits = mine is not None and tuple(mine.shape) == tuple(md.size)
            sd[key] = mine if fits else torch.empty(tuple(md.size), dtype=md.properties.dtype)
    with warnings.catch_warnings():  # one process, no process group: intended
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            dcp.load(sd, storage_reader=SafeReader(step), planner=SafePlanner())
        except Exception as exc:  # noqa: BLE001 - DCP wraps every failure
            raise InputError(f"{step}: cannot read the model weights ({exc})") from None
    return {k[len(prefix) :]: t for k, t in sd.items()}


class CheckpointRead(NamedTuple):
    """What `read_checkpoint` read: the step directory, its run.json and the model's weights."""

    step: str
    run: dict[str, Any]
    weights: dict[str, torch.Tensor]


class _Removed(Exception):
    """The step directory disappeared while it was read."""


def _verify(step: str) -> None:
    """InputError naming the checkpoint unless its files match checksums.json."""
    try:
        problems = verify_files(step, read_checksums(step), 0, 1)
    except ValueError as exc:
        raise InputError(f"{step}: {exc}") from None
    if problems:
        raise InputError(f"{step}: " + "; ".join(problems))


def _read_step(
    step: str,
    island: int,
    before: Callable[[str, dict[str, Any]], Any] | None,
) -> CheckpointRead:
    _verify(step)
    try:
        run = read_json(os.path.join(step, RUN_FILE))
    except ValueError as exc:
        raise InputError(f"{step}/{RUN_FILE}: {str(exc).removeprefix(RUN_FILE + ' is ')}") from None
    if not isinstance(run, dict) or not isinstance(run.get("config"), dict):
        raise InputError(f"{step}/{RUN_FILE}: no `config` object (the run's settings)")
    islands = run["config"].get("parallel", {}).get("islands", 1)
    if isinstance(islands, int) and not 0 <= island < islands:
        many = f"{islands} island" + ("s" if islands != 1 else "")
        raise InputError(f"--island {island}: the run had {many} (parallel.islands = {islands})")
    into = before(step, run) if before is not None else None
    weights = read_model_weights(step, island, verify=False, into=into)
    for name, t in weights.items():
        if bad := non_finite(local_tensor(t)):
            raise InputError(
                f"{step}: weight {name} holds {bad:,} non-finite value{'s' if bad > 1 else ''} "
                "(NaN or infinity): the run diverged before this checkpoint; use an earlier one"
            )
    return CheckpointRead(step, run, weights)


def read_checkpoint(
    path: str,
    island: int = 0,
    before: Callable[[str, dict[str, Any]], Any] | None = None,
) -> CheckpointRead:
    """The checkpoint at `path` (a step directory, or a checkpoint.dir: its newest complete
    one): verified, then run.json, then island `island`'s weights (see the module docstring);
    `before(step, run)` runs between run.json and the weights (a caller's checks of what the
    settings imply; what it returns is `read_model_weights`'s `into`). InputError naming the
    checkpoint for anything damaged, non-finite or gone."""
    for attempt in range(3):
        step = checkpoint_step_dir(path)
        sidecar = os.path.join(step, CHECKSUMS_FILE)
        complete = os.path.isfile(sidecar)
        try:
            return _read_step(step, island, before)
        except (InputError, OSError):
            if not complete or os.path.isfile(sidecar):
                raise  # still there: a problem of this checkpoint itself
            if os.path.normpath(step) == os.path.normpath(path) or attempt == 2:
                raise InputError(
                    f"{step}: removed while it was being read (a running training keeps only its "
                    "newest checkpoint.keep checkpoints); name a newer one, or its checkpoint.dir"
                ) from None
    raise AssertionError("unreachable")


def check_weights(
    weights: Mapping[str, torch.Tensor], shape: ModelConfig, step: str, source: str
) -> None:
    """InputError unless `weights` are exactly the parameters of `shape` with their shapes;
    `source` says where the shape comes from (the run's model, or its pretrained folder's
    config.json, which may have been replaced since the run)."""
    need = parameter_shapes(shape)
    missing, extra = sorted(set(need) - set(weights)), sorted(set(weights) - set(need))
    if missing or extra:
        raise InputError(
            f"{step}: the checkpoint's weights are not those of the model of {source} (missing "
            f"{missing[:3]}, unexpected {extra[:3]}): was it changed since the run?"
        )
    for name, want in need.items():
        got = tuple(weights[name].shape)
        if got != tuple(want):
            raise InputError(
                f"{step}: weight {name} has shape {got}, but the model of {source} needs "
                f"{tuple(want)}: was it changed since the run?"
            )
