"""Shared scenarios for tests/test_executor.py, tests/test_reference_trainer.py and
tests/test_train.py, and their gloo workers.

The exactness scenario: global batches holding a sample that needs 3 ranks, one that needs 2 and
several short ones (capacity 64, 4 ranks), trained for a few AdamW steps (warmup, cosine schedule,
clipping) under a policy. The reference it is compared with is tests/test_reference_trainer.py's
plain trainer on whole samples, which shares nothing with the executor but the model's forward.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np
import torch
import torch.distributed as dist
from _datasets import make_dataset  # noqa: F401 - the tests import it from here too

from datapipe.fetch import MemoryFetcher
from datapipe.plan.cost import DEVICES, CostModel, build_cost_model, preset
from datapipe.plan.planner import PlannerConfig
from datapipe.shapes import ModelConfig
from trainer.model.transformer import build_model, get_config
from trainer.offload.config import OffloadConfig
from trainer.offload.manager import ActivationPolicy
from trainer.offload.plan import HostNeed
from trainer.parallel.comm import Communicator, SoloComm, TorchComm, init_local_gloo
from trainer.parallel.executor import HDPExecutor
from trainer.parallel.zero import ZeroOptimizer

CAPACITY = 64
WORLD = 4
# 155 needs 3 ranks (zigzag pair 52 <= 64), 103 needs 2, the rest are packed short samples. Neither
# long length divides evenly into 2k chunks for any k the policies use (hdp 3 and 2, widen 4 and 3,
# static 4), so uneven zigzag chunks (the first S mod 2k one token longer) are exercised.
LENGTHS = [155, 103, 20, 17, 30, 9, 25, 12, 5, 40, 3]
STEPS = 5
# ranks run 3, 3, 3 and 2 micro-batches of these on 4 ranks (rings of 3 and 2 beside local work;
# hdp forms its tail sample by sample, so with 58 and 50 as well every rank would run 3)
ZERO_LENGTHS = [150, 100, 60, 20, 17, 30, 9, 25, 12, 5, 40, 3]
# bfloat16 (compute) vs the bfloat16 single-process run: relative error of the gradient in norm.
# Measured ~2-4e-3 on these batches (different sum orders of bf16 partial results); bound 2e-2.
BF16_GRAD_RTOL = 2e-2


# Tokens come from the first TOKEN_IDS ids and the embeddings are untied, so the embedding rows of
# the other ids get exactly zero gradient: the "exact zeros stay zero" check has zeros to check.
TOKEN_IDS = 200


def model_config():
    return get_config("debug", dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, tie_embeddings=False)


# The scenario's optimisation ([train] keys): 2 warmup steps, then cosine towards min_lr_ratio, AdamW,
# clipping at a global norm that lies between the steps' gradient norms (some steps clip, some not).
TRAIN = {
    "steps": STEPS,
    "lr": 3e-3,
    "warmup": 2,
    "min_lr_ratio": 0.1,
    "schedule": "cosine",
    "grad_clip": 0.415,  # the gradient norms are 0.409 to 0.428
    "weight_decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.95,
}
MODEL_SEED = 1


def scenario_data(
    seed: int = 0, lengths: list[int] = LENGTHS
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token arrays of STEPS batches of `lengths` (shuffled per step) and each step's sample
    ids."""
    rng = np.random.default_rng(seed)
    tokens: list[np.ndarray] = []
    batches = []
    for _ in range(STEPS):
        order = rng.permutation(len(lengths))
        ids = np.arange(len(tokens), len(tokens) + len(lengths), dtype=np.int64)[order]
        batches.append(ids)
        tokens += [rng.integers(0, TOKEN_IDS, size=n) for n in lengths]
    return tokens, batches


# Attention-dominated costs with a small per-micro-batch overhead: here hdp+widen puts 155 on 4
# ranks and 103 on 3 (debug's 1 ms overhead per micro-batch makes widening pointless at these
# lengths). Chunks of n positions run at n / (n + 8) of the rate, so splitting the short samples
# too (widen's static-mesh candidate, CP 4: free rings would make it win) does not pay.
WIDEN_COST = CostModel(
    1e-6, 1e-6, 1e-7, 64.0, 1e12, 2, 2000.0, 5e8, attn_n_half=8.0, name="widen-test"
)


def make_plan(policy: str, lengths: np.ndarray, ids: np.ndarray, n: int, capacity: int = CAPACITY):
    """A plan for `policy` (hdp, naive-hdp, static, single, or hdp+widen)."""
    widen = policy == "hdp+widen"
    return (
        PlannerConfig(policy=policy.split("+")[0], capacity=capacity, widen=widen)
        .build(WIDEN_COST if widen else preset("debug"), num_ranks=n)
        .plan(lengths, ids)
    )


def optimizer(model, master, comm: Communicator, **kwargs) -> tuple:
    """The island's optimizer and LR schedule as trainer.trainer.Trainer builds them from TRAIN
    (`kwargs` override ZeroOptimizer's arguments, e.g. `level`)."""
    from trainer.config.job import from_dict
    from trainer.trainer import lr_lambda

    cfg = from_dict({"data": {"path": "unused"}, "train": TRAIN})
    t = cfg.train
    args = {"lr": t.lr, "betas": (t.beta1, t.beta2), "weight_decay": t.weight_decay,
            "grad_clip": t.grad_clip, **kwargs}  # fmt: skip
    opt = ZeroOptimizer.for_model(model, comm, master=master, **args)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt.optimizer, lr_lambda(cfg.train))


def run_policy(
    comm: Communicator,
    policy: str,
    dtype: torch.dtype,
    steps: int = STEPS,
    zero: int = 0,
    clip: float | None = None,
    grad_comm: Communicator | None = None,
    all_grads: bool = False,
    lengths: list[int] = LENGTHS,
    tp: dict | None = None,
    offload: float | None = None,
    shape: ModelConfig | None = None,
) -> dict:
    """Train `steps` steps through the executor at ZeRO level `zero`, with the optimizer and
    schedule built as trainer.trainer.Trainer builds them from TRAIN (`clip` replaces its
    grad_clip). Returns the first step's reduced gradient (flat, float64; every step's in "grads"
    with `all_grads`), the loss curve, the pre-clip gradient norms, each step's learning rate, the
    final master weights (flat, float64), the group sizes each plan used and the first step's
    micro-batch counts. `tp`: {"mesh": the TP group's DeviceMesh, "comm": its communicator}:
    the model is split over it (trainer.parallel.tensor) and the gradient and weights returned
    are put back together whole. `offload`: every micro-batch offloads this ratio of its
    blocks' saved activations (`offload.force_ratio`). `shape`: the model (model_config())."""
    tokens, batches = scenario_data(lengths=lengths)
    fetcher = MemoryFetcher(tokens)
    shape = shape or model_config()
    model, master = build_model(shape, dtype, "cpu", seed=MODEL_SEED)
    kw = {} if clip is None else {"grad_clip": clip}
    whole = lambda flat: flat  # noqa: E731
    if tp is not None:
        from trainer.parallel.tensor import parallelize, whole_flat

        for m in {id(model): model, id(master): master}.values():
            parallelize(m, tp["mesh"])
        kw["tp_comm"] = tp["comm"]
        whole = functools.partial(whole_flat, model)
    opt, sched = optimizer(model, master, comm, level=zero, grad_comm=grad_comm, **kw)
    acts = None
    if offload is not None:
        settings = OffloadConfig(enabled=True, force_ratio=offload, min_bytes=0)
        pol = ActivationPolicy("none", settings)
        size = torch.empty(0, dtype=dtype).element_size()
        acts = pol.build(
            "cpu", HostNeed.of(model_config(), size, pol.checkpointed(model_config().n_layers))
        )
    ex = HDPExecutor(model, opt, comm, scheduler=sched, activations=acts)
    out: dict = {"losses": [], "grad_norms": [], "lrs": [], "group_sizes": [], "grads": []}
    for step in range(steps):
        ids = batches[step]
        plan = make_plan(policy, fetcher.lengths[ids], ids, comm.size)
        out["group_sizes"].append(sorted({int(k) for k in plan.group_sizes}))
        mine = plan.microbatches(comm.rank)
        fetched = fetcher.fetch_step([np.array(m.pieces, dtype=np.int64) for m in mine])
        out["lrs"].append(opt.optimizer.param_groups[0]["lr"])
        res = ex.accumulate(plan, fetched, step)
        if step == 0 or all_grads:
            grad = whole(opt.gather_grad()).double()
            out.setdefault("grad", grad)
            if all_grads:
                out["grads"].append(grad)
        out.setdefault("microbatches", res.microbatches)
        ex.update(res)
        out["losses"].append(res.loss)
        out["grad_norms"].append(res.grad_norm)
        if acts is not None:
            out.setdefault("moved", []).append(sum(st.moved_bytes for st in ex.act_stats))
    out["weights"] = whole(opt.gather_master()).double()
    return out


def compare(ref: dict, got: dict, dtype: torch.dtype) -> None:
    """Assert the exactness requirement for `dtype` (docs/ARCHITECTURE.md, "Loss and exactness"):
    float64 gradient elements within 1e-10 relative (exact zeros exactly zero) and the loss curve
    within 1e-9; float32 the gradient within 1e-5 relative in norm; bfloat16 within
    BF16_GRAD_RTOL.

    In float64 an element that is a near-cancelling sum of token contributions (1.7e-11 beside a
    largest element of 2.4e-2 in this scenario) cannot keep 1e-10 of itself under another
    summation order: its error is bounded by 1e-14 of the largest element instead (tens of float64
    ulps at that element's size)."""
    g, r = got["grad"], ref["grad"]
    if dtype == torch.float64:
        zero = r == 0
        assert zero.any(), "the reference has no exact zeros to check"
        assert torch.equal(g[zero], r[zero]), "exact zeros of the reference are not zero"
        err = (g - r).abs()
        bound = 1e-10 * r.abs() + 1e-14 * r.abs().max()
        worst = int(torch.argmax(err / bound))
        assert bool((err <= bound).all()), (
            f"float64 gradient element {worst} is {float(g[worst])!r}, the reference's "
            f"{float(r[worst])!r} (relative error {float(err[worst] / r[worst].abs()):.3g})"
        )
        la, lb = np.array(got["losses"]), np.array(ref["losses"])
        assert np.all(np.abs(la - lb) <= 1e-9 * np.abs(lb)), f"loss curves differ: {la} vs {lb}"
    else:
        rtol = 1e-5 if dtype == torch.float32 else BF16_GRAD_RTOL
        err = float((g - r).norm() / r.norm())
        assert err <= rtol, f"{dtype} gradient off by {err:.3g} relative in norm (bound {rtol})"


def describe_errors(ref: dict, got: dict) -> str:
    """The measured errors of `got` against `ref`, for benchmarks/RESULTS.md (pytest -s)."""
    g, r = got["grad"], ref["grad"]
    rel = (g - r).abs() / r.abs()
    elem = float(rel[r != 0].max())
    big = float(rel[r.abs() >= 1e-4 * r.abs().max()].max())
    norm = float((g - r).norm() / r.norm())
    la, lb = np.array(got["losses"]), np.array(ref["losses"])
    loss = float(np.max(np.abs(la - lb) / np.abs(lb)))
    return (
        f"gradient {norm:.1e} in norm, elements max {elem:.1e} ({big:.1e} above 1e-4 of the "
        f"largest); loss curve max {loss:.1e}"
    )


# --- offload and activation checkpointing (trainer.offload.manager) in the executor ---------------------------


def offload_model_config():
    """The exactness model with 4 layers (with 2, Eq. 3's (l - 2) term vanishes)."""
    return dataclasses.replace(model_config(), n_layers=4)


# the model's cost preset on the cpu device, with a host link fast enough to hide every copy: hdp
# then plans the scenario's long samples with offload ratios 0.5 and 1 (155 on a ring of 2, 103
# alone on one rank)
OFFLOAD_COST = dataclasses.replace(
    build_cost_model("offload-test", offload_model_config(), DEVICES["cpu"], dtype_bytes=8),
    offload_bytes_per_s=1e15,
)
OFFLOAD_STEPS = 3  # the bitwise cases (the planned case runs all STEPS, against the reference)


def run_offload(
    comm: Communicator,
    policy: str = "hdp",
    *,
    managed: bool = True,
    force: float | None = None,
    checkpoint: str = "none",
    planned: bool = False,
    budget: int = 0,
    steps: int = OFFLOAD_STEPS,
) -> dict:
    """run_policy's training (TRAIN, float64) of the 4-layer model through an executor with an
    ActivationManager (none if not `managed`) running `force` ratio / the `checkpoint` policy, on
    plans made with offload if `planned`. Returns the first step's gradient, the loss curve, the
    final weights, each step's StepResult and plan, and this rank's micro-batch stats beside the
    plan's host bytes for them."""
    tokens, batches = scenario_data()
    fetcher = MemoryFetcher(tokens)
    shape = offload_model_config()
    model, master = build_model(shape, torch.float64, "cpu", seed=MODEL_SEED)
    opt, sched = optimizer(model, master, comm)
    acts = None
    if managed:
        settings = OffloadConfig(
            enabled=planned or force is not None,
            force_ratio=force,
            host_budget_bytes=budget,
            min_bytes=0,  # every saved storage moves: bytes moved are the plan's host bytes
        )
        pol = ActivationPolicy(checkpoint, settings)
        acts = pol.build("cpu", HostNeed.of(shape, 8, pol.checkpointed(shape.n_layers)))
    ex = HDPExecutor(model, opt, comm, scheduler=sched, activations=acts)
    out: dict = {"losses": [], "results": [], "mbs": [], "plans": []}
    for step in range(steps):
        ids = batches[step]
        config = PlannerConfig(policy, capacity=CAPACITY)
        plan = config.build(OFFLOAD_COST, comm.size, offload=planned).plan(
            fetcher.lengths[ids], ids
        )
        mine = plan.microbatches(comm.rank)
        fetched = fetcher.fetch_step([np.array(m.pieces, dtype=np.int64) for m in mine])
        res = ex.accumulate(plan, fetched, step)
        if step == 0:
            out["grad"] = opt.gather_grad().double()
        ex.update(res)
        out["losses"].append(res.loss)
        out["results"].append(res)
        out["plans"].append(plan)
        if acts is not None:
            po = ex.plan_offload
            own = np.flatnonzero(po.rank == comm.rank)  # this rank's memberships, slot order
            out["mbs"].append(
                [
                    (int(po.mb[i]), float(po.ratio[i]), int(po.host_bytes[i]), st)
                    for i, st in zip(own, ex.act_stats)
                ]
            )
            assert acts.store_bytes == 0 and acts.pool.live_bytes == 0  # emptied every backward
    out["weights"] = opt.gather_master().double()
    return out


OFFLOAD_RUNS = {  # name -> run_offload keywords (the offload cases of the gloo worker)
    "r=0": {"force": 0.0},
    "r=0.5": {"force": 0.5},
    "r=1": {"force": 1.0},
    "full": {"checkpoint": "full"},
    "every:2+r=0.5": {"checkpoint": "every:2", "force": 0.5},
}


def compare_offload(plain: dict, got: dict, name: str) -> str:
    """Offload only moves bytes: gradients, losses and final weights bitwise those of the plain
    executor; checkpointing recomputes: within float64 1e-12. Returns the errors measured."""
    g, r = got["grad"], plain["grad"]
    err = float(((g - r).abs() / r.abs().clamp_min(1e-300)).max())
    w, wr = got["weights"], plain["weights"]
    werr = float(((w - wr).abs() / wr.abs().clamp_min(1e-300)).max())
    if any(mode in name for mode in ("full", "every", "selective")):
        assert err <= 1e-12 and werr <= 1e-12, f"{name}: off by {err:.3g} / {werr:.3g}"
        la, lb = np.array(got["losses"]), np.array(plain["losses"])
        assert np.all(np.abs(la - lb) <= 1e-12 * np.abs(lb)), f"{name}: {la} vs {lb}"
    else:
        assert torch.equal(g, r), f"{name}: gradients differ from r = 0 (max rel {err:.3g})"
        assert torch.equal(got["weights"], plain["weights"]), f"{name}: weights differ"
        assert got["losses"] == plain["losses"], name
    return f"{name}: gradient elements max rel {err:.1e}, final weights {werr:.1e}"


def offload_cases(comm: Communicator) -> dict:
    """The offload cases of the gloo worker: the plain executor, OFFLOAD_RUNS, and plans made with
    offload over all STEPS (results without the per-micro-batch objects)."""
    keep = ("grad", "losses", "weights")
    out = {"plain": run_offload(comm, managed=False)}
    for name, kw in OFFLOAD_RUNS.items():
        out[name] = run_offload(comm, **kw)
    out["planned"] = run_offload(comm, planned=True, steps=STEPS)
    for name, got in out.items():
        everyone = comm.all_gather(got["grad"])
        assert all(torch.equal(x, got["grad"]) for x in everyone), f"{name}: ranks' grads differ"
        lean = {k: got[k] for k in keep}
        lean["moved"] = [r.offload_bytes for r in got["results"]]
        lean["ratios"] = sorted({float(x) for p in got["plans"] for x in p.mb_offload})
        out[name] = lean
    return out


# --- gloo worker: exactness over 4 processes ------------------------------------------------------

# float32 runs on threads (tests/test_reference_trainer.py); over gloo the float64 exactness and a
# second dtype through the collectives, bfloat16
GLOO_CASES = (
    ("hdp", torch.float64),
    ("static", torch.float64),
    ("hdp", torch.bfloat16),
)


def exactness_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """Every case of GLOO_CASES over the process group, and `single` in bfloat16 on rank 0 (the
    bfloat16 comparison); checks that every rank holds the same reduced gradient, and rank 0
    saves the results to out_dir/exactness.pt for the test to compare with the reference."""
    init_local_gloo(rank, world, port, timeout_s=60)
    try:
        comm = TorchComm()
        results = {}
        for policy, dtype in GLOO_CASES:
            got = run_policy(comm, policy, dtype)
            everyone = comm.all_gather(got["grad"])
            assert all(torch.equal(x, got["grad"]) for x in everyone), "ranks' grads differ"
            results[(policy, str(dtype))] = got
        offload = offload_cases(comm)  # hdp on the 4-layer model (trainer.offload.manager)
        if rank == 0:
            results["offload"] = offload
            results[("single", str(torch.bfloat16))] = run_policy(
                SoloComm(), "single", torch.bfloat16
            )
            tmp = os.path.join(out_dir, "exactness.pt.tmp")
            torch.save(results, tmp)
            os.replace(tmp, os.path.join(out_dir, "exactness.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# --- training runs: a config over a tiny dataset (tests/_datasets.py) and a 2-process worker ---


def train_config(data: str, run: str, **sections: dict):
    """A small TrainerConfig over `data` writing into `run` (section dicts override)."""
    from trainer.config.job import from_dict

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

    from trainer.parallel.runtime import setup_runtime
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
