"""Planning time and plan quality of mixlen's planners at scale, beside lightbinpack and binpacking.

    .venv/bin/python benchmarks/bench_plan.py [--repeats 15] [--skip-binpacking]

Cases: (a) 65,536 lognormal lengths (median 512, sigma 1.6, capped at 128K) onto 1,024 ranks,
C = 8,192; (b) one 32M-token global batch drawn from the byted-like distribution (2M context)
onto 1,024 and 12,288 ranks. Policies: hdp, naive-hdp, static, hdp+offload, hdp+widen. Times are
medians over repeats after a JIT warm-up call (wall clock, and the calling thread's CPU time,
less sensitive to other jobs on a shared box), policies interleaved round-robin so machine noise
hits all alike. Quality is the estimated makespan over
the lower bound max(total work / N, largest member share) of the same cost model (llama-7b@h100).
lightbinpack's grouped packer and binpacking's constant-bin-number packer see the per-sequence
lengths / costs with sequences capped at C (they cannot split), so they are timing references only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from datapipe.plan import cost as costmod  # noqa: E402
from datapipe.plan import simulate as S  # noqa: E402
from datapipe.plan.compare import Variant, compare, variant_planners  # noqa: E402
from datapipe.plan.planner import PlannerConfig  # noqa: E402

VARIANTS = (
    Variant("hdp"),
    Variant("naive-hdp"),
    Variant("static"),
    Variant("hdp", offload=True),
    Variant("hdp", widen=True),
)


def case_a() -> np.ndarray:
    rng = np.random.default_rng(0)
    x = np.rint(rng.lognormal(np.log(512.0), 1.6, 65536))
    return np.clip(x, 1, 128 * 1024).astype(np.int64)


def case_b(seed: int = 0) -> np.ndarray:
    pool = np.minimum(S.sample_lengths("byted", 400_000, seed), 2 * 1024 * 1024)
    return S.draw_batches(pool, 32 * 1024 * 1024, 1, seed)[0]


def bench_case(name: str, lengths: np.ndarray, ranks: int, cap: int, repeats: int, cost) -> list:
    base = PlannerConfig(capacity=cap, max_context=int(lengths.max()))
    planners = variant_planners(VARIANTS, base, cost, ranks)
    res = compare(planners, [(lengths, None)], cost, passes=repeats)  # warm-up (JIT) first
    rows = []
    for label, r in res.items():
        plan = r.plans[0]
        rows.append(
            {
                "case": name,
                "ranks": ranks,
                "capacity": cap,
                "samples": int(lengths.size),
                "tokens": int(lengths.sum()),
                "policy": label,
                "plan_ms_median": r.plan_ms[0],
                "plan_ms_min": float(np.min(r.pass_ms[0])),
                "plan_cpu_ms_median": float(np.median(r.pass_cpu_ms[0])),
                "makespan_s": plan.makespan_ns / 1e9,
                "lower_bound_s": plan.lower_bound_ns / 1e9,
                "max_over_lower_bound": plan.makespan_ns / plan.lower_bound_ns,
                "microbatches": plan.num_microbatches,
            }
        )
    return rows


def quality_over_batches(ranks: int, cap: int, cost, n: int = 10) -> list:
    """max/LB of each policy over n byted-like 32M-token batches (mean and worst)."""
    pool = np.minimum(S.sample_lengths("byted", 400_000, 0), 2 * 1024 * 1024)
    batches = S.draw_batches(pool, 32 * 1024 * 1024, n, 0)
    base = PlannerConfig(capacity=cap, max_context=2 * 1024 * 1024)
    res = compare(variant_planners(VARIANTS, base, cost, ranks), [(b, None) for b in batches], cost)
    rows = []
    for label, v in res.items():
        r = [m.max_over_lower_bound for m in v.metrics]
        rows.append(
            {
                "policy": label,
                "ranks": ranks,
                "mean_max_over_lb": float(np.mean(r)),
                "worst_max_over_lb": float(np.max(r)),
                "per_batch": r,
            }
        )
    return rows


def bench_references(
    lengths: np.ndarray, ranks: int, cap: int, cost, repeats: int, binpack: bool
) -> list:
    rows = []
    clipped = np.minimum(lengths, cap)
    try:
        import lightbinpack
    except ImportError:
        lightbinpack = None
    if lightbinpack is not None:
        xl = clipped.tolist()
        lightbinpack.pack(xl, cap, strategy="ogbfd", dp_size=ranks)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            lightbinpack.pack(xl, cap, strategy="ogbfd", dp_size=ranks)
            ts.append((time.perf_counter() - t0) * 1e3)
        rows.append(
            {
                "policy": "lightbinpack.pack(ogbfd)",
                "plan_ms_median": float(np.median(ts)),
                "note": "token balance only, lengths capped at C",
            }
        )
    if binpack:
        try:
            import binpacking
        except ImportError:
            binpacking = None
        if binpacking is not None:
            w = cost.work_ns(lengths, 1).tolist()
            t0 = time.perf_counter()
            bins = binpacking.to_constant_bin_number(w, ranks)
            ms = (time.perf_counter() - t0) * 1e3
            loads = np.array([sum(b) for b in bins], dtype=np.float64)
            rows.append(
                {
                    "policy": "binpacking.to_constant_bin_number",
                    "plan_ms_median": ms,
                    "note": f"per-sequence costs, no splitting; max/mean load "
                    f"{loads.max() / loads.mean():.3f}",
                }
            )
    return rows


def regime_batch(rng: np.random.Generator, n: int, cap: int) -> np.ndarray:
    """One step of 0.001 to 20 times N x C tokens: lognormal short samples (median 0.1% to 100% of
    C, sigma 0 to 2; at most 3,000), each a long one (C to N x C) with probability 0, 1% or 10%."""
    f = float(np.exp(rng.uniform(np.log(1e-3), np.log(20))))
    med = float(np.exp(rng.uniform(np.log(1e-3), 0)))
    sigma, long_p = float(rng.uniform(0, 2)), float(rng.choice([0, 0, 0.01, 0.1]))
    target, out, tot = max(1, int(f * n * cap)), [], 0
    while tot < target and len(out) < 3000:
        if rng.random() < long_p and n > 1:
            s = int(rng.integers(cap + 1, n * cap + 1))
        else:
            s = int(min(cap, max(1, rng.lognormal(np.log(med * cap), sigma))))
        out.append(s)
        tot += s
    return np.array(out, np.int64)


def regimes(count: int) -> list:
    """hdp and hdp+widen on `count` seeded steps from one sample to 20 times N x C (N 1..64, C
    256 / 2,048 / 16,384; presets debug, small, llama-7b in turn): makespan / lower bound, and
    how many steps with at least N samples leave a rank idle."""
    costs = [costmod.preset(m) for m in ("debug", "small", "llama-7b")]
    rng = np.random.default_rng(7)
    rows: dict = {"hdp": [], "hdp+widen": []}
    idle = {k: 0 for k in rows}
    enough = 0
    for i in range(count):
        n, cap = int(rng.integers(1, 65)), int(rng.choice([256, 2048, 16384]))
        lengths = regime_batch(rng, n, cap)
        enough += lengths.size >= n
        for name in rows:
            cfg = PlannerConfig(capacity=cap, widen=name.endswith("widen"))
            p = cfg.build(costs[i % 3], n).plan(lengths)
            rows[name].append(p.makespan_ns / p.lower_bound_ns)
            idle[name] += lengths.size >= n and bool((p.microbatch_counts() == 0).any())
    out = []
    for name, r in rows.items():
        r = np.array(r)
        out.append(
            {
                "policy": name,
                "steps": count,
                "mean": float(r.mean()),
                "p90": float(np.percentile(r, 90)),
                "worst": float(r.max()),
                "share_over_1_05": float((r > 1.05).mean()),
                "idle_rank_steps": int(idle[name]),
                "steps_with_n_samples": int(enough),
            }
        )
        print(
            f"  {name:<10} mean {r.mean():.3f}  p90 {np.percentile(r, 90):.3f}  worst "
            f"{r.max():.2f}  > 1.05: {(r > 1.05).mean():.1%}  idle rank in "
            f"{idle[name]} of {enough} steps with >= N samples"
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--skip-binpacking", action="store_true")
    ap.add_argument(
        "--regimes", type=int, default=0, help="only: hdp's balance over this many seeded steps"
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "bench_plan.json"))
    args = ap.parse_args()
    if args.regimes:
        print(f"{args.regimes} steps from 1 sample to 20 x N x C (makespan / lower bound):")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"regimes": regimes(args.regimes)}, indent=1))
        return 0
    cost = costmod.preset("llama-7b")
    a, b = case_a(), case_b()
    rows = bench_case("a", a, 1024, 8192, args.repeats, cost)
    refs = [
        dict(r, case="a")
        for r in bench_references(a, 1024, 8192, cost, args.repeats, not args.skip_binpacking)
    ]
    rows += bench_case("b", b, 1024, 8192, args.repeats, cost)
    rows += bench_case("b", b, 12288, 8192, max(3, args.repeats // 3), cost)
    refs += [dict(r, case="b") for r in bench_references(b, 1024, 8192, cost, args.repeats, False)]
    print(
        f"{'case':<5}{'ranks':>7}{'policy':>14}{'plan ms (median)':>18}{'min':>8}{'cpu ms':>8}"
        f"{'makespan s':>12}{'max/LB':>8}{'mbs':>7}"
    )
    for r in rows:
        print(
            f"{r['case']:<5}{r['ranks']:>7}{r['policy']:>14}{r['plan_ms_median']:>18.1f}"
            f"{r['plan_ms_min']:>8.1f}{r['plan_cpu_ms_median']:>8.1f}{r['makespan_s']:>12.3f}"
            f"{r['max_over_lower_bound']:>8.3f}"
            f"{r['microbatches']:>7}"
        )
    for r in refs:
        print(f"{r['case']:<5}{'':>7}  {r['policy']}: {r['plan_ms_median']:.1f} ms ({r['note']})")
    quality = quality_over_batches(1024, 8192, cost)
    print("byted-like, 10 batches of 32M tokens, 1,024 ranks: makespan / lower bound")
    for q in quality:
        print(
            f"  {q['policy']:<14} mean {q['mean_max_over_lb']:.3f}  worst {q['worst_max_over_lb']:.3f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"cost": cost.name, "rows": rows, "references": refs, "quality_byted_10": quality},
            indent=1,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
