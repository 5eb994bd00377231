"""Sharded optimizer benchmark (trainer.zero), before its wiring into the executor.

- Memory per rank: the debug and small models measured through ZeroOptimizer (bfloat16 compute,
  fake ranks in threads) against datapipe.plan.memory's formula, and the llama presets computed, for
  zero 0 (replicated optimizer) / 1 / 2.
- Optimizer phase over gloo (2 and 4 processes on this box): from the end of the backward to
  updated weights everywhere (reduction, clipping, AdamW, weight all-gather) for zero 0 / 1 / 2 on
  the `small` model in float32, gradients already accumulated; median of --reps, levels
  interleaved. Without hooks (one coalesced collective), so it measures the collectives and the
  sharded step, not the overlap.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_zero.py [--reps 5]

Prints tables and writes benchmarks/out/bench_zero.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GB = 1e9


def memory_table() -> list[dict]:
    import torch

    from datapipe.plan.memory import model_state_bytes
    from datapipe.shapes import get_config
    from trainer.comm import run_threads
    from trainer.model import build
    from trainer.zero import ZeroOptimizer

    rows = []
    for name in ("debug", "small"):
        cfg = get_config(name)
        model = build(cfg, "meta", torch.bfloat16)
        shapes = [p.shape for p in model.parameters()]
        for ranks in (2, 4):
            for level in (0, 1, 2):

                def run(comm, level=level, shapes=shapes):
                    params = [
                        torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in shapes
                    ]
                    return ZeroOptimizer(params, comm, level=level).memory()

                got = run_threads(ranks, run, timeout=120)[0]
                want = model_state_bytes(cfg.num_params(), ranks, level, "bfloat16")
                assert (got.weights, got.master, got.moments, got.grads) == (
                    want.weights, want.master, want.moments, want.grads,
                ), (name, ranks, level)  # fmt: skip
                rows.append({"model": name, "ranks": ranks, "zero": level, "measured": True,
                             "params": cfg.num_params(), **want.as_dict()})  # fmt: skip
    for name in ("llama-7b", "llama-13b", "llama-70b"):
        p = get_config(name).num_params()
        for level in (0, 1, 2):
            want = model_state_bytes(p, 8, level, "bfloat16")
            rows.append({"model": name, "ranks": 8, "zero": level, "measured": False,
                         "params": p, **want.as_dict()})  # fmt: skip
    return rows


def _phase_main(rank: int, world: int, port: int, reps: int, out: str) -> None:
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from datapipe.shapes import get_config
    from trainer.comm import TorchComm, init_local_gloo
    from trainer.model import build
    from trainer.zero import ZeroOptimizer

    init_local_gloo(rank, world, port, timeout_s=600)
    try:
        comm = TorchComm()
        model = build(get_config("small"), "meta", torch.float32).to_empty(device="cpu")
        params = [p for p in model.parameters()]
        g = torch.Generator().manual_seed(rank)
        grads = [torch.randn(p.shape, generator=g) * 1e-3 for p in params]
        zeros = {lv: ZeroOptimizer(params, comm, level=lv, grad_clip=1.0) for lv in (0, 1, 2)}
        times: dict[int, list[float]] = {0: [], 1: [], 2: []}
        for rep in range(reps + 1):  # the first round warms up
            for lv, zero in zeros.items():
                zero.layout.bind_params(params, zero.flat_params)
                zero.begin_step()
                for p, gr in zip(params, grads):
                    p.grad = gr.clone()
                zero.accumulate_grads()
                dist.barrier()
                t0 = time.perf_counter()
                zero.finish_backward()
                zero.step()
                dt = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if rep:
                    times[lv].append(float(dt))
        if rank == 0:
            res = {
                lv: {"median_s": statistics.median(t), "runs": t,
                     "bytes_per_rank": zeros[lv].memory().as_dict()}
                for lv, t in times.items()
            }  # fmt: skip
            with open(out, "w") as f:
                json.dump(res, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def phase_times(world: int, reps: int) -> dict:
    from trainer.comm import free_port, spawn

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "phase.json")
        spawn(_phase_main, world, (world, free_port(), reps, out), timeout=1200)
        with open(out) as f:
            return {int(k): v for k, v in json.load(f).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    rows = memory_table()
    print("model state per rank, bfloat16 compute (GB; measured = ZeroOptimizer's buffers)")
    print(f"{'model':10} {'ranks':>5} {'zero':>4} {'weights':>8} {'master':>8} {'moments':>8} "
          f"{'grads':>8} {'peak':>8} {'total':>8}  source")  # fmt: skip
    for r in rows:
        print(f"{r['model']:10} {r['ranks']:>5} {r['zero']:>4} {r['weights'] / GB:8.3f} "
              f"{r['master'] / GB:8.3f} {r['moments'] / GB:8.3f} {r['grads'] / GB:8.3f} "
              f"{r['grads_peak'] / GB:8.3f} {r['total'] / GB:8.3f}  "
              f"{'measured = formula' if r['measured'] else 'formula'}")  # fmt: skip

    phases = {}
    for world in (2, 4):
        phases[world] = phase_times(world, args.reps)
        print(f"\noptimizer phase, small model ({world} gloo ranks, float32): median of "
              f"{args.reps}")  # fmt: skip
        base = phases[world][0]["median_s"]
        for lv, r in phases[world].items():
            b = r["bytes_per_rank"]
            print(f"  zero {lv}: {r['median_s'] * 1e3:8.1f} ms  ({r['median_s'] / base:.2f}x "
                  f"zero 0)  optimizer state {(b['master'] + b['moments']) / 1e6:7.1f} MB/rank")  # fmt: skip

    os.makedirs(os.path.join(ROOT, "benchmarks", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "out", "bench_zero.json"), "w") as f:
        json.dump({"memory": rows, "phase": phases}, f, indent=2)


if __name__ == "__main__":
    main()
