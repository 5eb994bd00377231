"""`mixlen eval MODEL DATA [--nproc N] [--split val|all] [--json] [--out DIR]`: long-context
evaluation (trainer/eval/): loss and perplexity by position and by sample length over a dataset's
held-out samples, and passkey retrieval at every depth of filler up to the model's context, on N
ranks with the planner and executor of training (long samples on rings).

MODEL is a mixlen checkpoint (a `step-NNNNNNNN` directory, or a checkpoint.dir: its newest) or a
Hugging Face `save_pretrained` folder; DATA a dataset written by `mixlen preprocess`, or several
(a mixture: `DIR@WEIGHT ...` or `--mix FILE.toml`, weights not used): each source's held-out
samples evaluated separately (`by_source`), pooled for the overall figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from datapipe.errors import ConfigError, InputError
from datapipe.plan.setup import MAX_CAPACITY, MAX_CONTEXT
from datapipe.shapes import TP_DEGREES
from tools.cli import MAX_NPROC, int_in
from trainer.model.config import DTYPES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a mixlen checkpoint (or checkpoint.dir) or a Hugging Face folder")
    p.add_argument(
        "data",
        nargs="*",
        help="a dataset written by `mixlen preprocess`; several (DIR or DIR@WEIGHT) for a "
        "mixture, each source evaluated on its own",
    )
    p.add_argument(
        "--mix",
        metavar="FILE.toml",
        default=None,
        help="a mixture's sources (sources = [...], at the top or under [data], as in a training "
        "config): each evaluated on its own",
    )
    p.add_argument(
        "--split",
        choices=("val", "all"),
        default="val",
        help="the held-out samples (the checkpoint's data.val_fraction and seed, else "
        "--val-fraction and --seed) or every sample",
    )
    p.add_argument("--val-fraction", type=float, default=None, help="held-out fraction (0.01)")
    p.add_argument(
        "--seed", type=int_in(0, (1 << 63) - 1), default=None, help="the held-out split's seed (0)"
    )
    p.add_argument(
        "--max-tokens",
        type=int_in(1, 1 << 40),
        default=None,
        help="evaluate at most this many positions' predictions (the report's tokens), per "
        "dataset: held-out samples in order, the last one cut to its first tokens to make "
        "exactly N (a causal model predicts them as in the whole sample); on a dataset with a "
        "loss mask only the trained ones among them are scored and counted",
    )
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype")
    p.add_argument(
        "--nproc", type=int_in(1, MAX_NPROC), default=1, help="ranks to launch through torchrun"
    )
    p.add_argument(
        "--tp",
        type=int,
        choices=TP_DEGREES,
        default=1,
        help="tensor-parallel processes per rank (--nproc = ranks x tp; docs/training.md, "
        "Tensor parallelism)",
    )
    p.add_argument(
        "--capacity",
        type=int_in(1, MAX_CAPACITY),
        default=None,
        help="positions per rank per micro-batch",
    )
    p.add_argument("--policy", default="hdp", choices=("hdp", "naive-hdp", "static"))
    p.add_argument("--cost", default=None, help="a cost preset or file for the planner (debug)")
    p.add_argument("--no-passkey", action="store_true", help="skip passkey retrieval")
    p.add_argument("--passkey-lengths", default=None, help="comma list (default 1K, 2K, ...)")
    p.add_argument("--passkey-depths", default="0,0.25,0.5,0.75,1", help="comma list in [0, 1]")
    p.add_argument(
        "--passkey-beyond-context",
        action="store_true",
        help="allow passkey lengths beyond the model's declared context (a model measured "
        "before its context is extended)",
    )
    p.add_argument("--tokenizer", default=None, help="the passkey's tokenizer.json (or bytes)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default=None, help="write eval.json and passkey.png into this folder")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))


def _numbers(flag: str, text: str | None, kind: type) -> list | None:
    if text is None:
        return None
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated numbers, got {text!r}") from None


def _options(args: argparse.Namespace):
    from trainer.eval.cli import EvalOptions

    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        raise ConfigError(f"--val-fraction: must be in (0, 1), got {args.val_fraction}")
    depths = _numbers("--passkey-depths", args.passkey_depths, float) or []
    if any(not 0 <= d <= 1 for d in depths):
        raise ConfigError(f"--passkey-depths: each must be in [0, 1], got {depths}")
    lengths = _numbers("--passkey-lengths", args.passkey_lengths, int)
    if lengths is not None and any(not 16 <= n <= MAX_CONTEXT for n in lengths):
        raise ConfigError(f"--passkey-lengths: each must be in [16, 2^36], got {lengths}")
    for flag, given in (("--passkey-depths", depths), ("--passkey-lengths", lengths)):
        if given == [] and not args.no_passkey:
            raise ConfigError(f"{flag}: no value given (--no-passkey skips passkey retrieval)")
    data, sources = _datasets(args)
    return EvalOptions(
        model=args.model,
        data=data,
        sources=sources,
        passkey_beyond_context=args.passkey_beyond_context,
        split=args.split,
        dtype=args.dtype,
        capacity=args.capacity,
        policy=args.policy,
        cost=args.cost,
        val_fraction=args.val_fraction,
        seed=args.seed,
        max_tokens=args.max_tokens,
        passkey=not args.no_passkey,
        passkey_lengths=lengths,
        passkey_depths=depths,
        tokenizer=args.tokenizer,
    )


def _datasets(args: argparse.Namespace) -> tuple[str, list[tuple[str, str]]]:
    """DATA as one path, or a mixture's (name, path) sources and a label for the report."""
    from datapipe.mix.report import is_mixture_args, parse_mixture
    from datapipe.mix.sources import load_sources
    from datapipe.settings import Names

    if not args.data and not args.mix:
        raise ConfigError("DATA: a dataset written by `mixlen preprocess` (or several, or --mix)")
    if not is_mixture_args(args.data, args.mix):
        return args.data[0], []
    sources, _ = parse_mixture(args.data, args.mix)
    loaded = load_sources(sources, Names(flags=True).using(sources="DATA"))  # checked as train does
    pairs = [(s.name, s.config.path) for s in loaded]
    return "+".join(name for name, _ in pairs), pairs


def _without_nproc(argv: list[str]) -> list[str]:
    """The command line without its --nproc (each rank runs one process)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def _check_out(out: str | None) -> None:
    """InputError naming --out when eval.json could not be written there: the folder, or one
    above it, is a file (checked before the evaluation, not after it)."""
    if out is None:
        return
    from pathlib import Path

    path = Path(out).absolute()
    for anc in (path, *path.parents):
        if anc.exists():
            if not anc.is_dir():
                where = "is" if anc == path else f"{anc} is"
                raise InputError(
                    f"--out {out}: {where} a file, not a directory (the folder for eval.json)"
                )
            return


def finite_json(obj: Any) -> Any:
    """`obj` with every NaN or infinite float replaced by None (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def run(args: argparse.Namespace) -> int:
    from tools.launch import launch, under_torchrun

    opts = _options(args)
    _check_out(args.out)
    if args.nproc % args.tp and not under_torchrun():  # a rank's world: setup_runtime checks
        raise ConfigError(f"--tp: {args.tp} does not divide --nproc {args.nproc}")
    if args.nproc > 1 and not under_torchrun():
        from trainer.eval.cli import preflight

        preflight(opts, args.nproc, args.tp, args.device)  # the ranks' refusals, once, here
        return launch(_without_nproc(args.argv), args.nproc)
    from trainer.eval.cli import run_eval
    from trainer.eval.report import plot_passkey, render
    from trainer.parallel.runtime import setup_runtime

    rt = setup_runtime(args.device, tp=args.tp)
    try:
        result = run_eval(opts, rt)
    finally:
        rt.close()
    if rt.global_rank != 0:
        return 0
    if args.out:
        from datapipe.files import write_text_atomic

        os.makedirs(args.out, exist_ok=True)
        text = json.dumps(finite_json(result), indent=1, allow_nan=False)
        png = os.path.join(args.out, "passkey.png")
        if os.path.lexists(png):  # an earlier evaluation's plot never sits beside this eval.json
            os.remove(png)
        if result.get("passkey"):
            plot_passkey(result["passkey"], png)
        write_text_atomic(os.path.join(args.out, "eval.json"), text)
    if args.json:
        print(json.dumps(finite_json(result), allow_nan=False))
    else:
        print(render(result), end="")
    return 0
