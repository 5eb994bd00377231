"""A mixlen command run as N local ranks without torchrun: each rank a process forked from
trainer.parallel.comm.spawn's forkserver (nothing imported again) with the environment torchrun
gives its ranks, running tools.cli.main as a rank does. Tests of what the ranks compute use it;
the launch itself (`--nproc` through torchrun, restarts) keeps its own tests."""

from __future__ import annotations

import os
from collections.abc import Sequence


def _cli_rank(rank: int, world: int, port: int, argv: list[str], env: dict[str, str]) -> None:
    """One rank: torchrun's variables (standalone, one node), `env`, then `mixlen ARGV...`;
    raise if it exits with other than 0."""
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
    from tools.cli import main

    code = main(list(argv))
    if code != 0:
        raise RuntimeError(f"rank {rank}: mixlen {' '.join(argv[:1])} exited with {code}")


def run_cli_ranks(
    argv: Sequence[str], nproc: int, timeout: float, env: dict[str, str] | None = None
) -> None:
    """Run `mixlen ARGV...` on `nproc` local ranks (as `--nproc` would, minus torchrun); raise
    the first rank's error, or TimeoutError after `timeout` seconds."""
    import uuid

    from trainer.parallel.comm import free_port, spawn

    # one job id for all ranks, random per launch, as torchrun's --standalone gives
    env = {"TORCHELASTIC_RUN_ID": uuid.uuid4().hex, **(env or {})}
    spawn(_cli_rank, nproc, (nproc, free_port(), list(argv), env), timeout)
