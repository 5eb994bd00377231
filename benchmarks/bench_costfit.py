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
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def refit(report: dict, world: int, power: float):
    """The cost model refitted from a run's stored calibration at residual weight 1/t**power."""
    from datapipe.plan.costfit import Timing
    from datapipe.shapes import ModelConfig
    from trainer.calibrate import calibrate

    timings = [Timing.from_dict(t) for t in report["timings"]]
    shape = ModelConfig(**report["shape"])
    model = report["model"]  # the model the run calibrated (its shape as stored)
    cal = calibrate(
        model, world, clock=report["clock"], shape=shape, timings=timings, weight_power=power
    )
    return cal.cost


def deviations(cost, run: dict, world: int) -> dict[str, float]:
    """(measured / predicted - 1) per kind and policy row under `cost`: the run's batches
    re-planned, its records re-costed and summarised as bench_train summarises them."""
    from bench_train import STEP_KEY, policy_planners, summarise

    from datapipe.plan.compare import compare
    from datapipe.plan.metrics import predicted_step_ns

    summary = run[f"ranks{world}"]
    max_context = max(max(b) for bs in run["batches"].values() for b in bs)
    planners = policy_planners(cost, world, summary["capacity"], max_context)
    keys = [(k, i) for k, bs in run["batches"].items() for i in range(len(bs))]
    steps = [
        (np.asarray(run["batches"][k][i], dtype=np.int64), np.arange(len(run["batches"][k][i])))
        for k, i in keys
    ]
    planned = compare(planners, steps, cost)
    pred = {
        (*key, p): predicted_step_ns(plan, cost) / 1e9
        for p in planners
        for key, plan in zip(keys, planned[p].plans)
    }
    records = [
        {**r, "predicted_s": pred[r["kind"], r["batch"], r["policy"]]} for r in summary["records"]
    ]
    kinds = summarise(records, STEP_KEY[world])["kinds"]
    return {
        f"{k}/{p}": row["deviation"] for k, v in kinds.items() for p, row in v["policies"].items()
    }


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
