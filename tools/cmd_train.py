"""`mixlen train CONFIG.toml [--set section.key=value ...] [--nproc N]`.

With `--nproc N > 1` this process becomes a torchrun launcher (`torch.distributed.run`, standalone
rendezvous on this node) that starts N copies of `mixlen train` (gloo on CPU, NCCL on CUDA). Under
torchrun (RANK/WORLD_SIZE set) it trains directly. Multi-node: run torchrun yourself on every
node with a run id of its own (the checkpoint lock and a restart recognise the job by it;
torchrun's default "none" identifies no job), starting the installed `mixlen` command as each
rank's program (`--no-python`), e.g.

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        --rdzv-id my-run-1 --no-python mixlen train configs/demo.toml

not `-m tools.cli`: `python -m` puts the working directory first on sys.path, so a project
folder with its own `tools/` package would run its `tools/cli.py` instead (the console script's
sys.path starts at its own folder; `--nproc` launches its ranks in safe-path mode, tools.launch).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from datapipe.errors import ConfigError
from tools.cli import MAX_NPROC, int_in


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    """`--set section.key=value`, repeatable (into `overrides`)."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value (TOML syntax for the value; repeatable)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="TOML config (see configs/*.toml)")
    add_set_argument(parser)
    parser.add_argument(
        "--nproc",
        type=int_in(1, MAX_NPROC),
        default=1,
        help="ranks to launch on this node through torchrun",
    )
    parser.add_argument(
        "--max-restarts",
        type=int_in(0, 10_000),
        default=0,
        metavar="N",
        help="with --nproc: restart every rank up to N times after a rank dies; the restarted "
        "job resumes from the newest complete checkpoint by itself",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config")
    parser.add_argument(
        "--log-ranks",
        choices=["0", "all"],
        default="0",
        help="ranks whose information lines are shown, prefixed [rank R/W] (default 0; warnings "
        "and errors always)",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar and no information lines (the bar draws only on a terminal anyway)",
    )


def _launch(args: argparse.Namespace) -> int:
    """Re-run this command under torchrun's own machinery with N local ranks."""
    from tools.launch import launch

    argv = ["train", args.config]
    for o in args.overrides:
        argv += ["--set", o]
    argv += ["--log-ranks", args.log_ranks] + (["--quiet"] if args.quiet else [])
    return launch(argv, args.nproc, args.max_restarts)


def run(args: argparse.Namespace) -> int:
    from trainer.config.toml import load_config, to_toml

    if args.config is None and not args.print_config:
        raise ConfigError("a config file is required (e.g. configs/debug.toml)")
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(to_toml(cfg, comments=True), end="")
        return 0
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not under_torchrun:
        cfg.parallel.ranks_per_island(args.nproc)  # once, before any rank starts
    if args.nproc > 1 and not under_torchrun:
        from trainer.train import preflight

        preflight(cfg, args.nproc)  # what the ranks would refuse, refused once, here
        return _launch(args)
    if args.max_restarts and not under_torchrun:
        raise ConfigError("--max-restarts needs --nproc > 1 (torchrun restarts the ranks)")
    from trainer.hooks import TrainingInterrupted
    from trainer.logs import setup_logging
    from trainer.parallel.runtime import is_peer_failure
    from trainer.train import run_training

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    setup_logging(rank, world, args.log_ranks, args.quiet)
    if args.quiet:
        cfg.metrics.progress = False
    try:
        run_training(cfg)
    except TrainingInterrupted as stop:
        if rank == 0:
            where = stop.checkpoint or "none (this run saved none)"
            print(
                f"mixlen train: interrupted at step {stop.step} "
                f"({signal.Signals(stop.signum).name}); last complete checkpoint: {where}",
                file=sys.stderr,
            )
        return stop.exit_code
    except RuntimeError as exc:
        if not (under_torchrun and is_peer_failure(exc)):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(
            f"mixlen train: rank {os.environ.get('RANK')}: stopped, a collective failed; another "
            f"rank probably died (see its message; torchrun names it): {first[:200]}",
            file=sys.stderr,
        )
        return 1
    return 0
