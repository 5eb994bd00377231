"""`[model]`: the network a run trains: a named shape (datapipe.shapes.MODEL_CONFIGS) or a Hugging
Face `save_pretrained` folder (`pretrained`), with fields replaced; `rope_theta`, `rope_scaling`
and `max_position_embeddings` extend a model's context (they replace a pretrained model's values;
every other field that contradicts config.json is an error naming both)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from datapipe.errors import ConfigError, MixlenError
from datapipe.settings import Names, setting
from datapipe.shapes import DTYPES, INT_BOUNDS, MODEL_CONFIGS, ModelConfig, RopeScaling, get_config

__all__ = ["DTYPES", "ModelSection"]

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
            keys = ", ".join(names(k) for k in over) or names("name")
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
