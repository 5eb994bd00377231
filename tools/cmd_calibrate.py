"""`mixlen calibrate [CONFIG.toml] --nproc 2 --out cost.json`: fit the cost model by timing the real
model and real ring attention on this machine (trainer/calibrate.py measures, datapipe/plan/costfit.py
fits by least squares) and write a `mixlen-cost/2` file (datapipe.plan.cost) that `mixlen train`
(`[parallel] cost`) and `mixlen plan --cost` read.

With `--tp N` (default: the config's `parallel.tp`) the processes form TP groups of N: the model
is timed split over each group (every term is then a group's, one HDP rank to the planner), the
group's all-reduces of [T, dim] activations are timed and fitted (latency, bandwidth), and b and c
include them; rings join the same TP index of the --nproc / N HDP ranks.

With `--nproc 1` only local micro-batches are timed (a, b, c; the ring terms stay neutral and the
link is `--link-bytes-per-s`). With K >= 2 processes (one per core, or one per GPU) rings of 2..K
ranks are timed too, and the hop latency, link bandwidth, attention chunk efficiency and overlap
are fitted. The fit's residuals are printed and stored in the file's `calibration` section, with
the model shape it was timed on.

With a training config (CONFIG.toml, `--set` overrides as in `mixlen train`) the model it trains is
timed (its shape, vocabulary and `train.dtype`; a pack as large as `parallel.capacity` is added),
and the file goes to its `parallel.cost` unless `--out` says otherwise. Without one, `--model`
names a shape.
"""

from __future__ import annotations

import argparse
import os

from datapipe.errors import ConfigError, InputError
from datapipe.files import write_text_atomic
from datapipe.plan.costfit import TP_PASSES
from datapipe.shapes import TP_DEGREES
from tools.cli import MAX_NPROC, int_in
from tools.cmd_train import add_set_argument
from trainer.calibrate import CalibrationGrid
from trainer.model.config import DTYPES, check_model_fits

_FLAG_OF = {"vocab_size": "--vocab-size"}  # the shape keys a flag sets without a config

# the flags' defaults are the grid's
DEFAULT_LENGTHS = ",".join(map(str, CalibrationGrid.lengths))
DEFAULT_RING_LENGTHS = ",".join(map(str, CalibrationGrid.ring_lengths))
DEFAULT_HOP_BYTES = ",".join(map(str, CalibrationGrid.hop_bytes))
DEFAULT_PACKS = ",".join(f"{m}x{n}" for m, n in CalibrationGrid.packed)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", nargs="?", default=None, help="a `mixlen train` config: time the model it trains"
    )
    add_set_argument(parser)
    parser.add_argument("--model", default=None, help="a named shape, without a config (debug)")
    parser.add_argument(
        "--vocab-size",
        type=int_in(1, 1 << 32),
        default=None,
        help="the model's vocabulary (default: its own)",
    )
    parser.add_argument(
        "--out", default=None, help="cost file to write (JSON; default: the config's parallel.cost)"
    )
    parser.add_argument(
        "--nproc",
        type=int_in(1, MAX_NPROC),
        default=1,
        help="processes (ranks) to time rings with (default 1)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        choices=TP_DEGREES,
        default=None,
        help="tensor-parallel processes per rank (default: the config's parallel.tp, else 1): "
        "the model is timed split over TP groups and their all-reduces are fitted",
    )
    parser.add_argument(
        "--clock",
        default="wall",
        choices=("wall", "cpu"),
        help="wall clock (default), or each rank's thread CPU time (more ranks than cores)",
    )
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help="local sample lengths")
    parser.add_argument(
        "--packs",
        default=DEFAULT_PACKS,
        help="micro-batches of several equal samples, COUNTxLENGTH (at least one, so that the "
        "size table's rates are fitted, one at each packed size: include one as large as the "
        "trainer's capacity)",
    )
    parser.add_argument("--ring-lengths", default=DEFAULT_RING_LENGTHS, help="ring sample lengths")
    parser.add_argument("--ring-sizes", default="", help="ring sizes (default 2..nproc)")
    parser.add_argument("--hop-bytes", default=DEFAULT_HOP_BYTES, help="ring hop message sizes")
    parser.add_argument(
        "--repeats", type=int_in(1, 1000), default=3, help="timed runs per case (min kept)"
    )
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=CalibrationGrid.min_seconds,
        help="a short case runs until its timed runs add up to this many seconds (at most 30 "
        "runs; 0: exactly --repeats)",
    )
    parser.add_argument(
        "--threads", type=int_in(1, 4096), default=1, help="torch threads per process"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="compute dtype (default: train.dtype, float32)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    _add_link_arguments(parser)


def _add_link_arguments(parser: argparse.ArgumentParser) -> None:
    """The links the timings cannot see (or that another machine has)."""
    parser.add_argument(
        "--link-bytes-per-s",
        type=float,
        default=None,
        help="ring link bandwidth when no rings are timed (--nproc 1; default: the cpu preset)",
    )
    parser.add_argument(
        "--offload-bytes-per-s",
        type=float,
        default=None,
        help="host link bandwidth (default: the device preset's)",
    )
    parser.add_argument(
        "--ranks-per-node",
        type=int_in(0, MAX_NPROC),
        default=0,
        help="with --inter-node-bytes-per-s: the measured link is the node link, groups that "
        "span nodes use the given one",
    )
    parser.add_argument("--inter-node-bytes-per-s", type=float, default=None)


def _ints(flag: str, text: str, minimum: int = 1) -> tuple[int, ...]:
    try:
        vals = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if vals and vals[0] < minimum:
        raise ConfigError(f"{flag}: values must be >= {minimum}, got {vals[0]}")
    return vals


def _packs(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        count, _, length = item.partition("x")
        if not (count.isdigit() and length.isdigit() and int(count) >= 2 and int(length) >= 1):
            raise ConfigError(
                f"--packs: expected COUNTxLENGTH items (COUNT >= 2, LENGTH >= 1), got {item!r}"
            )
        out.append((int(count), int(length)))
    return tuple(dict.fromkeys(out))


def run(args: argparse.Namespace) -> int:
    from trainer.calibrate import calibrate

    lengths = _ints("--lengths", args.lengths)
    if len(lengths) < 3:
        raise ConfigError("--lengths: need at least 3 distinct positive lengths to fit a, b, c")
    sizes = _ints("--ring-sizes", args.ring_sizes, 2)
    if sizes and sizes[-1] > args.nproc:
        raise ConfigError(f"--ring-sizes: {sizes[-1]} is more than --nproc {args.nproc}")
    hop_bytes = _ints("--hop-bytes", args.hop_bytes)
    if args.nproc > 1 and len(hop_bytes) < 2:
        raise ConfigError("--hop-bytes: need at least 2 sizes to fit latency and bandwidth")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise ConfigError(f"--device: expected cpu or cuda[:N], got {args.device!r}")
    if not (args.min_seconds >= 0 and args.min_seconds < float("inf")):
        raise ConfigError(f"--min-seconds must be a number >= 0, got {args.min_seconds}")
    for key in ("link_bytes_per_s", "offload_bytes_per_s", "inter_node_bytes_per_s"):
        v = getattr(args, key)
        if v is not None and not v > 0:
            raise ConfigError(f"--{key.replace('_', '-')} must be > 0, got {v}")
    _check_nproc(args)
    name, shape, dtype, out, packs = _what_to_time(args)
    _check_out(out)
    if args.nproc % args.tp:
        raise ConfigError(f"--tp {args.tp} must divide --nproc {args.nproc}")
    if sizes and sizes[-1] > args.nproc // args.tp:
        raise ConfigError(
            f"--ring-sizes: {sizes[-1]} is more than the {args.nproc // args.tp} HDP ranks of "
            f"--nproc {args.nproc} at --tp {args.tp}"
        )
    grid = CalibrationGrid(
        lengths=lengths,
        packed=packs,
        ring_lengths=_ints("--ring-lengths", args.ring_lengths),
        ring_sizes=sizes,
        hop_bytes=hop_bytes,
        repeats=args.repeats,
        min_seconds=args.min_seconds,
    )
    cal = calibrate(
        name,
        args.nproc,
        grid,
        dtype,
        args.device,
        args.threads,
        args.clock,
        args.link_bytes_per_s,
        args.offload_bytes_per_s,
        args.ranks_per_node,
        args.inter_node_bytes_per_s,
        shape=shape,
        tp=args.tp,
    )
    try:
        write_text_atomic(out, cal.to_json())
    except OSError as exc:  # made unwritable while timing: name --out, not the temporary file
        raise InputError(f"--out {out}: cannot write the cost file ({exc.strerror})") from None
    print(render(cal))
    print(f"-> {out}")
    return 0


# processes per core `--clock cpu` may time (each rank's own CPU time: ranks may share cores)
CPU_CLOCK_RANKS_PER_CORE = 4


def _check_nproc(args: argparse.Namespace) -> None:
    """ConfigError naming --nproc when the machine cannot run that many timed ranks: on the CPU
    one core per rank (--threads each) with the wall clock, CPU_CLOCK_RANKS_PER_CORE ranks a core
    with --clock cpu; on CUDA one rank per GPU."""
    if args.device.startswith("cuda"):
        import torch

        gpus = torch.cuda.device_count()
        if args.nproc > gpus:
            raise ConfigError(
                f"--nproc {args.nproc}: more processes than this machine's {gpus} GPUs"
            )
        return
    cores = len(os.sched_getaffinity(0))
    wall = max(cores // args.threads, 1)
    most = wall if args.clock == "wall" else CPU_CLOCK_RANKS_PER_CORE * cores
    if args.nproc > most:
        raise ConfigError(
            f"--nproc {args.nproc}: more processes than this machine's {cores} cores can time "
            f"(at most {wall} with --clock wall and --threads {args.threads}, "
            f"{CPU_CLOCK_RANKS_PER_CORE * cores} with --clock cpu)"
        )


def _check_out(out: str) -> None:
    """InputError naming --out when the cost file could not be written there (under a file, a
    directory in its place), checked before anything is timed."""
    from pathlib import Path

    from datapipe.ingest.output import check_out_path

    check_out_path(Path(out).absolute(), out, [])
    if os.path.isdir(out):
        raise InputError(f"--out {out}: is a directory; name the cost file to write (cost.json)")


def _what_to_time(args: argparse.Namespace):
    """(name, shape, dtype, output file, packs) from a training config or --model."""
    from datapipe.shapes import get_config

    packs = _packs(args.packs)
    if args.config is None:
        if args.overrides:
            raise ConfigError("--set needs a config file")
        if args.out is None:
            raise ConfigError("--out: required without a config file")
        args.tp = args.tp or 1
        model = args.model or "debug"
        extra = {"vocab_size": args.vocab_size} if args.vocab_size is not None else {}
        try:
            shape = get_config(model, **extra)
        except ValueError as exc:
            raise ConfigError(f"--model: {exc}") from None
        dtype = args.dtype or "float32"
        check_model_fits(
            shape, dtype, args.device, lambda k: _FLAG_OF.get(k, f"--model {model}'s {k}")
        )
        return model, shape, dtype, args.out, packs
    from trainer.config.toml import load_model_config

    if args.model is not None or args.vocab_size is not None:
        raise ConfigError("--model and --vocab-size come from the config file (model.*)")
    cfg = load_model_config(args.config, args.overrides)
    shape = cfg.model.shape()
    args.tp = args.tp or cfg.parallel.tp
    out = args.out or (cfg.parallel.cost if cfg.parallel.cost.endswith(".json") else None)
    if out is None:
        raise ConfigError(
            f"--out: required (the config's parallel.cost {cfg.parallel.cost!r} is a preset, "
            "not a file)"
        )
    cap = cfg.parallel.planner.capacity
    full = (max(2, cap // 256), min(256, cap))  # a pack as large as the capacity
    dtype = args.dtype or cfg.train.dtype
    check_model_fits(shape, dtype, args.device, cfg.model.key_of)
    return cfg.model.name, shape, dtype, out, tuple(dict.fromkeys((*packs, full)))


def render(cal) -> str:
    """Timings beside the fit, the residual summary and the fitted terms (a trainer.calibrate
    Calibration)."""
    lines = [f"{'kind':<6} {'k':>2} {'case':<16} {'measured s':>11} {'fit s':>10} {'resid':>7}"]
    for m, f, r in zip(cal.fit.timings, cal.fit.fitted_s, cal.fit.rel_residuals):
        if m.kind in ("hop", "tp"):
            case = f"{int(m.nbytes)} B"
        elif len(set(m.lengths)) == 1 and len(m.lengths) > 1:
            case = f"{len(m.lengths)} x {m.lengths[0]}"
        else:
            case = ",".join(map(str, m.lengths))
        lines.append(f"{m.kind:<6} {m.k:>2} {case:<16} {m.seconds:>11.5f} {f:>10.5f} {r:>+7.1%}")
    lines.append(
        "residuals (relative): "
        + "; ".join(
            f"{k} n={v['n']} rms {v['rms_rel']:.1%} max {v['max_abs_rel']:.1%}"
            for k, v in cal.fit.summary().items()
        )
    )
    lines += [f"note: {n}" for n in cal.fit.notes]
    c = cal.cost
    size = ", ".join(f"{r:.3g} at {k:g}" for k, r in zip(c.size_knots, c.size_rates)) or "none"
    lines.append(
        f"a = {c.a:.4g} s/S^2, b = {c.b:.4g} s/token, c = {c.c:.4g} s, size s/position: {size}, "
        f"attn_n_half = "
        f"{c.attn_n_half:.4g}, hop_latency_s = {c.hop_latency_s:.4g}, link = "
        f"{c.link_bytes_per_s:.4g} B/s, overlap = {c.overlap:.3f}  ({cal.meta['seconds']:.0f} s)"
    )
    if c.tp > 1:
        lines.append(
            f"tp {c.tp}: all-reduce latency {c.tp_latency_s:.4g} s, {c.tp_bytes_per_s:.4g} B/s "
            f"(in b and c: {TP_PASSES} all-reduces per layer and micro-batch)"
        )
    m, shape = cal.meta, cal.meta["shape"]
    lines.append(
        f"timed: {m['model']} (vocab_size {shape['vocab_size']}, dim {shape['dim']}, n_layers "
        f"{shape['n_layers']}, {m['dtype']}); a model of another vocabulary, width, depth or dtype "
        "costs another time per position: time it (`mixlen calibrate CONFIG.toml`)"
    )
    return "\n".join(lines)
