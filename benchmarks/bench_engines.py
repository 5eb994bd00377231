"""Preprocess engines side by side: local with 1 worker, local with K workers, Ray Data with K CPUs,
on the same synthetic JSON Lines files, with the bytes tokenizer and a BPE tokenizer.

Each engine runs several input sizes (sets of 2 MB files), each the best of --repeats runs with
the engines interleaved (the box is shared: load drifts hit every engine alike), and a least-squares
line through (MB, seconds) separates its steady rate (MB/s, the slope) from its fixed cost per run
(the intercept); Ray's start-up (init, the workers' first task with their imports, shutdown) is
measured apart. From these the break-even
input size where Ray beats local K workers is computed for a cluster of W Ray workers that each
run at this machine's per-worker Ray rate: D* = fixed / (1/rate_localK - 1/(W * rate_ray_per_worker)).

Usage: .venv/bin/python benchmarks/bench_engines.py [--workers 2] [--file-mb 2]
       [--sizes 4,8,16] [--repeats 3] [--skip-bpe]
Prints a table and writes benchmarks/out/bench_engines.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from datapipe.ingest.preprocess import PreprocessConfig, preprocess  # noqa: E402

BPE = str(ROOT / "tests" / "assets" / "bpe-stdlib.json")
WORDS = (
    "def class return import for while if else self value data length token the of and to in "
    "is that with as on by this from at be are not or which"
).split()


def make_files(folder: Path, n: int, mb: float, seed: int) -> list[str]:
    """n JSON Lines files of about `mb` MB each (documents of 50..5,000 words)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = folder / f"part-{i:04d}.jsonl"
        size = 0
        with open(path, "w") as f:
            while size < mb * 1e6:
                words = rng.choice(WORDS, size=int(rng.integers(50, 5000)))
                line = json.dumps({"text": " ".join(words)}) + "\n"
                f.write(line)
                size += len(line)
        paths.append(str(path))
    return paths


def run(
    files: list[str], out: str, engine: str, workers: int, tokenizer: str | None, repeats: int = 1
) -> float:
    """Best (least loaded) wall seconds of `repeats` preprocess runs."""
    times = []
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        preprocess(
            PreprocessConfig(
                files, out, engine=engine, workers=workers, tokenizer=tokenizer, progress=False
            ),
            warn=lambda _m: None,
        )
        times.append(time.perf_counter() - t0)
        shutil.rmtree(out, ignore_errors=True)
    return float(min(times))


def fit(mb: list[float], seconds: list[float]) -> tuple[float, float]:
    """(steady MB/s, fixed s per run): least-squares line seconds = fixed + MB / rate."""
    slope, fixed = np.polyfit(np.asarray(mb), np.asarray(seconds), 1)
    return 1.0 / slope, float(fixed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--file-mb", type=float, default=2.0)
    ap.add_argument("--sizes", default="4,8,16", help="files per input set")
    ap.add_argument("--repeats", type=int, default=3, help="median of this many runs")
    ap.add_argument("--skip-bpe", action="store_true")
    args = ap.parse_args()
    k = args.workers
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="mxbench", dir="/tmp"))
    tmp = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    results: dict = {"workers": k, "file_mb": args.file_mb, "load_avg_start": os.getloadavg()[0]}
    try:
        sizes = [int(x) for x in args.sizes.split(",")]
        files = make_files(tmp / "in", max(sizes), args.file_mb, 0)
        sets = {n: files[:n] for n in sizes}
        mb = {n: sum(os.path.getsize(f) for f in fs) / 1e6 for n, fs in sets.items()}
        tokenizers = {"bytes": None} if args.skip_bpe else {"bytes": None, "bpe": BPE}
        from datapipe.ingest.engines import ray as ray_engine

        r = args.repeats
        engines = (("local", 1), ("local", k), ("ray", k))
        times: dict = {}
        t0 = time.perf_counter()
        with ray_engine.ray_runtime(k):  # Ray idles beside the local runs (interleaved, below)
            results["ray_init_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()  # the workers' first tasks import mixlen and streaming
            run(files[:1], str(tmp / "o"), "ray", k, None)
            results["ray_first_run_s"] = time.perf_counter() - t0
            for tok in tokenizers.values():  # imports (streaming, tokenizers) before timing
                run(files[:1], str(tmp / "o"), "local", 1, tok)
            for tok_name, tok in tokenizers.items():
                for size, fs in sets.items():
                    for engine, w in engines:  # interleaved: load drifts hit every engine alike
                        t = run(fs, str(tmp / "o"), engine, w, tok, r)
                        times.setdefault((f"{engine} {w}", tok_name), {})[size] = t
            t0 = time.perf_counter()
        results["ray_shutdown_s"] = time.perf_counter() - t0
        rows = [(name, tok_name, t) for (name, tok_name), t in times.items()]
        startup = results["ray_init_s"] + results["ray_first_run_s"] + results["ray_shutdown_s"]
        results["ray_startup_s"] = startup
        table = []
        for name, tok_name, t in rows:
            rate, fixed = fit([mb[n] for n in sizes], [t[n] for n in sizes])
            table.append(
                {
                    "engine": name,
                    "tokenizer": tok_name,
                    "mb": [mb[n] for n in sizes],
                    "seconds": [t[n] for n in sizes],
                    "rate_mb_s": rate,
                    "fixed_s": fixed,
                    "s_per_file": args.file_mb / rate,
                }
            )
        results["rows"] = table
        # break-even: Ray with W workers at this machine's per-worker Ray rate vs local K
        breakeven = []
        for tok_name in tokenizers:
            by = {r["engine"]: r for r in table if r["tokenizer"] == tok_name}
            local, ray = by[f"local {k}"], by[f"ray {k}"]
            fixed = startup + ray["fixed_s"] - local["fixed_s"]
            per_worker = ray["rate_mb_s"] / k
            for w in (k, 8, 32, 128):
                gain = 1 / local["rate_mb_s"] - 1 / (w * per_worker)
                d = fixed / gain if gain > 0 else None
                breakeven.append(
                    {
                        "tokenizer": tok_name,
                        "ray_workers": w,
                        "breakeven_mb": d,
                        "breakeven_files": d / args.file_mb if d else None,
                    }
                )
        results["breakeven"] = breakeven
        results["load_avg_end"] = os.getloadavg()[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)
    head = "".join(f"{f'{m:.0f} MB s':>10}" for m in results["rows"][0]["mb"])
    print(f"{'engine':<10}{'tokenizer':<10}{head}{'MB/s':>8}{'fixed s':>9}{'s/file':>8}")
    for r in results["rows"]:
        cells = "".join(f"{x:>10.2f}" for x in r["seconds"])
        print(
            f"{r['engine']:<10}{r['tokenizer']:<10}{cells}{r['rate_mb_s']:>8.2f}"
            f"{r['fixed_s']:>9.2f}{r['s_per_file']:>8.2f}"
        )
    print(
        f"ray start-up: init {results['ray_init_s']:.1f} s, first run (worker imports) "
        f"{results['ray_first_run_s']:.1f} s, shutdown {results['ray_shutdown_s']:.1f} s"
    )
    for b in results["breakeven"]:
        d = b["breakeven_mb"]
        where = f"{d:,.0f} MB ({b['breakeven_files']:,.0f} files)" if d else "never"
        print(
            f"ray beats local {k} ({b['tokenizer']}) with {b['ray_workers']} workers from: {where}"
        )
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_engines.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'bench_engines.json'}")


if __name__ == "__main__":
    main()
