"""Where a training process runs: its rank in the island, the island's communicator, the device.

`setup_runtime` joins the process group named by torchrun's environment (gloo on CPU, NCCL with
eager `device_id` initialisation on CUDA) or runs as one process.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from datapipe.errors import ConfigError
from trainer.comm import Communicator, SoloComm, TorchComm
from trainer.faults import restart_count

__all__ = ["TIMEOUT_ENV", "Runtime", "is_peer_failure", "setup_runtime"]

TIMEOUT_ENV = "MIXLEN_DIST_TIMEOUT"  # seconds a collective may wait (default 600)


@dataclass
class Runtime:
    """Where this process runs: its rank in the island, the island's communicator, the device."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    comm: Communicator
    owns_group: bool  # this module initialised torch.distributed (and tears it down)

    def close(self) -> None:
        """Tear down the process group if this runtime created it."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def setup_runtime(device: str = "auto") -> Runtime:
    """Join the process group named by torchrun's environment, or run as one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        world = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("train.device: 'cuda' requested but no CUDA device is available")
    if use_cuda:
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
        env = os.environ.get("OMP_NUM_THREADS", "")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = int(env) if env.isdigit() else (cores or 1) // max(local_world, 1)
        torch.set_num_threads(max(1, threads))  # OMP_NUM_THREADS if set, else a core share
    owns = False
    if world > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "600")))
        # torchrun's agent may hand every restart the same store: without a prefix per restart
        # a rank that starts early reads the dead ranks' addresses and fails to connect
        store, rank, size = next(dist.rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore(f"mixlen/restart-{restart_count()}", store)
        backend = "nccl" if use_cuda else "gloo"
        extra = {"device_id": dev} if use_cuda else {}
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=size, timeout=timeout, **extra
        )
        owns = True
    if dist.is_initialized() and dist.get_world_size() > 1:
        comm: Communicator = TorchComm()
        dist.barrier()
        return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, dev, comm, owns)
    return Runtime(0, 1, 0, dev, SoloComm(), owns)


_PEER_FAILURE = ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer")


def is_peer_failure(exc: BaseException) -> bool:
    """Did a collective fail because another rank died or hung (not a bug on this rank)?"""
    dist_error = getattr(dist, "DistError", ())
    if dist_error and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _PEER_FAILURE)
