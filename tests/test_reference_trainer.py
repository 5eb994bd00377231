"""The reference trainer, and every policy's training checked against it (the project's first
correctness test: docs/ARCHITECTURE.md, "Loss and exactness").

The reference shares nothing with the HDP executor (trainer/parallel/executor.py) but the model's forward.
Each step, written out below so that it can be read against the documentation line by line:

1. every sample of the step runs whole, one at a time, through the model (positions 0..L-1,
   causal attention over the sample alone);
2. the step's loss is the sum of the token losses of all its samples (position i predicts token
   i + 1; `torch.nn.functional.cross_entropy` with reduction "sum") divided by the step's labelled
   positions, the sum of L - 1 over its samples (a sample's last position has no next token);
3. the gradient is that loss's gradient, clipped to `grad_clip` in global norm
   (`torch.nn.utils.clip_grad_norm_`);
4. `torch.optim.AdamW` steps with the step's learning rate: linear warmup over `warmup` steps
   (lr * (step + 1) / warmup), then cosine from lr down to min_lr_ratio * lr, reached on the last
   step (trainer.config.job.TrainConfig: `lr`, `warmup`, `schedule`, `min_lr_ratio`, `steps`).

The executor runs the same batches through plans of every policy (hdp, naive-hdp, static, hdp+widen
and single) on 4 fake ranks (threads) and on 4 gloo processes; the results must agree with the
reference (tests/_train_worker.py `compare`): in float64 every gradient element within 1e-10
relative (or 1e-14 of the largest element, for near-cancelling sums), exact zeros exactly zero, the
loss curve and gradient norms within 1e-9; in float32 within 1e-5 relative in norm. The learning
rates and the final weights are compared too. tests/test_train.py checks whole `mixlen train` runs
against `reference_run`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Sequence

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _train_worker import (
    GLOO_CASES,
    LENGTHS,
    MODEL_SEED,
    OFFLOAD_RUNS,
    STEPS,
    TRAIN,
    WORLD,
    compare,
    compare_offload,
    describe_errors,
    exactness_main,
    model_config,
    offload_model_config,
    run_policy,
    scenario_data,
)
from readback import read_rows, samples_from_rows

from datapipe.shapes import ModelConfig
from trainer.config.job import TrainerConfig
from trainer.data import held_out_mask
from trainer.model.transformer import build_model
from trainer.parallel.comm import free_port, spawn
from trainer.testing.threads import run_threads

F64 = torch.float64
F32 = torch.float32


# --- the reference trainer ------------------------------------------------------------------------


def reference_lr(step: int, train: dict) -> float:
    """Learning rate of 0-based step `step`: linear warmup, then cosine to min_lr_ratio * lr."""
    lr, warmup, steps = train["lr"], train["warmup"], train["steps"]
    if step < warmup:
        return lr * (step + 1) / warmup
    if train["schedule"] == "constant":
        return lr
    progress = min((step - warmup) / max(steps - 1 - warmup, 1), 1.0)  # 1 on the last step
    floor = train["min_lr_ratio"]
    return lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def reference_loss(model: torch.nn.Module, samples: Sequence[np.ndarray]) -> torch.Tensor:
    """The step's loss: token losses of whole samples, summed, / the step's labelled positions."""
    token_loss_sum = torch.zeros((), dtype=torch.float64)
    labelled_positions = 0
    for tokens in samples:
        n = len(tokens)
        labelled_positions += max(n - 1, 0)
        if n < 2:  # no position of this sample has a next token
            continue
        ids = torch.as_tensor(np.asarray(tokens), dtype=torch.int64)
        logits = model(ids, torch.arange(n))  # the whole sample, alone
        loss = F.cross_entropy(logits[:-1], ids[1:], reduction="sum")
        token_loss_sum = token_loss_sum + loss.double()
    return token_loss_sum / labelled_positions


def reference_train(
    tokens: Sequence[np.ndarray],
    batches: Sequence[np.ndarray],
    train: dict,
    shape: ModelConfig,
    dtype: torch.dtype,
    seed: int,
    val_samples: Sequence[np.ndarray] = (),
    eval_interval: int = 0,
) -> dict:
    """Train on `batches` (sample ids into `tokens`): the loss curve, the first step's gradient
    (flat, float64, before clipping), the gradient norms before clipping, each step's learning
    rate, the final weights (flat, float64) and, every `eval_interval` steps (1-based step
    numbers), the loss of `val_samples` after that step's update."""
    model, _ = build_model(shape, dtype, "cpu", seed=seed)  # float32/float64: one module
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        params,
        lr=train["lr"],
        betas=(train["beta1"], train["beta2"]),
        weight_decay=train["weight_decay"],
    )
    out: dict = {"losses": [], "grad_norms": [], "lrs": [], "val_losses": [], "tokens": []}
    for step, ids in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        loss = reference_loss(model, [tokens[i] for i in ids])
        loss.backward()
        if step == 0:
            out["grad"] = torch.cat([p.grad.reshape(-1).double() for p in params])
        if train["grad_clip"] > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, train["grad_clip"])
        else:
            norm = torch.cat([p.grad.reshape(-1) for p in params]).norm()
        lr = reference_lr(step, train)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        out["losses"].append(float(loss.detach()))
        out["grad_norms"].append(float(norm))
        out["lrs"].append(lr)
        out["tokens"].append(int(sum(len(tokens[i]) for i in ids)))
        if eval_interval and (step + 1) % eval_interval == 0 and len(val_samples):
            with torch.no_grad():
                out["val_losses"].append((step + 1, float(reference_loss(model, val_samples))))
    out["weights"] = torch.cat([p.detach().reshape(-1).double() for p in params])
    return out


def reference_run(cfg: TrainerConfig) -> dict:
    """The reference run of a `mixlen train` config on a preprocessed dataset: tokens read back
    with the storage library's own reader (tests/readback.py), the same held-out split and global
    batches (the stream is the data layer's, tested on its own in tests/test_stream.py), the
    held-out set's first non-empty samples up to `data.val_tokens` (trainer.data.Validation also
    drops samples no plan holds: none in the tests' datasets), then reference_train."""
    with open(os.path.join(cfg.data.path, "manifest.json")) as f:
        manifest = json.load(f)
    by_id = samples_from_rows(read_rows(cfg.data.path, manifest))
    tokens = [by_id[i] for i in range(len(by_id))]
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    ids = np.arange(len(tokens), dtype=np.int64)
    held = held_out_mask(ids, cfg.data.stream.seed, cfg.data.val_fraction)
    train_ids, val_ids = ids[~held], ids[held & (lengths > 0)]
    stream = cfg.data.stream.build(lengths[train_ids], cfg.train.global_batch_tokens)
    batches = [train_ids[next(stream).sample_ids] for _ in range(cfg.train.steps)]
    n_val = max(int(np.searchsorted(np.cumsum(lengths[val_ids]), cfg.data.val_tokens, "right")), 1)
    val = [tokens[i] for i in val_ids[:n_val]] if cfg.train.eval_interval else []
    out = reference_train(
        tokens,
        batches,
        dataclasses.asdict(cfg.train),
        cfg.model.shape(),
        getattr(torch, cfg.train.dtype),
        cfg.train.seed,
        val,
        cfg.train.eval_interval,
    )
    out["val_tokens"] = sum(len(v) for v in val)  # the evaluated prefix's tokens
    return out


@functools.cache
def scenario_reference(dtype: torch.dtype) -> dict:
    """The reference run of the exactness scenario (tests/_train_worker.py) in `dtype`."""
    tokens, batches = scenario_data()
    return reference_train(tokens, batches, TRAIN, model_config(), dtype, MODEL_SEED)


@functools.cache
def offload_reference() -> dict:
    """The reference run of the exactness scenario on the 4-layer offload model, float64."""
    tokens, batches = scenario_data()
    return reference_train(tokens, batches, TRAIN, offload_model_config(), F64, MODEL_SEED)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


# --- the scenario exercises what it claims --------------------------------------------------------


def test_scenario_exercises_uneven_chunks_clipping_and_schedule():
    """The long samples do not divide evenly into 2k zigzag chunks for the group sizes the
    policies give them; clipping is active on some steps and not on others; the schedule has
    warmup and cosine steps."""
    for s, ks in ((LENGTHS[0], (3, 4)), (LENGTHS[1], (2, 3, 4))):
        assert all(s % (2 * k) != 0 for k in ks), (s, ks)
    ref = scenario_reference(F64)
    norms = np.array(ref["grad_norms"])
    assert (norms > TRAIN["grad_clip"]).any() and (norms < TRAIN["grad_clip"]).any(), norms
    lrs = np.array(ref["lrs"]) / TRAIN["lr"]
    assert lrs[0] == 0.5 and lrs[1] == 1.0 and lrs[2] == 1.0  # warmup over 2 steps
    assert 1.0 > lrs[3] > lrs[4]  # cosine
    assert lrs[4] == pytest.approx(TRAIN["min_lr_ratio"], rel=1e-12)  # the last step: the floor


# --- exactness: 4 fake ranks (threads) ------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "policy,dtype,sizes",
    [
        pytest.param("hdp", F64, [1, 2, 3], id="hdp-f64"),  # rings of 3 and 2 beside local work
        pytest.param("static", F64, [4], id="static-f64"),  # one CP-4 mesh, samples share rings
        pytest.param("naive-hdp", F64, [1, 2, 3], id="naive-hdp-f64"),
        pytest.param("hdp+widen", F64, [1, 3, 4], id="hdp+widen-f64"),  # widened to 4 and 3
        pytest.param("single", F64, [1], id="single-f64"),  # the executor on one rank, packed
        pytest.param("hdp", F32, [1, 2, 3], id="hdp-f32"),
        pytest.param("static", F32, [4], id="static-f32"),
    ],
)
def test_executor_matches_reference_trainer(policy, dtype, sizes):
    """Every policy's loss curve, gradients, clipping and schedule equal the reference's."""
    ref = scenario_reference(dtype)
    world = 1 if policy == "single" else WORLD
    res = run_threads(world, lambda comm: run_policy(comm, policy, dtype), timeout=100)
    for r in res[1:]:  # the reduced gradient is the same on every rank
        assert torch.equal(r["grad"], res[0]["grad"]) and r["losses"] == res[0]["losses"]
    got = res[0]
    assert got["group_sizes"][0] == sizes
    print(f"{policy} {dtype} threads vs reference: {describe_errors(ref, got)}")
    compare(ref, got, dtype)
    np.testing.assert_allclose(got["lrs"], ref["lrs"], rtol=1e-12, atol=0)
    tol = 1e-9 if dtype == F64 else 1e-5
    np.testing.assert_allclose(got["grad_norms"], ref["grad_norms"], rtol=tol, atol=0)
    w, rw = got["weights"], ref["weights"]
    assert float((w - rw).norm() / rw.norm()) <= tol, "final weights differ"


def test_reference_denominator_is_labelled_positions():
    """The reference's own rule on a tiny case, against a loss spelled out token by token."""
    shape = model_config()
    model, _ = build_model(shape, F64, "cpu", seed=3)
    rng = np.random.default_rng(0)
    samples = [rng.integers(0, 200, n) for n in (5, 1, 3)]
    with torch.no_grad():
        got = float(reference_loss(model, samples))
        total, count = 0.0, 0
        for s in samples:
            logits = model(torch.as_tensor(s), torch.arange(len(s)))
            logp = torch.log_softmax(logits, dim=-1)
            for i in range(len(s) - 1):
                total -= float(logp[i, int(s[i + 1])])
                count += 1
    assert count == 4 + 0 + 2
    assert abs(got - total / count) <= 1e-12 * abs(got)


# --- exactness: 4 gloo processes ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_exactness_gloo_4_processes(tmp_path):
    """4 gloo processes: hdp and static in float64 against the reference trainer (float32 on
    threads above), hdp in bfloat16 (compute) against `single` in bfloat16 within BF16_GRAD_RTOL;
    hdp on a 4-layer model with activation offload r = 0, 0.5, 1 bitwise the plain executor's,
    checkpointing within 1e-12, and plans made with offload against the reference trainer."""
    spawn(exactness_main, WORLD, (WORLD, free_port(), str(tmp_path)), timeout=290)
    results = torch.load(tmp_path / "exactness.pt", weights_only=False)
    for policy, dtype in GLOO_CASES:
        got = results[(policy, str(dtype))]
        # hdp ran rings of 3 and 2 beside local work; static one CP-4 mesh
        assert got["group_sizes"][0] == ([4] if policy == "static" else [1, 2, 3])
        assert len(got["losses"]) == STEPS
        ref = (
            results[("single", str(dtype))]
            if dtype == torch.bfloat16
            else scenario_reference(dtype)
        )
        vs = "single" if dtype == torch.bfloat16 else "reference"
        print(f"{policy} {dtype} gloo vs {vs}: {describe_errors(ref, got)}")
        compare(ref, got, dtype)
    off = results["offload"]
    for name, kw in OFFLOAD_RUNS.items():
        print(
            f"offload {name} gloo vs plain executor: {compare_offload(off['plain'], off[name], name)}"
        )
        moved = sum(sum(step) for step in off[name]["moved"])  # every rank, every step
        assert (moved > 0) == (kw.get("force", 0.0) > 0), (name, moved)
    planned = off["planned"]
    assert planned["ratios"] == [0.0, 0.5, 1.0]  # a ring at 0.5, a local micro-batch at 1
    print(f"offload planned gloo vs reference: {describe_errors(offload_reference(), planned)}")
    compare(offload_reference(), planned, F64)
