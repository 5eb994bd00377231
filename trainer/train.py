"""`mixlen train`'s entry: validate the config, set up the runtime, run the Trainer.

Run it under torchrun (one process per rank: RANK/WORLD_SIZE/LOCAL_RANK in the environment) or as
one process.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from datapipe.plan.warm import compile_kernels
from trainer.config.job import TrainerConfig
from trainer.model.config import check_model_fits
from trainer.parallel.runtime import Runtime, setup_runtime
from trainer.trainer import Trainer

__all__ = ["preflight", "run_training"]


def preflight(cfg: TrainerConfig, world: int) -> None:
    """Check, without starting it, that a run of `world` ranks can start: the config, the dataset
    (manifest, index, shard sizes), the plan fitting its longest sample on `world` ranks, the
    model covering its vocabulary, the checkpoint `checkpoint.resume` names belonging to this run
    and leaving it a step to run, a mixture's sources lasting to `train.steps`, and
    `parallel.islands` dividing `world`. The launcher calls it before torchrun, so such an error
    is printed once; it also compiles the planner's and the fetch's kernels
    (datapipe.plan.warm) the ranks would each compile."""
    from trainer.checkpoint.checkpointer import (
        check_run_matches,
        check_steps_left,
        resume_candidates,
    )

    cfg.validate()
    check_model_fits(cfg.model.shape(), cfg.train.dtype, cfg.train.device, cfg.model.key_of)
    n = cfg.parallel.ranks_per_island(world)  # the plan is an island's
    with ExitStack() as stack:
        data = cfg.train_data(0, n, stack, validation=False)
        paths, _ = resume_candidates(cfg.checkpoint)
        if paths:
            state = check_run_matches(paths[0], cfg, data.stream, data.fingerprint)
            check_steps_left(cfg, paths[0])
            if data.mixture:
                data.stream.load_state_dict(state)
        data.check_supply(cfg.train.steps)  # a mixture running out before train.steps
    compile_kernels()  # once here, so that the ranks load the step's numba kernels, not compile


def run_training(cfg: TrainerConfig, rt: Runtime | None = None) -> dict[str, Any]:
    """Train as configured; returns the Trainer's summary. Collective: every rank of the island
    calls it. A runtime made here (rt None) is torn down at the end."""
    cfg.validate()
    check_model_fits(cfg.model.shape(), cfg.train.dtype, cfg.train.device, cfg.model.key_of)
    own_rt = rt is None
    rt = rt or setup_runtime(cfg.train.device, cfg.parallel.islands, cfg.parallel.tp)
    try:
        with Trainer(cfg, rt) as trainer:
            return trainer.train()
    finally:
        if own_rt:
            rt.close()
