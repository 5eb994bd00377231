"""Pretrained models through the whole job: `[model] pretrained` with a longer RoPE base, 2 steps
on 2 gloo ranks at ZeRO 1, `mixlen export`, and transformers' `from_pretrained` of the export
giving mixlen's logits on the trained weights; `mixlen eval` on a Hugging Face folder against
transformers' own per-token cross-entropy (float64); and the errors a mismatched dataset gets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _hf_reference import F64, float64_reference, hf_model, save
from _train_worker import make_dataset, train_config
from test_hf_export import hf_load

from datapipe.errors import ConfigError
from tools.cli import main as cli_main
from trainer.config.toml import to_toml
from trainer.model.config import ModelSection
from trainer.model.pretrained import inspect_pretrained, load_pretrained_weights
from trainer.model.transformer import build
from trainer.testing.ranks import run_cli_ranks

ROOT = Path(__file__).resolve().parent.parent
BYTES_IDS = {"vocab_size": 300, "bos_token_id": 256, "eos_token_id": 257}  # the byte tokenizer's


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    # parquet: `mixlen eval --nproc 2`'s torchrun ranks leave the streaming library unimported
    return make_dataset(str(tmp_path_factory.mktemp("data") / "ds"), n_docs=40, fmt="parquet")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[torch.nn.Module, str]:
    model = hf_model("llama-llama3", **BYTES_IDS, max_position_embeddings=1024)
    return model, save(model, str(tmp_path_factory.mktemp("hf") / "llama"))


def _by_bucket(losses: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's per-token losses summed, and counted, by position bucket (0 for positions
    0-1023, then k for [1024 * 2^(k-1), 1024 * 2^k)), as index k of the two arrays."""
    pos = np.concatenate([np.arange(len(x)) for x in losses])
    k = np.searchsorted(1024 << np.arange(20), pos, side="right")
    x = np.concatenate([x.to(F64).numpy() for x in losses])
    return np.bincount(k, weights=x), np.bincount(k)


def _mixlen(path: str, weights: dict | None, dtype: torch.dtype) -> torch.nn.Module:
    pre = inspect_pretrained(path)
    model = build(pre.shape, "meta", dtype).to_empty(device="cpu")
    if weights is None:
        load_pretrained_weights(model, pre)
    else:
        model.load_state_dict({k: v.to(dtype) for k, v in weights.items()})
    return model.eval()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_from_pretrained_then_export_loads_in_transformers(dataset, llama, tmp_path, capsys):
    """2 steps on 2 gloo ranks (zero 1) from a Llama folder with rope_theta raised, exported:
    transformers loads the folder without missing or unexpected weights, its config has the run's
    RoPE base, and its logits equal mixlen's on the trained weights (float32, 1e-5 in norm); the
    weights moved from the pretrained ones; `mixlen eval --nproc 2` of the checkpoint gives the
    one-rank losses."""
    from trainer.checkpoint.weights import read_model_weights

    _, src = llama
    run = tmp_path / "run"
    c = train_config(dataset, str(run), train={"steps": 2, "eval_interval": 0})
    c.model = ModelSection(pretrained=src, rope_theta=2000.0)
    c.parallel.zero = 1
    cfg = tmp_path / "run.toml"
    cfg.write_text(to_toml(c))
    # the ranks `--nproc 2` would start, forked from the test's preloaded server (torchrun's
    # launch of train has its own tests: test_train, test_hostile_launch)
    env = {"MIXLEN_DIST_TIMEOUT": "90"}
    run_cli_ranks(["train", str(cfg), "--nproc", "2", "--quiet"], 2, 240, env, tmp_path / "tlog")
    out = tmp_path / "export"
    assert cli_main(["export", str(run / "ckpt"), "--hf", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 2000.0 and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["bos_token_id"], config["eos_token_id"]) == (256, 257)
    hf = hf_load(str(out))  # no missing, unexpected or mismatched weights, in its info or log
    trained = read_model_weights(str(run / "ckpt"))
    mine = _mixlen(str(out), trained, torch.float32)
    before = dict(_mixlen(src, None, torch.float32).named_parameters())
    assert any(not torch.equal(before[k], v) for k, v in trained.items())
    ids = torch.randint(0, 258, (300,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = mine(ids, torch.arange(300))
        want = hf(ids[None]).logits[0]
    assert (got - want).norm() <= 1e-5 * want.norm()
    # the trained checkpoint evaluated on 2 gloo ranks (capacity 256: long samples on rings) and on
    # one, in process: the same losses
    ev = ["eval", str(run / "ckpt"), dataset, "--split", "all", "--json", "--no-passkey"]
    # through torchrun (the one test of `mixlen eval --nproc`'s launch)
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    two = subprocess.run([sys.executable, "-m", "tools.cli", *ev, "--nproc", "2", "--capacity",
                          "256"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert cli_main([*ev, "--capacity", "1024"]) == 0
    one = json.loads(capsys.readouterr().out)
    got2 = json.loads(two.stdout.strip().splitlines()[-1])
    assert got2["tokens"] == one["tokens"] and got2["loss"] == pytest.approx(one["loss"], rel=1e-5)


def test_eval_on_a_hugging_face_folder_equals_transformers(dataset, llama, tmp_path, capsys):
    """`mixlen eval HF_DIR DATA --split all --dtype float64`: the overall and position-bucket
    losses equal transformers' per-token cross-entropy of each sample alone (float64, 1e-9)."""
    model, src = llama
    assert cli_main(["eval", src, dataset, "--split", "all", "--dtype", "float64", "--json",
                     "--no-passkey", "--capacity", "4096"]) == 0  # fmt: skip
    got = json.loads(capsys.readouterr().out)
    from datapipe.fetch import FetchConfig

    ref = model.to(F64)
    losses = []
    with FetchConfig().build(dataset) as fetcher, float64_reference(ref), torch.no_grad():
        for i, n in enumerate(fetcher.lengths.tolist()):
            if n < 2:
                continue
            ids = torch.from_numpy(fetcher.fetch(np.array([[i, 0, n]])).input_ids.astype(np.int64))
            losses.append(F.cross_entropy(ref(ids[None]).logits[0][:-1], ids[1:], reduction="none"))
    sums, counts = _by_bucket(losses)
    total, count = float(sums.sum()), int(counts.sum())
    assert got["tokens"] == count and got["loss"] == pytest.approx(total / count, rel=1e-9)
    for r in got["by_position"]:
        k = 0 if r["start"] == 0 else (r["start"] // 1024).bit_length()
        assert counts[k] > 0 and r["tokens"] == counts[k]
        assert r["loss"] == pytest.approx(sums[k] / counts[k], rel=1e-9)


def test_a_dataset_the_model_cannot_read_is_refused(dataset, tmp_path) -> None:
    """A vocabulary smaller than the dataset's ids, and BOS/EOS ids that differ from the
    dataset's, are errors naming both sides before training."""
    from contextlib import ExitStack

    small = save(hf_model("llama-llama3", vocab_size=97), str(tmp_path / "small"))
    c = train_config(dataset, str(tmp_path / "r"), parallel={"capacity": 1024})
    c.model = ModelSection(pretrained=small)
    with pytest.raises(ConfigError, match=r"model: vocab_size 97 < the dataset's 258"):
        with ExitStack() as st:
            c.train_data(0, 1, st, validation=False)
    other = save(hf_model("llama-llama3", vocab_size=300, bos_token_id=1), str(tmp_path / "o"))
    c.model = ModelSection(pretrained=other)
    with pytest.raises(ConfigError, match=r"bos_id 256, but .*config.json has bos_token_id 1"):
        with ExitStack() as st:
            c.train_data(0, 1, st, validation=False)
    c.model = ModelSection(pretrained=other, n_layers=5)
    with pytest.raises(
        ConfigError, match=r"model.n_layers = 5 contradicts .*num_hidden_layers = 2"
    ):
        c.model.shape()


def test_the_readme_context_extension_example_loads(dataset, tmp_path) -> None:
    """configs/extend-llama3.toml on a tiny Llama-3-style folder (trained "at 8K"): the shape keeps
    the folder's and takes the config's llama3 scaling and 64K context; its RoPE frequencies are
    transformers' llama3 rule's."""
    from transformers import LlamaConfig, modeling_rope_utils

    from trainer.config.toml import load_config
    from trainer.model.rope import inv_freq

    src = save(
        hf_model("llama-tied", **BYTES_IDS, max_position_embeddings=8192), str(tmp_path / "m")
    )
    sets = [f'model.pretrained="{src}"', f'data.path="{dataset}"', 'parallel.cost="debug"']
    cfg = load_config(ROOT / "configs" / "extend-llama3.toml", sets)
    shape = cfg.model.shape()
    assert shape.max_position_embeddings == 65536 and shape.rope_scaling.type == "llama3"
    assert shape.rope_scaling.factor == 8.0 and shape.dim == 64 and shape.vocab_size == 300
    hf = LlamaConfig(**{**json.loads((Path(src) / "config.json").read_text()),
                        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}})  # fmt: skip
    want, _ = modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    got = inv_freq(shape.head_dim, shape.rope_theta, shape.rope_scaling)
    assert torch.allclose(got.double(), want.double(), rtol=1e-6)


def _long_dataset(out: str, chars: list[int]) -> str:
    """A byte-tokenized dataset of one document per entry of `chars` (that many characters)."""
    from datapipe.ingest.preprocess import PreprocessConfig, preprocess

    rng = np.random.default_rng(1)
    with open(out + ".jsonl", "w") as f:
        for n in chars:
            text = "".join(rng.choice(list("abcdefgh ij\n"), size=n))
            f.write(json.dumps({"text": text}) + "\n")
    preprocess(PreprocessConfig(inputs=[out + ".jsonl"], out=out, progress=False))
    return out


@pytest.mark.timeout(240)
def test_a_run_from_scratch_reports_position_buckets_and_exports(dataset, tmp_path, capsys):
    """2 steps of a randomly initialised model (1 rank, zero 0, float32) evaluating a held-out
    dataset of samples up to 2.5K tokens: metrics.jsonl's val_by_position has the buckets 0-1K,
    1K-2K, 2K-4K with each bucket's labelled positions counted from the sample lengths, val_loss is
    their token-weighted mean, and each bucket's loss is transformers' per-token cross-entropy of
    the exported model (1e-5). `mixlen export` stores the trained weights exactly in float32 and as
    torch's own cast with `--dtype bfloat16`."""
    from datapipe.fetch import FetchConfig
    from datapipe.index import read_lengths
    from trainer.checkpoint.weights import read_model_weights

    val = _long_dataset(str(tmp_path / "val"), [2500, 1300, 600, 40])
    run = tmp_path / "run"
    c = train_config(dataset, str(run), train={"steps": 2, "eval_interval": 2},
                     parallel={"policy": "single", "capacity": 4096, "zero": 0})  # fmt: skip
    c.data.val_path, c.data.val_tokens = val, 1 << 20
    from trainer.train import run_training

    run_training(c)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rec = next(r for r in recs if "val_by_position" in r and r["step"] == 2)
    buckets = rec["val_by_position"]
    # the buckets and their counts, from the sample lengths alone
    lengths = read_lengths(val).tolist()
    assert max(lengths) > 2048 and min(lengths) < 1024
    bounds = [(0, 1024), (1024, 2048), (2048, 4096)]
    assert [(b["start"], b["end"]) for b in buckets] == bounds
    for b in buckets:
        assert b["tokens"] == sum(max(0, min(n - 1, b["end"]) - b["start"]) for n in lengths)
    mean = sum(b["loss"] * b["tokens"] for b in buckets) / sum(b["tokens"] for b in buckets)
    assert rec["val_loss"] == pytest.approx(mean, rel=1e-12)
    # exports: float32 (the run's dtype) exactly, bfloat16 as torch casts the trained weights
    trained = read_model_weights(str(run / "ckpt"))
    f32, bf16 = tmp_path / "f32", tmp_path / "bf16"
    assert cli_main(["export", str(run / "ckpt"), "--hf", str(f32), "--max-position-embeddings",
                     "4096"]) == 0  # fmt: skip
    assert cli_main(["export", str(run / "ckpt"), "--hf", str(bf16), "--dtype", "bfloat16"]) == 0
    capsys.readouterr()
    for out, dtype in ((f32, torch.float32), (bf16, torch.bfloat16)):
        config = json.loads((out / "config.json").read_text())
        assert config["torch_dtype"] == str(dtype).removeprefix("torch.")
        got = dict(_mixlen(str(out), None, dtype).named_parameters())
        assert sorted(got) == sorted(trained)
        for k, t in trained.items():
            assert t.dtype == torch.float32 and got[k].dtype == dtype
            assert torch.equal(got[k].detach(), t.to(dtype)), k
    assert json.loads((f32 / "config.json").read_text())["max_position_embeddings"] == 4096
    # transformers' per-token cross-entropy of each held-out sample, bucketed by hand
    hf = hf_load(str(f32))
    losses = []
    with FetchConfig().build(val) as fetcher, torch.no_grad():
        for i, n in enumerate(lengths):
            ids = torch.from_numpy(fetcher.fetch(np.array([[i, 0, n]])).input_ids.astype(np.int64))
            losses.append(F.cross_entropy(hf(ids[None]).logits[0][:-1], ids[1:], reduction="none"))
    sums, counts = _by_bucket(losses)
    assert len(counts) == len(buckets)
    for k, b in enumerate(buckets):
        assert b["tokens"] == counts[k]
        assert b["loss"] == pytest.approx(sums[k] / counts[k], rel=1e-5)
