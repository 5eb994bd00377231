"""`[model]`: the network a run trains: a named shape (datapipe.shapes.MODEL_CONFIGS) or a Hugging
Face `save_pretrained` folder (`pretrained`), with fields replaced; `rope_theta`, `rope_scaling`
and `max_position_embeddings` extend a model's context (they replace a pretrained model's values;
every other field that contradicts config.json is an error naming both)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from datapipe.errors import ConfigError, MixlenError
from datapipe.settings import Names, setting
from datapipe.shapes import DTYPES, INT_BOUNDS, MODEL_CONFIGS, ModelConfig, RopeScaling, get_config

__all__ = ["DTYPES", "ModelSection", "check_model_fits", "machine_memory"]

_SHAPE_HELP = "replaces the named shape's value (default: the shape's own)"
_SHAPE_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")
_CONTEXT_KEYS = ("rope_theta", "rope_scaling", "max_position_embeddings")


def _bounds(field: str) -> dict[str, int]:
    """A shape key's setting bounds: the shape's own (datapipe.shapes.INT_BOUNDS)."""
    lo, hi = INT_BOUNDS[field]
    return {"lo": lo, "hi": hi}


@dataclass
class ModelSection:
    """`[model]`: a named shape or a pretrained folder, optionally with fields replaced."""

    name: str = setting(
        "debug", help="a named shape (ignored with pretrained)", choices=tuple(MODEL_CONFIGS)
    )
    pretrained: str | None = setting(
        None,
        help="a Hugging Face save_pretrained folder (Llama, Qwen2, Mistral): its shape from "
        "config.json, its weights loaded before training",
    )
    vocab_size: int | None = setting(
        None,
        help="vocabulary size, e.g. a BPE tokenizer's (the dataset's manifest vocab_size)",
        **_bounds("vocab_size"),
    )
    dim: int | None = setting(None, help=f"model width; {_SHAPE_HELP}", **_bounds("dim"))
    n_layers: int | None = setting(
        None, help=f"decoder blocks; {_SHAPE_HELP}", **_bounds("n_layers")
    )
    n_heads: int | None = setting(None, help=f"query heads; {_SHAPE_HELP}", **_bounds("n_heads"))
    n_kv_heads: int | None = setting(
        None, help=f"key/value heads; {_SHAPE_HELP}", **_bounds("n_kv_heads")
    )
    ffn_dim: int | None = setting(
        None, help=f"SwiGLU hidden width; {_SHAPE_HELP}", **_bounds("ffn_dim")
    )
    rope_theta: float | None = setting(
        None, help="RoPE base (context extension: replaces the pretrained or named value)"
    )
    rope_scaling: dict | None = setting(
        None,
        help='RoPE scaling, e.g. {type = "llama3", factor = 8.0, original_max_position_embeddings '
        "= 8192} (types linear, llama3, yarn, dynamic, with their keys as in transformers)",
    )
    max_position_embeddings: int | None = setting(
        None,
        help="the context the model declares (written by mixlen export; default: the "
        "pretrained value)",
        **_bounds("max_position_embeddings"),
    )

    def validate(self, names: Names) -> None:
        if self.pretrained and self.name != "debug":
            raise ConfigError(
                f"{names('name')} and {names('pretrained')}: give one (the shape comes from the "
                "pretrained folder's config.json)"
            )
        self.shape(names)

    def overrides(self) -> dict[str, Any]:
        """The shape fields this section replaces (rope_scaling as a RopeScaling)."""
        out: dict[str, Any] = {}
        for key in (*_SHAPE_KEYS, *_CONTEXT_KEYS):
            v = getattr(self, key)
            if v is not None:
                out[key] = v
        return out

    def key_of(self, field: str) -> str:
        """How the user wrote the shape key `field`: `model.<field>`, or the pretrained folder's
        config.json key when the folder, not `[model]`, sets it."""
        if self.pretrained and getattr(self, field, None) is None:
            from trainer.model.families.base import SHAPE_KEYS

            return f"{os.path.join(self.pretrained, 'config.json')}: {SHAPE_KEYS[field]}"
        return f"model.{field}"

    def check_context(self, lengths: Any, data: str) -> None:
        """ConfigError when the dataset `data` holds samples longer than the context the model
        declares (max_position_embeddings, the context an export writes), unless dynamic NTK
        scaling stretches the base for longer documents by design."""
        shape = self.shape()
        declared = shape.max_position_embeddings
        longest = int(np.max(lengths)) if len(lengths) else 0
        dynamic = shape.rope_scaling is not None and shape.rope_scaling.type == "dynamic"
        if declared is None or dynamic or longest <= declared:
            return
        raise ConfigError(
            f"{self.key_of('max_position_embeddings')} = {declared:,}, but {data} holds samples "
            f"of up to {longest:,} tokens: the model would train beyond the context it declares "
            f"(and an export would declare {declared:,}); set model.max_position_embeddings to "
            f"at least {longest:,} (with rope_scaling to extend a pretrained model), or "
            f"preprocess with --max-len {declared}"
        )

    def shape(self, names: Names | None = None) -> ModelConfig:
        """The model's shape: the named one or the pretrained folder's, with the overrides."""
        names = names or Names("model")
        over = self.overrides()
        try:
            if "rope_scaling" in over:
                over["rope_scaling"] = RopeScaling.from_dict(over["rope_scaling"])
            if self.pretrained:
                return _pretrained_shape(self.pretrained, over, names)
            return get_config(self.name, **over)
        except ValueError as exc:  # shape constraints between fields (heads, head dim, rope)
            if isinstance(exc, MixlenError):
                raise
            msg = str(exc)
            if msg.startswith("rope_scaling"):
                raise ConfigError(f"{names.prefix}.{msg}") from None
            # a message about one override names it alone (so a --set is named as the --set)
            named = [k for k in over if msg.split(" ", 1)[0] == k] or list(over)
            keys = ", ".join(names(k) for k in named) or names("name")
            raise ConfigError(f"{keys}: {exc}") from None


_INSPECTED: dict[tuple[str, float], Any] = {}


def _pretrained_shape(path: str, over: dict[str, Any], names: Names) -> ModelConfig:
    """A pretrained folder's shape (config.json and the safetensors headers checked, once per
    folder and version) with `over` applied."""
    from trainer.model.pretrained import apply_overrides, inspect_pretrained

    config = os.path.join(path, "config.json")
    key = (os.path.abspath(path), os.path.getmtime(config) if os.path.exists(config) else 0.0)
    if key not in _INSPECTED:
        _INSPECTED[key] = inspect_pretrained(path)
    shape = _INSPECTED[key].shape
    return apply_overrides(shape, over, config, section=names.prefix or "model")


def pretrained_of(section: ModelSection) -> Any:
    """The inspected pretrained folder of `section` (None without one)."""
    if not section.pretrained:
        return None
    from trainer.model.pretrained import inspect_pretrained

    return inspect_pretrained(section.pretrained)


# --- what the weights take, against the machine ---------------------------------------------------

_ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2}
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def machine_memory(device: str) -> tuple[int, str]:
    """The memory one rank's model lives in on `device` (cpu, cuda[:N], or auto: CUDA when there
    is one) and what it is: a GPU's memory, or this machine's RAM (within a cgroup's limit)."""
    if device != "cpu":
        import torch

        if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
            if torch.cuda.is_available():
                idx = int(device.partition(":")[2] or 0)
                return torch.cuda.get_device_properties(idx).total_memory, f"GPU {idx}'s memory"
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            have = min(have, int(text))
    return have, "memory"


def _size_keys(shape: ModelConfig) -> tuple[str, ...]:
    """The shape keys that make most of its parameters: the embeddings' or the layers'."""
    emb = shape.vocab_size * shape.dim * (1 if shape.tie_embeddings else 2)
    if emb >= shape.num_params() - emb:
        return ("vocab_size", "dim")
    mlp = 3 * shape.dim * shape.ffn_dim * shape.n_layers
    return ("n_layers", "dim", "ffn_dim") if 2 * mlp >= shape.num_params() else ("n_layers", "dim")


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def check_model_fits(
    shape: ModelConfig, dtype: str, device: str, key: Callable[[str], str]
) -> None:
    """ConfigError before anything is allocated when the model's weights alone (a lower bound
    of what one rank holds) take more than the memory of `device`; it names the shape keys that
    make the size (`key(field)`: how the user wrote each) and both sizes."""
    need = shape.num_params() * _ITEMSIZE[dtype]
    have, what = machine_memory(device)
    if need <= have:
        return
    named = " and ".join(f"{key(k)} = {getattr(shape, k):,}" for k in _size_keys(shape))
    raise ConfigError(
        f"{named}: the model's weights alone take {_size(need)} ({shape.num_params():,} "
        f"parameters in {dtype}), more than this machine's {_size(have)} of {what}; refused "
        "before allocating anything (choose a smaller model)"
    )
