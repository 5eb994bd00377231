"""`mixlen train` on instruction data, end to end in one process: the loss curve on a preprocessed
conversation dataset equals the whole-sample reference with the mask read back by the storage
library (both loss rules, float64), a run stopped and resumed continues it, and a mixture of the
SFT source with a text source cut into max_sample_tokens units carries each unit's mask and its
labelled positions (loss_tokens) into every step, with tokens_by_source and val_by_source."""

from __future__ import annotations

import json
import os
from contextlib import ExitStack

import numpy as np
import pytest
import torch
from test_sft_fetch import _text_tokens, reference_labels, sft_dataset, sft_dataset_text
from test_sft_ingest import read_masked_rows
from test_sft_train import reference_loss

from datapipe.index import read_index
from trainer.data import held_out_mask
from trainer.model.transformer import build_model
from trainer.train import run_training

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

STEPS = 4


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    path = sft_dataset(root, "parquet", n=64, chunk=64)
    return path, read_masked_rows(path, read_index(path).manifest)


def sft_config(run: str, **sections: dict):
    """A small TrainerConfig on the byte vocabulary writing into `run` (sections override)."""
    from trainer.config.job import from_dict

    d = {
        "model": {"name": "debug", "dim": 32, "ffn_dim": 64, "vocab_size": 258},
        "data": {"val_fraction": 0.0},
        "train": {"steps": STEPS, "global_batch_tokens": 2048, "lr": 3e-3, "warmup": 2},
        "parallel": {"policy": "single"},
        "checkpoint": {"dir": os.path.join(run, "ckpt"), "interval": 2},
        "metrics": {"dir": run, "progress": False},
    }
    for name, values in sections.items():
        d[name] = {**d.get(name, {}), **values}
    return from_dict(d)


def config(data: str, run: str, rule: str, **train):
    return sft_config(
        run,
        data={"path": data},
        train={"dtype": "float64", "loss_normalization": rule, **train},
    )


def reference_curve(cfg, rows) -> list[float]:
    """The same batches (the data layer's stream over the index's lengths), trained on whole
    samples with masked labels by plain AdamW."""
    from test_reference_trainer import reference_lr

    lengths = np.array([len(rows[i][0]) for i in range(len(rows))], np.int64)
    ids = np.arange(len(lengths), dtype=np.int64)
    train_ids = ids[~held_out_mask(ids, cfg.data.stream.seed, cfg.data.val_fraction)]
    stream = cfg.data.stream.build(lengths[train_ids], cfg.train.global_batch_tokens)
    tokens = [rows[i][0] for i in ids]
    masks = [rows[i][1] for i in ids]
    model, _ = build_model(cfg.model.shape(), torch.float64, "cpu", seed=cfg.train.seed)
    params = list(model.parameters())
    t = cfg.train
    opt = torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
    train = {"lr": t.lr, "warmup": t.warmup, "steps": t.steps, "schedule": t.schedule,
             "min_lr_ratio": t.min_lr_ratio}  # fmt: skip
    losses = []
    for step in range(cfg.train.steps):
        batch = train_ids[next(stream).sample_ids]
        opt.zero_grad(set_to_none=True)
        loss = reference_loss(model, tokens, masks, batch, t.loss_normalization)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        for g in opt.param_groups:
            g["lr"] = reference_lr(step, train)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("rule", ["token", "sequence"])
def test_sft_training_equals_reference_and_resumes(sft, tmp_path, rule):
    path, rows = sft
    straight = run_training(config(path, str(tmp_path / "a"), rule))
    ref = reference_curve(config(path, str(tmp_path / "unused"), rule), rows)
    np.testing.assert_allclose(straight["losses"], ref, rtol=1e-9)
    recs = [json.loads(x) for x in open(straight["metrics"])]
    assert all(r["labelled"] < r["tokens"] - r["samples"] for r in recs)  # a mask trains fewer
    if rule == "token":
        assert [r["loss_divisor"] for r in recs] == [r["labelled"] for r in recs]
        # mixlen eval of the run's checkpoint says its loss is over the trained positions
        from tools.cli import main

        out = tmp_path / "eval"
        args = ["eval", str(tmp_path / "a" / "ckpt"), path, "--split", "all", "--no-passkey"]
        assert main([*args, "--max-tokens", "300", "--out", str(out)]) == 0
        result = json.loads((out / "eval.json").read_text())
        assert result["loss_mask"] is True and 0 < result["tokens"] < 300  # trained ones only
        return
    part = str(tmp_path / "b")  # stopped after 2 steps, resumed: the same curve, bit for bit
    first = run_training(config(path, part, rule, stop_after=2))
    again = config(path, part, rule)
    again.checkpoint.resume = True
    resumed = run_training(again)
    assert first["losses"] + resumed["losses"] == straight["losses"]


def test_mixture_of_sft_and_text_units(sft, tmp_path):
    """A mixture: the SFT source and a text source, a stage cutting units of at most 24 tokens.
    Every step's loss_tokens (from the index) and every micro-batch's labels (from the shards)
    equal the reference built from the rows read back; training runs with tokens_by_source and
    val_by_source."""
    path, rows = sft
    text = sft_dataset_text(tmp_path)
    text_rows = {i: (t, np.ones(len(t), bool)) for i, t in enumerate(_text_tokens(text))}
    by_source = [rows, text_rows]

    def mix_config(**parallel):
        return sft_config(
            str(tmp_path / "run"),
            data={"sources": [{"path": path, "weight": 0.7}, {"path": text, "weight": 0.3}],
                  "stages": [{"start_step": 1, "max_sample_tokens": 24}], "val_fraction": 0.1,
                  "val_tokens": 512},
            parallel=parallel,
            train={"steps": 3, "global_batch_tokens": 256, "eval_interval": 3,
                   "loss_normalization": "sequence"},
        )  # fmt: skip

    cfg = mix_config(policy="hdp", capacity=16)
    with ExitStack() as stack:
        data = cfg.train_data(0, 4, stack)
        assert data.mixture
        steps = data.steps()
        for _ in range(3):
            item = next(steps)
            units, lengths = item.batch.units, item.batch.lengths
            want = [
                int(by_source[s][sid][1][start + 1 : start + n].sum())
                for (s, sid, start), n in zip(units.tolist(), lengths.tolist())
            ]
            assert item.loss_tokens.tolist() == want
            key0 = int(item.batch.sample_ids[0])
            for mb, pm in zip(item.microbatches, item.plan.microbatches(0)):
                expect = []
                for key, a, b in np.asarray(pm.pieces).reshape(-1, 3).tolist():
                    s, sid, start = units[key - key0]
                    n = int(lengths[key - key0])
                    toks, mask = by_source[s][sid]
                    unit = (toks[start : start + n], mask[start : start + n])
                    expect += reference_labels(*unit, a, b, n)
                assert mb.labels.tolist() == expect
        assert (np.array(want) < lengths - 1).any()  # the SFT units train fewer than L - 1
        names = set(data.source_names)
    out = run_training(mix_config(policy="single", capacity=256))  # one process runs it whole
    recs = [json.loads(x) for x in open(out["metrics"])]
    assert all(set(r["tokens_by_source"]) == names for r in recs)
    assert set(recs[-1]["val_by_source"]) == names
    assert all(np.isfinite(r["loss"]) and r["labelled"] < r["tokens"] for r in recs)
