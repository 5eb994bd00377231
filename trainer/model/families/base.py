"""What every Hugging Face family adapter provides, and the Llama-style decoder they share.

A `Family` turns a `config.json` into a `ModelConfig` (refusing what mixlen's model cannot run),
maps mixlen's parameter names to the checkpoint's tensor names, and writes the `config.json` of
an export. Llama, Qwen2 and Mistral name their tensors alike (`model.layers.N.self_attn.q_proj`
...); each family's module sets its architecture, its config.json defaults (the values
transformers' config class assumes for a missing key) and its own refusals.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from datapipe.errors import InputError
from datapipe.shapes import FLOAT_RANGES, INT_BOUNDS, ROPE_SETTINGS, ModelConfig, RopeScaling

__all__ = ["SHAPE_KEYS", "Family", "LlamaStyle"]

# ModelConfig field -> the config.json key that sets it (names in messages)
SHAPE_KEYS: dict[str, str] = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tie_embeddings": "tie_word_embeddings",
    "explicit_head_dim": "head_dim",
    "rope_scaling": "rope_scaling",
    "max_position_embeddings": "max_position_embeddings",
    "qkv_bias": "q/k/v projection biases",
}

# config.json keys carried from the source model into an export (not shape: token ids)
CARRIED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")

# mixlen's names -> transformers' within one decoder layer
_LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_BIAS_NAMES = {
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
}


class Family:
    """One Hugging Face architecture: the interface `pretrained.py` and `export.py` use."""

    architecture: ClassVar[str]  # config.json's `architectures` entry
    model_type: ClassVar[str]

    def shape(self, config: Mapping[str, Any], where: str) -> ModelConfig:
        """The ModelConfig of `config` (config.json's content, read from `where`); InputError
        naming `where` and the key for anything mixlen cannot run."""
        raise NotImplementedError

    def weight_names(self, shape: ModelConfig) -> dict[str, str]:
        """mixlen parameter name -> tensor name in the checkpoint, in parameter order."""
        raise NotImplementedError

    def optional_tensors(self, shape: ModelConfig) -> list[str]:
        """Tensor names a checkpoint may hold that are not read (e.g. a tied lm_head)."""
        raise NotImplementedError

    def ignored(self, name: str) -> bool:
        """Tensors of older checkpoints that carry nothing to load (rotary tables)."""
        raise NotImplementedError

    def config_json(
        self,
        shape: ModelConfig,
        max_position_embeddings: int,
        torch_dtype: str,
        base: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The config.json of an export of `shape`; token ids carried from `base`."""
        raise NotImplementedError


_FIELD_OF = {theirs: mine for mine, theirs in SHAPE_KEYS.items()}


def _int(config: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    """config[key] as an int within the shape's bounds for it (datapipe.shapes.INT_BOUNDS); a
    missing or null key takes `default` when there is one."""
    lo, hi = INT_BOUNDS[_FIELD_OF[key]]
    value = config.get(key)
    if value is None and default is not None:
        return default
    if not (isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi):
        got = "missing" if value is None else f"got {value!r}"
        raise InputError(f"{where}: {key} must be an integer in [{lo:,}, {hi:,}] ({got})")
    return value


def _number(config: Mapping[str, Any], key: str, where: str, default: float) -> float:
    """config[key] as a float within the shape's range for it (datapipe.shapes.FLOAT_RANGES:
    finite, and in range); a missing or null key takes `default`."""
    value = config.get(key)
    value = default if value is None else value
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)):
        raise InputError(f"{where}: {key} must be a number, got {value!r}")
    problem = FLOAT_RANGES[_FIELD_OF[key]].problem(float(value))
    if problem:
        raise InputError(f"{where}: {key} {problem}")
    return float(value)


class LlamaStyle(Family):
    """Llama-style decoders: the tensor names of transformers' Llama, Qwen2 and Mistral.
    Subclasses set the class attributes and add refusals in `check`."""

    defaults: ClassVar[dict[str, Any]]  # transformers' config class defaults for missing keys
    qkv_bias: ClassVar[bool] = False  # the architecture always has q/k/v biases (Qwen2)
    extra_config: ClassVar[dict[str, Any]] = {}  # written into an export's config.json

    def check(self, config: Mapping[str, Any], where: str) -> None:
        """Family-specific refusals (InputError naming `where` and the key)."""

    def shape(self, config: Mapping[str, Any], where: str) -> ModelConfig:
        d = {**self.defaults, **config}  # a missing key takes transformers' default
        if "quantization_config" in config:
            raise InputError(
                f"{where}: quantization_config is set: quantised checkpoints are not supported"
            )
        if d.get("hidden_act") not in (None, "silu"):
            raise InputError(
                f"{where}: hidden_act {d['hidden_act']!r}: only 'silu' (SwiGLU) is supported"
            )
        if d.get("attention_dropout") not in (None, 0, 0.0):
            raise InputError(
                f"{where}: attention_dropout {d['attention_dropout']!r}: mixlen trains without dropout"
            )
        self.check(d, where)
        tie = d.get("tie_word_embeddings")
        if tie is not None and not isinstance(tie, bool):  # bool("false") would tie them
            raise InputError(
                f"{where}: tie_word_embeddings must be true, false or null, got {tie!r}"
            )
        dim, n_heads = _int(d, "hidden_size", where), _int(d, "num_attention_heads", where)
        head_dim = _int(d, "head_dim", where, dim // n_heads)
        max_pos = _int(d, "max_position_embeddings", where)
        try:
            return ModelConfig(
                vocab_size=_int(d, "vocab_size", where),
                dim=dim,
                n_layers=_int(d, "num_hidden_layers", where),
                n_heads=n_heads,
                n_kv_heads=_int(d, "num_key_value_heads", where, n_heads),
                ffn_dim=_int(d, "intermediate_size", where),
                norm_eps=_number(d, "rms_norm_eps", where, 1e-6),
                rope_theta=_number(d, "rope_theta", where, 10000.0),
                tie_embeddings=bool(d.get("tie_word_embeddings")),
                qkv_bias=self.qkv_bias,
                explicit_head_dim=None if head_dim * n_heads == dim else head_dim,
                rope_scaling=self._rope_scaling(d.get("rope_scaling"), max_pos, where),
                max_position_embeddings=max_pos,
            )
        except InputError:
            raise
        except ValueError as exc:  # shape constraints between fields
            raise InputError(f"{where}: {exc}") from None

    def _rope_scaling(self, rs: Any, max_pos: int, where: str) -> RopeScaling | None:
        """config.json's rope_scaling as a RopeScaling (transformers' rules for what is missing:
        yarn's original context defaults to max_position_embeddings, dynamic NTK always uses
        max_position_embeddings)."""
        if rs is None:
            return None
        if not isinstance(rs, Mapping):
            raise InputError(f"{where}: rope_scaling must be an object or null, got {rs!r}")
        kind = rs.get("type", rs.get("rope_type"))  # transformers: a legacy `type` wins
        if kind == "default":
            return None
        if kind not in ROPE_SETTINGS:
            raise InputError(
                f"{where}: rope_scaling type {kind!r} is not supported "
                f"(supported: default, {', '.join(ROPE_SETTINGS)})"
            )
        settings = {k: v for k, v in rs.items() if k not in ("rope_type", "type")}
        if kind == "linear":  # transformers reads no original context for linear scaling
            settings.pop("original_max_position_embeddings", None)
        if kind == "dynamic":
            settings["original_max_position_embeddings"] = max_pos
        elif kind == "yarn" and settings.get("original_max_position_embeddings") is None:
            settings["original_max_position_embeddings"] = max_pos
        known = {f.name for f in dataclasses.fields(RopeScaling)}
        for key in settings:
            if key not in known:
                raise InputError(f"{where}: rope_scaling.{key}: unknown setting of type {kind!r}")
        if kind == "yarn" and "truncate" in settings and settings["truncate"] is None:
            settings["truncate"] = False  # transformers rounds only where truncate is truthy
        settings = {k: v for k, v in settings.items() if v is not None}
        try:
            return RopeScaling(type=kind, **settings)
        except (TypeError, ValueError) as exc:
            raise InputError(f"{where}: {exc}") from None

    def weight_names(self, shape: ModelConfig) -> dict[str, str]:
        names = {"tok_embeddings.weight": "model.embed_tokens.weight"}
        per_layer = {**_LAYER_NAMES, **(_BIAS_NAMES if shape.qkv_bias else {})}
        for i in range(shape.n_layers):
            for mine, theirs in per_layer.items():
                names[f"layers.{i}.{mine}"] = f"model.layers.{i}.{theirs}"
        names["norm.weight"] = "model.norm.weight"
        if not shape.tie_embeddings:
            names["output.weight"] = "lm_head.weight"
        return names

    def optional_tensors(self, shape: ModelConfig) -> list[str]:
        return ["lm_head.weight"] if shape.tie_embeddings else []

    _ROTARY = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")

    def ignored(self, name: str) -> bool:
        return bool(self._ROTARY.match(name))

    def config_json(
        self,
        shape: ModelConfig,
        max_position_embeddings: int,
        torch_dtype: str,
        base: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        if shape.qkv_bias != self.qkv_bias:
            have = "has" if shape.qkv_bias else "has no"
            raise ValueError(
                f"{self.architecture}: this shape {have} q/k/v biases; the architecture does not match"
            )
        rs = shape.rope_scaling
        if rs is not None and rs.type == "dynamic":  # transformers' dynamic NTK starts here
            max_position_embeddings = rs.original_max_position_embeddings or max_position_embeddings
        rope = None if rs is None else {"rope_type": rs.type, **rs.to_dict()}
        if rope is not None:
            del rope["type"]
        out = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": shape.vocab_size,
            "hidden_size": shape.dim,
            "intermediate_size": shape.ffn_dim,
            "num_hidden_layers": shape.n_layers,
            "num_attention_heads": shape.n_heads,
            "num_key_value_heads": shape.n_kv_heads,
            "head_dim": shape.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": shape.norm_eps,
            "rope_theta": shape.rope_theta,
            "rope_scaling": rope,
            "max_position_embeddings": max_position_embeddings,
            "tie_word_embeddings": shape.tie_embeddings,
            "attention_dropout": 0.0,
            "torch_dtype": torch_dtype,
            **self.extra_config,
        }
        for key in CARRIED_KEYS:
            if base is not None and key in base:
                out[key] = base[key]
        return out
