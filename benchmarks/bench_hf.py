"""Hugging Face checkpoints: load time and peak memory of mixlen's loader beside transformers', and
export time.

The benchmark writes a random Llama-shaped checkpoint itself (default: Llama 3.2 1B's shape,
1.24B parameters, bfloat16) with mixlen's `export_hf` into a temporary directory (sharded: 1 GB
shards with the index; this is the export time), then loads it in a fresh process per run, the
two loaders interleaved:

- mixlen: `inspect_pretrained` (config.json and the headers) + a model built on the meta device and
  materialised uninitialised + `load_pretrained_weights` (memory-mapped, one tensor at a time,
  copied into the parameters);
- transformers: `AutoModelForCausalLM.from_pretrained(dir, dtype=bfloat16)` (its default
  `low_cpu_mem_usage` path), whose parameters stay backed by the files' memory mapping until
  used; and the same followed by reading one element per page of every parameter
  (transformers+touch: the whole model resident, as after a first forward).

Peak memory is the process's ru_maxrss, and the same minus the resident size after the imports
(what the load itself added). The page cache is warm for every run (the file was just written).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_hf.py [--repeats 2] [--small]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_hf.py --eval [--data .demo/stdlib]

`--eval`: `mixlen eval` throughput on 1 and 2 ranks (tokens of the held-out positions per second of
the whole command, and of the evaluation alone, from its start-up-free timing line): a random
Llama-shaped folder of EVAL_SHAPE with the dataset's vocabulary, the dataset's samples
(`--split all --max-tokens`), no passkey. 2 ranks run at `--capacity` (samples longer than it on
a ring of both); 1 rank at the dataset's longest sample when that is more (it must hold each
sample alone).

Prints a table and writes benchmarks/out/bench_hf.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GB = 1e9
# Llama 3.2 1B: 16 layers of width 2048, 32 query / 8 KV heads, SwiGLU 8192, 128,256 tokens, tied
SHAPE_1B = dict(
    vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
    rope_theta=500000.0, tie_embeddings=True, max_position_embeddings=131072,
    rope_scaling={"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)  # fmt: skip
LOADERS = ("mixlen", "transformers", "transformers+touch")
SHAPE_SMALL = {**SHAPE_1B, "vocab_size": 32000, "dim": 512, "n_layers": 4, "ffn_dim": 1536}


def _rss_now() -> int:
    """Resident bytes of this process now (/proc/self/status VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def child(loader: str, path: str) -> dict:
    """One load in this (fresh) process: seconds, peak and post-import resident bytes."""
    import torch

    # one-time imports before the clock and the baseline: torch's meta-device kernels (the
    # trainer builds every model on the meta device anyway), transformers' Llama modules
    if loader == "mixlen":
        from datapipe.shapes import ModelConfig
        from trainer.model.pretrained import inspect_pretrained, load_pretrained_weights
        from trainer.model.transformer import build

        build(ModelConfig(), "meta")
    else:
        import transformers.models.llama.modeling_llama  # noqa: F401
        from transformers import AutoModelForCausalLM
    base = _rss_now()
    t0 = time.perf_counter()
    t_inspect = t_build = float("nan")
    if loader == "mixlen":
        pre = inspect_pretrained(path)
        t_inspect = time.perf_counter() - t0
        model = build(pre.shape, "meta", torch.bfloat16).to_empty(device="cpu")
        for p in model.parameters():  # the fresh memory's page faults, apart from the reads
            p.detach().zero_()
        t_build = time.perf_counter() - t0 - t_inspect
        load_pretrained_weights(model, pre)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        if loader == "transformers+touch":  # one element per page: the whole model resident
            for p in model.parameters():
                flat = p.detach().reshape(-1)
                flat[:: 4096 // flat.element_size()].float().sum()
    seconds = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"loader": loader, "seconds": seconds, "inspect_s": t_inspect, "build_s": t_build,
            "params": params, "peak_rss": peak, "base_rss": base, "end_rss": _rss_now()}  # fmt: skip


def write_checkpoint(path: str, shape_kw: dict, shard_bytes: int) -> dict:
    """A random bfloat16 model of `shape_kw` exported to `path`; returns sizes and the export time."""
    import torch

    from datapipe.shapes import ModelConfig
    from trainer.model.export import export_hf
    from trainer.model.transformer import parameter_shapes

    shape = ModelConfig(**shape_kw)
    gen = torch.Generator().manual_seed(0)
    weights = {
        name: (torch.randn(s, generator=gen, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        for name, s in parameter_shapes(shape).items()
    }
    t0 = time.perf_counter()
    files = export_hf(weights, shape, "LlamaForCausalLM", path, shard_bytes=shard_bytes)
    seconds = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    return {"params": shape.num_params(), "bytes": size, "files": files, "export_s": seconds}


def run_child(loader: str, path: str) -> dict:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", loader, path],
        check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT},
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(runs: list[dict], repeats: int) -> dict:
    """Print the table (each loader's fastest run; the largest memory figures) and return it."""
    print(f"\n| loader | load s (best of {repeats}) | inspect ms | build s | weights s "
          "| peak RSS GB | peak - after imports GB | RSS at the end GB |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    summary = {}
    for loader in LOADERS:
        mine = [r for r in runs if r["loader"] == loader]
        best = min(mine, key=lambda r: r["seconds"])
        row = {
            "seconds": best["seconds"],
            "inspect_ms": best["inspect_s"] * 1e3,
            "build_s": best["build_s"],
            "weights_s": best["seconds"] - best["inspect_s"] - best["build_s"],  # the copies
            "peak_rss": max(r["peak_rss"] for r in mine),
            "added_rss": max(r["peak_rss"] - r["base_rss"] for r in mine),
            "end_rss": max(r["end_rss"] for r in mine),
        }
        summary[loader] = row
        parts = " | ".join(
            "-" if row[k] != row[k] else f"{row[k]:.{digits}f}"  # nan: not measured
            for k, digits in (("inspect_ms", 1), ("build_s", 2), ("weights_s", 2))
        )
        print(f"| {loader} | {row['seconds']:.2f} | {parts} | {row['peak_rss'] / GB:.2f} "
              f"| {row['added_rss'] / GB:.2f} | {row['end_rss'] / GB:.2f} |")  # fmt: skip
    return summary


EVAL_SHAPE = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=768, tie_embeddings=True)


def bench_eval(data: str, max_tokens: int, capacity: int) -> dict:
    """`mixlen eval` of a random folder on `data` with 1 and 2 ranks: wall seconds, tokens/s."""
    from datapipe.index import read_lengths, read_manifest

    vocab = int(read_manifest(data).get("vocab_size") or 258)
    caps = {1: max(capacity, int(read_lengths(data).max())), 2: capacity}
    tmp = tempfile.mkdtemp(prefix="bench_hf_eval_")
    path = os.path.join(tmp, "model")
    rows = []
    try:
        write_checkpoint(
            path, {**EVAL_SHAPE, "vocab_size": vocab, "max_position_embeddings": 16384}, int(GB)
        )
        for nproc in (1, 2):
            cmd = [sys.executable, "-m", "tools.cli", "eval", path, data, "--split", "all",
                   "--max-tokens", str(max_tokens), "--no-passkey", "--json", "--nproc",
                   str(nproc), "--capacity", str(caps[nproc]), "--dtype", "float32"]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
            t0 = time.perf_counter()
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if out.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"ranks": nproc, "capacity": caps[nproc], "tokens": res["tokens"], "wall_s": wall,
                         "eval_s": res.get("seconds"), "tokens_per_s": res["tokens"] / wall,
                         "eval_tokens_per_s": res["tokens"] / res["seconds"] if res.get("seconds") else None})  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"mixlen eval: {EVAL_SHAPE} with vocab {vocab} on {data}")
    print(
        "| ranks | capacity | tokens | command s | tokens/s | evaluation s | tokens/s (evaluation) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['ranks']} | {r['capacity']:,} | {r['tokens']:,} | {r['wall_s']:.1f} | {r['tokens_per_s']:,.0f} | "
              f"{r['eval_s']:.1f} | {r['eval_tokens_per_s']:,.0f} |")  # fmt: skip
    return {"eval": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="loads per loader (interleaved)")
    ap.add_argument("--small", action="store_true", help="a 50M-parameter shape (a quick check)")
    ap.add_argument("--shard-gb", type=float, default=1.0)
    ap.add_argument(
        "--dir", default=None, help="where to write the checkpoint (default: a temp dir)"
    )
    ap.add_argument("--child", nargs=2, metavar=("LOADER", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--eval", action="store_true", help="mixlen eval throughput on 1 and 2 ranks")
    ap.add_argument("--data", default=os.path.join(ROOT, ".demo", "stdlib"))
    ap.add_argument("--max-tokens", type=int, default=300_000)
    ap.add_argument("--capacity", type=int, default=8192)
    args = ap.parse_args()
    if args.eval:
        res = bench_eval(args.data, args.max_tokens, args.capacity)
        os.makedirs(os.path.join(ROOT, "benchmarks", "out"), exist_ok=True)
        with open(os.path.join(ROOT, "benchmarks", "out", "bench_hf_eval.json"), "w") as f:
            json.dump({**res, "args": vars(args)}, f, indent=2)
        return
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    tmp = tempfile.mkdtemp(prefix="bench_hf_", dir=args.dir)
    path = os.path.join(tmp, "model")
    try:
        ckpt = write_checkpoint(
            path, SHAPE_SMALL if args.small else SHAPE_1B, int(args.shard_gb * GB)
        )
        print(f"checkpoint: {ckpt['params'] / 1e9:.2f}B parameters, {ckpt['bytes'] / GB:.2f} GB "
              f"in {len(ckpt['files'])} files; export_hf {ckpt['export_s']:.1f} s")  # fmt: skip
        runs = [run_child(loader, path) for _ in range(args.repeats) for loader in LOADERS]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = report(runs, args.repeats)
    os.makedirs(os.path.join(ROOT, "benchmarks", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "out", "bench_hf.json"), "w") as f:
        json.dump(
            {"checkpoint": ckpt, "runs": runs, "summary": summary, "args": vars(args)}, f, indent=2
        )


if __name__ == "__main__":
    main()
