"""Shared scenarios for tests/test_executor.py and tests/test_train.py, and their gloo workers.

The exactness scenario: global batches holding a sample that needs 3 ranks, one that needs 2 and
several short ones (capacity 64, 4 ranks), trained for a few AdamW steps under a policy; the
`single` policy (one process, whole samples) is the reference.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist

from datapipe.fetch import MemoryFetcher
from datapipe.plan.cost import CostModel, preset
from datapipe.plan.planner import PlannerConfig
from trainer.comm import Communicator, SoloComm, TorchComm, init_local_gloo
from trainer.executor import HDPExecutor
from trainer.model import build_model, get_config

CAPACITY = 64
WORLD = 4
# 150 needs 3 ranks (zigzag pair 50 <= 64), 100 needs 2, the rest are packed short samples
LENGTHS = [150, 100, 20, 17, 30, 9, 25, 12, 5, 40, 3]
STEPS = 5
# bfloat16 (compute) vs the bfloat16 single-process run: relative error of the gradient in norm.
# Measured ~2-4e-3 on these batches (different sum orders of bf16 partial results); bound 2e-2.
BF16_GRAD_RTOL = 2e-2


# Tokens come from the first TOKEN_IDS ids and the embeddings are untied, so the embedding rows of
# the other ids get exactly zero gradient: the "exact zeros stay zero" check has zeros to check.
TOKEN_IDS = 200


def model_config():
    return get_config("debug", dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, tie_embeddings=False)


def scenario_data(seed: int = 0) -> tuple[MemoryFetcher, list[np.ndarray]]:
    """Token store of STEPS batches of LENGTHS (shuffled per step) and each step's sample ids."""
    rng = np.random.default_rng(seed)
    tokens, batches = [], []
    for _ in range(STEPS):
        order = rng.permutation(len(LENGTHS))
        ids = np.arange(len(tokens), len(tokens) + len(LENGTHS), dtype=np.int64)[order]
        batches.append(ids)
        tokens += [rng.integers(0, TOKEN_IDS, size=n) for n in LENGTHS]
    return MemoryFetcher(tokens), batches


# Attention-dominated costs with a small per-micro-batch overhead: here hdp+widen puts 150 on 4
# ranks and 100 on 3 (debug's 1 ms overhead per micro-batch makes widening pointless at these
# lengths).
WIDEN_COST = CostModel(1e-6, 1e-6, 1e-7, 64.0, 1e12, 2, 2000.0, 5e8, name="widen-test")


def make_plan(policy: str, lengths: np.ndarray, ids: np.ndarray, n: int):
    """A plan for `policy` (hdp, naive-hdp, static, single, or hdp+widen)."""
    widen = policy == "hdp+widen"
    return (
        PlannerConfig(policy=policy.split("+")[0], num_ranks=n, capacity=CAPACITY, widen=widen)
        .build(WIDEN_COST if widen else preset("debug"))
        .plan(lengths, ids)
    )


def run_policy(comm: Communicator, policy: str, dtype: torch.dtype, steps: int = STEPS) -> dict:
    """Train `steps` steps; return the first step's reduced gradient (flat, float64), the loss
    curve and the group sizes each plan used."""
    fetcher, batches = scenario_data()
    model, master = build_model(model_config(), dtype, "cpu", seed=1)
    opt = torch.optim.AdamW(master.parameters(), lr=3e-3, weight_decay=0.1)
    ex = HDPExecutor(model, opt, comm, master=master, grad_clip=1.0)
    out: dict = {"losses": [], "group_sizes": []}
    for step in range(steps):
        ids = batches[step]
        plan = make_plan(policy, fetcher.lengths[ids], ids, comm.size)
        out["group_sizes"].append(sorted({int(k) for k in plan.group_sizes}))
        mine = plan.microbatches(comm.rank)
        fetched = fetcher.fetch_step([np.array(m.pieces, dtype=np.int64) for m in mine])
        res = ex.accumulate(plan, fetched, step)
        if step == 0:
            out["grad"] = torch.cat([p.grad.reshape(-1).double() for p in master.parameters()])
        ex.update(res)
        out["losses"].append(res.loss)
    return out


def compare(ref: dict, got: dict, dtype: torch.dtype) -> None:
    """Assert the exactness requirement for `dtype` (docs/ARCHITECTURE.md, "Loss and exactness")."""
    g, r = got["grad"], ref["grad"]
    if dtype == torch.float64:
        zero = r == 0
        assert zero.any(), "the reference has no exact zeros to check"
        assert torch.equal(g[zero], r[zero]), "exact zeros of the reference are not zero"
        rel = ((g - r).abs() / r.abs())[~zero]
        assert float(rel.max()) <= 1e-10, f"float64 gradient element off by {float(rel.max()):.3g}"
        la, lb = np.array(got["losses"]), np.array(ref["losses"])
        assert np.all(np.abs(la - lb) <= 1e-9 * np.abs(lb)), f"loss curves differ: {la} vs {lb}"
    else:
        rtol = 1e-5 if dtype == torch.float32 else BF16_GRAD_RTOL
        err = float((g - r).norm() / r.norm())
        assert err <= rtol, f"{dtype} gradient off by {err:.3g} relative in norm (bound {rtol})"


# --- gloo worker: exactness over 4 processes ------------------------------------------------------


def exactness_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """Every policy and dtype of the exactness test; rank 0 also computes `single` and compares
    (gradients are identical on every rank after the all-reduce: checked too)."""
    init_local_gloo(rank, world, port, timeout_s=60)
    try:
        comm = TorchComm()
        lines = []
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            policies = ("hdp", "static") if dtype != torch.bfloat16 else ("hdp",)
            ref = None
            if rank == 0:
                ref = run_policy(SoloComm(), "single", dtype)
            for policy in policies:
                got = run_policy(comm, policy, dtype)
                everyone = comm.all_gather(got["grad"])
                assert all(torch.equal(x, got["grad"]) for x in everyone), "ranks' grads differ"
                if rank == 0:
                    assert ref is not None
                    compare(ref, got, dtype)
                    err = float((got["grad"] - ref["grad"]).norm() / ref["grad"].norm())
                    lines.append(f"{policy} {dtype} {got['group_sizes'][0]} {err:.3e}")
        if rank == 0:
            with open(os.path.join(out_dir, "exactness.txt"), "w") as f:
                f.write("\n".join(lines) + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()


# --- training runs: a tiny dataset and a 2-process worker ------------------------------------------


def make_dataset(out: str, n_docs: int = 120, max_chars: int = 500, seed: int = 0) -> str:
    """A small byte-tokenized dataset of mixed lengths (storage chunks of 128 tokens)."""
    import json

    from datapipe.ingest.preprocess import PreprocessConfig, preprocess

    rng = np.random.default_rng(seed)
    words = "def class return import for while if else self value data length token".split()
    src = out + ".jsonl"
    with open(src, "w") as f:
        for _ in range(n_docs):
            n = int(
                rng.choice(
                    [rng.integers(5, 60), rng.integers(60, 250), rng.integers(250, max_chars)],
                    p=[0.5, 0.35, 0.15],
                )
            )
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=n // 4 + 1))[:n]}) + "\n")
    preprocess(PreprocessConfig(inputs=[src], out=out, chunk_tokens=128, progress=False))
    return out


def train_config(data: str, run: str, **sections: dict):
    """A small TrainerConfig over `data` writing into `run` (section dicts override)."""
    from trainer.config import from_dict

    d = {
        "model": {"name": "debug", "dim": 32, "ffn_dim": 64},
        "data": {"path": data, "val_fraction": 0.1, "val_tokens": 1024},
        "train": {
            "steps": 6,
            "global_batch_tokens": 1024,
            "lr": 3e-3,
            "warmup": 2,
            "eval_interval": 3,
        },
        "parallel": {"policy": "hdp", "capacity": 256},
        "checkpoint": {"dir": os.path.join(run, "ckpt"), "interval": 3},
        "metrics": {"dir": run, "progress": False},
    }
    for name, values in sections.items():
        d[name] = {**d.get(name, {}), **values}
    return from_dict(d)


def train_main(rank: int, world: int, port: int, data: str, out_dir: str) -> None:
    """2 ranks: hdp straight for 6 steps (comparing with static every 2nd step); 3 steps then
    resume to 6 (checkpoint at 3); static for 3 steps. Rank 0 writes the loss curves to
    out_dir/losses.json."""
    import json

    from trainer.runtime import setup_runtime
    from trainer.train import run_training

    init_local_gloo(rank, world, port, timeout_s=60)
    try:
        rt = setup_runtime("cpu")
        torch.set_num_threads(1)
        out = {}
        # the straight run also runs every 2nd batch under static (no update): it must not change
        # the loss curve (first + second below run without it)
        straight = run_training(
            train_config(
                data,
                os.path.join(out_dir, "straight"),
                metrics={"compare": "static", "compare_interval": 2},
            ),
            rt,
        )
        out["straight"] = straight["losses"]
        out["val"] = straight["val_losses"]
        part = os.path.join(out_dir, "part")
        first = run_training(train_config(data, part, train={"stop_after": 3}), rt)
        second = run_training(train_config(data, part, checkpoint={"resume": True}), rt)
        out["first"], out["second"], out["second_start"] = (
            first["losses"],
            second["losses"],
            second["start_step"],
        )
        static = run_training(
            train_config(
                data,
                os.path.join(out_dir, "static"),
                train={"steps": 3},
                parallel={"policy": "static"},
                checkpoint={"dir": None},
            ),
            rt,
        )
        out["static"] = static["losses"]
        if rank == 0:
            with open(os.path.join(out_dir, "losses.json"), "w") as f:
                json.dump(out, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
