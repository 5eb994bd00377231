"""A mixlen command run as N local ranks without torchrun: each rank a process forked from
trainer.parallel.comm.spawn's forkserver (nothing imported again) with the environment torchrun
gives its ranks, running tools.cli.main as a rank does. Tests of what the ranks compute or log use
it; the launch itself (`--nproc` through torchrun, restarts) keeps its own tests."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


def _cli_rank(
    rank: int, world: int, port: int, argv: list[str], env: dict[str, str], logs: str | None
) -> None:
    """One rank: torchrun's variables (standalone, one node), `env`, its stdout and stderr into
    LOGS/rankR.stdout and .stderr if `logs`, then `mixlen ARGV...`; raise if it exits with other
    than 0."""
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="0",
        OMP_NUM_THREADS="1",  # as tools.launch sets on CPU
    )
    if logs is not None:
        for fd, stream, ext in ((1, sys.stdout, "stdout"), (2, sys.stderr, "stderr")):
            stream.flush()
            path = os.path.join(logs, f"rank{rank}.{ext}")  # a rerun starts it anew
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
    from tools.cli import main

    code = main(list(argv))
    if code != 0:
        said = ""
        if logs is not None:  # what it printed, into the error the test reports
            sys.stderr.flush()
            with open(os.path.join(logs, f"rank{rank}.stderr")) as f:
                said = ":\n" + f.read()[-3000:]
        raise RuntimeError(f"rank {rank}: mixlen {' '.join(argv[:1])} exited with {code}{said}")


def run_cli_ranks(
    argv: Sequence[str],
    nproc: int,
    timeout: float,
    env: dict[str, str] | None = None,
    logs: str | os.PathLike | None = None,
) -> None:
    """Run `mixlen ARGV...` on `nproc` local ranks (as `--nproc` would, minus torchrun), each
    rank's output into LOGS/rankR.stdout and .stderr if `logs` (a folder, created); raise the
    first rank's error, or TimeoutError after `timeout` seconds."""
    import uuid

    from trainer.parallel.comm import free_port, spawn

    if logs is not None:
        os.makedirs(logs, exist_ok=True)
        logs = os.fspath(logs)
    # one job id for all ranks, random per launch, as torchrun's --standalone gives
    env = {"TORCHELASTIC_RUN_ID": uuid.uuid4().hex, **(env or {})}
    spawn(_cli_rank, nproc, (nproc, free_port(), list(argv), env, logs), timeout)
