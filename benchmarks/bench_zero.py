"""Sharded optimizer benchmark (trainer.parallel.zero through the HDP executor).

- Memory per rank: the debug and small models measured through ZeroOptimizer (bfloat16 compute,
  fake ranks in threads) against datapipe.plan.memory's formula, and the llama presets computed,
  for zero 0 (the replicated optimizer) / 1 / 2.
- Whole training steps over gloo, 2 and 4 processes on this box: hdp plans of the corpus's
  lengths (random token ids), the `small` shape with --layers layers in float32; every level runs
  every batch (interleaved), step time = the slowest rank's from a barrier to updated weights.
  Hidden share of the gradient reduction: 1 - (exposed wait after the backward) / (the same
  reduction run alone, blocking), per rank, averaged; beside it the span-based figure the
  trainer's metrics report (1 - wait / (first launch to done)).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_zero.py [--data .demo/stdlib] [--steps 6]

- With `--update N [--baseline REV]` instead: one rank's per-step work on N bfloat16 parameters
  (a float32 master) that does not depend on the tokens: one micro-batch's gradients into the
  buffer, the reduction's scale (the scaled norm about 4) and norm, clipping at 1 (which then
  applies) or none, AdamW, the weights cast back;
  beside the optimizer at git revision REV (benchmarks/at_revision.py), interleaved, this
  thread's CPU time, median of --steps.

Prints tables and writes benchmarks/out/bench_zero.json (`--update`: bench_zero_update.json).
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
    from trainer.model.transformer import build
    from trainer.parallel.zero import ZeroOptimizer
    from trainer.testing.threads import run_threads

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


# --- whole training steps over gloo ----------------------------------------------------------------


def _batches(data: str, ranks: int, capacity: int, steps: int, seed: int = 0) -> list:
    """`steps` global batches of the corpus's lengths (samples a ring of `ranks` can hold) with
    random token ids, as (lengths, token arrays)."""
    import numpy as np

    from datapipe.index import read_lengths
    from datapipe.stream import StreamConfig

    lengths = read_lengths(data)
    lengths = lengths[(lengths > 1) & (lengths <= ranks * capacity)]
    stream = StreamConfig(seed=seed).build(lengths, ranks * capacity)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        b = next(stream)
        out.append((b.lengths, [rng.integers(0, 256, size=int(n)) for n in b.lengths]))
    return out


def _step_main(rank: int, world: int, port: int, job: dict) -> None:
    """Every ZeRO level on every batch (levels interleaved so machine noise hits all alike);
    rank 0 writes per-step records: the slowest rank's step time, every rank's exposed wait for
    the gradient reduction, its span, and the same reduction timed alone (blocking)."""
    import time

    import numpy as np
    import torch
    import torch.distributed as dist

    from datapipe.fetch import MemoryFetcher
    from datapipe.plan.cost import preset
    from datapipe.plan.planner import PlannerConfig
    from datapipe.shapes import get_config
    from trainer.model.transformer import build_model
    from trainer.parallel.comm import TorchComm, init_local_gloo
    from trainer.parallel.executor import HDPExecutor
    from trainer.parallel.zero import ZeroOptimizer

    init_local_gloo(rank, world, port, timeout_s=900)
    try:
        comm = TorchComm()
        grad_comm = TorchComm(dist.new_group(list(range(world))))
        shape = get_config(job["model"], n_layers=job["layers"])
        runs = {}
        for level in (0, 1, 2):
            model, master = build_model(shape, torch.float32, seed=0)
            zero = ZeroOptimizer.for_model(
                model, comm, master=master, level=level, lr=1e-4, grad_clip=1.0,
                grad_comm=grad_comm,
            )  # fmt: skip
            runs[level] = HDPExecutor(model, zero, comm)
        planner = PlannerConfig(policy="hdp", capacity=job["capacity"], widen=False).build(
            preset("debug"), num_ranks=world
        )
        records = []
        batches = _batches(job["data"], world, job["capacity"], job["steps"] + 1)
        for i, (lengths, tokens) in enumerate(batches):
            fetcher = MemoryFetcher(tokens)
            plan = planner.plan(lengths, np.arange(len(lengths)))
            mine = plan.microbatches(rank)
            fetched = fetcher.fetch_step([np.array(m.pieces, dtype=np.int64) for m in mine])
            for level, ex in runs.items():
                dist.barrier()
                t0 = time.perf_counter()
                res = ex.step(plan, fetched, i)
                ex.zero.wait_weights()
                step_s = time.perf_counter() - t0
                red = ex.zero.last_reduce
                # the same reduction alone, blocking, for the hidden share
                flat = ex.zero.layout.new_flat(torch.float32, "cpu")
                dist.barrier()
                t1 = time.perf_counter()
                if level == 0:
                    grad_comm.all_reduce(flat)
                else:
                    a, b = ex.zero.layout.padded_slice(rank)
                    grad_comm.reduce_scatter(flat, flat[a:b])
                alone_s = time.perf_counter() - t1
                row = torch.tensor([step_s, red.wait_s, red.span_s, alone_s, red.early,
                                    red.buckets], dtype=torch.float64)  # fmt: skip
                rows = comm.all_gather(row)
                if i and rank == 0:  # the first batch warms up
                    records.append({
                        "level": level, "step": i, "tokens": int(lengths.sum()),
                        "microbatches": res.microbatches,
                        "step_s": max(float(r[0]) for r in rows),
                        "wait_s": [float(r[1]) for r in rows],
                        "span_s": [float(r[2]) for r in rows],
                        "alone_s": [float(r[3]) for r in rows],
                        "early": [int(r[4]) for r in rows],
                        "buckets": int(rows[0][5]),
                    })  # fmt: skip
        if rank == 0:
            with open(job["out"], "w") as f:
                json.dump({"params": shape.num_params(), "records": records}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def step_times(world: int, job: dict) -> dict:
    """Run _step_main on `world` gloo processes; summary per level."""
    import statistics

    from trainer.parallel.comm import free_port, spawn

    with tempfile.TemporaryDirectory() as tmp:
        job = {**job, "out": os.path.join(tmp, "steps.json")}
        spawn(_step_main, world, (world, free_port(), job), timeout=3600)
        with open(job["out"]) as f:
            got = json.load(f)
    out = {"params": got["params"], "levels": {}}
    for level in (0, 1, 2):
        recs = [r for r in got["records"] if r["level"] == level]
        waits = [w for r in recs for w in r["wait_s"]]
        alone = [a for r in recs for a in r["alone_s"]]
        spans = [(s - w) / s for r in recs for s, w in zip(r["span_s"], r["wait_s"]) if s > 0]
        out["levels"][level] = {
            "step_s": [r["step_s"] for r in recs],
            "median_step_s": statistics.median(r["step_s"] for r in recs),
            "tokens_per_step": statistics.mean(r["tokens"] for r in recs),
            "wait_s": statistics.mean(waits),
            "alone_s": statistics.mean(alone),
            "hidden": max(0.0, 1.0 - statistics.mean(waits) / statistics.mean(alone)),
            "hidden_span": statistics.mean(spans) if spans else 0.0,
            "early_share": statistics.mean(e / r["buckets"] for r in recs for e in r["early"]),
            "microbatches": recs[0]["microbatches"],
        }
    return out


def update_times(numel: int, baseline: str | None, repeats: int) -> list[dict]:
    """Median seconds of one rank's optimizer work a step (module docstring), with clipping that
    applies (grad_clip 1) and without (grad_clip 0), today's and at `baseline`."""
    import statistics
    import time

    import torch

    from trainer.parallel.comm import SoloComm
    from trainer.parallel.zero import ZeroOptimizer

    classes = {"today": ZeroOptimizer}
    if baseline:
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        from at_revision import module_at

        classes[baseline] = module_at(baseline, "trainer/parallel/zero.py").ZeroOptimizer
    g = torch.Generator().manual_seed(0)
    shapes = [(numel // 8,)] * 8  # eight tensors, as a model's are several
    grads = [torch.randn(s, generator=g).bfloat16() for s in shapes]
    scale = 4.0 / numel**0.5  # the scaled norm about 4: clipping at 1 applies at any size
    rows = []
    for clip in (1.0, 0.0):
        opts = {}
        for name, cls in classes.items():
            params = [torch.zeros(s, dtype=torch.bfloat16, requires_grad=True) for s in shapes]
            masters = [torch.zeros(s) for s in shapes]
            opts[name] = (params, cls(params, SoloComm(), level=0, lr=1e-4, grad_clip=clip,
                                      master_params=masters))  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in opts}
        for _ in range(repeats + 1):  # the first allocates the moments' pages: not counted
            for name, (params, opt) in opts.items():
                t0 = time.thread_time()
                opt.begin_step()
                opt.begin_microbatch(True)
                for p, gr in zip(params, grads):
                    p.grad = gr
                opt.accumulate_grads()
                opt.finish_backward()
                opt.apply(opt.reduce(scale))
                times[name].append(time.thread_time() - t0)
        base = statistics.median(times["today"][1:])
        for name, ts in times.items():
            med = statistics.median(ts[1:])
            rows.append({"numel": numel, "clip": clip, "optimizer": name, "seconds": med,
                         "x_today": med / base})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data",
        default=os.path.join(ROOT, ".demo", "stdlib"),
        help="corpus whose lengths make the batches (`make demo-data`)",
    )
    ap.add_argument("--model", default="small")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6, help="measured steps per level")
    ap.add_argument("--update", type=int, help="only the optimizer's work on this many params")
    ap.add_argument("--baseline", help="with --update: also the optimizer at this git revision")
    args = ap.parse_args()
    if args.update:
        rows = update_times(args.update, args.baseline, args.steps)
        print("| params | grad_clip | optimizer | s a step | x today's |")
        print("| ---: | ---: | --- | ---: | ---: |")
        for r in rows:
            print(f"| {r['numel']:,} | {r['clip']:g} | {r['optimizer']} | {r['seconds']:.3f} "
                  f"| {r['x_today']:.2f} |")  # fmt: skip
        os.makedirs(os.path.join(ROOT, "benchmarks", "out"), exist_ok=True)
        with open(os.path.join(ROOT, "benchmarks", "out", "bench_zero_update.json"), "w") as f:
            json.dump(rows, f, indent=2)
        return

    rows = memory_table()
    print("model state per rank, bfloat16 compute (GB; measured = ZeroOptimizer's buffers)")
    print(f"{'model':10} {'ranks':>5} {'zero':>4} {'weights':>8} {'master':>8} {'moments':>8} "
          f"{'grads':>8} {'peak':>8} {'total':>8}  source")  # fmt: skip
    for r in rows:
        print(f"{r['model']:10} {r['ranks']:>5} {r['zero']:>4} {r['weights'] / GB:8.3f} "
              f"{r['master'] / GB:8.3f} {r['moments'] / GB:8.3f} {r['grads'] / GB:8.3f} "
              f"{r['grads_peak'] / GB:8.3f} {r['total'] / GB:8.3f}  "
              f"{'measured = formula' if r['measured'] else 'formula'}")  # fmt: skip

    job = {"data": args.data, "model": args.model, "layers": args.layers,
           "capacity": args.capacity, "steps": args.steps}  # fmt: skip
    steps = {}
    for world in (2, 4):
        steps[world] = step_times(world, job)
        lv = steps[world]["levels"]
        print(f"\nwhole steps, {args.model} with {args.layers} layers "
              f"({steps[world]['params'] / 1e6:.1f}M params, float32), {world} gloo ranks, "
              f"capacity {args.capacity}, {lv[0]['tokens_per_step']:.0f} tokens/step, "
              f"median of {args.steps}")  # fmt: skip
        base = lv[0]["median_step_s"]
        for level, r in lv.items():
            print(f"  zero {level}: step {r['median_step_s']:7.3f} s ({r['median_step_s'] / base:.3f}x"
                  f" zero 0)  reduction alone {r['alone_s'] * 1e3:6.1f} ms, exposed "
                  f"{r['wait_s'] * 1e3:6.1f} ms: hidden {r['hidden']:.2f} (span-based "
                  f"{r['hidden_span']:.2f}); buckets launched in the backward "
                  f"{r['early_share']:.2f}")  # fmt: skip
    os.makedirs(os.path.join(ROOT, "benchmarks", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "out", "bench_zero.json"), "w") as f:
        json.dump({"memory": rows, "steps": steps, "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
