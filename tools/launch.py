"""Re-running a `mixlen` subcommand as N local ranks through torchrun's own launcher
(`torch.distributed.run`, standalone rendezvous): `mixlen train --nproc N`, `mixlen eval --nproc N`.

The ranks must import this mixlen, whatever folder the command runs in: `python -m tools.cli`
would put the working directory first on sys.path, so a user's project with its own `tools/`
(or `trainer/`, `datapipe/`) package would run in its place. Each rank therefore runs this Python
in safe-path mode (`-P`: neither the working directory nor a script's folder goes on sys.path),
with the folder this launcher's packages came from put first (`rank_command`)."""

from __future__ import annotations

import os
import sys

# the folder holding mixlen's packages (datapipe/, trainer/, tools/), as this process found them
PACKAGES_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_command(argv: list[str], root: str = PACKAGES_ROOT) -> list[str]:
    """The command of one rank running `mixlen ARGV...`: this Python in safe-path mode (-P),
    unbuffered, with `root` first on sys.path, then `tools.cli.main` (which leaves a rank as the
    console script does)."""
    boot = (
        "import sys; root = " + repr(root) + "\n"
        "if root not in sys.path: sys.path.insert(0, root)\n"
        "from tools.cli import main; sys.exit(main())"
    )
    return [sys.executable, "-P", "-u", "-c", boot, *argv]


def launch(argv: list[str], nproc: int, max_restarts: int = 0) -> int:
    """Run `mixlen ARGV...` (`rank_command`) on `nproc` local ranks (gloo with one thread each on
    CPU, NCCL on CUDA); the exit code: 2 if a rank stopped on a user error, 128 + the signal if
    the launcher was stopped, else 1 on a failure."""
    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import get_args_parser, run

    from trainer.parallel.runtime import dist_timeout

    dist_timeout()  # a bad MIXLEN_DIST_TIMEOUT: one message here, not one per rank
    if not torch.cuda.is_available():
        os.environ["OMP_NUM_THREADS"] = "1"  # one core per rank; torchrun passes the env on
    cmd = ["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc)]
    cmd += ["--max-restarts", str(max_restarts), "--no-python", *rank_command(argv)]
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
