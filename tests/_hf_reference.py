"""Test support for the Hugging Face tests: tiny random transformers models saved with
`save_pretrained`, transformers' forward of each document alone (the independent reference), and
packed batches of documents.

transformers upcasts to float32 explicitly (RMSNorm, the softmax, the RoPE tables), so a float64
model is not float64 throughout. `float64_reference` runs it in float64: its modeling modules see
a `torch` whose float32 is float64, and the rotary embedding evaluates transformers' own RoPE
parameter functions (`rope_init_fn`, under the same float64 `torch`) for each document.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    modeling_rope_utils,
)

F64 = torch.float64
BASE = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    intermediate_size=96,
    vocab_size=97,
    rope_theta=500.0,  # wavelengths from 6 to ~1,600 positions: every llama3 / yarn band is used
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
    attn_implementation="eager",
)
ORIGINAL = 32  # original_max_position_embeddings of the scaled cases; documents reach past it
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": ORIGINAL,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
YARN_SET = {**YARN, "beta_fast": 8.0, "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 0.5}

# name -> (model class, config class, config overrides)
CASES = {
    "llama-tied": (LlamaForCausalLM, LlamaConfig, {"tie_word_embeddings": True}),
    "llama-linear": (
        LlamaForCausalLM,
        LlamaConfig,
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    "llama-llama3": (
        LlamaForCausalLM,
        LlamaConfig,
        {"rope_scaling": LLAMA3, "tie_word_embeddings": True},
    ),
    "llama-yarn": (LlamaForCausalLM, LlamaConfig, {"rope_scaling": YARN}),
    # dynamic NTK stretches the base for documents longer than max_position_embeddings
    "llama-dynamic": (
        LlamaForCausalLM,
        LlamaConfig,
        {
            "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
            "max_position_embeddings": ORIGINAL,
        },
    ),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {"rope_scaling": YARN_SET}),
    # an explicit head_dim: 4 heads of 24 over a width of 64
    "mistral": (MistralForCausalLM, MistralConfig, {"sliding_window": None, "head_dim": 24}),
}


def hf_model(case: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A tiny random float32 model of `case`; every parameter drawn (biases and norms too)."""
    model_cls, config_cls, extra = CASES[case]
    config = config_cls(**{**BASE, **copy.deepcopy(extra), **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(noise)
            else:
                p.copy_(0.1 * noise)
    return model


def save(model: torch.nn.Module, path: str, dtype: torch.dtype | None = None, **kw: object) -> str:
    """`save_pretrained` into `path` (in `dtype` if given); returns `path`."""
    m = model if dtype is None else copy.deepcopy(model).to(dtype)
    m.save_pretrained(path, **kw)
    return path


def rewrite_header(file: str, edit: Callable[[dict, bytes], bytes]) -> None:
    """Rewrite a safetensors file in place: its JSON header through `edit(header, data)`, which
    returns the data section to write after it; the header padded to 8 bytes."""
    import json
    import struct

    with open(file, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = edit(header, raw[8 + n :])
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


class _Float64Torch:
    """torch, except that float32 (and `torch.float`) is float64."""

    float = float32 = F64

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)


def _rotary_float64(rotary: torch.nn.Module):
    def forward(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq = int(position_ids.max()) + 1 if "dynamic" in rotary.rope_type else None
        inv, scale = rotary.rope_init_fn(rotary.config, x.device, seq_len=seq)
        ang = position_ids.to(F64)[..., None] * inv.to(F64)
        emb = torch.cat([ang, ang], dim=-1)
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)

    return forward


@contextlib.contextmanager
def float64_reference(model: torch.nn.Module) -> Iterator[None]:
    """Run the float64 `model` in float64 throughout (see the module docstring)."""
    modules = [sys.modules[type(model).__module__], modeling_rope_utils]
    saved = [m.torch for m in modules]
    rotary = model.model.rotary_emb
    for m in modules:
        m.torch = _Float64Torch()
    rotary.forward = _rotary_float64(rotary)
    try:
        yield
    finally:
        for m, t in zip(modules, saved):
            m.torch = t
        del rotary.forward


@torch.no_grad()
def reference_logits(
    model: torch.nn.Module, ids: torch.Tensor, lengths: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """transformers' logits of each document run alone (positions 0..L-1), packed back in the
    input order. Documents run shortest first, so transformers' dynamic NTK (which keeps the
    frequencies of the longest sequence seen) uses each document's own length."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int)
    out: list[torch.Tensor | None] = [None] * len(lengths)
    ctx = contextlib.nullcontext()
    if dtype == F64:
        model = copy.deepcopy(model).to(F64)
        ctx = float64_reference(model)
    else:
        model = copy.deepcopy(model)  # dynamic NTK's cached frequencies stay with this copy
    with ctx:
        for d in sorted(range(len(lengths)), key=lambda i: lengths[i]):
            doc = ids[starts[d] : starts[d] + lengths[d]]
            out[d] = model(doc[None]).logits[0]
    return torch.cat(out)  # type: ignore[arg-type]


def packed(
    lengths: Sequence[int], vocab: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(token ids, positions within each document, cu_seqlens) of documents of `lengths`."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return ids, pos, [0, *np.cumsum(lengths).tolist()]


def assert_close_per_doc(
    got: torch.Tensor, want: torch.Tensor, lengths: Sequence[int], rel: float
) -> None:
    """Every document's logits within `rel` of the reference, relative in norm."""
    assert got.shape == want.shape, (got.shape, want.shape)
    for d, (g, w) in enumerate(
        zip(torch.split(got, list(lengths)), torch.split(want, list(lengths)))
    ):
        err = float((g.to(F64) - w.to(F64)).norm() / w.to(F64).norm())
        assert err <= rel, f"document {d} (length {lengths[d]}): relative error {err:.3g} > {rel}"
