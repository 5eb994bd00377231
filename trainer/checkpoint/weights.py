"""The model's whole weights from a mixlen checkpoint, read in one process (for an export).

A checkpoint saves the compute weights under `model.<parameter>` (`island<i>.model.<parameter>`
when the islands' weights differ: trainer.checkpoint.state), whole tensors whatever the rank count
and ZeRO level it was saved under. They are read through DCP with the project's safe reader
(trainer.checkpoint.files: nothing untrusted is unpickled), after the checkpoint's files are
verified against its checksums.json.
"""

from __future__ import annotations

import os
import pickle
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from datapipe.errors import InputError
from trainer.checkpoint.checkpointer import latest_checkpoint
from trainer.checkpoint.files import SafePlanner, SafeReader, read_checksums, verify_files

__all__ = ["checkpoint_step_dir", "read_model_weights"]

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


def read_model_weights(path: str, island: int = 0, verify: bool = True) -> dict[str, torch.Tensor]:
    """Parameter name -> whole tensor (the saved dtype) of the checkpoint at `path` (a step
    directory, or a checkpoint root: its newest complete checkpoint); with islands saved apart,
    island `island`'s. `verify`: check the files against checksums.json first. InputError naming
    the checkpoint for a damaged, incomplete or unreadable one."""
    step = checkpoint_step_dir(path)
    if verify:
        try:
            problems = verify_files(step, read_checksums(step), 0, 1)
        except ValueError as exc:
            raise InputError(f"{step}: {exc}") from None
        if problems:
            raise InputError(f"{step}: " + "; ".join(problems))
    try:
        meta = SafeReader(step).read_metadata()
    except (OSError, pickle.UnpicklingError, EOFError) as exc:
        raise InputError(f"{step}: unreadable DCP metadata ({exc})") from None
    keys = list(meta.state_dict_metadata)
    prefix = _model_keys(keys, island, step)
    sd = {}
    for key in keys:
        md = meta.state_dict_metadata[key]
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata):
            sd[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    with warnings.catch_warnings():  # one process, no process group: intended
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            dcp.load(sd, storage_reader=SafeReader(step), planner=SafePlanner())
        except Exception as exc:  # noqa: BLE001 - DCP wraps every failure
            raise InputError(f"{step}: cannot read the model weights ({exc})") from None
    return {k[len(prefix) :]: t for k, t in sd.items()}
