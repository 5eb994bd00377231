"""Hugging Face folders beyond what the logits tests reach, each against transformers or
safetensors themselves: keys a config.json leaves out take transformers' defaults; options mixlen
does not implement are refused with the key named; a dynamic-NTK config's own original context is
ignored, as transformers ignores it; a tied model's stored head must have the embeddings' shape;
the tensors' byte ranges must tile the file (as safetensors requires); mixlen's RMSNorm in bfloat16
rounds as transformers' does; uint32 token ids give the int64 ids' logits."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
from _hf_reference import (
    ORIGINAL,
    assert_close_per_doc,
    hf_model,
    packed,
    reference_logits,
    rewrite_header,
    save,
)
from safetensors import safe_open
from test_hf_errors import edit_config, edit_tensors
from test_hf_model import mixlen_model
from transformers import AutoConfig

from datapipe.errors import InputError
from datapipe.shapes import get_config
from trainer.model.families import FAMILIES
from trainer.model.pretrained import inspect_pretrained
from trainer.model.transformer import RMSNorm, build

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

# the keys each family's config.json may leave out (transformers' config class defaults)
DEFAULTED = (
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "num_key_value_heads",
    "tie_word_embeddings",
)


@pytest.mark.parametrize("case", ["llama-linear", "qwen2", "mistral"])
def test_keys_left_out_take_transformers_defaults(case, tmp_path) -> None:
    path = save(hf_model(case), str(tmp_path / "m"))
    file = os.path.join(path, "config.json")
    config = json.loads(open(file).read())
    for key in DEFAULTED:
        config.pop(key)
    config["num_attention_heads"] = 32  # a multiple of every family's default key-value heads
    with open(file, "w") as f:
        json.dump(config, f)
    shape = FAMILIES[config["architectures"][0]].shape(config, file)
    ref = AutoConfig.from_pretrained(path)
    assert shape.norm_eps == ref.rms_norm_eps
    assert shape.rope_theta == ref.rope_theta
    assert shape.max_position_embeddings == ref.max_position_embeddings
    assert shape.n_kv_heads == ref.num_key_value_heads
    assert shape.tie_embeddings == ref.tie_word_embeddings


@pytest.mark.parametrize(
    "case,key,value,message",
    [
        ("llama-linear", "hidden_act", "gelu", "hidden_act 'gelu': only 'silu'"),
        ("qwen2", "hidden_act", "relu", "hidden_act 'relu': only 'silu'"),
        ("mistral", "attention_dropout", 0.1, "attention_dropout 0.1: mixlen trains without"),
        ("llama-linear", "attention_bias", True, "attention_bias = true: biases"),
        ("llama-linear", "mlp_bias", True, "mlp_bias = true: biases"),
    ],
)
def test_options_mixlen_does_not_implement_are_refused(case, key, value, message, tmp_path):
    """Refused from config.json alone (the tensors of a model without them would load)."""
    path = save(hf_model(case), str(tmp_path / "m"))
    inspect_pretrained(path)
    edit_config(path, **{key: value})
    with pytest.raises(InputError, match=f"config.json: {message}"):
        inspect_pretrained(path)


def test_a_dynamic_configs_original_context_is_its_max_position_embeddings(tmp_path) -> None:
    """transformers' dynamic NTK stretches past `max_position_embeddings` whatever
    `original_max_position_embeddings` the config states: documents between the two are not
    stretched, longer ones are (float64 logits per document)."""
    rs = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": ORIGINAL // 2}
    hf = hf_model("llama-dynamic", rope_scaling=rs)
    path = save(hf, str(tmp_path / "m"))
    assert json.loads(open(os.path.join(path, "config.json")).read())["rope_scaling"] == rs
    scaling = inspect_pretrained(path).shape.rope_scaling
    assert scaling.original_max_position_embeddings == ORIGINAL
    model = mixlen_model(path, torch.float64)
    lengths = [ORIGINAL // 2 + 5, ORIGINAL, 2 * ORIGINAL + 3]
    ids, pos, cu = packed(lengths, model.cfg.vocab_size, seed=6)
    with torch.no_grad():
        got = model(ids, pos, cu)
    assert_close_per_doc(got, reference_logits(hf, ids, lengths, torch.float64), lengths, 1e-10)


def test_a_tied_models_stored_head_must_be_the_embeddings_shape(tmp_path) -> None:
    path = save(hf_model("llama-tied"), str(tmp_path / "m"))
    emb = "model.embed_tokens.weight"
    edit_tensors(path, lambda t: t.update({"lm_head.weight": torch.zeros(97, 65)}))
    with pytest.raises(
        InputError,
        match=r"tensor lm_head.weight has shape \[97, 65\], config.json's shape needs \[97, 64\]",
    ):
        inspect_pretrained(path)
    edit_tensors(path, lambda t: t.update({"lm_head.weight": t[emb].clone()}))
    assert "lm_head.weight" in inspect_pretrained(path).tensors


def _last(header: dict) -> str:
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def _shift_last(by: int):
    def edit(header: dict, data: bytes) -> bytes:
        header[_last(header)]["data_offsets"] = [
            x + by for x in header[_last(header)]["data_offsets"]
        ]
        return data + bytes(by) if by > 0 else data[:by]

    return edit


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda h, d: d + bytes(64),
            r"the tensors' bytes end at (\d+), the file holds (\d+) after",
        ),
        (_shift_last(8), r"tensor \S+: data_offsets \[\d+, \d+\] leave a gap after tensor \S+"),
        (_shift_last(-8), r"tensor \S+: data_offsets \[\d+, \d+\] overlap tensor \S+"),
    ],
    ids=["trailing bytes", "gap", "overlap"],
)
def test_byte_ranges_must_tile_the_file(edit, message, tmp_path) -> None:
    """Trailing bytes, a gap between two tensors, two tensors sharing bytes: each refused at
    inspection naming the file and the tensor, as safetensors itself refuses the file."""
    path = save(hf_model("llama-tied"), str(tmp_path / "m"))
    file = os.path.join(path, "model.safetensors")
    rewrite_header(file, edit)
    with pytest.raises(Exception):  # noqa: B017 (safetensors' own error type varies by version)
        with safe_open(file, "pt") as f:
            [f.get_tensor(k) for k in f.keys()]
    with pytest.raises(InputError, match=f"model.safetensors: {message}") as exc:
        inspect_pretrained(path)
    m = re.search(message, str(exc.value))
    if m.groups():  # the 64 bytes appended
        assert int(m.group(2)) == int(m.group(1)) + 64


def test_rmsnorm_in_bfloat16_rounds_as_transformers() -> None:
    """bfloat16 input and weights: normalised in float32, rounded to bfloat16, then scaled,
    bit for bit transformers' LlamaRMSNorm."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(64, 256, generator=g)).bfloat16()
    weight = (1 + 0.1 * torch.randn(256, generator=g)).bfloat16()
    mine, theirs = RMSNorm(256, 1e-5).bfloat16(), LlamaRMSNorm(256, eps=1e-5).bfloat16()
    with torch.no_grad():
        mine.weight.copy_(weight)
        theirs.weight.copy_(weight)
        got, want = mine(x), theirs(x)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_narrow_token_ids_give_the_int64_ids_logits(dtype) -> None:
    """The fetch keeps token ids as uint16 or uint32 (vocabularies past 65,536): the model embeds
    them as it embeds the same ids in int64."""
    model = build(get_config("debug"), dtype=torch.float64)
    ids, pos, cu = packed([9, 30, 4], model.cfg.vocab_size, seed=1)
    narrow = torch.from_numpy(ids.numpy().astype(dtype))
    with torch.no_grad():
        assert torch.equal(model(narrow, pos, cu), model(ids, pos, cu))
