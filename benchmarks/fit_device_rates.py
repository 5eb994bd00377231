"""A device preset's rates (datapipe.plan.cost.DeviceRates) from a `mixlen calibrate` file: the
matmul and attention FLOP rates and the per-micro-batch overhead that reproduce its local timings
best (least squares on relative error, at the preset's half-rate length), and the optimizer's
seconds a parameter from its `step` term. With
bench_gpu.json files, each `train`/`compiled` row's measured step time beside the step time
planned with the fitted rates and with the preset now in datapipe/plan/cost.py. Nothing is timed.

    .venv/bin/python benchmarks/fit_device_rates.py COST.json [BENCH_GPU.json ...] [--preset h100]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gpu  # noqa: E402

from datapipe.plan.cost import DEVICES, DeviceRates, build_cost_model  # noqa: E402
from datapipe.shapes import ModelConfig, get_config  # noqa: E402


def _local(cal: dict) -> tuple[list[np.ndarray], np.ndarray]:
    rows = [t for t in cal["timings"] if t["kind"] == "local" and t["k"] == 1]
    return [np.asarray(t["lengths"], dtype=np.float64) for t in rows], np.array(
        [t["seconds"] for t in rows]
    )


def fit(cal: dict, shape: ModelConfig, base: DeviceRates) -> tuple[DeviceRates, np.ndarray]:
    """(rates, relative residual of each local timing). The half-rate length stays `base`'s:
    on one rank a sample's S x n_half pairs grow with its positions as the GEMMs do, so the
    local timings cannot tell it from the GEMM rate (only ring chunks could)."""
    lens, secs = _local(cal)
    h = base.attn_n_half
    x = np.array([[float((s * (s + h)).sum()), float(s.sum()), 1.0] for s in lens])
    (a, b, c), *_ = np.linalg.lstsq(x / secs[:, None], np.ones_like(secs), rcond=None)
    if min(a, b, c) <= 0:
        raise SystemExit(f"the fit gives a non-positive term: a={a:.3g}, b={b:.3g}, c={c:.3g}")
    step = [t["seconds"] for t in cal["timings"] if t["kind"] == "step"]
    # the cost model's a and b are FLOPs over the rates: the base's scaled by the fitted ones
    ref = build_cost_model("base", shape, base)
    rates = dataclasses.replace(
        base,
        matmul_flops=float(base.matmul_flops * ref.b / b),
        attn_flops=float(base.attn_flops * ref.a / a),
        microbatch_overhead_s=float(c),
        step_s_per_param=float(np.median(step)) / shape.num_params() if step else 0.0,
    )
    return rates, x @ np.array([a, b, c]) / secs - 1.0


def planned(shape: ModelConfig, rates: DeviceRates, lens: list[int], tokens: int) -> float:
    """Step seconds the planner gives one rank's batch `lens` at `tokens` a micro-batch."""
    from datapipe.plan.metrics import predicted_step_ns
    from datapipe.plan.planner import PlannerConfig

    cost = build_cost_model("bench", shape, rates)
    plan = PlannerConfig(policy="single", capacity=tokens).build(cost, 1).plan(np.array(lens))
    return predicted_step_ns(plan, cost) / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cost", help="a cost file written by `mixlen calibrate --device cuda`")
    p.add_argument("bench", nargs="*", help="bench_gpu.json files with train/compiled rows")
    p.add_argument("--preset", default="h100", help="the device preset to compare and extend")
    args = p.parse_args(argv)
    cal = json.loads(Path(args.cost).read_text())["calibration"]
    shape = get_config(cal["model"])
    rates, rel = fit(cal, shape, DEVICES[args.preset])
    print(f"fitted to {Path(args.cost).name} ({cal['model']}, {cal['device']}):")
    for k in ("matmul_flops", "attn_flops", "microbatch_overhead_s", "attn_n_half (kept)"):
        print(f"  {k} = {getattr(rates, k.split()[0]):.4g}")
    print(f"  step_s_per_param = {rates.step_s_per_param:.4g}")
    lens, secs = _local(cal)
    print("\n| local timing | measured s | fitted |")
    print("| --- | --- | --- |")
    for s, t, r in zip(lens, secs, rel):
        print(f"| {len(s)} x {int(s[0])} | {t:.4f} | {r:+.1%} |")
    print(f"\n| bench row | measured s | planned, fitted | planned, preset {args.preset} now |")
    print("| --- | --- | --- | --- |")
    now = DEVICES[args.preset]
    # the batches as the benchmark drew them (bench_gpu's own draw, kept per size and layout)
    b = bench_gpu.Bench(bench_gpu.Sizes(device="cpu"), Path("/tmp"), 1.0)
    for path in args.bench:
        results = json.loads(Path(path).read_text())
        for name in ("train", "compiled"):
            for row in results["parts"].get(name, {}).get("rows", []):
                if "step_s" not in row:
                    continue
                tokens, layout = row["tokens"], row["layout"]
                lens = bench_gpu._batch(b, tokens, layout)
                fit_s = planned(shape, rates, lens, tokens)
                now_s = planned(shape, now, lens, tokens)
                what = f"{name} {tokens} {layout}"
                print(
                    f"| {what} | {row['step_s']:.3f} | {fit_s:.3f} ({fit_s / row['step_s'] - 1:+.1%})"
                    f" | {now_s:.3f} ({now_s / row['step_s'] - 1:+.1%}) |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
