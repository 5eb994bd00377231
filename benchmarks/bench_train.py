"""Training-step benchmark: hdp, hdp+widen and static on the same global batches of the demo corpus
(`make demo` builds .demo/stdlib), measured beside the planner's prediction, for five kinds of
batches from about 0.2 s to about 30 s a step: `tiny` (samples of at most 1,024 tokens, 4,096-token
batches), `short` (the same samples, 16,384-token batches), `mixed` (the demo's stream batches:
32,768 tokens, capacity 8,192), `long` (samples over 4,096 tokens, 32,768-token batches) and `huge`
(those samples, 131,072-token batches).

- 2 gloo ranks (one per core), wall clock: step time = the slowest rank's, barrier to the end of the
  optimizer step. Predicted: the plan's makespan plus the cost model's per-step term (the work
  around the micro-batches), from a cost file calibrated here with `mixlen calibrate --nproc 2`.
- 4 ranks on 2 cores would measure the time sharing, so each micro-batch's thread CPU time (max
  over its group's members: a group waits for its slowest) is replayed through the plan's slot
  order (datapipe.plan.stepplan.replay_kernel), plus the slowest rank's CPU time of the rest of the
  step. Predicted by `mixlen calibrate --nproc 4 --clock cpu` (the same clock).
- Every (kind, batch, policy) runs `--repeats` times, and a kind of short steps until a batch's
  runs add up to `--min-seconds` (as `mixlen calibrate` times its short cases), policies
  interleaved with a rotating order so drift hits all alike; the minimum is kept. Noise floor:
  the spread (max / min - 1) of the repeats of each configuration, median and 90th percentile
  over all configurations of a world size.
- Drift: a fixed one-thread matmul probe (`probe_s`) is timed before each world size's calibration
  and after its measurement; its change says whether the machine's speed moved under the run
  (it did by 20-30% in one run here, in both directions).
- Optional: hdp against torch DistributedDataParallel on the short batches (`overhead`).
- Tensor parallelism (`tp`): one HDP rank at tp 2 (2 processes) beside tp 1 (1 process) on the
  mixed batches' one-rank hdp plans, interleaved in one run: step time and model state per
  process (`--skip wall2,replay4,overhead` runs only this part).

    .venv/bin/python benchmarks/bench_train.py [--data .demo/stdlib] [--steps 3] [--repeats 3]
        [--min-seconds 2]

Prints tables and writes benchmarks/out/bench_train.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

POLICIES = ("hdp", "hdp+widen", "static")  # "+widen": PlannerConfig(widen=True)
STEP_KEY = {2: "wall_s", 4: "step_cpu_s"}  # the measured step time of each world size's rows
SHORT_MAX, LONG_MIN = 1024, 4096
# kind -> (global batch tokens, which samples, stream seed); None: --gbt
KIND_SPECS = {
    "tiny": (4096, "short", 3),
    "short": (16384, "short", 1),
    "mixed": (None, "all", 0),
    "long": (None, "long", 2),
    "huge": (131072, "long", 4),
}
KINDS = tuple(KIND_SPECS)


# --- workers -------------------------------------------------------------------------------------


def _init(rank: int, world: int, port: int) -> None:
    from trainer.parallel.comm import init_local_gloo
    from trainer.parallel.runtime import keep_freed_memory

    keep_freed_memory()  # as the trainer's CPU ranks and `mixlen calibrate` run
    init_local_gloo(rank, world, port, timeout_s=600)


def _executor(comm, shape: dict, lr: float = 1e-3):
    import torch

    from datapipe.shapes import ModelConfig
    from trainer.model.transformer import build_model
    from trainer.parallel.executor import HDPExecutor
    from trainer.parallel.zero import ZeroOptimizer

    model, master = build_model(ModelConfig(**shape), torch.float32, seed=0)
    level = 1 if comm.size > 1 else 0  # the trainer's default
    opt = ZeroOptimizer.for_model(model, comm, master=master, level=level, lr=lr, grad_clip=1.0)
    return HDPExecutor(model, opt, comm)


def policy_planners(cost, world: int, capacity: int, max_context: int) -> dict:
    """POLICIES' planners (datapipe.plan.compare's variants) under `cost` on `world` ranks."""
    from datapipe.plan.compare import Variant, variant_planners
    from datapipe.plan.planner import PlannerConfig

    base = PlannerConfig(capacity=capacity, max_context=max_context)
    variants = [Variant("hdp"), Variant("hdp", widen=True), Variant("static")]
    planners = variant_planners(variants, base, cost, world)
    assert tuple(planners) == POLICIES
    return planners


def _policies_main(rank: int, world: int, port: int, job: dict) -> None:
    """Every policy on every batch of every kind, `repeats` times at least (short steps more);
    rank 0 writes the records."""
    import torch
    import torch.distributed as dist

    from datapipe.fetch import MemoryFetcher
    from datapipe.plan.compare import compare
    from datapipe.plan.cost import load
    from datapipe.plan.metrics import predicted_step_ns
    from trainer.calibrate_ranks import runs_for
    from trainer.compare import replayed_cpu_s
    from trainer.parallel.comm import TorchComm

    _init(rank, world, port)
    try:
        comm = TorchComm()
        data = np.load(job["tokens"], allow_pickle=True)
        fetcher = MemoryFetcher(list(data["tokens"]))
        kinds = [k for k in KINDS if k in data]
        batches = {k: [np.asarray(b) for b in data[k]] for k in kinds}
        cost = load(job["cost"])
        # the policies' plans of every batch, from the planning package's comparison service
        planners = policy_planners(cost, world, job["capacity"], job["max_context"])
        steps = [(fetcher.lengths[ids], ids) for k in kinds for ids in batches[k]]
        planned = compare(planners, steps, cost)
        execs = {p: _executor(comm, job["shape"]) for p in POLICIES}
        cases = {}  # (kind, batch, policy) -> (plan, fetched)
        keys = [(k, i) for k in kinds for i in range(len(batches[k]))]
        for p in POLICIES:
            for key, plan in zip(keys, planned[p].plans):
                fetched = fetcher.fetch_step([m.pieces for m in plan.microbatches(rank)])
                cases[(*key, p)] = (plan, fetched)

        def run(kind: str, i: int, policy: str) -> dict:
            plan, fetched = cases[kind, i, policy]
            ex = execs[policy]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            res = ex.step(plan, fetched, i)
            # wall: the slowest rank's step; CPU: beyond its micro-batches, the slowest rank's
            rest_cpu = time.thread_time() - c0 - sum(c for _, c in ex.mb_log)
            wall = torch.tensor([time.perf_counter() - t0, rest_cpu], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            cpu = replayed_cpu_s(comm, ex.mb_log, plan, rank)  # slowest member, slot order
            return {
                "kind": kind,
                "batch": i,
                "policy": policy,
                "wall_s": float(wall[0].item()),
                "replayed_cpu_s": cpu,
                "step_cpu_s": cpu + float(wall[1].item()),
                "predicted_s": predicted_step_ns(plan, cost) / 1e9,
                "predicted_mb_s": plan.makespan_ns / 1e9,
                "digest": plan.digest().hex(),
                "tokens": res.tokens,
                "samples": int(plan.lengths.shape[0]),
                "ring_bytes": int(sum(res.p2p_bytes)),
                "group_sizes": sorted({int(k) for k in plan.group_sizes}),
                "static_mesh": "static_mesh" in plan.meta,  # widen took the batch's static mesh
                "microbatches": res.microbatches,
            }

        for kind in kinds:  # warm-up: every policy once on each kind's first batch
            for p in POLICIES:
                run(kind, 0, p)
        # runs per kind: at least `repeats`, short steps until they add up to min_seconds
        hdp_s = [predicted_step_ns(plan, cost) / 1e9 for plan in planned["hdp"].plans]
        reps = {
            k: runs_for(
                float(np.mean([t for (kk, _), t in zip(keys, hdp_s) if kk == k])),
                job["repeats"],
                job["min_seconds"],
            )
            for k in kinds
        }
        records = []
        for rep in range(max(reps.values())):
            for kind in [k for k in kinds if rep < reps[k]]:
                for i in range(len(batches[kind])):
                    for j in range(len(POLICIES)):  # rotate the order: drift hits all alike
                        p = POLICIES[(rep + i + j) % len(POLICIES)]
                        records.append({**run(kind, i, p), "repeat": rep})
        if rank == 0:
            with open(job["out"], "w") as f:
                json.dump(records, f)
        if job.get("overhead"):
            _overhead(rank, world, comm, job)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _overhead(rank: int, world: int, comm, job: dict) -> None:
    """hdp executor vs torch DDP (no_sync accumulation) on the same packed micro-batches of the
    short batches (every sample local)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from datapipe.fetch import MemoryFetcher
    from datapipe.plan.cost import load
    from datapipe.plan.loss import labelled_positions
    from datapipe.plan.planner import PlannerConfig
    from datapipe.shapes import ModelConfig
    from trainer.attention.local import LocalAttention
    from trainer.model.transformer import build_model

    data = np.load(job["tokens"], allow_pickle=True)
    fetcher = MemoryFetcher(list(data["tokens"]))
    batches = [np.asarray(b) for b in data["short"]]
    planner = PlannerConfig(policy="hdp", capacity=4096, widen=False).build(
        load(job["cost"]), num_ranks=world
    )
    plans = [planner.plan(fetcher.lengths[ids], ids) for ids in batches]
    fetched = [fetcher.fetch_step([m.pieces for m in p.microbatches(rank)]) for p in plans]
    assert all(len(f) > 0 for f in fetched), "every rank needs a micro-batch for DDP"
    ex = _executor(comm, job["shape"])
    model, _ = build_model(ModelConfig(**job["shape"]), torch.float32, seed=0)
    ddp = DDP(model)  # the model has no buffers
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    def ddp_step(plan, mbs) -> None:
        n = labelled_positions(plan.lengths)
        for j, mb in enumerate(mbs):
            ctx = ddp.no_sync() if j + 1 < len(mbs) else contextlib.nullcontext()
            with ctx:
                loss, _ = ddp(
                    torch.from_numpy(mb.input_ids),
                    torch.from_numpy(mb.position_ids),
                    labels=torch.from_numpy(mb.labels),
                    attn=LocalAttention(mb.cu_seqlens.tolist()),
                )
                (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    names = ("hdp", "ddp")
    times = dict.fromkeys(names, 0.0)
    tokens = 0
    for rep in range(job["repeats"] + 1):
        for i, (plan, mbs) in enumerate(zip(plans, fetched)):
            for j in range(len(names)):
                name = names[(rep + i + j) % len(names)]
                dist.barrier()
                t0 = time.perf_counter()
                if name == "hdp":
                    ex.step(plan, mbs, i)
                else:
                    ddp_step(plan, mbs)
                dist.barrier()
                if rep:  # the first pass warms up
                    times[name] += time.perf_counter() - t0
            if rep:
                tokens += int(plan.lengths.sum())
    if rank == 0:
        with open(job["overhead_out"], "w") as f:
            json.dump({"tokens": tokens, "seconds": times}, f)


def _tp_main(rank: int, world: int, port: int, job: dict) -> None:
    """One HDP rank at tp 1 (process 0 alone) and at tp 2 (both processes) on the same hdp
    plans of one rank, interleaved, the order alternating; rank 0 writes each step's time (the
    slowest member's, barrier to the end of the optimizer step), the first step's loss and the
    bytes of model state per process."""
    import torch
    import torch.distributed as dist

    from datapipe.fetch import MemoryFetcher
    from datapipe.plan.cost import load
    from datapipe.plan.planner import PlannerConfig
    from datapipe.shapes import ModelConfig
    from trainer.model.transformer import build_model
    from trainer.parallel.comm import SoloComm, TorchComm
    from trainer.parallel.executor import HDPExecutor
    from trainer.parallel.tensor import parallelize, tp_mesh
    from trainer.parallel.zero import ZeroOptimizer

    _init(rank, world, port)
    try:
        torch.set_num_threads(1)
        data = np.load(job["tokens"], allow_pickle=True)
        fetcher = MemoryFetcher(list(data["tokens"]))
        cfg = PlannerConfig(policy="hdp", capacity=job["capacity"], widen=False)
        planner = cfg.build(load(job["cost"]), num_ranks=1)
        plans = [planner.plan(fetcher.lengths[ids], ids) for ids in data[job["kind"]]]
        fetched = [fetcher.fetch_step([m.pieces for m in p.microbatches(0)]) for p in plans]
        shape = ModelConfig(**job["shape"])
        model, master = build_model(shape, torch.float32, seed=0)
        for m in {id(model): model, id(master): master}.values():
            parallelize(m, tp_mesh(world))
        opt = ZeroOptimizer.for_model(model, SoloComm(), master=master, level=0, lr=1e-3,
                                      grad_clip=1.0, tp_comm=TorchComm())  # fmt: skip
        split = HDPExecutor(model, opt, SoloComm())
        plain = _executor(SoloComm(), job["shape"]) if rank == 0 else None
        times: dict[str, list[list[float]]] = {"tp1": [], "tp2": []}
        first = {}
        for rep in range(job["repeats"] + 1):
            for i, (plan, mbs) in enumerate(zip(plans, fetched)):
                for j in range(2):
                    name = ("tp1", "tp2")[(rep + i + j) % 2]
                    dist.barrier()
                    t0 = time.perf_counter()
                    if name == "tp2":
                        res = split.step(plan, mbs, i)
                    elif plain is not None:
                        res = plain.step(plan, mbs, i)
                    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                    if rep == 0:
                        first.setdefault(name, res.loss if name == "tp2" or plain else None)
                    else:  # the first pass warms up
                        if len(times[name]) <= i:
                            times[name].append([])
                        times[name][i].append(float(dt.item()))
        if rank == 0:
            mem = {"tp1": plain.zero.memory(), "tp2": opt.memory()}
            out = {
                "times": times,
                "first_loss": first,
                "tokens": [int(p.lengths.sum()) for p in plans],
                "state_bytes": {
                    k: {"weights": m.weights, "moments": m.moments} for k, m in mem.items()
                },
            }
            with open(job["out"], "w") as f:
                json.dump(out, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(fn, world: int, job: dict, timeout: float) -> None:
    from trainer.parallel.comm import free_port, spawn

    spawn(fn, world, (world, free_port(), job), timeout)


# --- driver --------------------------------------------------------------------------------------


def _batches(data: str, gbt: int, steps: int, keep, seed: int, lookahead: int = 64):
    """Sample ids of the first `steps` stream batches over the samples `keep(lengths)` selects."""
    from datapipe.index import read_index
    from datapipe.stream import StreamConfig

    lengths = np.asarray(read_index(data).num_tokens, dtype=np.int64)
    pool = np.flatnonzero(keep(lengths))
    stream = StreamConfig(seed=seed, lookahead=lookahead).build(lengths[pool], gbt)
    return [pool[next(stream).sample_ids] for _ in range(steps)]


def _save(path: str, data: str, kinds: dict[str, list[np.ndarray]]) -> dict[str, list[list[int]]]:
    """Tokens of every sample the batches use (renumbered 0..n-1) and the batches, as one npz;
    returns each batch's lengths."""
    from datapipe.fetch import FetchConfig

    used = np.unique(np.concatenate([b for bs in kinds.values() for b in bs]))
    fetcher = FetchConfig().build(data)
    lengths = np.asarray(fetcher.lengths)
    mbs = fetcher.fetch_step([np.array([[s, 0, lengths[s]]]) for s in used])
    fetcher.close()
    tokens = np.empty(len(used), dtype=object)
    for i, mb in enumerate(mbs):
        tokens[i] = mb.input_ids.astype(np.int64)
    remap = {int(s): i for i, s in enumerate(used)}
    arrays = {}
    for k, bs in kinds.items():
        arr = np.empty(len(bs), dtype=object)
        for i, b in enumerate(bs):
            arr[i] = np.array([remap[int(s)] for s in b])
        arrays[k] = arr
    np.savez(path, tokens=tokens, **arrays)
    return {
        k: [sorted((int(lengths[s]) for s in b), reverse=True) for b in bs]
        for k, bs in kinds.items()
    }


def summarise(records: list[dict], key: str) -> dict:
    """Per kind and policy: measured (sum over batches of the min over repeats) and predicted
    seconds; the noise floor; ratios to static and whether the measurement ranks as predicted."""
    best: dict[tuple, float] = {}
    spread = []
    by_cfg: dict[tuple, list[float]] = {}
    for r in records:
        by_cfg.setdefault((r["kind"], r["batch"], r["policy"]), []).append(r[key])
    pred = {(r["kind"], r["batch"], r["policy"]): r["predicted_s"] for r in records}
    digest = {(r["kind"], r["batch"], r["policy"]): r["digest"] for r in records}
    for cfg, vals in by_cfg.items():
        best[cfg] = min(vals)
        if len(vals) > 1:
            spread.append(max(vals) / min(vals) - 1)
    noise = {
        "median_spread": float(np.median(spread)) if spread else 0.0,
        "p90_spread": float(np.percentile(spread, 90)) if spread else 0.0,
    }
    # identical plans under two policies: their difference is noise too
    same = []
    for (kind, i, p), d in digest.items():
        for q in POLICIES:
            if q > p and digest.get((kind, i, q)) == d:
                same.append(abs(best[kind, i, p] / best[kind, i, q] - 1))
    noise["identical_plan_diff_max"] = float(max(same)) if same else None
    floor = noise["p90_spread"]
    out: dict = {"noise": noise, "kinds": {}}
    for kind in [k for k in KINDS if any(c[0] == k for c in best)]:
        n_b = 1 + max(i for (k, i, _) in best if k == kind)
        rows = {}
        for p in POLICIES:
            m = sum(best[kind, i, p] for i in range(n_b))
            q = sum(pred[kind, i, p] for i in range(n_b))
            per_batch = [best[kind, i, p] / pred[kind, i, p] - 1 for i in range(n_b)]
            rows[p] = {
                "measured_s": m,
                "predicted_s": q,
                "deviation": m / q - 1,
                "worst_batch_deviation": max(per_batch, key=abs),
            }
        ranks = []
        for a in POLICIES:
            for b in POLICIES:
                if a >= b:
                    continue
                pr = rows[a]["predicted_s"] / rows[b]["predicted_s"]
                mr = rows[a]["measured_s"] / rows[b]["measured_s"]
                decided = abs(pr - 1) > floor
                agree = (pr > 1) == (mr > 1) if decided else abs(mr - 1) <= floor
                ranks.append(
                    {
                        "pair": f"{a}/{b}",
                        "predicted": pr,
                        "measured": mr,
                        "model_ranks": decided,
                        "agree": bool(agree),
                    }
                )
        w, s = rows["hdp+widen"], rows["static"]
        out["kinds"][kind] = {
            "batches": n_b,
            "policies": rows,
            "ranking": ranks,
            "static_over_widen": {
                "measured": s["measured_s"] / w["measured_s"],
                "predicted": s["predicted_s"] / w["predicted_s"],
            },
        }
    return out


def print_summary(title: str, summ: dict, unit: str) -> None:
    n = summ["noise"]
    print(f"\n{title}")
    print(
        f"noise floor: repeats spread median {n['median_spread']:.1%}, p90 {n['p90_spread']:.1%}"
        + (
            f"; identical plans differ by up to {n['identical_plan_diff_max']:.1%}"
            if n["identical_plan_diff_max"] is not None
            else ""
        )
    )
    print(f"| kind | policy | {unit} | predicted s | deviation | worst batch |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for kind, k in summ["kinds"].items():
        for p, r in k["policies"].items():
            print(
                f"| {kind} ({k['batches']}) | {p} | {r['measured_s']:.2f} | {r['predicted_s']:.2f} "
                f"| {r['deviation']:+.1%} | {r['worst_batch_deviation']:+.1%} |"
            )
    for kind, k in summ["kinds"].items():
        q = k["static_over_widen"]
        agree = all(r["agree"] for r in k["ranking"])
        print(
            f"{kind}: static / hdp+widen measured {q['measured']:.3f}, predicted "
            f"{q['predicted']:.3f}; rankings agree: {agree} "
            + ", ".join(
                f"{r['pair']} {r['measured']:.3f} ({r['predicted']:.3f}"
                f"{'' if r['model_ranks'] else ', tie'})"
                for r in k["ranking"]
            )
        )


def probe_s(runs: int = 5) -> float:
    """The machine's speed now: the least of `runs` timings of 40 float32 512x512 matmuls on one
    thread (about 0.2 s each here). A calibration and the measurement it predicts are only
    comparable while this stays put: the box is shared and its speed drifts by tens of percent
    over minutes."""
    import torch

    torch.set_num_threads(1)
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        y = x
        for _ in range(40):
            y = torch.tanh(y @ x)
        best = min(best, time.perf_counter() - t0)
    return best


def _calibrate(nproc: int, clock: str, shape, path: str) -> dict:
    from datapipe.files import write_text_atomic
    from tools.cmd_calibrate import render
    from trainer.calibrate import calibrate

    cal = calibrate("debug", nproc, clock=clock, shape=shape)
    write_text_atomic(path, cal.to_json())
    print(f"\ncalibration, {nproc} processes, {clock} clock:\n{render(cal)}")
    return cal.report()


def _tp_part(args, tok_path: str, shape, work: str) -> dict:
    """The executor at tp 2 beside tp 1 for one HDP rank on the mixed batches (2 processes on
    2 cores against 1 process on 1 core: the CPU cost of the split; the gain is the memory)."""
    cost = args.cost2 or os.path.join(work, "cost2.json")
    if not os.path.isfile(cost):
        _calibrate(2, "wall", shape, cost)
    job = {
        "tokens": tok_path,
        "cost": cost,
        "capacity": args.tp_capacity,
        "kind": "mixed",
        "repeats": args.repeats,
        "shape": dataclasses.asdict(shape),
        "out": os.path.join(work, "tp.json"),
    }
    _spawn(_tp_main, 2, job, timeout=7200)
    o = json.load(open(job["out"]))
    print(f"\none HDP rank, capacity {args.tp_capacity}: tp 1 (1 process) vs tp 2 (2 processes)")
    print("| batch | tokens | tp 1 s (min) | tp 2 s (min) | tp 1 / tp 2 |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for i, tok in enumerate(o["tokens"]):
        a, b = min(o["times"]["tp1"][i]), min(o["times"]["tp2"][i])
        print(f"| {i} | {tok} | {a:.3f} | {b:.3f} | {a / b:.2f} |")
    tot = {k: sum(min(t) for t in v) for k, v in o["times"].items()}
    o["speedup"] = tot["tp1"] / tot["tp2"]
    print(
        f"all batches: tp 2 {o['speedup']:.2f}x the speed of tp 1 (ideal 2x with twice the cores)"
    )
    for k, m in o["state_bytes"].items():
        print(
            f"{k}: weights {m['weights'] / 1e6:.2f} MB, moments {m['moments'] / 1e6:.2f} MB per process"
        )
    print(
        f"first step's loss: tp 1 {o['first_loss']['tp1']:.6f}, tp 2 {o['first_loss']['tp2']:.6f}"
    )
    return o


def main() -> int:
    from trainer.calibrate import CalibrationGrid

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.join(ROOT, ".demo", "stdlib"))
    ap.add_argument("--steps", type=int, default=3, help="batches per kind")
    ap.add_argument("--kinds", default=",".join(KINDS), help="batch kinds to run")
    ap.add_argument("--huge-steps", type=int, default=1, help="batches of the huge kind")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per batch and policy")
    ap.add_argument(
        "--min-seconds",
        type=float,
        default=CalibrationGrid.min_seconds,
        help="short steps run until a batch's runs add up to this (at most 30 runs; default: "
        "what `mixlen calibrate` gives its short cases, so both keep the least of as many runs)",
    )
    ap.add_argument("--gbt", type=int, default=32768, help="global batch tokens (the demo's)")
    ap.add_argument("--capacity", type=int, default=8192, help="capacity C (the demo's)")
    ap.add_argument("--cost2", default=None, help="cost file for 2 ranks (default: calibrate)")
    ap.add_argument("--cost4", default=None, help="cost file for 4 ranks (default: calibrate)")
    ap.add_argument("--skip", default="", help="comma list of: wall2,replay4,overhead,tp")
    ap.add_argument(
        "--tp-capacity", type=int, default=16384, help="capacity of the tp part's one rank"
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out", "bench_train.json"))
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.data, "index.parquet")):
        print(f"{args.data}: no dataset; run `make demo` first", file=sys.stderr)
        return 2
    from datapipe.index import read_index
    from datapipe.shapes import get_config

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    work = os.path.join(os.path.dirname(args.out), "bench_train")
    os.makedirs(work, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    result: dict = {"args": vars(args), "load_before": os.getloadavg()}
    index = read_index(args.data)
    vocab = int(index.manifest.get("vocab_size") or 258)
    shape = get_config("debug", vocab_size=max(258, vocab))
    max_context = int(np.max(index.num_tokens))

    keep = {
        "all": lambda s: s > 0,
        "short": lambda s: (s > 0) & (s <= SHORT_MAX),
        "long": lambda s: s > LONG_MIN,
    }
    kinds = {}
    for kind in args.kinds.split(","):
        gbt, which, seed = KIND_SPECS[kind]
        n = args.huge_steps if kind == "huge" else args.steps
        kinds[kind] = _batches(args.data, gbt or args.gbt, n, keep[which], seed)
    tok_path = os.path.join(work, "batches.npz")
    result["batches"] = _save(tok_path, args.data, kinds)
    for k, bs in result["batches"].items():
        print(
            f"{k}: " + "; ".join(f"{len(b)} samples, longest {b[0]}, {sum(b)} tokens" for b in bs)
        )

    cap = args.capacity
    for world, clock, flag in ((2, "wall", "wall2"), (4, "cpu", "replay4")):
        key = STEP_KEY[world]
        if flag in skip:
            continue
        cost = getattr(args, f"cost{world}")
        probe = {"before_calibration": probe_s()}
        if cost is None:
            cost = os.path.join(work, f"cost{world}.json")
            result[f"calibration{world}"] = _calibrate(world, clock, shape, cost)
        job = {
            "tokens": tok_path,
            "cost": cost,
            "capacity": cap,
            "max_context": max_context,
            "repeats": args.repeats,
            "min_seconds": args.min_seconds,
            "shape": dataclasses.asdict(shape),
            "out": os.path.join(work, f"records{world}.json"),
            "overhead": world == 2 and "overhead" not in skip,
            "overhead_out": os.path.join(work, "overhead.json"),
        }
        t0 = time.perf_counter()
        _spawn(_policies_main, world, job, timeout=7200)
        recs = json.load(open(job["out"]))
        probe["after_measurement"] = probe_s()
        probe["drift"] = probe["after_measurement"] / probe["before_calibration"] - 1
        result[f"probe{world}"] = probe
        summ = summarise(recs, key)
        result[f"ranks{world}"] = {
            "capacity": cap,
            "clock": clock,
            "records": recs,
            "summary": summ,
        }
        print_summary(
            f"{world} ranks, capacity {cap}, {'wall clock' if world == 2 else 'replayed CPU'}"
            f" (took {time.perf_counter() - t0:.0f} s)",
            summ,
            "measured s",
        )
        print(
            f"machine speed probe: {probe['before_calibration']:.3f} s before the calibration, "
            f"{probe['after_measurement']:.3f} s after the measurement ({probe['drift']:+.1%}: "
            "beyond a few percent the machine changed under the run)"
        )
        if job["overhead"]:
            o = json.load(open(job["overhead_out"]))
            tps = {k: o["tokens"] / v for k, v in o["seconds"].items()}
            result["overhead"] = {**o, "tokens_per_s": tps, "hdp_over_ddp": tps["hdp"] / tps["ddp"]}
            print(
                f"short batches, 2 ranks: hdp {tps['hdp']:.0f} tok/s, DDP {tps['ddp']:.0f} tok/s "
                f"(hdp/DDP {tps['hdp'] / tps['ddp']:.3f})"
            )
    if "tp" not in skip:
        result["tp"] = _tp_part(args, tok_path, shape, work)
    result["load_after"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nload average before {result['load_before']}, after {result['load_after']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
