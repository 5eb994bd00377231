"""`mixlen plan DIR`: plan the first K steps of a dataset's stream and print a balance report."""

from __future__ import annotations

import argparse
import json
import time

POLICY_CHOICES = ("hdp", "static", "naive-hdp", "single", "all")
# how the planner's and the stream's fields are spelled on this command line
PLANNER_FLAGS = {
    "policy": "--policy",
    "num_ranks": "--ranks",
    "capacity": "--capacity",
    "max_context": "--max-context",
    "widen": "--widen",
    "offload": "--offload",
}
STREAM_FLAGS = {"path": "DIR", "global_batch_tokens": "--global-batch-tokens", "seed": "--seed"}


def add_planner_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by plan and simulate."""
    p.add_argument(
        "--model",
        default="llama-7b",
        help="cost preset: debug, llama-7b, llama-13b, llama-70b, optionally @h100/@cpu",
    )
    p.add_argument(
        "--cost",
        metavar="FILE",
        default=None,
        help="cost model JSON (schema in datapipe/plan/cost.py); overrides --model",
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="selective activation offload (ByteScale Eq. 3) for hdp and naive-hdp",
    )
    p.add_argument(
        "--offload-gbps",
        type=float,
        default=None,
        metavar="B",
        help="host link bandwidth for offload, Gbit/s per direction (default: cost model)",
    )
    p.add_argument(
        "--widen",
        action="store_true",
        help="also plan hdp with groups wider than the smallest where that shortens the step "
        "(an hdp+widen row; docs/PLAN.md)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="per-rank stacked bars")
    p.add_argument(
        "--html",
        metavar="FILE.html",
        default=None,
        help="self-contained report page: policy table, per-rank timelines per step, lengths",
    )
    p.add_argument(
        "--quiet", action="store_true", help="no progress bar (also off when not a terminal)"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="dataset directory (index.parquet + manifest.json)")
    p.add_argument("--ranks", type=int, required=True, help="ranks N of one island")
    p.add_argument(
        "--capacity", type=int, required=True, help="positions C per rank per micro-batch"
    )
    p.add_argument("--global-batch-tokens", type=int, required=True, help="tokens per step T")
    p.add_argument("--policy", choices=POLICY_CHOICES, default="all")
    p.add_argument("--steps", type=int, default=1, help="plan the first K steps")
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="static mesh context (default: the dataset's longest sample)",
    )
    p.add_argument("--seed", type=int, default=0, help="stream seed")
    p.add_argument(
        "--dump",
        metavar="FILE.json",
        default=None,
        help="write the planned steps (format in docs/PLAN.md)",
    )
    add_planner_arguments(p)


def resolve_cost(args: argparse.Namespace):
    from datapipe.errors import ConfigError
    from datapipe.plan.cost import resolve

    cost = resolve(args.model, args.cost)
    if args.offload_gbps is not None:
        if args.offload_gbps <= 0:
            raise ConfigError(f"--offload-gbps must be > 0, got {args.offload_gbps}")
        cost = cost.with_offload_bandwidth(args.offload_gbps * 1e9 / 8)
    return cost


def model_name(args: argparse.Namespace) -> str:
    """The model shape whose per-rank memory is reported: --model's (none with --cost FILE)."""
    return "" if args.cost else args.model


def policy_variants(
    policy: str, offload: bool, widen: bool = False
) -> list[tuple[str, bool, bool]]:
    """(policy, offload, widen) per report column: --policy all plans static, naive-hdp and hdp
    (and hdp+widen beside hdp with --widen); --policy hdp --widen plans hdp+widen only. Offload
    applies to the dynamic policies (static and single never offload)."""
    from datapipe.errors import ConfigError

    if widen and policy not in ("hdp", "all"):
        raise ConfigError(f"--widen applies to the hdp policy only, not --policy {policy}")
    names = ("static", "naive-hdp", "hdp") if policy == "all" else (policy,)
    dynamic = ("hdp", "naive-hdp")
    out = [(n, offload and n in dynamic, widen and policy == "hdp") for n in names]
    if widen and policy == "all":
        out.append(("hdp", offload, True))
    return out


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from datapipe.errors import ConfigError
    from datapipe.index import read_lengths, read_manifest
    from datapipe.plan.memory import format_preset_memory, preset_memory
    from datapipe.plan.planner import PlannerConfig
    from datapipe.progress import progress
    from datapipe.stream import StreamConfig
    from tools import report, report_html

    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    cost = resolve_cost(args)
    read_manifest(args.dir)
    lengths = read_lengths(args.dir)
    max_ctx = args.max_context or int(max(lengths.max(initial=0), 1))
    stream = StreamConfig(
        path=args.dir,
        global_batch_tokens=args.global_batch_tokens,
        seed=args.seed,
        keys=STREAM_FLAGS,
    ).build()
    batches = [next(stream) for _ in range(args.steps)]
    variants = policy_variants(args.policy, args.offload, args.widen)
    planners = {
        v: PlannerConfig(
            policy=v[0],
            num_ranks=args.ranks,
            capacity=args.capacity,
            offload=v[1],
            widen=v[2],
            max_context=max_ctx,
            seed=args.seed,
            keys=PLANNER_FLAGS,
        ).build(cost)
        for v in variants
    }
    all_metrics, first_plans, dumped = [], [], []
    timings: dict[str, report_html.Timings] = {}
    step_plans: list[list] = [[] for _ in batches]
    bar = progress(2 * len(planners) * len(batches), "plan", "plan", False if args.quiet else None)
    for planner in planners.values():
        # warm-up pass over every step (numba compiles or loads a kernel on its first use, and
        # some kernels are first used by a later step), timed apart from the timed pass
        t0 = time.perf_counter()
        for b in batches:
            warm = planner.plan(b.lengths, b.sample_ids)
            bar.update(1)
        timing = report_html.Timings((time.perf_counter() - t0) * 1e3)
        per_step = []
        for i, b in enumerate(batches):
            t0 = time.perf_counter()
            plan = planner.plan(b.lengths, b.sample_ids)
            ms = (time.perf_counter() - t0) * 1e3
            timing.step_ms.append(ms)
            per_step.append(report.plan_metrics(plan, cost, ms))
            if i == 0:
                first_plans.append(plan)
            if args.html:
                step_plans[i].append(plan)
            if args.dump:
                d = plan.dump_step()
                d["step"] = int(b.step)
                dumped.append(d)
            bar.update(1)
        timings[warm.label] = timing
        all_metrics.append(report.average_metrics(per_step))
    bar.close()
    title = (
        f"mixlen plan {args.dir}: N={args.ranks} C={args.capacity} T={args.global_batch_tokens} "
        f"steps={args.steps} cost={cost.name} ({cost.hash[:12]})"
    )
    table = report.format_table(all_metrics, title)
    if args.dump:
        from datapipe.files import write_text_atomic

        dump = {
            "schema": "mixlen-plan-dump/1",
            "cost": cost.to_dict(),
            "cost_hash": cost.hash,
            "steps": dumped,
        }
        write_text_atomic(args.dump, json.dumps(dump))
    if args.plot:
        report.plot_ranks(first_plans, cost, args.plot, title=f"{title} (step 0)")
    if args.html:
        steps = [
            {
                "step": int(b.step),
                "samples": int(b.lengths.shape[0]),
                "tokens": int(b.lengths.sum()),
                "plans": [report_html.timeline(p, cost) for p in plans],
            }
            for b, plans in zip(batches, step_plans)
        ]
        params = {
            "dataset": args.dir,
            "ranks": args.ranks,
            "capacity": args.capacity,
            "tokens/step": args.global_batch_tokens,
            "steps": args.steps,
            "cost": f"{cost.name} ({cost.hash[:12]})",
            "seed": args.seed,
        }
        hist = report_html.length_histogram(lengths, args.capacity)
        data = report_html.page_data(title, params, all_metrics, steps, timings, hist)
        report_html.write_page(args.html, data)
    if args.json:
        by = {m.policy: m for m in all_metrics}
        out = {
            "ranks": args.ranks,
            "capacity": args.capacity,
            "global_batch_tokens": args.global_batch_tokens,
            "steps": args.steps,
            "cost": cost.name,
            "cost_hash": cost.hash,
            "tokens_per_step": float(np.mean([int(b.lengths.sum()) for b in batches])),
            "policies": [m.to_dict() for m in all_metrics],
        }
        hdp = next((m for m in all_metrics if m.policy.startswith("hdp")), None)
        if "static" in by and hdp is not None and hdp.est_step_time_s > 0:
            out["speedup_hdp_over_static"] = by["static"].est_step_time_s / hdp.est_step_time_s
        out["model_state_bytes_per_rank"] = preset_memory(model_name(args), args.ranks)
        print(json.dumps(out))
    else:
        print(table)
        memory = format_preset_memory(model_name(args), args.ranks)
        if memory:
            print(memory)
        for path in (args.plot, args.html, args.dump):
            if path:
                print(f"wrote {path}")
    return 0
