"""MistralForCausalLM without a sliding window.

`sliding_window` null, or at least `max_position_embeddings` (the window never bites within the
context the model was trained for), is read as full causal attention, and an export writes
`sliding_window: null` so transformers attends as mixlen trained it at every length. A smaller
window is refused: such a model attends differently beyond it (Mistral 7B v0.1's 4,096)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from datapipe.errors import InputError
from trainer.model.families.base import LlamaStyle

__all__ = ["FAMILY", "Mistral"]


class Mistral(LlamaStyle):
    architecture: ClassVar[str] = "MistralForCausalLM"
    model_type: ClassVar[str] = "mistral"
    # transformers' MistralConfig defaults, for keys a config.json leaves out
    defaults: ClassVar[dict[str, Any]] = {
        "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
    }
    extra_config: ClassVar[dict[str, Any]] = {"sliding_window": None}

    def check(self, config: Mapping[str, Any], where: str) -> None:
        window, context = config.get("sliding_window"), config.get("max_position_embeddings")
        number = isinstance(window, (int, float)) and not isinstance(window, bool)
        if window is not None and not (number and window == window):  # NaN != NaN
            raise InputError(f"{where}: sliding_window must be an integer or null, got {window!r}")
        if window is not None and not (isinstance(context, int) and window >= context):
            raise InputError(
                f"{where}: sliding_window = {window} is smaller than max_position_embeddings "
                f"= {context}: sliding-window attention is not supported, mixlen attends to the "
                "whole document (a null window, or one >= max_position_embeddings, is)"
            )


FAMILY = Mistral()
