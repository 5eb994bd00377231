"""Hugging Face architecture families, chosen by config.json's `architectures` entry.

A new architecture is one new module here (a `Family`: shape from config.json, tensor names,
exported config.json, refusals) and one entry in `FAMILIES`.
"""

from __future__ import annotations

from datapipe.errors import InputError
from trainer.model.families import llama, mistral, qwen2
from trainer.model.families.base import Family

__all__ = ["FAMILIES", "Family", "family_of"]

FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": llama.FAMILY,
    "Qwen2ForCausalLM": qwen2.FAMILY,
    "MistralForCausalLM": mistral.FAMILY,
}


def family_of(architecture: str, where: str = "config.json") -> Family:
    """The family of an `architectures` entry; InputError naming `where` if unknown."""
    if architecture not in FAMILIES:
        raise InputError(
            f"{where}: architecture {architecture!r} is not supported "
            f"(supported: {', '.join(FAMILIES)})"
        )
    return FAMILIES[architecture]
