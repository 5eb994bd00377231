"""Hostile input, round four (issue 29): pretrained folders and the model's settings. Every float
of config.json and `[model]` finite and in its range (an infinite RoPE factor, attention factor or
norm epsilon trained NaN or a dead model; a yarn beta_fast of 1e308 was a math domain error), every
integer bounded (10^9 layers listed weight names until memory ran out), non-finite weights named
with the file and tensor before training or evaluating on them, a model whose weights alone
exceed the machine's memory refused by key before any allocation, calibrate's `--nproc` bounded by
the cores, safetensors headers whose tensors share bytes, and a device in place of the weights
file."""

from __future__ import annotations

import json
import math
import os
import struct
import time
from pathlib import Path

import pytest
import torch
from _faults import cli_error
from _hf_reference import hf_model, save
from _train_worker import make_dataset, train_config
from test_hf_errors import copy_of, edit_config, edit_tensors

from datapipe.errors import InputError
from trainer.model.config import ModelSection
from trainer.model.pretrained import inspect_pretrained, load_pretrained_weights
from trainer.model.transformer import build

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(60)]  # conftest.py

ROOT = Path(__file__).resolve().parent.parent
BYTES_IDS = {"vocab_size": 300, "bos_token_id": 256, "eos_token_id": 257}  # the byte tokenizer's
INF = float("inf")
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return save(hf_model("llama-tied", **BYTES_IDS), str(tmp_path_factory.mktemp("hf") / "llama"))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("data") / "ds"), n_docs=40)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rope_theta": INF}, "rope_theta must be finite, got inf"),
        ({"rms_norm_eps": INF}, "rms_norm_eps must be finite, got inf"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be finite, got nan"),
        ({"rms_norm_eps": 2.0}, "rms_norm_eps must be <= 1, got 2.0"),
        ({"rope_theta": 1.0}, "rope_theta must be > 1, got 1.0"),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": INF}},
            "rope_scaling.factor: must be finite, got inf",
        ),
        (
            {"rope_scaling": {**YARN, "attention_factor": INF}},
            "rope_scaling.attention_factor: must be finite, got inf",
        ),
        (
            {"rope_scaling": {**YARN, "beta_fast": 1e308}},
            r"rope_scaling.beta_fast: must be <= 1e\+06, got 1e\+308",
        ),
        (
            {"rope_scaling": {**YARN, "mscale": 1.0, "mscale_all_dim": -1 / (0.1 * math.log(2))}},
            "rope_scaling.mscale_all_dim: must be >= 0",
        ),
        (
            {"num_hidden_layers": 10**9},
            r"num_hidden_layers must be an integer in \[1, 4,096\] \(got 1000000000\)",
        ),
        (
            {"vocab_size": 10**11},
            r"vocab_size must be an integer in \[1, 4,294,967,296\] \(got 100000000000\)",
        ),
        (
            {"tie_word_embeddings": "false"},
            "tie_word_embeddings must be true, false or null, got 'false'",
        ),
    ],
    ids=[
        "theta-inf",
        "eps-inf",
        "eps-nan",
        "eps-2",
        "theta-1",
        "factor-inf",
        "attention-inf",
        "beta-1e308",
        "mscale-zero-denominator",
        "layers-1e9",
        "vocab-1e11",
        "tie-string",
    ],  # fmt: skip
)
def test_config_json_numbers_out_of_range_are_named(llama, tmp_path, changes, message):
    """Each refused by `inspect_pretrained` at once, naming config.json and the key (10^9 layers
    allocated until MemoryError after minutes)."""
    path = copy_of(llama, tmp_path / "m")
    edit_config(path, **changes)
    t0 = time.perf_counter()
    with pytest.raises(InputError, match=rf"{path}/config.json: {message}"):
        inspect_pretrained(path)
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ('model.rope_scaling={type="linear", factor=inf}', "must be finite, got inf"),
        (
            'model.rope_scaling={type="yarn", factor=2.0, original_max_position_embeddings=64, '
            "attention_factor=inf}",
            "attention_factor: must be finite, got inf",
        ),
        ("model.rope_theta=0.5", "rope_theta must be > 1, got 0.5"),
    ],
    ids=["factor-inf", "attention-inf", "theta-half"],
)
def test_model_overrides_out_of_range_are_named(override, message, capsys):
    """`--set` values a TOML file may hold (inf inside a table was accepted): exit 2 naming the
    key, before anything runs."""
    err = cli_error(
        ["train", str(ROOT / "configs" / "debug.toml"), "--set", override, "--print-config"], capsys
    )
    assert "model.r" in err and message in err, err


def _nan_folder(llama: str, dst: Path, value: float, dtype: torch.dtype = torch.float32) -> str:
    path = copy_of(llama, dst)

    def poison(t: dict) -> None:
        for k in t:
            t[k] = t[k].to(dtype)
        t[Q_PROJ][1, 2] = value

    edit_tensors(path, poison)
    return path


@pytest.mark.parametrize("value", [float("nan"), INF, -INF])
def test_a_non_finite_pretrained_weight_is_named(llama, tmp_path, value):
    path = _nan_folder(llama, tmp_path / "m", value)
    pre = inspect_pretrained(path)
    with pytest.raises(
        InputError, match=rf"model.safetensors: tensor {Q_PROJ} holds 1 non-finite value"
    ):
        load_pretrained_weights(build(pre.shape), pre)


def test_a_weight_beyond_the_compute_dtype_is_named(llama, tmp_path):
    """A float64 checkpoint's 1e300 is finite, but inf once cast to float32."""
    path = _nan_folder(llama, tmp_path / "m", 1e300, torch.float64)
    pre = inspect_pretrained(path)
    load_pretrained_weights(build(pre.shape, dtype=torch.float64), pre)
    with pytest.raises(InputError, match=rf"tensor {Q_PROJ} holds 1 value beyond float32's range"):
        load_pretrained_weights(build(pre.shape), pre)


def test_train_and_eval_refuse_a_nan_pretrained_folder(llama, dataset, tmp_path, capsys):
    """Training from a folder with one NaN weight ran, saved a NaN checkpoint and exited 0; eval
    printed loss NaN, exit 0. Both now exit 2 naming the tensor, and nothing is saved."""
    from trainer.train import run_training

    path = _nan_folder(llama, tmp_path / "m", float("nan"))
    c = train_config(dataset, str(tmp_path / "run"), train={"steps": 2, "eval_interval": 0},
                     checkpoint={"interval": 1}, parallel={"policy": "single", "capacity": 4096})  # fmt: skip
    c.model = ModelSection(pretrained=path)
    with pytest.raises(InputError, match=rf"tensor {Q_PROJ} holds 1 non-finite value"):
        run_training(c)
    assert not (tmp_path / "run" / "ckpt").exists() or not os.listdir(tmp_path / "run" / "ckpt")
    err = cli_error(["eval", path, dataset, "--split", "all", "--no-passkey"], capsys)
    assert f"tensor {Q_PROJ} holds 1 non-finite value" in err


def _shared_offsets(path: str) -> str:
    """Rewrite model.safetensors' header so that the first two tensors of equal size point at the
    same bytes (the file's size unchanged)."""
    file = os.path.join(path, "model.safetensors")
    raw = open(file, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    names = [k for k in header if k != "__metadata__"]
    first = next(a for a in names if any(header[a]["shape"] == header[b]["shape"]
                                         for b in names if b != a))  # fmt: skip
    second = next(b for b in names if b != first and header[b]["shape"] == header[first]["shape"])
    header[second]["data_offsets"] = header[first]["data_offsets"]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    assert len(text) == n
    with open(file, "wb") as f:
        f.write(raw[:8] + text + raw[8 + n :])
    return second


def test_tensors_sharing_bytes_in_a_header_are_named(llama, dataset, tmp_path, capsys):
    """Two tensors with one data_offsets range passed the check, then every rank of train and
    eval died with safetensors' own error (a traceback)."""
    path = copy_of(llama, tmp_path / "m")
    second = _shared_offsets(path)
    with pytest.raises(InputError, match=rf"model.safetensors: tensor {second}: data_offsets"):
        inspect_pretrained(path)
    err = cli_error(["eval", path, dataset, "--split", "all", "--no-passkey"], capsys)
    assert f"tensor {second}: data_offsets" in err


def test_a_device_as_the_weights_file_is_named(llama, tmp_path):
    """model.safetensors a symlink to /dev/zero was "neither model.safetensors nor ...index.json"."""
    path = copy_of(llama, tmp_path / "m")
    os.remove(os.path.join(path, "model.safetensors"))
    os.symlink("/dev/zero", os.path.join(path, "model.safetensors"))
    with pytest.raises(
        InputError, match=r"model.safetensors: a character device, not a regular file"
    ):
        inspect_pretrained(path)


@pytest.mark.parametrize("window", ["4096", float("nan"), True])
def test_a_mistral_window_that_is_not_a_number_is_named(tmp_path, window):
    """A string sliding_window was a TypeError traceback comparing it with the context."""
    path = save(hf_model("mistral"), str(tmp_path / "m"))
    edit_config(path, sliding_window=window)
    with pytest.raises(InputError, match="config.json: sliding_window must be an integer or null"):
        inspect_pretrained(path)


def test_qwen2_layer_types_that_are_not_a_list_are_named(tmp_path):
    """A number as layer_types was a TypeError traceback (`in` on an int)."""
    path = save(hf_model("qwen2"), str(tmp_path / "q"))
    edit_config(path, layer_types=5)
    with pytest.raises(InputError, match="config.json: layer_types must be a list or null, got 5"):
        inspect_pretrained(path)
