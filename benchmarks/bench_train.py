"""Training-step benchmark: hdp vs hdp+widen vs static vs naive-hdp on the same global batches of
the standard-library corpus (`make demo` builds .demo/stdlib), plus, on batches of short sequences
only, hdp against plain torch DistributedDataParallel and against static.

- Wall clock, 2 gloo ranks (one per core): every policy runs every batch (interleaved, so machine
  noise hits all alike); step time is the slowest rank's, from a barrier to the optimizer step.
- 4 ranks on 2 cores would hide imbalance in wall time (total work / 2), so for 4 ranks each
  micro-batch's CPU time (thread time, one torch thread per rank) is measured and replayed through
  the plan's slot order (a group waits for its slowest member; datapipe.plan.replay_kernel).
- Prediction: the planner's makespan for the same batches from a cost model calibrated here
  (tools.cmd_calibrate, one thread) unless --cost is given.
- Communication: ring bytes sent per step (all ranks) and the coalesced all-reduce payload.

    .venv/bin/python benchmarks/bench_train.py [--data .demo/stdlib] [--steps 4]

Prints tables and writes benchmarks/out/bench_train.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

POLICIES = ("hdp", "hdp+widen", "static", "naive-hdp")  # "+widen": PlannerConfig(widen=True)


# --- workers -------------------------------------------------------------------------------------


def _init(rank: int, world: int, port: int) -> None:
    from trainer.comm import init_local_gloo

    init_local_gloo(rank, world, port, timeout_s=300)


def _executor(comm, lr: float = 1e-3):
    import torch

    from trainer.executor import HDPExecutor, build_model
    from trainer.model import get_config
    from trainer.zero import ZeroOptimizer

    model, master = build_model(get_config("debug"), torch.float32, seed=0)
    opt = ZeroOptimizer.for_model(model, comm, master=master, level=0, lr=lr, grad_clip=1.0)
    return HDPExecutor(model, opt, comm)


def _policies_main(rank: int, world: int, port: int, job: dict) -> None:
    """Every policy on every batch; rank 0 writes per-step records to job['out']."""
    import torch
    import torch.distributed as dist

    from datapipe.plan.cost import load
    from datapipe.plan.planner import PlannerConfig
    from datapipe.plan.stepplan import replay_kernel
    from trainer.comm import TorchComm
    from trainer.executor import MemoryFetcher

    _init(rank, world, port)
    try:
        comm = TorchComm()
        data = np.load(job["tokens"], allow_pickle=True)
        fetcher = MemoryFetcher(list(data["tokens"]))
        batches = [np.asarray(b) for b in data["batches"]]
        cost = load(job["cost"])
        planners = {
            p: PlannerConfig(
                policy=p.split("+")[0],
                widen=p.endswith("+widen"),
                num_ranks=world,
                capacity=job["capacity"],
                max_context=int(fetcher.lengths.max()),
            ).build(cost)
            for p in POLICIES
        }
        execs = {p: _executor(comm) for p in POLICIES}
        records = []
        todo = [] if job.get("skip_policies") else [batches[0], *batches]
        for i, ids in enumerate(todo):  # batch 0 once more as warm-up
            for j in range(len(POLICIES)):  # rotate the order: drift hits every policy alike
                policy = POLICIES[(i + j) % len(POLICIES)]
                plan = planners[policy].plan(fetcher.lengths[ids], ids)
                ex = execs[policy]
                fetched = fetcher.fetch_step(
                    [np.array(m.pieces, dtype=np.int64) for m in plan.microbatches(rank)]
                )
                best_wall, replayed = float("inf"), None
                for _ in range(job["repeats"] if i else 1):  # min over repeats: less noise
                    dist.barrier()
                    t0 = time.perf_counter()
                    res = ex.step(plan, fetched, i)
                    wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
                    best_wall = min(best_wall, float(wall.item()))
                    log = torch.zeros(plan.num_microbatches, dtype=torch.float64)
                    for slot, _, cpu in ex.mb_log:
                        log[slot] = cpu
                    dist.all_reduce(log, op=dist.ReduceOp.MAX)  # a group waits for its slowest
                    rep = replay_kernel(
                        plan.mb_group_offsets,
                        plan.group_ranks.astype(np.int64),
                        (log.numpy() * 1e9).astype(np.int64),
                        world,
                    )
                    if replayed is None or rep.max() < replayed.max():
                        replayed = rep
                if i == 0:
                    continue
                records.append(
                    {
                        "batch": i - 1,
                        "policy": policy,
                        "tokens": res.tokens,
                        "samples": int(len(ids)),
                        "wall_s": best_wall,
                        "replayed_cpu_s": float(replayed.max()) / 1e9,
                        "cpu_s_per_rank": (replayed / 1e9).tolist(),
                        "predicted_s": plan.makespan_ns / 1e9,
                        "ring_bytes": int(sum(res.p2p_bytes)),
                        "allreduce_bytes_per_rank": res.reduce_bytes,
                        "group_sizes": sorted({int(k) for k in plan.group_sizes}),
                        "microbatches": res.microbatches,
                        "loss": res.loss,
                    }
                )
        if rank == 0 and todo:
            with open(job["out"], "w") as f:
                json.dump(records, f)
        if job.get("overhead"):
            _overhead(rank, world, comm, job["overhead"])
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _overhead(rank: int, world: int, comm, job: dict) -> None:
    """hdp executor vs torch DDP (no_sync accumulation) on the same packed micro-batches, and vs
    the static mesh a run over this dataset needs (CP sized for its longest sample) on the same
    short batches."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from datapipe.plan.cost import load
    from datapipe.plan.planner import PlannerConfig
    from trainer.attention import LocalAttention
    from trainer.executor import MemoryFetcher, build_model, labelled_positions
    from trainer.model import get_config

    data = np.load(job["tokens"], allow_pickle=True)
    fetcher = MemoryFetcher(list(data["tokens"]))
    batches = [np.asarray(b) for b in data["batches"]]
    planner = PlannerConfig(policy="hdp", num_ranks=world, capacity=job["capacity"]).build(
        load(job["cost"])
    )
    plans = [planner.plan(fetcher.lengths[ids], ids) for ids in batches]
    fetched = [
        fetcher.fetch_step([np.array(m.pieces, dtype=np.int64) for m in p.microbatches(rank)])
        for p in plans
    ]
    assert all(len(f) > 0 for f in fetched), "every rank needs a micro-batch for DDP"
    static = PlannerConfig(
        policy="static",
        num_ranks=world,
        capacity=job["static_capacity"],
        max_context=job["max_context"],
    ).build(load(job["cost"]))
    s_plans = [static.plan(fetcher.lengths[ids], ids) for ids in batches]
    s_fetched = [
        fetcher.fetch_step([np.array(m.pieces, dtype=np.int64) for m in p.microbatches(rank)])
        for p in s_plans
    ]
    ex = _executor(comm)
    ex_static = _executor(comm)
    model, _ = build_model(get_config("debug"), torch.float32, seed=0)
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

    names = ("hdp", "ddp", "static")
    times = dict.fromkeys(names, 0.0)
    tokens = 0
    for rep in range(job["repeats"] + 1):
        for i, (plan, mbs) in enumerate(zip(plans, fetched)):
            for j in range(len(names)):  # rotate the order: drift hits every run alike
                name = names[(rep + i + j) % len(names)]
                dist.barrier()
                t0 = time.perf_counter()
                if name == "hdp":
                    ex.step(plan, mbs, i)
                elif name == "static":
                    ex_static.step(s_plans[i], s_fetched[i], i)
                else:
                    ddp_step(plan, mbs)
                dist.barrier()
                if rep:  # the first pass warms up
                    times[name] += time.perf_counter() - t0
            if rep:
                tokens += int(plan.lengths.sum())
    if rank == 0:
        with open(job["out"], "w") as f:
            json.dump({"tokens": tokens, "seconds": times}, f)


def _spawn(fn, world: int, job: dict, timeout: float) -> None:
    from trainer.comm import free_port, spawn

    spawn(fn, world, (world, free_port(), job), timeout)


# --- driver --------------------------------------------------------------------------------------


def _batches(data: str, gbt: int, steps: int, max_len: int | None, seed: int):
    """(sample ids of the first `steps` stream batches, token arrays of those samples)."""
    from datapipe.fetch import FetchConfig
    from datapipe.stream import LengthAwareStream, StreamConfig

    fetcher = FetchConfig(data).build()
    lengths = np.asarray(fetcher.lengths)
    pool = np.flatnonzero(lengths <= max_len) if max_len else np.arange(len(lengths))
    stream = LengthAwareStream(StreamConfig(data, gbt, seed=seed), lengths[pool])
    batches = [pool[next(stream).sample_ids] for _ in range(steps)]
    used = np.unique(np.concatenate(batches))
    mbs = fetcher.fetch_step([np.array([[s, 0, lengths[s]]]) for s in used])
    fetcher.close()
    remap = {int(s): i for i, s in enumerate(used)}
    tokens = np.empty(len(used), dtype=object)
    for i, mb in enumerate(mbs):
        tokens[i] = mb.input_ids
    return [np.array([remap[int(s)] for s in b]) for b in batches], tokens


def _save(path: str, batches, tokens) -> None:
    b = np.empty(len(batches), dtype=object)
    for i, x in enumerate(batches):
        b[i] = x
    np.savez(path, tokens=tokens, batches=b)


def _summary(records: list[dict], key: str) -> dict:
    out = {}
    for p in POLICIES:
        rs = [r for r in records if r["policy"] == p]
        out[p] = {
            "measured_s": sum(r[key] for r in rs),
            "predicted_s": sum(r["predicted_s"] for r in rs),
            "ring_bytes_per_step": float(np.mean([r["ring_bytes"] for r in rs])),
            "allreduce_bytes_per_rank": rs[0]["allreduce_bytes_per_rank"],
            "tokens": sum(r["tokens"] for r in rs),
        }
    h, s = out["hdp"], out["static"]
    out["hdp_over_static"] = {
        "measured": h["measured_s"] / s["measured_s"],
        "predicted": h["predicted_s"] / s["predicted_s"],
    }
    out["hdp_over_static"]["deviation"] = (
        out["hdp_over_static"]["measured"] / out["hdp_over_static"]["predicted"] - 1
    )
    w = out["hdp+widen"]
    out["widen_over_static"] = {
        "measured": w["measured_s"] / s["measured_s"],
        "predicted": w["predicted_s"] / s["predicted_s"],
    }
    return out


def _print_table(title: str, summ: dict, unit: str) -> None:
    print(f"\n{title}")
    print(f"| policy | {unit} | predicted s | ring MB/step | all-reduce MB/rank | tokens |")
    print("| --- | --- | --- | --- | --- | --- |")
    for p in POLICIES:
        r = summ[p]
        print(
            f"| {p} | {r['measured_s']:.2f} | {r['predicted_s']:.2f} | "
            f"{r['ring_bytes_per_step'] / 1e6:.2f} | {r['allreduce_bytes_per_rank'] / 1e6:.2f} | "
            f"{r['tokens']} |"
        )
    q = summ["hdp_over_static"]
    print(
        f"hdp/static: measured {q['measured']:.3f}, predicted {q['predicted']:.3f} "
        f"(deviation {q['deviation']:+.1%})"
    )
    q = summ["widen_over_static"]
    print(f"hdp+widen/static: measured {q['measured']:.3f}, predicted {q['predicted']:.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.join(ROOT, ".demo", "stdlib"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per batch and policy")
    ap.add_argument("--gbt", type=int, default=32768, help="global batch tokens")
    ap.add_argument("--cost", default=None, help="cost file (default: calibrate here)")
    ap.add_argument("--skip", default="", help="comma list of: wall2,replay4,overhead")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out", "bench_train.json"))
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.data, "index.parquet")):
        print(f"{args.data}: no dataset; run `make demo` first", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    work = os.path.join(os.path.dirname(args.out), "bench_train")
    os.makedirs(work, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    result: dict = {"args": vars(args)}

    cost_path = args.cost
    if cost_path is None:
        from datapipe.files import write_text_atomic
        from tools.cmd_calibrate import calibrate

        lens = [256, 1024, 2048, 4096, 8192]
        model, t = calibrate("debug", lens, repeats=1)
        a, b, c = model.a, model.b, model.c
        cost_path = os.path.join(work, "cost.json")
        write_text_atomic(cost_path, model.to_json())
        result["calibration"] = {"lengths": lens, "seconds": t, "a": a, "b": b, "c": c}
        print(
            f"calibrated: a={a:.3g} b={b:.3g} c={c:.3g}  (lengths {lens}, s {[round(x, 3) for x in t]})"
        )
    result["cost"] = cost_path

    batches, tokens = _batches(args.data, args.gbt, args.steps, None, seed=0)
    tok_path = os.path.join(work, "batches.npz")
    _save(tok_path, batches, tokens)
    short_b, short_t = _batches(args.data, 16384, 6, 1024, seed=1)
    short_path = os.path.join(work, "short.npz")
    _save(short_path, short_b, short_t)
    result["batches"] = [sorted((int(len(tokens[i])) for i in b), reverse=True) for b in batches]

    if "wall2" not in skip or "overhead" not in skip:
        job = {
            "tokens": tok_path,
            "cost": cost_path,
            "capacity": 8192,
            "repeats": args.repeats,
            "out": os.path.join(work, "wall2.json"),
            "skip_policies": "wall2" in skip,
        }
        if "overhead" not in skip:
            job["overhead"] = {
                "tokens": short_path,
                "cost": cost_path,
                "capacity": 4096,
                # static over this dataset on 2 ranks: CP 2 x 8192 holds its longest sample
                "static_capacity": 8192,
                "max_context": int(max(len(t) for t in tokens)),
                "repeats": 2,
                "out": os.path.join(work, "overhead.json"),
            }
        t0 = time.perf_counter()
        _spawn(_policies_main, 2, job, timeout=1800)
    if "wall2" not in skip:
        recs = json.load(open(job["out"]))
        result["wall_2_ranks"] = {
            "capacity": 8192,
            "records": recs,
            "summary": _summary(recs, "wall_s"),
            "summary_replayed_cpu": _summary(recs, "replayed_cpu_s"),
        }
        _print_table(
            "2 ranks (one per core), capacity 8192: wall clock, sum over batches",
            result["wall_2_ranks"]["summary"],
            "wall s",
        )
        print(f"(took {time.perf_counter() - t0:.0f} s)")
    if "overhead" not in skip:
        o = json.load(open(job["overhead"]["out"]))
        tps = {k: o["tokens"] / v for k, v in o["seconds"].items()}
        result["overhead"] = {
            **o,
            "tokens_per_s": tps,
            "hdp_over_ddp": tps["hdp"] / tps["ddp"],
            "hdp_over_static": tps["hdp"] / tps["static"],
        }
        print(
            f"\nshort sequences only (<= 1024 tokens), 2 ranks: hdp {tps['hdp']:.0f} tok/s, "
            f"DDP {tps['ddp']:.0f} tok/s (hdp/DDP {tps['hdp'] / tps['ddp']:.3f}), static (CP 2) "
            f"{tps['static']:.0f} tok/s (hdp/static {tps['hdp'] / tps['static']:.3f})"
        )
    if "replay4" not in skip:
        job = {
            "tokens": tok_path,
            "cost": cost_path,
            "capacity": 4096,
            "repeats": args.repeats,
            "out": os.path.join(work, "replay4.json"),
        }
        t0 = time.perf_counter()
        _spawn(_policies_main, 4, job, timeout=2400)
        recs = json.load(open(job["out"]))
        result["replay_4_ranks"] = {
            "capacity": 4096,
            "records": recs,
            "summary": _summary(recs, "replayed_cpu_s"),
        }
        _print_table(
            "4 ranks, capacity 4096: per-rank CPU time replayed in slot order, sum over batches",
            result["replay_4_ranks"]["summary"],
            "replayed CPU s",
        )
        print(f"(took {time.perf_counter() - t0:.0f} s)")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
