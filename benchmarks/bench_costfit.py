"""How the cost fit's residual weight (datapipe.plan.costfit.WEIGHT_POWER) moves the training-step
benchmark's predictions: the calibration timings stored by earlier runs of
benchmarks/bench_train.py are refitted at each weight, the runs' batches re-planned under each
refitted cost model, and every (kind, policy) row's predicted step time set beside the minimum
those runs measured. Every calibration is checked against every run's measurements of its world
size (2 ranks wall clock, 4 ranks CPU replay), so a weight is not judged on its own timings only.
Nothing is timed here: it reads JSON.

    .venv/bin/python benchmarks/bench_costfit.py RUN.json [RUN.json ...] [--powers 0.5,0.75,1.0]

Prints one row per (world, calibration run, weight, measured run) and writes
benchmarks/out/bench_costfit.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CLOCK_KEY = {2: "wall_s", 4: "step_cpu_s"}


def refit(report: dict, world: int, power: float):
    """The cost model refitted from a run's stored calibration at residual weight 1/t**power."""
    from datapipe.plan.costfit import Timing
    from datapipe.shapes import ModelConfig
    from trainer.calibrate import calibrate

    timings = [Timing.from_dict(t) for t in report["timings"]]
    shape = ModelConfig(**report["shape"])
    cal = calibrate(
        "debug", world, clock=report["clock"], shape=shape, timings=timings, weight_power=power
    )
    return cal.cost


def deviations(cost, run: dict, world: int) -> dict[str, float]:
    """(measured / predicted - 1) per kind and policy row, summed over the kind's batches."""
    from datapipe.plan.compare import Variant, compare, variant_planners
    from datapipe.plan.metrics import predicted_step_ns
    from datapipe.plan.planner import PlannerConfig

    summary = run[f"ranks{world}"]
    best: dict[tuple, float] = {}
    for r in summary["records"]:
        key = (r["kind"], r["batch"], r["policy"])
        best[key] = min(best.get(key, np.inf), r[CLOCK_KEY[world]])
    max_context = max(max(b) for bs in run["batches"].values() for b in bs)
    base = PlannerConfig(capacity=summary["capacity"], max_context=max_context)
    variants = [Variant("hdp"), Variant("hdp", widen=True), Variant("static")]
    planners = variant_planners(variants, base, cost, world)
    keys = [(k, i) for k, bs in run["batches"].items() for i in range(len(bs))]
    steps = [
        (np.asarray(run["batches"][k][i], dtype=np.int64), np.arange(len(run["batches"][k][i])))
        for k, i in keys
    ]
    planned = compare(planners, steps, cost)
    out = {}
    for policy in planners:
        rows: dict[str, list[float]] = {}
        for (kind, i), plan in zip(keys, planned[policy].plans):
            if (kind, i, policy) in best:
                m, q = rows.setdefault(kind, [0.0, 0.0]), predicted_step_ns(plan, cost) / 1e9
                m[0] += best[kind, i, policy]
                m[1] += q
        for kind, (m, q) in rows.items():
            out[f"{kind}/{policy}"] = m / q - 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="bench_train.py output JSON files")
    ap.add_argument("--powers", default="0.5,0.75,1.0")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out", "bench_costfit.json"))
    args = ap.parse_args()
    runs = {}
    for path in args.runs:
        with open(path) as f:
            runs[os.path.basename(path)] = json.load(f)
    powers = [float(x) for x in args.powers.split(",")]
    rows = []
    print("| ranks | calibration of | weight | measured in | rows | worst row | max abs |")
    print("| ---: | --- | ---: | --- | ---: | --- | ---: |")
    for world in (2, 4):
        for cname, crun in runs.items():
            report = crun.get(f"calibration{world}")
            if report is None:
                continue
            for p in powers:
                cost = refit(report, world, p)
                for mname, mrun in runs.items():
                    if f"ranks{world}" not in mrun:
                        continue
                    dev = deviations(cost, mrun, world)
                    worst = max(dev, key=lambda k: abs(dev[k]))
                    rows.append(
                        {"world": world, "calibration": cname, "power": p, "measured": mname}
                        | {"deviations": dev, "max_abs": abs(dev[worst])}
                    )
                    print(
                        f"| {world} | {cname} | {p:g} | {mname} | {len(dev)} | {worst} "
                        f"{dev[worst]:+.1%} | {abs(dev[worst]):.1%} |",
                        flush=True,
                    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
