"""Qwen2ForCausalLM (Qwen2, Qwen2.5): the Llama layout with biases on the Q, K and V projections.
Refused: sliding-window attention (`use_sliding_window` true, or a `layer_types` entry
"sliding_attention"): mixlen's attention is full causal attention within each document."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from datapipe.errors import InputError
from trainer.model.families.base import LlamaStyle

__all__ = ["FAMILY", "Qwen2"]


class Qwen2(LlamaStyle):
    architecture: ClassVar[str] = "Qwen2ForCausalLM"
    model_type: ClassVar[str] = "qwen2"
    # transformers' Qwen2Config defaults, for keys a config.json leaves out
    defaults: ClassVar[dict[str, Any]] = {
        "max_position_embeddings": 32768,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    qkv_bias: ClassVar[bool] = True
    extra_config: ClassVar[dict[str, Any]] = {"use_sliding_window": False, "sliding_window": None}

    def check(self, config: Mapping[str, Any], where: str) -> None:
        if config.get("use_sliding_window"):
            raise InputError(
                f"{where}: use_sliding_window = true (sliding_window "
                f"{config.get('sliding_window')}): sliding-window attention layers are not "
                "supported, mixlen attends to the whole document"
            )
        layer_types = config.get("layer_types") or []
        if not isinstance(layer_types, list):
            raise InputError(f"{where}: layer_types must be a list or null, got {layer_types!r}")
        if "sliding_attention" in layer_types:
            raise InputError(
                f"{where}: layer_types has 'sliding_attention' layers: sliding-window attention "
                "is not supported, mixlen attends to the whole document"
            )


FAMILY = Qwen2()
