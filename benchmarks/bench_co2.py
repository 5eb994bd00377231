"""CO2 across islands: sync, diloco and co2 on 2 islands x 2 gloo ranks over emulated links.

The debug model with 4 layers trains on the standard-library corpus (Python sources of this
interpreter, preprocessed with --max-len 2048 into --data unless it exists) through the real
Trainer (`mixlen train`'s code: stream dealt to islands, plans, fetch, executor, trainer.islands.cross).
Every run trains the same token budget (--steps steps of --batch tokens per island).

1. No link (gloo on localhost, ~free): each method's compute time per step, and the loss after the
   budget (held-out loss of the final weights), also for the `--sweep` settings that chose the
   `[co2]` defaults.
2. Emulated links (`co2.link_gbps`, trainer.islands.co2.LinkEmulator) scaled from phase 1 so that one
   round's cross-island communication takes 0.5x, 1x and 4x the compute between two of them:
   tau steps for co2 and diloco (one average of each rank's slice per round), one step for sync
   (the gradient slice every step). Tokens/s in steady state (the first round and the last step,
   whose final average cannot overlap anything, are left out), the share of the communication
   hidden (1 - time lost against the no-link run / the link's busy time), and the loss.
3. The ablation: co2 without the staleness penalty and clipping beside co2 with them at a large
   tau, at 1x.

4. `--converge`: sync, diloco and co2 (or the `--runs` given) for 400 steps of 1,024 tokens per
   island with the debug model of 1 layer, on the demo corpus (these files with the demo's BPE
   tokenizer, tests/assets/bpe-stdlib.json) and on the same files as UTF-8 bytes: the training loss
   every step and the held-out loss every --eval-every steps, merged by run name into
   benchmarks/out/bench_co2_converge.json; prints the gap to sync at every eval and draws
   benchmarks/co2_converge.png.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_co2.py [--steps 48] [--sweep]
        [--methods co2 --factors 0.8,1,1.25 --ablation-tau 0]   # around 1x, co2 only
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_co2.py --converge [--corpora stdlib-bytes]
        [--runs 'sync;co2;lr1.0={"outer_lr": 1.0}'] [--report]

Prints tables and writes benchmarks/out/bench_co2.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ISLANDS, RANKS = 2, 2
FACTORS = (0.5, 1.0, 4.0)
# [co2] settings compared by --sweep (no link) to choose the defaults
SWEEP = [
    {"tau": 8, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True},
    {"tau": 8, "outer_lr": 0.7, "outer_momentum": 0.5},
    {"tau": 8, "outer_lr": 1.0, "outer_momentum": 0.5},
    {"tau": 8, "outer_lr": 1.0, "outer_momentum": 0.0},
    {"tau": 8, "outer_lr": 0.7, "outer_momentum": 0.5, "staleness_lambda": 0.0, "clip": "none"},
    {"tau": 8, "outer_lr": 0.7, "outer_momentum": 0.5, "clip_value": 0.01},
    {"tau": 4, "outer_lr": 0.7, "outer_momentum": 0.5},
    {"tau": 16, "outer_lr": 0.7, "outer_momentum": 0.5},
    # momentum hurts a one-round-stale update over so few rounds: without it
    {"tau": 8, "outer_lr": 1.0, "outer_momentum": 0.0, "clip_value": 0.01},
    {"tau": 8, "outer_lr": 0.8, "outer_momentum": 0.0},
    {"tau": 8, "outer_lr": 1.2, "outer_momentum": 0.0},
    {"tau": 8, "outer_lr": 1.0, "outer_momentum": 0.2},
    {"tau": 8, "outer_lr": 1.0, "outer_momentum": 0.0, "staleness_lambda": 0.0, "clip": "none"},
    {"tau": 4, "outer_lr": 1.0, "outer_momentum": 0.0},
    {"tau": 4, "outer_lr": 1.0, "outer_momentum": 0.0, "clip_value": 0.01},
]


def ensure_data(path: str, tokenizer: str | None = None) -> str:
    """The standard-library corpus with samples of at most 2048 tokens (built once): UTF-8 bytes,
    or the BPE `tokenizer` (a tokenizer.json path)."""
    if os.path.isfile(os.path.join(path, "index.parquet")):
        return path
    from datapipe.ingest.preprocess import PreprocessConfig, preprocess

    stdlib = sysconfig.get_paths()["stdlib"]
    preprocess(
        PreprocessConfig(
            inputs=[stdlib], out=path, globs=["**/*.py"], excludes=["site-packages/*"],
            tokenizer=tokenizer, max_len=2048, progress=False,
        )
    )  # fmt: skip
    return path


def base_config(args: argparse.Namespace, run_dir: str) -> dict:
    return {
        "model": {"name": "debug", "n_layers": 4},
        "data": {"path": args.data, "val_fraction": 0.02, "val_tokens": 16384},
        "train": {
            "steps": args.steps,
            "global_batch_tokens": args.batch,
            "lr": 4e-3,
            "warmup": 3,
            "eval_interval": args.steps,
        },
        "parallel": {"policy": "hdp", "capacity": 1024, "islands": ISLANDS},
        "checkpoint": {"dir": None},
        "metrics": {"dir": run_dir, "progress": False, "console_interval": 10**6},
    }


def _worker(rank: int, world: int, port: int, job: dict) -> None:
    """Every run of `job` in turn on one 2 x 2 runtime; rank 0 copies each run's records."""
    import torch
    import torch.distributed as dist

    from trainer.config.job import from_dict
    from trainer.parallel.comm import init_local_gloo
    from trainer.parallel.runtime import setup_runtime
    from trainer.train import run_training

    init_local_gloo(rank, world, port, timeout_s=1800)
    try:
        rt = setup_runtime("cpu", islands=ISLANDS)
        torch.set_num_threads(1)
        out = {}
        for name, d in job["runs"]:
            summary = run_training(from_dict(d), rt)
            if rank == 0:
                with open(summary["metrics"]) as f:
                    out[name] = [json.loads(x) for x in f]
            dist.barrier()
        if rank == 0:
            with open(job["out"], "w") as f:
                json.dump(out, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_all(runs: list[tuple[str, dict]]) -> dict[str, list[dict]]:
    from trainer.parallel.comm import free_port, spawn

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "runs.json")
        n = ISLANDS * RANKS
        spawn(_worker, n, (n, free_port(), {"runs": runs, "out": out}), timeout=7200)
        with open(out) as f:
            return json.load(f)


def config(args, tmp: str, name: str, co2: dict) -> tuple[str, dict]:
    d = base_config(args, os.path.join(tmp, name))
    d["co2"] = co2
    return name, d


# --- summaries ---------------------------------------------------------------------------------------


def steady(recs: list[dict], tau: int) -> list[dict]:
    """Whole rounds from the second to the one before the last (the first has no average to
    wait for, the last one's final average cannot overlap anything)."""
    rounds = len(recs) // tau
    return recs[tau : tau * (rounds - 1)] if rounds > 2 else recs[1:-1]


def summarize(recs: list[dict], tau: int, comm_s: float = 0.0, nolink: dict | None = None) -> dict:
    """Over the steady window: tokens/s (all islands) and time per step from the wall clock; the
    time blocked on the cross-island link in the same run (co2/diloco: waiting for the average at
    round ends, sync: in the cross-island all-reduces of every step); the loss after the budget.

    The box is shared, so wall-clock ratios between runs carry the load of the moment (tens of
    percent); the in-run figures do not: `keeps` = 1 - blocked / wall (the share of the run's
    no-communication throughput it kept), `hidden` = 1 - blocked / the link's busy time, and
    `factor` = one round's communication over the compute time of a round measured in the run."""
    st = steady(recs, tau)
    wall = sum(r["step_time_s"] for r in st)
    blocked = sum(r.get("co2_wait_s", 0.0) + r.get("cross_wait_s", 0.0) for r in st)
    steps = [r["step_time_s"] for r in st]
    out = {
        "tokens_per_s": ISLANDS * sum(r["tokens"] for r in st) / wall,
        "step_s": wall / len(st),
        "step_s_spread": [min(steps), statistics.median(steps), max(steps)],
        "blocked_s": blocked,
        "val_loss": recs[-1].get("val_loss"),
        "train_loss_last8": statistics.mean(r["loss"] for r in recs[-8:]),
        "clipped": [r["co2_clipped_fraction"] for r in recs if "co2_clipped_fraction" in r],
        "penalty": [r["co2_penalty"] for r in recs if "co2_penalty" in r],
    }
    if comm_s > 0:
        rounds = len(st) / tau
        out["keeps"] = 1.0 - blocked / wall
        out["hidden"] = min(1.0, max(0.0, 1.0 - blocked / (comm_s * rounds)))
        out["factor"] = comm_s / ((wall - blocked) / rounds)
        if nolink is not None:
            out["keeps_wall"] = out["tokens_per_s"] / nolink["tokens_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.join(ROOT, "benchmarks", "out", "stdlib-2k"))
    ap.add_argument("--steps", type=int, help="optimizer steps per run (48; --converge 400)")
    ap.add_argument(
        "--batch", type=int, help="global batch tokens per island (2048; --converge 1024)"
    )
    ap.add_argument("--converge", action="store_true", help="loss curves on two corpora")
    ap.add_argument("--corpora", default=",".join(CORPORA), help="--converge: these corpora")
    ap.add_argument(
        "--runs",
        default="sync;diloco;co2",
        help="--converge: ';'-separated names (sync, diloco, co2) or label={[co2] settings json}",
    )
    ap.add_argument("--layers", type=int, default=1, help="--converge: the debug model's layers")
    ap.add_argument("--lr", type=float, default=4e-3, help="--converge: train.lr")
    ap.add_argument("--warmup", type=int, default=20, help="--converge: train.warmup")
    ap.add_argument("--eval-every", type=int, default=16, help="--converge: held-out loss interval")
    ap.add_argument("--seed", type=int, default=0, help="--converge: data.seed (batches, split)")
    ap.add_argument(
        "--name",
        default="converge",
        help="--converge: results in benchmarks/out/bench_co2_NAME.json (a name per setup)",
    )
    ap.add_argument("--report", action="store_true", help="--converge: report the saved runs")
    ap.add_argument(
        "--sweep",
        nargs="?",
        const="all",
        default=None,
        metavar="I,J,..",
        help="only the no-link runs and the defaults sweep (all settings, or these indices)",
    )
    ap.add_argument("--ablation-tau", type=int, default=16, help="0: no ablation runs")
    ap.add_argument("--methods", default="sync,diloco,co2")
    ap.add_argument("--factors", default=",".join(str(f) for f in FACTORS))
    args = ap.parse_args()
    if args.converge:
        args.steps, args.batch = args.steps or 400, args.batch or 1024
        if args.report:
            with open(converge_out(args.name)) as f:
                converge_report(json.load(f), args.name)
        else:
            converge(args)
        return
    args.steps, args.batch = args.steps or 48, args.batch or 2048
    args.data = ensure_data(args.data)

    from datapipe.plan.memory import slice_length
    from datapipe.shapes import get_config
    from trainer.islands.config import CO2Config

    default = CO2Config()
    tau = default.tau
    numel = get_config("debug", n_layers=4).num_params()
    payload = slice_length(numel, RANKS, 64) * 4  # bytes of one rank's float32 slice
    result: dict = {"args": vars(args), "defaults": vars(default), "payload_bytes": payload}
    taus = {m: 1 if m == "sync" else tau for m in args.methods.split(",")}
    factors = [float(f) for f in args.factors.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        # 1. no link: compute per step, loss after the budget (or the defaults sweep)
        runs = [config(args, tmp, m, {"mode": m}) for m in taus]
        picked = []
        if args.sweep:
            all_ = args.sweep == "all"
            picked = list(range(len(SWEEP))) if all_ else [int(i) for i in args.sweep.split(",")]
            runs += [config(args, tmp, f"sweep{i}", SWEEP[i]) for i in picked]
        got = run_all(runs)
        nolink = {m: summarize(got[m], taus[m]) for m in taus}
        result["nolink"] = nolink
        if args.sweep:
            result["sweep"] = [
                {"index": i, **SWEEP[i], **summarize(got[f"sweep{i}"], SWEEP[i]["tau"])}
                for i in picked
            ]
            report(args, numel, result)
            return
        # 2. emulated links: one round's communication = factor x its compute; 3. the ablation
        runs, comm = [], {}
        for f in factors:
            for m in taus:
                comm[f"{m}@{f}"] = (f * taus[m] * nolink[m]["step_s"], m, taus[m], {"mode": m})
        big = args.ablation_tau
        if big and "co2" in taus:
            comm["co2-big-tau@1.0"] = (big * nolink["co2"]["step_s"], "co2", big, {"tau": big})
            comm["co2-big-tau-plain@1.0"] = (
                big * nolink["co2"]["step_s"], "co2", big,
                {"tau": big, "staleness_lambda": 0.0, "clip": "none"},
            )  # fmt: skip
        for name, (comm_s, _, _, co2) in comm.items():
            runs.append(config(args, tmp, name, {**co2, "link_gbps": payload * 8 / comm_s / 1e9}))
        got = run_all(runs)
        result["linked"] = {
            name: {
                **summarize(got[name], t, comm_s, nolink[m]),
                "link_gbps": payload * 8 / comm_s / 1e9,
                "comm_s": comm_s,
            }
            for name, (comm_s, m, t, _) in comm.items()
        }
    report(args, numel, result)


def report(args: argparse.Namespace, numel: int, result: dict) -> None:
    """Print the tables and write benchmarks/out/bench_co2.json (bench_co2_sweep.json)."""
    nolink, linked = result["nolink"], result.get("linked", {})
    print(
        f"debug model, 4 layers ({numel / 1e6:.2f}M params), {ISLANDS} islands x {RANKS} ranks, "
        f"{args.steps} steps x {args.batch} tokens per island; [co2] {result['defaults']}"
    )
    print("\nno link: tokens/s, s per step (min/median/max), held-out loss after the budget")
    for m, s in nolink.items():
        lo, med, hi = s["step_s_spread"]
        print(
            f"  {m:7} {s['tokens_per_s']:8.0f} tok/s  {s['step_s']:.3f} s/step "
            f"({lo:.2f}/{med:.2f}/{hi:.2f})  val {s['val_loss']:.4f}  "
            f"train(last 8) {s['train_loss_last8']:.4f}"
        )
    for k, s in enumerate(result.get("sweep", [])):
        i = s["index"]
        if k == 0:
            print("\nsweep (co2, no link; other settings the defaults) -> held-out loss")
        clipped = statistics.median(s["clipped"]) if s["clipped"] else 0.0
        penalty = max(s["penalty"], default=1.0)
        print(
            f"  {i:2} {json.dumps(SWEEP[i]):78} val {s['val_loss']:.4f}  train(last 8) "
            f"{s['train_loss_last8']:.4f}  clipped {clipped:.3f}  penalty <= {penalty:.2f}"
        )
    if linked:
        print("\nemulated link: one round's communication = factor x its compute (set from the")
        print("no-link runs; 'in run' = measured against the run's own compute)")
        print(f"  {'run':24} {'Gbit/s':>8} {'in run':>7} {'tok/s':>7} {'keeps':>6} "
              f"{'(wall)':>7} {'hidden':>7} {'val loss':>9}")  # fmt: skip
    for name, s in linked.items():
        print(
            f"  {name:24} {s['link_gbps']:8.4f} {s['factor']:6.2f}x {s['tokens_per_s']:7.0f} "
            f"{s['keeps']:6.2f} {s['keeps_wall']:7.2f} {s['hidden']:7.2f} {s['val_loss']:9.4f}"
        )
    os.makedirs(os.path.join(ROOT, "benchmarks", "out"), exist_ok=True)
    name = "bench_co2_sweep.json" if args.sweep else "bench_co2.json"
    with open(os.path.join(ROOT, "benchmarks", "out", name), "w") as f:
        json.dump(result, f, indent=2)


# --- --converge: loss curves of co2, diloco and sync on two corpora ---------------------------------

# (dataset folder under benchmarks/out, tokenizer, model.vocab_size): the demo corpus (the standard
# library with the demo's BPE tokenizer) and the same files as UTF-8 bytes (issue 24's report)
CORPORA = {
    "stdlib-bpe": ("stdlib-bpe-2k", os.path.join(ROOT, "tests", "assets", "bpe-stdlib.json"), 4096),
    "stdlib-bytes": ("stdlib-2k", None, 258),
}
# --converge runs by name: [co2] settings over the defaults
VARIANTS = {
    "sync": {"mode": "sync"},
    "diloco": {"mode": "diloco"},  # as published: Nesterov 0.9, outer lr 0.7, no penalty or clip
    "co2": {},  # the defaults (mixlen's adaptive staleness penalty)
    # the staleness penalty's rules, the other defaults kept: off, and the CO2 code's constant
    # factor (1 + lambda = 1.5)
    "co2-penalty-off": {"staleness_lambda": 0.0},
    "co2-penalty-constant": {"staleness_rule": "constant"},
    # the warm-up rounds moving the anchor all the way (issue 30's proposal for short runs)
    "warmup-lr1.0": {"warmup_outer_lr": 1.0},
    # DiLoCo's schedule with plain averaging of the deltas (outer lr 1, no momentum)
    "diloco-tuned": {"mode": "diloco", "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False},
}
CONVERGE_PNG = os.path.join(ROOT, "benchmarks", "co2_converge.png")
EARLY = 48  # issue 30: within 5% of sync at every evaluation from this step on


def converge_out(name: str) -> str:
    return os.path.join(ROOT, "benchmarks", "out", f"bench_co2_{name}.json")


def converge_config(args: argparse.Namespace, run_dir: str, corpus: str, co2: dict) -> dict:
    """One --converge run: the debug model (--layers), --steps of --batch tokens per island,
    the held-out loss every --eval-every steps."""
    folder, tokenizer, vocab = CORPORA[corpus]
    path = ensure_data(os.path.join(ROOT, "benchmarks", "out", folder), tokenizer)
    return {
        "model": {"name": "debug", "n_layers": args.layers, "vocab_size": vocab},
        "data": {"path": path, "val_fraction": 0.02, "val_tokens": 16384, "seed": args.seed},
        "train": {
            "steps": args.steps,
            "global_batch_tokens": args.batch,
            "lr": args.lr,
            "warmup": args.warmup,
            "eval_interval": args.eval_every,
        },
        "parallel": {"policy": "hdp", "capacity": 1024, "islands": ISLANDS},
        "checkpoint": {"dir": None},
        "metrics": {"dir": run_dir, "progress": False, "console_interval": 10**6},
        "co2": co2,
    }


def parse_runs(spec: str) -> dict[str, dict]:
    """--runs: names of VARIANTS, or `label={json}` ([co2] settings over the defaults)."""
    out = {}
    for item in spec.split(";"):
        label, _, js = item.partition("=")
        out[label.strip()] = json.loads(js) if js else VARIANTS[label.strip()]
    return out


def converge(args: argparse.Namespace) -> None:
    """Run --runs on --corpora, merge them into benchmarks/out/bench_co2_converge.json, report."""
    from trainer.islands.config import CO2Config

    runs = parse_runs(args.runs)
    setup = {
        k: getattr(args, k)
        for k in ("steps", "batch", "lr", "warmup", "eval_every", "layers", "seed")
    }
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [
            (f"{c}/{label}", converge_config(args, os.path.join(tmp, f"{c}-{label}"), c, co2))
            for c in args.corpora.split(",")
            for label, co2 in runs.items()
        ]
        got = run_all(jobs)
    result = {"setup": setup, "runs": {}}
    out = converge_out(args.name)
    if os.path.isfile(out):
        with open(out) as f:
            result = json.load(f)
        if result["setup"] != setup:
            raise SystemExit(f"{out} holds runs of {result['setup']}, not {setup} (--name)")
    for name, d in jobs:
        steps = [r for r in got[name] if "loss" in r and "step" in r]
        result["runs"][name] = {
            "co2": d["co2"],
            "settings": vars(CO2Config(**d["co2"])),  # with this run's code's mode defaults
            "train": [r["loss"] for r in steps],
            "val": [[r["step"], r["val_loss"]] for r in steps if "val_loss" in r],
            "step_s": statistics.median(r["step_time_s"] for r in steps),
            "clipped_max": max((r.get("co2_clipped_fraction", 0.0) for r in steps), default=0.0),
            "penalty_max": max((r.get("co2_penalty", 1.0) for r in steps), default=1.0),
        }
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    converge_report(result, args.name)


def gap(a: float, b: float) -> float:
    return 100.0 * (a - b) / b


def converge_report(result: dict, name: str = "converge") -> None:
    """The gap to sync at every eval, the final table (with the largest gap from step EARLY on),
    and the PNG (the default setup's only)."""
    runs = result["runs"]
    corpora = sorted({k.split("/")[0] for k in runs}, key=list(CORPORA).index)
    print(f"--converge {result['setup']}: held-out loss gap to sync (%) at every eval")
    for c in corpora:
        sync = dict(runs[f"{c}/sync"]["val"])
        print(f"\n{c}: step " + " ".join(f"{s:>6}" for s in sync))
        print(f"  {'sync loss':24} " + " ".join(f"{v:6.3f}" for v in sync.values()))
        for name_, r in runs.items():
            if name_.startswith(c + "/") and not name_.endswith("/sync"):
                row = " ".join(f"{gap(v, sync[s]):+6.1f}" for s, v in r["val"])
                print(f"  {name_.split('/', 1)[1]:24} {row}")
    print(
        f"\nfinal: held-out loss, gap to sync, the largest gap from step {EARLY} on; training "
        "loss (mean of the last 20 steps), gap"
    )
    for name_, r in runs.items():
        c = name_.split("/")[0]
        sync = runs[f"{c}/sync"]
        v, vs = r["val"][-1][1], sync["val"][-1][1]
        t, ts = statistics.mean(r["train"][-20:]), statistics.mean(sync["train"][-20:])
        print(
            f"  {name_:34} val {v:.4f} {gap(v, vs):+6.2f}% (max {worst_gap(r, sync):+6.2f}%)  "
            f"train {t:.4f} {gap(t, ts):+6.2f}%  {r['step_s']:.3f} s/step  {json.dumps(r['co2'])}"
        )
    print(
        "\nmarkdown (benchmarks/RESULTS.md): corpus, run, final held-out loss and gap, the largest"
    )
    print(f"gap from step {EARLY} on, the gap at some evals")
    evals = [s for s, _ in runs[f"{corpora[0]}/sync"]["val"]]
    marks = [s for s in evals if s >= EARLY and (s <= 96 or s % 80 == 0 or s == evals[-1])]
    print(
        "| corpus | run | held-out | gap | max gap >= "
        + f"{EARLY} | "
        + " | ".join(str(s) for s in marks)
        + " |"
    )
    for name_, r in runs.items():
        c, label = name_.split("/", 1)
        sync = runs[f"{c}/sync"]
        ref, v = dict(sync["val"]), r["val"][-1][1]
        at = dict(r["val"])
        cells = " | ".join(f"{gap(at[s], ref[s]):+.1f}" if s in at else "" for s in marks)
        print(f"| {c} | {label} | {v:.3f} | {gap(v, sync['val'][-1][1]):+.1f}% | "
              f"{worst_gap(r, sync):+.1f}% | {cells} |")  # fmt: skip
    if name == "converge":
        plot_converge(runs, corpora)


def worst_gap(run: dict, sync: dict) -> float:
    """The largest held-out gap to sync (%) at the evaluations from step EARLY on."""
    ref = dict(sync["val"])
    return max((gap(v, ref[s]) for s, v in run["val"] if s >= EARLY and s in ref), default=0.0)


def plot_converge(runs: dict, corpora: list[str]) -> None:
    """benchmarks/co2_converge.png: per corpus, the three methods' losses (training loss smoothed
    over 20 steps, held-out loss at the evals) and the gap to sync."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(corpora), figsize=(5 * len(corpora), 6), squeeze=False,
                             sharex=True, gridspec_kw={"height_ratios": [2, 1]})  # fmt: skip
    colors = {"sync": "black", "diloco": "tab:blue", "diloco-tuned": "tab:cyan", "co2": "tab:red"}
    for j, c in enumerate(corpora):
        top, bottom = axes[0][j], axes[1][j]
        sync = dict(runs[f"{c}/sync"]["val"])
        for m, color in colors.items():
            r = runs.get(f"{c}/{m}")
            if r is None:
                continue
            tr = r["train"]
            smooth = [statistics.mean(tr[max(0, i - 19) : i + 1]) for i in range(len(tr))]
            top.plot(range(1, len(tr) + 1), smooth, color=color, lw=0.8, alpha=0.6)
            steps, vals = zip(*r["val"], strict=True)
            top.plot(steps, vals, "o-", color=color, ms=3, label=f"{m} (held-out)")
            if m != "sync":
                bottom.plot(steps, [gap(v, sync[s]) for s, v in r["val"]], "o-", color=color,
                            ms=3, label=m)  # fmt: skip
        top.set_title(c)
        top.set_ylabel("loss (thin: training, 20-step mean)")
        top.legend(fontsize=8)
        bottom.axhline(0, color="black", lw=0.5)
        bottom.axhline(3, color="grey", lw=0.5, ls="--")
        bottom.axhline(5, color="grey", lw=0.5, ls=":")
        bottom.axvline(EARLY, color="grey", lw=0.5, ls=":")
        bottom.set_ylabel("held-out gap to sync (%)")
        bottom.set_xlabel("step")
        bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(CONVERGE_PNG, dpi=70)
    print(f"\nwrote {CONVERGE_PNG} and {converge_out('converge')}")


if __name__ == "__main__":
    main()
