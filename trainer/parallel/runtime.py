"""Where a training process runs: its island, its rank in the island, the communicators, the device.

`setup_runtime` joins the process group named by torchrun's environment (gloo on CPU, NCCL with
eager `device_id` initialisation on CUDA) or runs as one process, then creates, once, every process
group the run needs (`island_groups`): the world is `islands` x N ranks, global rank g is rank
g mod N of island g // N. Each island gets two groups over the same ranks: one for rings, plan
agreement and step statistics, one for the bucketed gradient reductions ZeRO launches during the
last backward (on NCCL a reduction queued on the ring's communicator would hold that backward's
ring hops behind a collective the other members join only after their own last micro-batch).
Rank i of every island shares a cross-island group (CO2's slice averages, sync's gradients).

With `tp` tensor-parallel processes per rank (`[parallel] tp`) the world is islands x N x tp:
process p is TP member p mod tp of HDP rank p // tp (TP members adjacent, on one node). The
island, gradient and cross-island groups above are made for each TP index over the processes of
that index, so rings, plan agreement and ZeRO run per TP index as they would without TP; the TP
group (`tp_mesh`, a DeviceMesh dimension, and `tp_comm`) holds the members of one rank.
"""

from __future__ import annotations

import ctypes
import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from datapipe.errors import ConfigError
from trainer.islands.config import ranks_per_island
from trainer.parallel.comm import Communicator, SoloComm, TorchComm

__all__ = [
    "TIMEOUT_ENV",
    "dist_timeout",
    "IslandGroups",
    "Runtime",
    "is_peer_failure",
    "island_groups",
    "job_id",
    "keep_freed_memory",
    "restart_count",
    "setup_runtime",
]

TIMEOUT_ENV = "MIXLEN_DIST_TIMEOUT"  # seconds a collective may wait (default 600)

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def restart_count() -> int:
    """How many times torchrun's elastic agent has restarted this job's workers (0: first run)."""
    value = os.environ.get(RESTART_ENV, "0")
    return int(value) if value.isdigit() else 0


def job_id() -> str | None:
    """torchrun's id of this job (the same across its restarts; random per `--standalone` launch),
    or None outside torchrun and where it identifies nothing: `--rdzv-id` defaults to "none" for
    every job."""
    value = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return value if value.strip() and value != "none" else None


@dataclass
class IslandGroups:
    """This rank's communicators: its island's (rings, statistics), its island's gradient
    reductions, and its cross-island slice (SoloComm where a group has one rank)."""

    island: int
    islands: int
    comm: Communicator
    grad_comm: Communicator
    cross_comm: Communicator
    tp_comm: Communicator | None = None
    tp_mesh: Any = None


@dataclass
class Runtime:
    """Where this process runs. `rank` and `world` are island-local (the StepPlan's ranks and
    their number N); `global_rank` / `global_world` count every island; `run_comm` spans the
    whole run (checkpoints; default: `comm`, the run of one island)."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    comm: Communicator
    owns_group: bool  # this module initialised torch.distributed (and tears it down)
    island: int = 0
    islands: int = 1
    grad_comm: Communicator | None = None  # default: comm
    cross_comm: Communicator | None = None  # default: a one-rank SoloComm
    run_comm: Communicator | None = None  # default: comm
    tp: int = 1  # tensor-parallel processes per rank
    tp_rank: int = 0  # this process's index in its TP group
    tp_comm: Communicator | None = None  # the TP group (None at tp 1)
    tp_mesh: Any = None  # its DeviceMesh (None at tp 1)

    def __post_init__(self) -> None:
        if self.grad_comm is None:
            self.grad_comm = self.comm
        if self.cross_comm is None:
            self.cross_comm = SoloComm()
        if self.run_comm is None:
            self.run_comm = self.comm

    @property
    def global_rank(self) -> int:
        """This process's rank in the run (0 writes the run's files)."""
        return (self.island * self.world + self.rank) * self.tp + self.tp_rank

    @property
    def global_world(self) -> int:
        """Processes in the run."""
        return self.islands * self.world * self.tp

    def close(self) -> None:
        """Tear down the process group if this runtime created it."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _comm(group: dist.ProcessGroup | None, size: int) -> Communicator:
    return SoloComm() if size == 1 else TorchComm(group)


def island_groups(islands: int, tp: int = 1) -> IslandGroups:
    """Create the island, gradient and cross-island groups of the world for each TP index, and
    the TP groups (collective: every rank creates every group, in one order, as
    torch.distributed.new_group requires)."""
    world, proc = dist.get_world_size(), dist.get_rank()
    n = ranks_per_island(islands, world, tp)
    rank, t = divmod(proc, tp)  # HDP rank across islands, TP index
    island, local = divmod(rank, n)
    comm = grad = cross = None
    for ti in range(tp):
        for j in range(islands):
            members = [(j * n + r) * tp + ti for r in range(n)]
            whole = islands == 1 and tp == 1
            g = dist.group.WORLD if whole else dist.new_group(members) if n > 1 else None
            gg = dist.new_group(members) if n > 1 else None
            if (j, ti) == (island, t):
                comm, grad = _comm(g, n), _comm(gg, n)
        for i in range(n):
            members = [(j * n + i) * tp + ti for j in range(islands)]
            g = dist.new_group(members) if islands > 1 else None
            if (i, ti) == (local, t):
                cross = _comm(g, islands)
    assert comm is not None and grad is not None and cross is not None
    tp_comm = tp_mesh = None
    if tp > 1:
        from trainer.parallel.tensor import tp_mesh as make_tp_mesh

        tp_mesh = make_tp_mesh(tp, _mesh_device())
        tp_comm = TorchComm(tp_mesh.get_group())
    return IslandGroups(island, islands, comm, grad, cross, tp_comm, tp_mesh)


def _mesh_device() -> str:
    """The device type of this process group's tensors ("cuda" on NCCL)."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def dist_timeout() -> datetime.timedelta:
    """How long a collective may wait: MIXLEN_DIST_TIMEOUT seconds (default 600); ConfigError
    naming the variable unless it is a finite number > 0."""
    raw = os.environ.get(TIMEOUT_ENV, "600")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < 1e9:  # NaN fails too
        raise ConfigError(f"{TIMEOUT_ENV}={raw!r}: expected a number of seconds > 0 (e.g. 600)")
    return datetime.timedelta(seconds=seconds)


def setup_runtime(device: str = "auto", islands: int = 1, tp: int = 1) -> Runtime:
    """Join the process group named by torchrun's environment (or run as one process) and create
    the island groups of `islands` islands of ranks of `tp` processes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        world = dist.get_world_size()
    ranks_per_island(islands, world, tp)  # before joining: every rank raises the same error
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
        keep_freed_memory()  # as `mixlen calibrate` times: no page faults step after step
    owns = False
    if world > 1 and not dist.is_initialized():
        timeout = dist_timeout()
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
        groups = island_groups(islands, tp)
        dist.barrier()
        n = dist.get_world_size() // islands // tp
        return Runtime(
            groups.comm.rank,
            n,
            local_rank,
            dev,
            groups.comm,
            owns,
            island=groups.island,
            islands=islands,
            grad_comm=groups.grad_comm,
            cross_comm=groups.cross_comm,
            run_comm=groups.comm if islands == 1 and tp == 1 else TorchComm(),
            tp=tp,
            tp_rank=dist.get_rank() % tp,
            tp_comm=groups.tp_comm,
            tp_mesh=groups.tp_mesh,
        )
    return Runtime(0, 1, 0, dev, SoloComm(), owns)


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Make the C allocator keep what a CPU step frees for the next step: glibc's malloc maps no
    allocation of its own (M_MMAP_MAX 0: tensors come from the heap) and never trims the heap
    (M_TRIM_THRESHOLD at its most), so a step's tensors reuse the pages earlier steps faulted in;
    the process keeps its peak memory. By default glibc maps each allocation above a threshold
    afresh and unmaps it when freed, and raises that threshold after the largest it has freed: a
    4 x 1,024-position step of the debug model (vocabulary 4,096) faulted in 268 MB a pass
    (65,000 page faults, 0.63 s against 0.52 s without), and `mixlen calibrate`, whose processes
    run 8,192-position samples before their packs, timed the same pack up to 10% faster than a
    process that runs only such packs (benchmarks/RESULTS.md, issue 30 item 6). The trainer's CPU
    ranks, `mixlen calibrate` and the training-step benchmark call this first. False (nothing
    changed) where the C library is not glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1


_PEER_FAILURE = ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer")


def is_peer_failure(exc: BaseException) -> bool:
    """Did a collective fail because another rank died or hung (not a bug on this rank)?"""
    dist_error = getattr(dist, "DistError", ())
    if dist_error and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _PEER_FAILURE)
