"""`mixlen plan DIR`: plan the first K steps of a dataset's stream and print a balance report."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NamedTuple

POLICY_CHOICES = ("hdp", "static", "naive-hdp", "single", "all")


def add_planner_arguments(p: argparse.ArgumentParser, offload_flag: bool = True) -> None:
    """Options shared by plan and simulate (`offload_flag`: --offload, which simulate leaves out
    since it shows every policy with and without offload)."""
    from datapipe.shapes import MODEL_CONFIGS

    p.add_argument(
        "--model",
        default="llama-7b",
        help=f"cost preset: {', '.join(sorted(MODEL_CONFIGS))}, optionally @h100/@cpu",
    )
    p.add_argument(
        "--cost",
        metavar="FILE",
        default=None,
        help="cost model JSON (schema in docs/PLAN.md); overrides --model",
    )
    if offload_flag:
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
        action=argparse.BooleanOptionalAction,
        default=None,
        help="hdp may give a sample more ranks than its smallest group, or take a static mesh, "
        "where that is estimated faster: on by default, as `mixlen train` plans ([parallel] "
        "widen); --no-widen plans hdp with ByteScale's smallest-group rule only (docs/PLAN.md)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel processes per rank (1, 2, 4, 8) for the model-state table: "
        "bytes per process of a Llama-like shape split as trainer.parallel.tensor splits it "
        "(the plan's times are per rank and do not model tp)",
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
    from tools.cmd_profile import add_dataset_arguments

    add_dataset_arguments(p, "; stages' start_step counts the planned steps from 1")
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
    p.add_argument(
        "--seed", type=int, default=None, help="stream seed (default: --mix's data.seed, else 0)"
    )
    p.add_argument(
        "--lengths-plot",
        metavar="FILE.png",
        default=None,
        help="a mixture: every source's length histogram on one figure",
    )
    p.add_argument(
        "--dump",
        metavar="FILE.json",
        default=None,
        help="write the planned steps (format in docs/PLAN.md)",
    )
    add_planner_arguments(p)


MAX_STEPS = 100_000  # --steps
OUTPUTS = ("--dump", "--plot", "--html", "--lengths-plot")  # the files plan writes


def legend(widen: bool | None, offload: bool | None) -> str:
    """What the rows' labels mean, and which one `mixlen train` runs (`offload` None: rows with
    and without offload are shown)."""
    from datapipe.plan.compare import Variant, widens_by_default

    wide = widens_by_default() if widen is None else widen
    train = Variant("hdp", bool(offload), wide).label
    if offload is None:
        train += f" ({Variant('hdp', True, wide).label} with [offload] enabled = true)"
    return (
        "rows: hdp = ByteScale's smallest-group rule ([parallel] widen = false, --no-widen); "
        "+widen = widen = true (mixlen train's default); +offload = planned with Eq. 3 "
        f"([offload] enabled = true); `mixlen train` with policy hdp and these options runs {train}"
    )


def resolve_cost(args: argparse.Namespace):
    from datapipe.errors import ConfigError
    from datapipe.plan.cost import resolve

    cost = resolve(args.model, args.cost)
    if args.offload_gbps is not None:
        if not 0 < args.offload_gbps < float("inf"):  # NaN fails too
            raise ConfigError(
                f"--offload-gbps must be a finite number > 0, got {args.offload_gbps}"
            )
        cost = cost.with_offload_bandwidth(args.offload_gbps * 1e9 / 8)
    return cost


def model_name(args: argparse.Namespace) -> str:
    """The model shape whose per-rank memory is reported: --model's (none with --cost FILE)."""
    return "" if args.cost else args.model


def check_tp_flag(args: argparse.Namespace) -> None:
    """--tp: a degree the model shape of --model splits over (ConfigError naming the flag)."""
    from datapipe.errors import ConfigError
    from datapipe.shapes import MODEL_CONFIGS, TP_DEGREES

    if args.tp not in TP_DEGREES:
        raise ConfigError(f"--tp: must be one of {', '.join(map(str, TP_DEGREES))}, got {args.tp}")
    shape = MODEL_CONFIGS.get(model_name(args).split("@")[0])
    problem = shape.tp_problem(args.tp) if shape is not None else None
    if problem:
        raise ConfigError(f"--tp: {problem}")


def planner_names():
    """How this command line spells the planner's settings and runtime values."""
    from datapipe.settings import Names

    return Names(flags=True).using(num_ranks="--ranks", path="DIR")


def run(args: argparse.Namespace) -> int:

    from datapipe.errors import ConfigError
    from datapipe.index import read_lengths, read_manifest
    from datapipe.mix.report import is_mixture_args
    from datapipe.plan.compare import compare, policy_variants, variant_planners
    from datapipe.plan.planner import PlannerConfig
    from datapipe.progress import progress
    from datapipe.stream import StreamConfig
    from tools.cmd_profile import check_outputs, check_outside

    # parse: the dataset's first steps and the planners (output folders checked first)
    if not 1 <= args.steps <= MAX_STEPS:
        raise ConfigError(f"--steps: must be in [1, {MAX_STEPS:,}], got {args.steps}")
    check_outputs(args, OUTPUTS)
    check_tp_flag(args)
    cost = resolve_cost(args)
    names = planner_names()
    mixture = None
    if not args.dir and not args.mix:
        raise ConfigError("a dataset directory (DIR), several (DIR@WEIGHT ...), or --mix FILE.toml")
    if is_mixture_args(args.dir, args.mix):
        mixture = plan_mixture(args, names)
        folders = [s.local for s in mixture.loaded]
        lengths, batches, longest = mixture.lengths, mixture.batches, mixture.longest
        vocab = max(int(s.manifest.get("vocab_size") or 0) for s in mixture.loaded)
    else:
        (path,) = args.dir
        args.seed = 0 if args.seed is None else args.seed
        vocab = int(read_manifest(path).get("vocab_size") or 0)
        folders = [path]
        lengths = read_lengths(path)
        stream = StreamConfig(seed=args.seed).build(
            lengths, args.global_batch_tokens, names=names.using(path="DIR")
        )
        batches = [next(stream) for _ in range(args.steps)]
        longest = int(max(lengths.max(initial=0), 1))
    check_outside(args, OUTPUTS, folders)  # before any planning
    max_ctx = longest if args.max_context is None else args.max_context
    base = PlannerConfig(capacity=args.capacity, max_context=max_ctx)
    variants = policy_variants(args.policy, args.offload, args.widen)
    planners = variant_planners(variants, base, cost, args.ranks, args.seed, names)
    # compute: plan every step with every variant, warm-up pass first
    steps = [(b.lengths, b.sample_ids) for b in batches]
    with progress(
        2 * len(planners) * len(batches), "plan", "plan", False if args.quiet else None
    ) as bar:
        res = compare(planners, steps, cost, on_plan=bar.update)
    # render
    warning = timed_vocab_warning(args.cost, vocab)
    if warning:
        print(f"mixlen plan: warning: {warning}", file=sys.stderr)
    render_plan(args, cost, lengths, batches, res, mixture)
    return 0


def timed_vocab_warning(cost_file: str | None, vocab: int) -> str:
    """What to say when `cost_file` was timed on a model whose vocabulary is smaller than the
    dataset's `vocab` token ids: no model that trains the data has that shape, and the loss over a
    larger vocabulary costs more per position, so the estimated times are another model's ('':
    no such record)."""
    from datapipe.plan.costcheck import timed_model

    timed = timed_model(cost_file).get("shape", {}).get("vocab_size") if cost_file else None
    if not isinstance(timed, int) or timed >= vocab:
        return ""
    return (
        f"--cost {cost_file} was timed on a model of vocab_size {timed}, but the dataset's token "
        f"ids need {vocab}: its estimated times are that model's, not the one you train on this "
        f"data; time that one (`mixlen calibrate CONFIG.toml`, or --vocab-size {vocab})"
    )


class PlannedMixture(NamedTuple):
    """A mixture's first steps for `mixlen plan`: its sources, batches, the weights each batch
    was drawn with, every sample length, the longest unit and its name."""

    loaded: list
    batches: list
    targets: list
    lengths: Any
    longest: int
    label: str


def plan_mixture(args: argparse.Namespace, names: Any) -> PlannedMixture:
    """The first --steps batches of the mixture stream, as `mixlen train` draws them."""
    import numpy as np

    from datapipe.errors import ConfigError
    from datapipe.mix.report import describe, load_mixture, read_mixture
    from datapipe.mix.sources import mix_sources
    from datapipe.mix.stream import DataExhausted, MixtureStream
    from datapipe.stream import StreamConfig, held_out_mask
    from trainer.data import DataConfig

    mix = read_mixture(args.dir, args.mix, DataConfig)
    keys = dict(mix.stream)  # the file's seed, look-ahead, oversize
    flags = {"global_batch_tokens": "--global-batch-tokens", "steps": "--steps"}
    if args.seed is not None:
        keys["seed"], flags["seed"] = args.seed, "--seed"
    args.seed = keys.setdefault("seed", 0)
    mix_names = mix.names.using(**names.given, **flags)
    loaded = load_mixture(mix, mix_names)
    held = [
        held_out_mask(np.arange(s.lengths.shape[0]), args.seed, mix.val_fraction) for s in loaded
    ]
    try:
        stream = MixtureStream(
            StreamConfig(**keys), mix_sources(loaded, held), mix.sources, mix.stages,
            args.global_batch_tokens, names=mix_names,
        )  # fmt: skip
        batches, targets = [], []
        for _ in range(args.steps):
            batches.append(next(stream))
            targets.append(stream.weights.copy())
    except (ConfigError, DataExhausted) as exc:
        raise type(exc)(f"{mix.where}{exc}") from None
    lengths = np.concatenate([s.lengths for s in loaded])
    return PlannedMixture(
        loaded, batches, targets, lengths, stream.longest_unit(), describe(loaded)
    )


def memory_report(args: argparse.Namespace) -> tuple[dict, str]:
    """--model's per-rank memory: the JSON fields and the printed lines ('' with --cost FILE)."""
    from datapipe.plan import memory as M

    name = model_name(args)
    out: dict = {"model_state_bytes_per_rank": M.preset_memory(name, args.ranks, tp=args.tp)}
    if args.tp == 1:
        out["activation_bytes_per_rank"] = M.activation_memory(name, args.capacity)
        out["largest_capacity_per_rank"] = M.capacity_fit(name, args.ranks)
    text = M.format_preset_memory(name, args.ranks, tp=args.tp)
    if text:
        text += "\n" + M.format_activation_memory(name, args.capacity, tp=args.tp)
        if args.tp == 1:
            text += "\n" + M.format_capacity_fit(name, args.ranks)
    return out, text


def render_plan(args, cost, lengths, batches, res, mixture=None) -> None:
    """The table (or JSON) on stdout, and the --plot, --html and --dump files."""
    import numpy as np

    from tools import report, report_html

    all_metrics = [r.average for r in res.values()]
    where = mixture.label if mixture is not None else args.dir[0]
    title = (
        f"mixlen plan {where}: N={args.ranks} C={args.capacity} T={args.global_batch_tokens} "
        f"steps={args.steps} cost={cost.name} ({cost.hash[:12]})"
    )
    if args.dump:
        write_dump(args.dump, cost, batches, res)
    shares: list = []
    if mixture is not None:
        from datapipe.mix.report import format_shares, plot_mixture, share_report

        shares = share_report(mixture.loaded, batches, mixture.targets)
        if args.lengths_plot:
            plot_mixture(mixture.loaded, args.lengths_plot, args.capacity)
    if args.plot:
        first = [r.plans[0] for r in res.values()]
        report.plot_ranks(first, cost, args.plot, title=f"{title} (step 0)")
    if args.html:
        steps = [
            {
                "step": int(b.step),
                "samples": int(b.lengths.shape[0]),
                "tokens": int(b.lengths.sum()),
                "plans": [report_html.timeline(r.plans[i], cost) for r in res.values()],
            }
            for i, b in enumerate(batches)
        ]
        timings = {r.label: report_html.Timings(r.warmup_ms, r.plan_ms) for r in res.values()}
        params = {
            "dataset": where,
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
        out.update(memory_report(args)[0])
        if mixture is not None:
            out["mixture"] = shares
        print(json.dumps(out))
        return
    print(report.format_table(all_metrics, title))
    print(legend(args.widen, args.offload))
    if mixture is not None:
        print(f"\ntoken shares over the {len(batches)} planned steps:")
        print(format_shares(shares))
    memory = memory_report(args)[1]
    if memory:
        print(memory)
    for path in (args.plot, args.html, args.dump, args.lengths_plot if mixture else None):
        if path:
            print(f"wrote {path}")


def write_dump(path: str, cost, batches, res) -> None:
    """The planned steps as JSON (docs/PLAN.md, "--dump"), variant by variant."""
    from datapipe.files import write_text_atomic
    from datapipe.plan.metrics import predicted_step_ns

    dumped = []
    for r in res.values():
        for b, plan in zip(batches, r.plans):
            d = plan.dump_step()
            d["step"] = int(b.step)
            d["est_step_time_s"] = predicted_step_ns(plan, cost) / 1e9  # as --json reports it
            dumped.append(d)
    dump = {"schema": "mixlen-plan-dump/1", "cost": cost.to_dict(), "cost_hash": cost.hash}
    dump["steps"] = dumped
    write_text_atomic(path, json.dumps(dump))
