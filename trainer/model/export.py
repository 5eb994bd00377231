"""Write a model as a Hugging Face `save_pretrained` folder.

`export_hf` writes config.json (the family's architecture, the shape, the RoPE settings and the
declared context), the weights as safetensors (`model.safetensors` when they fit one shard, else
`model-0000K-of-0000N.safetensors` listed by `model.safetensors.index.json`, as transformers
writes them) and copies the tokenizer files. It writes into a temporary directory beside the
destination, fsyncs every file, and renames it into place: the destination is either absent or
complete. An existing destination is refused unless `overwrite` (the old folder is then moved
aside and removed only after the new one is in place).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from datapipe.errors import ConfigError, InputError, MixlenError
from datapipe.files import host_tag
from datapipe.ingest.output import clean_stale, partial_dir
from datapipe.shapes import ModelConfig
from trainer.checkpoint.files import fsync_dir
from trainer.logs import get_logger
from trainer.model.families import Family, family_of
from trainer.model.pretrained import CONFIG_FILE, INDEX_FILE, RUN_FILE, SINGLE_FILE, non_finite
from trainer.model.transformer import parameter_shapes

__all__ = ["DEFAULT_SHARD_BYTES", "export_hf", "plan_shards"]

DEFAULT_SHARD_BYTES = 2 * 1000**3  # tensor bytes per shard


def plan_shards(names: Sequence[str], nbytes: Mapping[str, int], limit: int) -> list[list[str]]:
    """Tensors in order, cut into shards of at most `limit` bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        if shards[-1] and size + nbytes[name] > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes[name]
    return shards


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _own(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """`t` on the CPU in `dtype`, contiguous and owning its storage (safetensors refuses views
    sharing one buffer, such as a sharded optimizer's flat weights); ConfigError naming the
    tensor if the cast made a value infinite (a float16 export of a weight beyond 65,504)."""
    src = t
    t = t.detach().to(device="cpu", dtype=dtype)
    if dtype != src.dtype and non_finite(t) > non_finite(src):
        raise ConfigError(
            f"--dtype {str(dtype).removeprefix('torch.')}: {name} holds values beyond that "
            f"dtype's range (largest magnitude {float(src.detach().abs().max()):.4g}); export "
            "in float32 or bfloat16"
        )
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes:
        t = t.contiguous().clone()
    return t


def _hf_tensors(
    weights: Mapping[str, torch.Tensor], shape: ModelConfig, family: Family
) -> dict[str, str]:
    """mixlen name -> tensor name, checking `weights` holds exactly the shape's parameters."""
    names = family.weight_names(shape)
    missing = [n for n in names if n not in weights]
    extra = [n for n in weights if n not in names]
    if missing or extra:
        raise ValueError(
            f"weights do not match the {family.architecture} shape: missing {missing[:4]}, "
            f"unexpected {extra[:4]}"
        )
    for mine, need in parameter_shapes(shape).items():
        if tuple(weights[mine].shape) != need:
            raise ValueError(
                f"weight {mine} has shape {tuple(weights[mine].shape)}, the shape needs {need}"
            )
    return names


def _write_weights(
    tmp: str,
    weights: Mapping[str, torch.Tensor],
    names: Mapping[str, str],
    dtype: torch.dtype | None,
    shard_bytes: int,
) -> list[str]:
    """The safetensors files (and the index when there are several); returns the file names."""
    from safetensors.torch import save_file

    dtypes = {m: dtype or weights[m].dtype for m in names}
    nbytes = {m: weights[m].numel() * dtypes[m].itemsize for m in names}
    shards = plan_shards(list(names), nbytes, shard_bytes)
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for file, shard in zip(files, shards):
        tensors = {names[m]: _own(weights[m], dtypes[m], names[m]) for m in shard}
        try:
            save_file(tensors, os.path.join(tmp, file), metadata={"format": "pt"})
        except Exception as exc:  # safetensors' own error type for a failed write (a full disk)
            if type(exc).__name__ != "SafetensorError":
                raise
            raise MixlenError(f"{tmp}: cannot write {file} ({exc})") from None
        fsync_dir(os.path.join(tmp, file))
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}
        _write_json(os.path.join(tmp, INDEX_FILE), index)
        files.append(INDEX_FILE)
    return files


def _host_part() -> str:
    """The host's part of the temporaries' names: exports run without a lock, so two hosts
    exporting beside each other on a shared file system must never take the other's for dead."""
    return f"{host_tag()}-"


def _install(tmp: str, out_dir: str, overwrite: bool) -> None:
    """Rename the finished `tmp` to `out_dir` (an old `out_dir` moved aside first, under a name
    the next export puts back if this process dies before the rename: `clean_stale`)."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    old = None
    if os.path.lexists(out_dir):
        if not overwrite:
            raise InputError(f"{out_dir}: already exists (overwrite it explicitly)")
        old = os.path.join(parent, f".{os.path.basename(out_dir)}.old-{_host_part()}{os.getpid()}")
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    fsync_dir(parent)
    if old is not None and os.path.isdir(old):
        shutil.rmtree(old)
    elif old is not None:
        os.remove(old)


def export_hf(
    weights: Mapping[str, torch.Tensor],
    shape: ModelConfig,
    family: Family | str,
    out_dir: str,
    *,
    dtype: torch.dtype | None = None,
    tokenizer_files: Sequence[str | tuple[str, str]] = (),
    max_position_embeddings: int | None = None,
    base_config: Mapping[str, Any] | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    run_settings: Mapping[str, Any] | None = None,
) -> list[str]:
    """Write `weights` (mixlen parameter names, whole tensors) of `shape` as a `family` (a Family
    or an architecture name) save_pretrained folder `out_dir`; returns the file names written.

    `dtype`: the stored dtype (default: each tensor's own); `max_position_embeddings`: the
    declared context (default: the shape's; dynamic NTK writes its original context, where
    transformers starts stretching); `base_config`: the source config.json, whose token ids
    (bos, eos, pad) are carried over; `run_settings`: written as mixlen.json (the exported
    run's held-out split, for mixlen eval); `tokenizer_files`: copied into the folder, each a path
    (under its own name) or (path, name in the folder).
    Raises InputError (destination exists, a tokenizer file missing), ConfigError (no declared
    context), ValueError (weights not of the shape)."""
    out_dir = os.path.normpath(os.fspath(out_dir))
    # an export killed before (SIGKILL, SIGTERM: no cleanup ran) left its temporary folder, or
    # the old folder moved aside: removed, or put back, when its process is gone
    clean_stale(Path(os.path.abspath(out_dir)), get_logger().warning, _host_part())
    fam = family_of(family) if isinstance(family, str) else family
    names = _hf_tensors(weights, shape, fam)
    context = max_position_embeddings or shape.max_position_embeddings
    if context is None:
        raise ConfigError("max_position_embeddings: needed for config.json (the model's context)")
    if os.path.lexists(out_dir) and not overwrite:
        raise InputError(f"{out_dir}: already exists (overwrite it explicitly)")
    copies = [(f, os.path.basename(f)) if isinstance(f, str) else f for f in tokenizer_files]
    for src, name in copies:
        if not os.path.isfile(src):
            raise InputError(f"{src}: tokenizer file missing")
        if name in (CONFIG_FILE, INDEX_FILE) or name.endswith(".safetensors"):
            raise InputError(f"{src}: a tokenizer file cannot be named like the model's files")
    stored = dtype or next(iter(weights.values())).dtype
    config = fam.config_json(shape, context, str(stored).removeprefix("torch."), base_config)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = str(partial_dir(Path(os.path.abspath(out_dir)), _host_part()))
    shutil.rmtree(tmp, ignore_errors=True)  # this process's own, from an export that raised
    os.mkdir(tmp)
    try:
        files = _write_weights(tmp, weights, names, dtype, shard_bytes)
        _write_json(os.path.join(tmp, CONFIG_FILE), config)
        files.append(CONFIG_FILE)
        if run_settings is not None:
            _write_json(os.path.join(tmp, RUN_FILE), dict(run_settings))
            files.append(RUN_FILE)
        for src, name in copies:
            dst = os.path.join(tmp, name)
            shutil.copyfile(src, dst)
            fsync_dir(dst)
            files.append(name)
        fsync_dir(tmp)
        _install(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files
