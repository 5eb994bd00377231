"""Re-running a `mixlen` subcommand as N local ranks through torchrun's own launcher
(`torch.distributed.run`, standalone rendezvous): `mixlen train --nproc N`, `mixlen eval --nproc N`."""

from __future__ import annotations

import os
import sys


def launch(argv: list[str], nproc: int, max_restarts: int = 0) -> int:
    """Run `python -m tools.cli ARGV...` on `nproc` local ranks (gloo with one thread each on
    CPU, NCCL on CUDA); the exit code: 2 if a rank stopped on a user error, 128 + the signal if
    the launcher was stopped, else 1 on a failure."""
    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import get_args_parser, run

    if not torch.cuda.is_available():
        os.environ["OMP_NUM_THREADS"] = "1"  # one core per rank; torchrun passes the env on
    cmd = ["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc)]
    cmd += ["--max-restarts", str(max_restarts), "--module", "tools.cli", *argv]
    try:
        run(get_args_parser().parse_args(cmd))
    except SignalException as exc:  # the launcher was stopped: rank 0 said where
        return 128 + int(exc.sigval)
    except Exception as exc:  # torchrun's ChildFailedError: the ranks printed their errors
        codes = sorted(
            {f.exitcode for f in getattr(exc, "failures", {}).values()}, key=lambda c: c != 2
        )
        what = ", ".join(f"exit code {c}" for c in codes) or type(exc).__name__
        print(f"mixlen {argv[0]}: stopped, a rank failed ({what})", file=sys.stderr)
        return 2 if 2 in codes else 1
    return 0


def under_torchrun() -> bool:
    """Is this process one of torchrun's ranks?"""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
