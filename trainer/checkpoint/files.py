"""A checkpoint directory's files: small JSON files written durably, the checksum sidecar that
marks a checkpoint complete, its verification, and DCP reading that unpickles nothing untrusted.

- `checksums.json` lists every other file of the checkpoint with its size and XXH3-64. It is
  written last, just before the directory is renamed into place: a step directory without it is
  incomplete (or written by an older mixlen) and is never resumed from.
- `verify_files` checks a share of the listed files (ranks split the work); a flipped byte, a
  truncated or a missing file is named.
- DCP reads `.metadata` with `pickle.load` and non-tensor values with `torch.load(...,
  weights_only=False)`. `SafeReader` unpickles `.metadata` allowing only DCP's own metadata
  classes, torch dtypes and sizes; `SafePlanner` loads non-tensor values with
  `weights_only=True`. Tensors are already loaded with `weights_only=True` by DCP.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from datapipe.integrity import checksum_file

__all__ = [
    "CHECKSUMS_FILE",
    "CHECKPOINT_FORMAT",
    "SafePlanner",
    "SafeReader",
    "fsync_dir",
    "read_checksums",
    "read_json",
    "verify_files",
    "write_checksums",
    "write_json",
]

CHECKSUMS_FILE = "checksums.json"
CHECKPOINT_FORMAT = 2  # 1: everything inside DCP (no sidecar); 2: DCP + JSON + checksums.json


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, obj: Any) -> None:
    """Write `obj` as JSON to `path` (temporary name, fsync, rename)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str) -> Any:
    """JSON from `path`; ValueError saying what is wrong with it."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{os.path.basename(path)} is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{os.path.basename(path)} is not valid JSON ({exc})") from None


def write_checksums(directory: str) -> None:
    """List every file of `directory` with size and XXH3-64 in checksums.json (written last)."""
    files = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name != CHECKSUMS_FILE and os.path.isfile(path):
            files[name] = {"bytes": os.path.getsize(path), "xxh3_64": checksum_file(path)}
    write_json(
        os.path.join(directory, CHECKSUMS_FILE), {"format": CHECKPOINT_FORMAT, "files": files}
    )
    fsync_dir(directory)


def read_checksums(directory: str) -> dict[str, dict[str, Any]]:
    """checksums.json's file table; ValueError if it is missing or malformed (incomplete)."""
    try:
        obj = read_json(os.path.join(directory, CHECKSUMS_FILE))
    except ValueError as exc:
        raise ValueError(
            f"{exc}: the checkpoint is incomplete or was written by an older mixlen"
        ) from None
    files = obj.get("files") if isinstance(obj, dict) else None
    ok = isinstance(files, dict) and all(
        isinstance(v, dict)
        and isinstance(v.get("bytes"), int)
        and isinstance(v.get("xxh3_64"), str)
        for v in files.values()
    )
    if not ok or obj.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{CHECKSUMS_FILE} is malformed or of another format")
    for name in files:
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"{CHECKSUMS_FILE} lists {name!r}, not a file of the checkpoint")
    return files


def verify_files(
    directory: str, files: dict[str, dict[str, Any]], rank: int, size: int
) -> list[str]:
    """Problems of the files this rank checks (every `size`-th, from `rank`): missing, another
    size, another checksum."""
    problems = []
    for i, name in enumerate(sorted(files)):
        if i % size != rank:
            continue
        want = files[name]
        path = os.path.join(directory, name)
        try:
            got = os.path.getsize(path)
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if got != want["bytes"]:
            problems.append(f"{name} has {got} bytes, {want['bytes']} were written (truncated?)")
        elif checksum_file(path) != want["xxh3_64"]:
            problems.append(f"{name}: XXH3-64 checksum differs from {CHECKSUMS_FILE} (corrupt)")
    return problems


# --- reading DCP without unpickling anything untrusted ---------------------------------------------


_ALLOWED_MODULES = {
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
}
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata classes and torch dtypes, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


class SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is unpickled by an allow-list of DCP's own classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path}: not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor values with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
