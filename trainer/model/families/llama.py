"""LlamaForCausalLM (Llama 2, 3, 3.1, 3.2; grouped-query attention, tied or untied embeddings,
rope_scaling linear, llama3, yarn or dynamic). Refused: biases on the attention or MLP
projections (`attention_bias`, `mlp_bias`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from datapipe.errors import InputError
from trainer.model.families.base import LlamaStyle

__all__ = ["FAMILY", "Llama"]


class Llama(LlamaStyle):
    architecture: ClassVar[str] = "LlamaForCausalLM"
    model_type: ClassVar[str] = "llama"
    # transformers' LlamaConfig defaults, for keys a config.json leaves out
    defaults: ClassVar[dict[str, Any]] = {
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    extra_config: ClassVar[dict[str, Any]] = {"attention_bias": False, "mlp_bias": False}

    def check(self, config: Mapping[str, Any], where: str) -> None:
        for key in ("attention_bias", "mlp_bias"):
            if config.get(key):
                raise InputError(
                    f"{where}: {key} = true: biases on these projections are not supported"
                )


FAMILY = Llama()
