"""The 4-process worker of tests/test_faults_slow.py: an uninterrupted 2-rank run (the reference
of the crash test) and elastic resumes 4 -> 2 and 2 -> 4 ranks, in one spawn (each process pays
the imports once). Two-rank phases run on a sub-group of ranks 0 and 1; ranks 2 and 3 wait."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from _train_worker import train_config

from trainer.parallel.comm import TorchComm, init_local_gloo
from trainer.parallel.runtime import Runtime, setup_runtime
from trainer.train import run_training

CRASH_STEPS = 6


def crash_config(data: str, run: str):
    """The crash test's run: float32 hdp, 6 steps, checkpoints every 2 (keep 3)."""
    return train_config(
        data,
        run,
        train={"steps": CRASH_STEPS, "eval_interval": 0},
        checkpoint={"interval": 2, "keep": 3},
        metrics={"progress": False},
    )


def elastic_config(data: str, run: str, stop_after: int = 0, resume: bool = False):
    """The elastic test's run: float64 hdp, 6 steps, a checkpoint after step 3."""
    return train_config(
        data,
        run,
        train={"steps": 6, "eval_interval": 0, "dtype": "float64", "stop_after": stop_after},
        checkpoint={"interval": 3, "resume": resume},
        metrics={"progress": False},
    )


def _ranks_per_step(run: str) -> dict[int, int]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        recs = [json.loads(x) for x in f]
    return {r["step"]: len(r["compute_time_s_per_rank"]) for r in recs}


def faults_main(rank: int, world: int, port: int, data: str, out_dir: str) -> None:
    init_local_gloo(rank, world, port, timeout_s=120)
    try:
        torch.set_num_threads(1)
        rt4 = setup_runtime("cpu")
        g2 = dist.new_group([0, 1])  # every rank takes part in creating it
        rt2 = (
            Runtime(rank, 2, rank, torch.device("cpu"), TorchComm(g2), False) if rank < 2 else None
        )
        out: dict = {}
        # the crash test's reference: its 2 ranks, no interruption
        if rt2 is not None:
            out["ref2"] = run_training(crash_config(data, os.path.join(out_dir, "ref2")), rt2)[
                "losses"
            ]
        dist.barrier()
        # elastic 4 -> 2: 3 steps on 4 ranks, then resume on 2
        e42 = os.path.join(out_dir, "e42")
        out["e42_first"] = run_training(elastic_config(data, e42, stop_after=3), rt4)["losses"]
        if rt2 is not None:
            second = run_training(elastic_config(data, e42, resume=True), rt2)
            out["e42_second"], out["e42_start"] = second["losses"], second["start_step"]
        dist.barrier()
        # elastic 2 -> 4: 3 steps on 2 ranks, then resume on 4
        e24 = os.path.join(out_dir, "e24")
        if rt2 is not None:
            out["e24_first"] = run_training(elastic_config(data, e24, stop_after=3), rt2)["losses"]
        dist.barrier()
        second = run_training(elastic_config(data, e24, resume=True), rt4)
        out["e24_second"], out["e24_start"] = second["losses"], second["start_step"]
        if rank == 0:
            out["e42_ranks"] = _ranks_per_step(e42)
            out["e24_ranks"] = _ranks_per_step(e24)
            with open(os.path.join(out_dir, "faults.json"), "w") as f:
                json.dump(out, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
