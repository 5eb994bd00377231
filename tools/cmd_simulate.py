"""`mixlen simulate`: predicted step times of static, naive-hdp and hdp (ByteScale's smallest-group
rule), with and without offload, and hdp+widen (what `mixlen train` runs by default; --no-widen
leaves it out) at scale, on synthetic length distributions or a dataset's lengths, beside
ByteScale's figures."""

from __future__ import annotations

import argparse
import json

from tools.cmd_plan import (
    add_planner_arguments,
    check_tp_flag,
    legend,
    model_name,
    planner_names,
    resolve_cost,
)
from tools.cmd_profile import check_outputs, check_outside

ASSUMPTIONS = """assumptions:
  - per-rank time = cost model (a*S^2/k at the chunk efficiency eff(S/k) + b*S/k, c per
    micro-batch); a ring hop costs a latency plus its K/V bytes over the node link (groups inside
    one node) or the link between nodes; `overlap` of that hides under attention compute, the
    rest shows; offload copies hide under forward/backward compute, only the excess counts; no
    pipeline/tensor parallelism
  - gradient all-reduce, optimizer step and data loading are the same for every policy and left out
  - samples longer than --context are truncated to it; batches follow the stream's fill rule
  - static: CP = smallest divisor of N holding --context, micro-batches token-balanced over DP
  - step time = the slowest rank's finish in the slot-order replay (blocking rendezvous)"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--capacity", type=int, default=8192)
    p.add_argument(
        "--context",
        type=int,
        default=2 * 1024 * 1024,
        help="longest sequence (static mesh CP size); longer samples are truncated",
    )
    p.add_argument("--lengths", default="byted", help="byted | github | DIR (a dataset's index)")
    p.add_argument("--global-batch-tokens", type=int, default=32 * 1024 * 1024)
    p.add_argument("--steps", type=int, default=3, help="global batches to average over")
    p.add_argument("--seed", type=int, default=0)
    add_planner_arguments(p, offload_flag=False)


def run(args: argparse.Namespace) -> int:
    from datapipe.errors import ConfigError
    from datapipe.plan import simulate as S
    from datapipe.plan.compare import compare, variant_planners, widens_by_default
    from datapipe.plan.planner import PlannerConfig
    from datapipe.progress import progress

    # parse: batches drawn from the length pool, the planners (output folders checked first)
    check_outputs(args, ("--plot", "--html"))
    if args.lengths not in S.DISTRIBUTIONS:  # a dataset folder
        check_outside(args, ("--plot", "--html"), [args.lengths])
    if args.seed < 0:
        raise ConfigError(f"--seed: must be >= 0, got {args.seed}")
    if not 1 <= args.steps <= 10_000:
        raise ConfigError(f"--steps: must be in [1, 10,000], got {args.steps}")
    if args.context < 1 or args.ranks < 1 or args.capacity < 1:
        raise ConfigError("--context, --ranks and --capacity must be >= 1")
    check_tp_flag(args)
    if not 1 <= args.global_batch_tokens <= 1 << 40:
        raise ConfigError(
            f"--global-batch-tokens: must be in [1, 2^40], got {args.global_batch_tokens}"
        )
    if args.steps * args.global_batch_tokens > 1 << 40:
        raise ConfigError("--steps x --global-batch-tokens: at most 2^40 tokens in all")
    cost = resolve_cost(args)
    n_pool = max(200_000, int(args.steps * args.global_batch_tokens / 2000))
    pool = S.length_pool(args.lengths, args.context, n_pool, args.seed)
    batches = S.draw_batches(pool, args.global_batch_tokens, args.steps, args.seed)
    wide = widens_by_default() if args.widen is None else args.widen
    variants = S.VARIANTS + (S.WIDEN_VARIANTS if wide else ())
    base = PlannerConfig(capacity=args.capacity, max_context=args.context)
    planners = variant_planners(variants, base, cost, args.ranks, names=planner_names())
    # compute: every batch under every variant
    total = 2 * len(variants) * len(batches)
    with progress(total, "simulate", "plan", False if args.quiet else None) as bar:
        res = compare(planners, [(b, None) for b in batches], cost, on_plan=bar.update)
    # render
    render_simulate(args, cost, pool, batches, res)
    return 0


def render_simulate(args, cost, pool, batches, res) -> None:
    """The table and the paper's figures (or JSON), and the --plot and --html files."""

    from datapipe.plan import simulate as S
    from datapipe.plan.memory import format_preset_memory, preset_memory
    from tools import report

    metrics = {label: r.average for label, r in res.items()}
    static = metrics["static"].est_step_time_s
    speedup = {
        k: (static / m.est_step_time_s if m.est_step_time_s else 0.0) for k, m in metrics.items()
    }
    paper_steps = {k: S.PAPER_STEP_TIMES_S["static"] / v for k, v in S.PAPER_STEP_TIMES_S.items()}
    stats = S.length_stats(pool)
    if args.json:
        out = {
            "model": cost.name,
            "cost_hash": cost.hash,
            "ranks": args.ranks,
            "capacity": args.capacity,
            "context": args.context,
            "lengths": args.lengths,
            "global_batch_tokens": args.global_batch_tokens,
            "steps": args.steps,
            "length_stats": stats,
            "policies": [
                dict(m.to_dict(), speedup_over_static=speedup[k]) for k, m in metrics.items()
            ],
            "paper": {
                "ablation_speedup": S.PAPER_ABLATION,
                "step_times_s": S.PAPER_STEP_TIMES_S,
                "step_time_speedup": paper_steps,
            },
            "model_state_bytes_per_rank": preset_memory(model_name(args), args.ranks, tp=args.tp),
        }
        print(json.dumps(out))
    else:
        title = (
            f"mixlen simulate: {cost.name}, N={args.ranks}, C={args.capacity}, "
            f"context={args.context}, lengths={args.lengths}, "
            f"T={args.global_batch_tokens}, {args.steps} step(s)"
        )
        print(report.format_table(list(metrics.values()), title))
        print()
        print(
            f"{'policy':<20}{'ours step (s)':>14}{'ours x':>9}{'paper ablation x':>18}"
            f"{'paper step-time x':>19}"
        )
        for k, m in metrics.items():
            pa = S.PAPER_ABLATION.get(k)
            ps = paper_steps.get(k)
            print(
                f"{k:<20}{m.est_step_time_s:>14.3f}{speedup[k]:>9.2f}"
                f"{(f'{pa:.2f}' if pa else '-'):>18}{(f'{ps:.2f}' if ps else '-'):>19}"
            )
        print(
            "(paper: 7B, 2M context, Byted, 1,024 GPUs; ablation order dynamic communication,"
            " + offload, + balance; its step times 8m40s / 4m32s / 2m37s)"
        )
        print(f"length stats of the pool: {json.dumps({k: round(v, 4) for k, v in stats.items()})}")
        memory = format_preset_memory(model_name(args), args.ranks, tp=args.tp)
        if memory:
            print(memory)
        print(legend(args.widen, None))
        print(ASSUMPTIONS)
    if args.plot:
        plans = [r.plans[0] for r in res.values()]
        report.plot_ranks(plans, cost, args.plot, title="mixlen simulate (first batch)")
    if args.html:
        write_html(args, cost, pool, batches, res)


def write_html(args, cost, pool, batches, res) -> None:
    """The --html report page: the policy table, per-rank timelines per batch, the lengths."""
    import numpy as np

    from tools import report_html

    steps = [
        {
            "step": i,
            "samples": int(len(b)),
            "tokens": int(np.sum(b)),
            "plans": [report_html.timeline(r.plans[i], cost) for r in res.values()],
        }
        for i, b in enumerate(batches)
    ]
    timings = {k: report_html.Timings(r.warmup_ms, r.plan_ms) for k, r in res.items()}
    params = {
        "model": cost.name,
        "ranks": args.ranks,
        "capacity": args.capacity,
        "context": args.context,
        "lengths": args.lengths,
        "tokens/step": args.global_batch_tokens,
        "steps": args.steps,
    }
    hist = report_html.length_histogram(pool, args.capacity)
    title = f"mixlen simulate: {cost.name}, N={args.ranks}, lengths={args.lengths}"
    data = report_html.page_data(
        title, params, [r.average for r in res.values()], steps, timings, hist
    )
    report_html.write_page(args.html, data)
