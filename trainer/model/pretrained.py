"""Hugging Face `save_pretrained` folders: check one cheaply, load its weights into a model.

A folder holds `config.json` and either `model.safetensors` or shards listed by
`model.safetensors.index.json` (`weight_map`: tensor name -> file). `inspect_pretrained` reads
only config.json, the index and the safetensors headers: the architecture's family
(trainer.model.families), the shape, and every tensor the shape needs present exactly once with
its shape and a float dtype, nothing left over, every listed file there, so a launcher refuses a
bad folder before any rank starts. `load_pretrained_weights` then maps one tensor at a time
with safetensors' memory-mapped `safe_open` and copies it into the model's parameter in place
(cast to its dtype), so a process never holds a second copy of the model (nor more than one
tensor's pages of the file); a tensor-parallel shard reads only its slice. Errors are
`InputError`s naming the file and the tensor (or key).

`apply_overrides` merges a run's `[model]` keys with the pretrained shape: `rope_theta`,
`rope_scaling` and `max_position_embeddings` replace the pretrained values (context extension),
as does `init_std` (mixlen's own, which config.json does not hold); any other key that differs from
config.json is an error naming both values.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from datapipe.errors import ConfigError, InputError
from datapipe.files import CONFIG_FILE_LIMIT, NotRegularFile, open_regular, read_bounded_text
from datapipe.shapes import ModelConfig
from trainer.model.families import Family, family_of
from trainer.model.families.base import SHAPE_KEYS
from trainer.model.transformer import parameter_shapes

__all__ = [
    "CONFIG_FILE",
    "CONTEXT_KEYS",
    "INDEX_FILE",
    "SINGLE_FILE",
    "Pretrained",
    "TensorEntry",
    "apply_overrides",
    "inspect_pretrained",
    "load_pretrained_weights",
    "non_finite",
    "read_header",
]

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# what mixlen export adds: the held-out split of the run it exports, which mixlen eval reads
RUN_FILE = "mixlen.json"
FLOAT_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
_ITEMSIZE = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
# [model] keys that replace the pretrained values instead of contradicting them
CONTEXT_KEYS = ("rope_theta", "rope_scaling", "max_position_embeddings", "init_std")
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of a checkpoint lives and what its header says."""

    file: str  # file name inside the folder
    dtype: str  # safetensors dtype code (BF16, F32, ...)
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Pretrained:
    """A checked `save_pretrained` folder."""

    path: str
    config: dict[str, Any]  # config.json
    family: Family
    shape: ModelConfig
    tensors: dict[str, TensorEntry]  # every tensor of the folder by name
    names: dict[str, str]  # mixlen parameter name -> tensor name, in parameter order

    @property
    def dtype(self) -> str:
        """The dtype name (torch) of most of the weights."""
        counts: dict[str, int] = {}
        for hf in self.names.values():
            e = self.tensors[hf]
            counts[e.dtype] = counts.get(e.dtype, 0) + _numel(e.shape)
        return FLOAT_DTYPES[max(counts, key=lambda k: counts[k])]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _read_json(path: str) -> Any:
    """A folder's JSON file (a regular file of at most 16 MiB; InputError naming it)."""
    try:
        return json.loads(read_bounded_text(path, CONFIG_FILE_LIMIT, "a JSON file"))
    except FileNotFoundError:
        raise InputError(f"{path}: missing") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not readable JSON ({exc})") from None


def read_header(path: str) -> dict[str, TensorEntry]:
    """The tensors a safetensors file's header lists, checked against the file's size."""
    name = os.path.basename(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (-1,)
            if not 2 <= n <= min(_MAX_HEADER, size - 8):
                raise InputError(f"{path}: not a safetensors file (header length {n})")
            header = json.loads(f.read(n).decode("utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: missing") from None
    except NotRegularFile as exc:
        raise InputError(f"{path}: {exc.reason}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: unreadable safetensors header")
    out, data = {}, size - 8 - n
    spans: list[tuple[int, int, str]] = []
    for key, info in header.items():
        if key == "__metadata__":
            _check_metadata(path, info)
            continue
        try:
            dtype, shape, (a, b) = str(info["dtype"]), tuple(info["shape"]), info["data_offsets"]
            ok = all(isinstance(s, int) and s >= 0 for s in shape) and 0 <= a <= b <= data
            if dtype in _ITEMSIZE:  # a float tensor's bytes are its elements'
                ok = ok and b - a == _numel(shape) * _ITEMSIZE[dtype]
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise InputError(f"{path}: tensor {key}: bad header entry or past the file's end")
        out[key] = TensorEntry(name, dtype, shape)
        spans.append((a, b, key))
    _check_spans(path, spans, data)
    return out


def _check_metadata(path: str, meta: object) -> None:
    """InputError unless a header's `__metadata__` maps strings to strings, as safetensors
    requires (it refuses any other, at load time)."""
    if not isinstance(meta, dict):
        raise InputError(f"{path}: __metadata__ must be a string-to-string map, not {meta!r:.80}")
    for key, value in meta.items():
        if not isinstance(value, str):
            raise InputError(
                f"{path}: __metadata__ key {key!r}: must be a string, not {value!r:.80}"
            )


def _check_spans(path: str, spans: list[tuple[int, int, str]], data: int) -> None:
    """The tensors' byte ranges tile the data section (as safetensors requires: no two tensors
    share a byte, no gap, nothing after the last), else InputError naming the tensor."""
    end, prev = 0, "the header"
    for a, b, key in sorted(spans):
        if a != end:
            what = "overlap" if a < end else "leave a gap after"
            raise InputError(
                f"{path}: tensor {key}: data_offsets [{a}, {b}] {what} {prev} (each tensor "
                "must have bytes of its own, one after another)"
            )
        end, prev = b, f"tensor {key}'s [{a}, {b}]"
    if end != data:
        raise InputError(
            f"{path}: the tensors' bytes end at {end}, the file holds {data} after the header "
            "(each tensor must have bytes of its own, one after another)"
        )


def _weight_files(path: str) -> dict[str, TensorEntry]:
    """Every tensor of the folder by name: from model.safetensors, or from the shards the index
    lists (each listed file present, each tensor in the file the index names, once)."""
    single, index = os.path.join(path, SINGLE_FILE), os.path.join(path, INDEX_FILE)
    if os.path.lexists(single):
        return read_header(single)
    if not os.path.lexists(index):
        raise InputError(
            f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors checkpoints are "
            "read, not pickled pytorch_model.bin)"
        )
    obj = _read_json(index)
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) and os.path.basename(v) == v and v for v in weight_map.values()
    ):
        raise InputError(f"{index}: weight_map must map tensor names to file names in {path}")
    tensors: dict[str, TensorEntry] = {}
    for file in sorted(set(weight_map.values())):
        fpath = os.path.join(path, file)
        if not os.path.lexists(fpath):
            listed = sorted(k for k, v in weight_map.items() if v == file)
            raise InputError(
                f"{fpath}: missing ({INDEX_FILE} lists {len(listed)} tensors in it, e.g. "
                f"{listed[0]})"
            )
        for name, entry in read_header(fpath).items():
            if name in tensors:
                raise InputError(f"{fpath}: tensor {name} is also in {tensors[name].file}")
            if weight_map.get(name) != file:
                raise InputError(
                    f"{fpath}: holds tensor {name}, which {INDEX_FILE} puts in "
                    f"{weight_map.get(name, 'no file')}"
                )
            tensors[name] = entry
    for name, file in weight_map.items():
        if name not in tensors:
            raise InputError(
                f"{os.path.join(path, file)}: tensor {name} (listed in {INDEX_FILE}) is not in it"
            )
    return tensors


def _check_tensors(path: str, pre: Pretrained) -> None:
    """Every tensor the shape needs present with its shape and a float dtype, none left over."""
    want = parameter_shapes(pre.shape)
    problems = []
    optional = set(pre.family.optional_tensors(pre.shape))
    for mine, hf in pre.names.items():
        if hf not in pre.tensors:
            problems.append(f"tensor {hf} is missing (needed for parameter {mine})")
    for hf, e in pre.tensors.items():
        where = os.path.join(path, e.file)
        if e.dtype not in FLOAT_DTYPES:
            problems.append(
                f"{where}: tensor {hf} has dtype {e.dtype}: quantised or integer checkpoints are "
                f"not supported (float dtypes: {', '.join(FLOAT_DTYPES)})"
            )
    mine_of = {hf: mine for mine, hf in pre.names.items()}
    for hf, e in pre.tensors.items():
        where = os.path.join(path, e.file)
        if hf in mine_of or hf in optional:
            need = want[mine_of.get(hf, "tok_embeddings.weight")]
            if e.shape != need:
                problems.append(
                    f"{where}: tensor {hf} has shape {list(e.shape)}, config.json's shape needs {list(need)}"
                )
        elif not pre.family.ignored(hf):
            problems.append(
                f"{where}: tensor {hf} is not a weight of {pre.family.architecture} with this config.json (left over)"
            )
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise InputError(f"{path}: " + "; ".join(problems[:8]) + more)


def inspect_pretrained(path: str) -> Pretrained:
    """Check a `save_pretrained` folder from config.json and the safetensors headers alone."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise InputError(f"{path}: not a directory (a Hugging Face save_pretrained folder)")
    where = os.path.join(path, CONFIG_FILE)
    config = _read_json(where)
    if not isinstance(config, dict):
        raise InputError(f"{where}: not a JSON object")
    archs = config.get("architectures")
    if not (isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str)):
        raise InputError(f"{where}: architectures must list one architecture, got {archs!r}")
    family = family_of(archs[0], where)
    shape = family.shape(config, where)
    pre = Pretrained(path, config, family, shape, _weight_files(path), family.weight_names(shape))
    _check_tensors(path, pre)
    return pre


@torch.no_grad()
def load_pretrained_weights(model: nn.Module, pretrained: str | Pretrained) -> Pretrained:
    """Copy a folder's weights into `model`'s parameters in place (cast to each parameter's
    dtype, on its device), one tensor at a time; the model must have the folder's shape (up to
    the CONTEXT_KEYS) and real (not meta) parameters. A tensor-parallel model's process reads
    only its shards' slices of each tensor. Returns the inspection."""
    from safetensors import SafetensorError, safe_open

    from trainer.parallel.tensor import local_tensor, place_of

    pre = pretrained if isinstance(pretrained, Pretrained) else inspect_pretrained(pretrained)
    params = dict(model.named_parameters())
    if set(params) != set(pre.names):
        odd = sorted(set(params) ^ set(pre.names))[:4]
        raise ValueError(f"{pre.path}: the model's parameters are not this shape's (e.g. {odd})")
    for mine, hf in pre.names.items():
        p, e = params[mine], pre.tensors[hf]
        if p.is_meta or tuple(p.shape) != e.shape:
            raise ValueError(
                f"{pre.path}: parameter {mine} {tuple(p.shape)} cannot take {hf} {e.shape}"
            )
    for mine, hf in pre.names.items():
        # one mapping per tensor: only that tensor's pages are mapped while it is copied; a
        # tensor-parallel shard reads only its slice of the tensor
        p = params[mine]
        local, place = local_tensor(p), place_of(mine, p)
        part = tuple(slice(o, o + n) for o, n in zip(place.offset, local.shape))
        fpath = os.path.join(pre.path, pre.tensors[hf].file)
        try:
            with safe_open(fpath, framework="pt", device="cpu") as f:
                src = f.get_slice(hf)[part] if part else f.get_tensor(hf)
                local.copy_(src)
        except (OSError, RuntimeError, ValueError, SafetensorError) as exc:
            raise InputError(f"{fpath}: cannot read tensor {hf} ({exc})") from None
        _check_finite(local, src, f"{fpath}: tensor {hf}")
        del src
    return pre


def non_finite(t: torch.Tensor, chunk: int = 1 << 22) -> int:
    """How many values of `t` are NaN or infinite, read in chunks (no second copy of `t`): each
    chunk's min and max first (one pass, ~7 GiB/s a core; NaN propagates), counted only when
    they are not finite."""
    flat, bad = t.detach().reshape(-1), 0
    for i in range(0, flat.numel(), chunk):
        part = flat[i : i + chunk]
        lo, hi = torch.aminmax(part)
        if not (torch.isfinite(lo) and torch.isfinite(hi)):
            bad += int((~torch.isfinite(part)).sum())
    return bad


def _check_finite(param: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """InputError naming `what` when the loaded `param` holds a NaN or infinity: already in the
    file's `src`, or made by the cast to the parameter's dtype."""
    bad = non_finite(param)
    if not bad:
        return
    own = non_finite(src)
    if own:
        raise InputError(
            f"{what} holds {own:,} non-finite value{'s' if own > 1 else ''} (NaN or infinity): "
            "training or evaluating on it gives NaN; use an intact copy of the model"
        )
    dtype, stored = (str(t.dtype).removeprefix("torch.") for t in (param, src))
    raise InputError(
        f"{what} holds {bad:,} value{'s' if bad > 1 else ''} beyond {dtype}'s range (infinite "
        f"once cast from {stored}); use a wider compute dtype"
    )


def apply_overrides(
    pretrained: ModelConfig,
    overrides: Mapping[str, Any],
    source: str,
    section: str = "model",
) -> ModelConfig:
    """The run's shape: `pretrained` (read from `source`, a config.json) with the CONTEXT_KEYS of
    `overrides` replacing its values; any other override that differs is a ConfigError naming
    `section.key`, its value, and config.json's key and value (all contradictions at once)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    problems, replace = [], {}
    for key, value in overrides.items():
        if key not in fields:
            raise ConfigError(f"{section}.{key}: not a model shape key")
        if key in CONTEXT_KEYS:
            replace[key] = value
        elif value != getattr(pretrained, key):
            theirs = SHAPE_KEYS.get(key, key)
            problems.append(
                f"{section}.{key} = {value!r} contradicts {source}: {theirs} = "
                f"{getattr(pretrained, key)!r}"
            )
    if problems:
        raise ConfigError("; ".join(problems))
    try:
        return dataclasses.replace(pretrained, **replace)
    except ValueError as exc:
        keys = ", ".join(f"{section}.{k}" for k in replace)
        raise ConfigError(f"{keys}: {exc}") from None
