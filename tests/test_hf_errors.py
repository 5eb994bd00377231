"""What a Hugging Face folder can get wrong, each refused by `inspect_pretrained` (config.json and
safetensors headers only) with the file and the tensor or key named; `[model]` overrides that
contradict config.json; RoPE settings; the RoPE frequency rules against transformers' own
functions evaluated in float64."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from _hf_reference import (
    CASES,
    LLAMA3,
    ORIGINAL,
    YARN_SET,
    _Float64Torch,
    hf_model,
    rewrite_header,
    save,
)
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, modeling_rope_utils

from datapipe.errors import ConfigError, InputError
from datapipe.shapes import ModelConfig, RopeScaling
from trainer.model.pretrained import apply_overrides, inspect_pretrained, load_pretrained_weights
from trainer.model.rope import attention_factor, dynamic_inv_freq, inv_freq
from trainer.model.transformer import build, parameter_shapes

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return save(hf_model("llama-linear"), str(tmp_path_factory.mktemp("llama")))


def copy_of(src: str, dst) -> str:
    os.makedirs(dst)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())
    return str(dst)


def edit_config(path: str, **changes: object) -> None:
    cfg = json.loads(open(os.path.join(path, "config.json")).read())
    cfg.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def edit_tensors(path: str, fn) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_a_missing_shard_is_named(tmp_path):
    path = save(hf_model("llama-tied"), str(tmp_path / "m"), max_shard_size="40KB")
    shards = sorted(n for n in os.listdir(path) if n.startswith("model-0"))
    assert len(shards) >= 3
    os.remove(os.path.join(path, shards[1]))
    with pytest.raises(
        InputError,
        match=rf"{shards[1]}: missing \(model.safetensors.index.json lists \d+ tensors in it, e.g. model\.",
    ):
        inspect_pretrained(path)


def test_a_wrong_tensor_shape_is_named(llama, tmp_path):
    path = copy_of(llama, tmp_path / "m")
    name = "model.layers.1.mlp.up_proj.weight"
    edit_tensors(path, lambda t: t.update({name: t[name][:-1].clone()}))
    msg = rf"model.safetensors: tensor {name} has shape \[95, 64\], config.json's shape needs \[96, 64\]"
    with pytest.raises(InputError, match=msg):
        inspect_pretrained(path)


def test_an_unknown_architecture_is_named(llama, tmp_path):
    path = copy_of(llama, tmp_path / "m")
    edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(
        InputError,
        match=r"config.json: architecture 'GPT2LMHeadModel' is not supported \(supported: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM\)",
    ):
        inspect_pretrained(path)


def test_quantised_checkpoints_are_refused(llama, tmp_path):
    path = copy_of(llama, tmp_path / "m")
    edit_config(path, quantization_config={"quant_method": "bitsandbytes", "load_in_8bit": True})
    with pytest.raises(
        InputError,
        match="config.json: quantization_config is set: quantised checkpoints are not supported",
    ):
        inspect_pretrained(path)
    path = copy_of(llama, tmp_path / "m2")
    name = "model.layers.0.self_attn.q_proj.weight"
    edit_tensors(path, lambda t: t.update({name: t[name].to(torch.int8)}))
    with pytest.raises(
        InputError, match=rf"model.safetensors: tensor {name} has dtype I8: quantised"
    ):
        inspect_pretrained(path)


def test_sliding_windows_are_refused(tmp_path):
    qwen = save(
        hf_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1),
        str(tmp_path / "q"),
    )
    with pytest.raises(
        InputError,
        match=r"config.json: use_sliding_window = true \(sliding_window 16\): sliding-window attention layers are not supported",
    ):
        inspect_pretrained(qwen)
    mistral = save(hf_model("mistral", sliding_window=64), str(tmp_path / "m"))
    with pytest.raises(
        InputError,
        match="config.json: sliding_window = 64 is smaller than max_position_embeddings = 128",
    ):
        inspect_pretrained(mistral)
    wide = save(hf_model("mistral", sliding_window=128), str(tmp_path / "w"))  # never bites
    assert inspect_pretrained(wide).shape.head_dim == 24


def test_qwen2_sliding_layer_types_are_refused(tmp_path):
    """A Qwen2 config.json whose `layer_types` lists a sliding-window layer is refused even with
    use_sliding_window false; one of full-attention layers only loads."""
    qwen = save(hf_model("qwen2"), str(tmp_path / "q"))
    edit_config(qwen, use_sliding_window=False, layer_types=["full_attention"] * 2)
    assert inspect_pretrained(qwen).shape.qkv_bias
    edit_config(qwen, layer_types=["full_attention", "sliding_attention"], sliding_window=16)
    with pytest.raises(
        InputError,
        match=r"q/config.json: layer_types has 'sliding_attention' layers: sliding-window "
        "attention is not supported",
    ):
        inspect_pretrained(qwen)


def test_leftover_and_missing_tensors_are_named(llama, tmp_path):
    path = copy_of(llama, tmp_path / "m")
    edit_tensors(
        path, lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)})
    )
    with pytest.raises(
        InputError,
        match=r"model.safetensors: tensor model.layers.0.self_attn.extra.weight is not a weight of LlamaForCausalLM with this config.json \(left over\)",
    ):
        inspect_pretrained(path)
    path = copy_of(llama, tmp_path / "m2")
    edit_tensors(path, lambda t: t.pop("lm_head.weight"))  # untied: the head is needed
    with pytest.raises(
        InputError, match=r"tensor lm_head.weight is missing \(needed for parameter output.weight\)"
    ):
        inspect_pretrained(path)
    # older checkpoints' rotary tables carry nothing and are skipped
    path = copy_of(llama, tmp_path / "m3")
    edit_tensors(
        path, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    )
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" in inspect_pretrained(path).tensors


def test_a_tied_model_may_store_its_head(tmp_path):
    path = save(hf_model("llama-tied"), str(tmp_path / "m"))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    assert "lm_head.weight" not in tensors
    edit_tensors(
        path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()})
    )
    pre = inspect_pretrained(path)
    model = build(pre.shape)
    load_pretrained_weights(model, pre)
    assert torch.equal(model.tok_embeddings.weight.detach(), tensors["model.embed_tokens.weight"])


def test_a_tensor_whose_bytes_are_not_its_shapes_is_refused(llama, tmp_path):
    """A header entry declaring 16 bytes more than its shape and dtype hold (the file padded, so
    the ranges still tile the data section) is refused at inspection, naming the tensor, before
    any rank loads it."""
    path = copy_of(llama, tmp_path / "p")
    names: list[str] = []

    def longer(header: dict, data: bytes) -> bytes:
        last = max(
            (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"]
        )
        header[last]["data_offsets"][1] += 16
        names.append(last)
        return data + bytes(16)

    rewrite_header(os.path.join(path, "model.safetensors"), longer)
    (last,) = names
    with pytest.raises(InputError, match=rf"model.safetensors: tensor {last}: bad header entry"):
        inspect_pretrained(path)


def _with_metadata(file: str, meta: object) -> None:
    """Rewrite a safetensors file's header with `meta` as its __metadata__ (data unchanged)."""

    def edit(header: dict, data: bytes) -> bytes:
        header["__metadata__"] = meta
        return data

    rewrite_header(file, edit)


@pytest.mark.parametrize("meta", [{"format": 1}, ["pt"], {"format": None}, "pt", {"a": {}}])
def test_metadata_safetensors_refuses_is_named(llama, tmp_path, meta):
    """A __metadata__ safetensors refuses (it must map strings to strings) is named at
    inspection, and a file that changes so after inspection is named at load (not
    safetensors' own exception); metadata safetensors reads is accepted."""
    from safetensors import SafetensorError, safe_open

    path = copy_of(llama, tmp_path / "p")
    file = os.path.join(path, "model.safetensors")
    pre = inspect_pretrained(path)
    _with_metadata(file, {"format": "pt", "by": "hand"})
    with safe_open(file, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "by": "hand"}
    assert inspect_pretrained(path).tensors == pre.tensors
    _with_metadata(file, meta)
    with pytest.raises(SafetensorError), safe_open(file, framework="pt"):
        pass  # the reference: safetensors refuses this header
    with pytest.raises(InputError, match=r"model.safetensors: __metadata__ .*must be a string"):
        inspect_pretrained(path)
    with pytest.raises(InputError, match=r"model.safetensors: cannot read tensor .*deserializ"):
        load_pretrained_weights(build(pre.shape), pre)


def test_index_and_file_problems_are_named(llama, tmp_path):
    path = save(hf_model("llama-tied"), str(tmp_path / "s"), max_shard_size="40KB")
    index = json.loads(open(os.path.join(path, "model.safetensors.index.json")).read())
    files = list(index["weight_map"].values())
    name, file = next((n, f) for n, f in index["weight_map"].items() if files.count(f) > 1)
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != file)
    index["weight_map"][name] = other
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with pytest.raises(
        InputError,
        match=rf"{file}: holds tensor {name}, which model.safetensors.index.json puts in {other}",
    ):
        inspect_pretrained(path)
    path = copy_of(llama, tmp_path / "t")
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(path, "model.safetensors")) - 100)
    with pytest.raises(
        InputError, match=r"model.safetensors: tensor .* bad header entry or past the file's end"
    ):
        inspect_pretrained(path)
    path = copy_of(llama, tmp_path / "b")
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(
        InputError, match="neither model.safetensors nor model.safetensors.index.json"
    ):
        inspect_pretrained(path)


def test_rope_scaling_in_config_json(llama, tmp_path):
    path = copy_of(llama, tmp_path / "m")
    edit_config(
        path, rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}
    )
    with pytest.raises(
        InputError,
        match=r"config.json: rope_scaling type 'longrope' is not supported \(supported: default, linear, llama3, yarn, dynamic\)",
    ):
        inspect_pretrained(path)
    edit_config(
        path,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 32,
        },
    )
    with pytest.raises(
        InputError, match="config.json: rope_scaling.high_freq_factor: required for type 'llama3'"
    ):
        inspect_pretrained(path)
    edit_config(
        path, rope_scaling={"type": "dynamic", "factor": 2.0}
    )  # the old spelling of rope_type
    assert inspect_pretrained(path).shape.rope_scaling == RopeScaling("dynamic", 2.0, 128)
    # both spellings: transformers takes `type`, and so does mixlen
    both = {"type": "linear", "rope_type": "yarn", "factor": 2.0}
    assert LlamaConfig(rope_scaling=dict(both)).rope_scaling["rope_type"] == "linear"
    edit_config(path, rope_scaling=both)
    assert inspect_pretrained(path).shape.rope_scaling == RopeScaling("linear", 2.0)
    # yarn's truncate null: transformers does not round the correction range (not its default)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    edit_config(path, rope_scaling={**yarn, "truncate": None})
    got = inspect_pretrained(path).shape.rope_scaling
    want = _transformers_rope({**yarn, "truncate": None})[0]
    torch.testing.assert_close(inv_freq(16, 500.0, got), want, rtol=1e-14, atol=0)


def test_loading_copies_in_place_and_casts(llama):
    pre = inspect_pretrained(llama)
    model = build(pre.shape, dtype=torch.bfloat16)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    load_pretrained_weights(model, llama)
    tensors = load_file(os.path.join(llama, "model.safetensors"))
    for mine, hf in pre.names.items():
        p = dict(model.named_parameters())[mine]
        assert p.data_ptr() == ptrs[mine] and p.dtype == torch.bfloat16
        assert torch.equal(p.detach(), tensors[hf].to(torch.bfloat16))
    with pytest.raises(ValueError, match="the model's parameters are not this shape's"):
        load_pretrained_weights(build(ModelConfig(vocab_size=97, dim=64)), pre)


def test_overrides_that_contradict_config_json_name_both_values(llama):
    pre = inspect_pretrained(llama)
    src = os.path.join(llama, "config.json")
    with pytest.raises(
        ConfigError,
        match=rf"model.dim = 128 contradicts {src}: hidden_size = 64; model.n_kv_heads = 4 contradicts {src}: num_key_value_heads = 2",
    ):
        apply_overrides(pre.shape, {"dim": 128, "n_kv_heads": 4, "vocab_size": 97}, src)
    with pytest.raises(
        ConfigError, match="model.tie_embeddings = True contradicts .*tie_word_embeddings = False"
    ):
        apply_overrides(pre.shape, {"tie_embeddings": True}, src)
    extended = apply_overrides(
        pre.shape,
        {
            "rope_theta": 5e5,
            "rope_scaling": {"type": "yarn", "factor": 8, "original_max_position_embeddings": 128},
            "max_position_embeddings": 1024,
        },
        src,
    )
    assert extended.rope_theta == 5e5 and extended.rope_scaling == RopeScaling("yarn", 8.0, 128)
    assert extended.max_position_embeddings == 1024 and extended.dim == pre.shape.dim
    with pytest.raises(
        ConfigError, match=r"model.rope_scaling: rope_scaling.factor: must be >= 1, got 0.5"
    ):
        apply_overrides(pre.shape, {"rope_scaling": {"type": "linear", "factor": 0.5}}, src)
    with pytest.raises(ConfigError, match="model.depth: not a model shape key"):
        apply_overrides(pre.shape, {"depth": 3}, src)


def test_rope_settings_are_validated_with_the_key_named():
    with pytest.raises(
        ValueError,
        match=r"rope_scaling.type: unknown 'ntk' \(known: linear, llama3, yarn, dynamic\)",
    ):
        RopeScaling("ntk", 2.0)
    with pytest.raises(
        ValueError, match="rope_scaling.original_max_position_embeddings: required for type 'yarn'"
    ):
        RopeScaling("yarn", 2.0)
    with pytest.raises(
        ValueError,
        match=r"rope_scaling.beta_fast: not a setting of type 'llama3' \(its settings: factor, original_max_position_embeddings, low_freq_factor, high_freq_factor\)",
    ):
        RopeScaling("llama3", 8.0, 32, 1.0, 4.0, beta_fast=32.0)
    with pytest.raises(
        ValueError,
        match=r"rope_scaling.high_freq_factor: must be > low_freq_factor \(4.0\), got 4.0",
    ):
        RopeScaling("llama3", 8.0, 32, 4.0, 4.0)
    with pytest.raises(ValueError, match="rope_scaling.scale: unknown setting"):
        RopeScaling.from_dict({"type": "linear", "factor": 2.0, "scale": 1})
    with pytest.raises(ValueError, match="rope_scaling.factor: must be a number, got 'x'"):
        RopeScaling("linear", "x")
    shape = ModelConfig(
        rope_scaling={"type": "dynamic", "factor": 2, "original_max_position_embeddings": 64}
    )
    assert shape.rope_scaling == RopeScaling("dynamic", 2.0, 64)


def _transformers_rope(
    settings: dict | None, seq_len: int | None = None, max_positions: int = ORIGINAL
) -> tuple[torch.Tensor, float]:
    """transformers' own RoPE parameter function for `settings`, evaluated in float64."""
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        rope_theta=500.0,
        max_position_embeddings=max_positions,
        rope_scaling=settings,
    )
    kind = "default" if settings is None else settings["rope_type"]
    saved = modeling_rope_utils.torch
    modeling_rope_utils.torch = _Float64Torch()
    try:
        return modeling_rope_utils.ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)
    finally:
        modeling_rope_utils.torch = saved


@pytest.mark.parametrize(
    "settings",
    [
        None,
        {"rope_type": "linear", "factor": 3.0},
        LLAMA3,
        YARN_SET,
        {**YARN_SET, "truncate": False, "attention_factor": 1.3},
        {"rope_type": "dynamic", "factor": 2.0},
    ],
    ids=["default", "linear", "llama3", "yarn", "yarn-set", "dynamic"],
)
def test_frequencies_equal_transformers_in_float64(settings):
    scaling = None
    if settings is not None:
        rest = {k: v for k, v in settings.items() if k != "rope_type"}
        if settings["rope_type"] == "dynamic":
            rest["original_max_position_embeddings"] = ORIGINAL
        scaling = RopeScaling(settings["rope_type"], **rest)
    want, want_af = _transformers_rope(settings)
    assert want.dtype == torch.float64
    torch.testing.assert_close(inv_freq(16, 500.0, scaling), want, rtol=1e-14, atol=0)
    assert attention_factor(scaling) == pytest.approx(want_af, rel=1e-15)
    if scaling is not None and scaling.type == "dynamic":
        lengths = torch.tensor([1, ORIGINAL, ORIGINAL + 1, 100, 5000])
        got = dynamic_inv_freq(16, 500.0, scaling, lengths)
        for row, n in zip(got, lengths.tolist()):
            torch.testing.assert_close(row, _transformers_rope(settings, n)[0], rtol=1e-13, atol=0)


def test_yarn_over_a_long_original_context_equals_transformers():
    """Qwen-style YaRN (factor 4 over an original context of 32768, max_position_embeddings 4x
    that): the correction range ends past head_dim / 2 - 1, where transformers clamps it to
    head_dim - 1, not earlier."""
    omp = 32768
    settings = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": omp}
    want, want_af = _transformers_rope(settings, max_positions=4 * omp)
    high = 16 * math.log(omp / (2 * math.pi)) / (2 * math.log(500.0))  # beta_slow 1
    assert 16 // 2 - 1 < math.ceil(high) < 16 - 1
    scaling = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=omp)
    torch.testing.assert_close(inv_freq(16, 500.0, scaling), want, rtol=1e-14, atol=0)
    assert attention_factor(scaling) == pytest.approx(want_af, rel=1e-15)


@pytest.mark.parametrize(
    "shape",
    [
        ModelConfig(),
        ModelConfig(tie_embeddings=False, qkv_bias=True),
        ModelConfig(dim=48, n_heads=4, n_kv_heads=1, explicit_head_dim=24, n_layers=3),
    ],
    ids=["tied", "untied-bias", "head-dim"],
)
def test_parameter_shapes_are_the_built_models(shape):
    built = build(shape, device="meta").named_parameters()
    assert list(parameter_shapes(shape).items()) == [(n, tuple(p.shape)) for n, p in built]


def test_every_family_has_a_case():
    assert {"llama-tied", "qwen2", "mistral"} <= set(CASES)
