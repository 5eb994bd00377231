"""A small communicator interface for the trainer's collectives and ring point-to-point hops.

Ranks are island-local (0..N-1, as in the StepPlan). Implementations:
- `TorchComm`: torch.distributed over one process group (the island's), P2P ops addressed by the
  global ranks of that group and issued as one `batch_isend_irecv` per hop (gloo on CPU, NCCL on CUDA).
- `trainer.testing.threads.ThreadComm` (tests only): an in-process fake, one thread per rank.
- `SoloComm`: a one-rank island (no process group). `CountingComm` wraps any of them and counts
  ring bytes and the time blocked in ring hops.

Collectives on flat buffers cut into consecutive per-rank chunks (`sizes`, default equal; a chunk
may be empty) serve ZeRO and CO2 (trainer.parallel.slices): `reduce_scatter` sums chunk i of every rank into
rank i, `all_gather_into` fills every chunk from its owner. On NCCL, equal chunks use its
reduce-scatter / all-gather; otherwise one reduce / broadcast per non-empty chunk, which moves the
same bytes: gloo's all-gather refuses unequal sizes, and in torch 2.14 its reduce-scatter and
all-gather took 2-14x the time of per-chunk reduces and broadcasts on 25M floats (2 and 4 ranks,
this box). With `async_op=True` a collective returns a Handle; a rank's collectives run in the
order it issued them, on every implementation.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = [
    "Communicator",
    "CountingComm",
    "Done",
    "Handle",
    "SoloComm",
    "TorchComm",
    "chunk_offsets",
    "free_port",
    "init_local_gloo",
    "set_spawn_preload",
    "spawn",
    "start_spawn_server",
]


class Handle(Protocol):
    """An operation in flight."""

    def wait(self) -> None: ...


class Communicator(Protocol):
    """What the trainer needs from a process group."""

    rank: int
    size: int

    def send_recv(
        self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, tag: int = 0
    ) -> Handle:
        """Post a paired send of `send` to `dst` and receive into `recv` from `src`."""
        ...

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Handle | None:
        """Sum `tensor` in place over all ranks (a Handle if async_op, else None)."""
        ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape everywhere), in rank order: new tensors, this rank's a
        copy too (the caller may write to them)."""
        ...

    def reduce_scatter(
        self,
        flat: torch.Tensor,
        out: torch.Tensor,
        sizes: Sequence[int] | None = None,
        async_op: bool = False,
    ) -> Handle | None:
        """`out` = SUM over ranks of this rank's chunk of the 1-D `flat` (chunks of `sizes`,
        default equal). `out` may be this rank's chunk of `flat` itself; the rest of `flat` is
        undefined afterwards."""
        ...

    def all_gather_into(
        self, flat: torch.Tensor, sizes: Sequence[int] | None = None, async_op: bool = False
    ) -> Handle | None:
        """Fill every chunk of the 1-D `flat` with its owner's chunk (this rank's is the input)."""
        ...


def chunk_offsets(numel: int, size: int, sizes: Sequence[int] | None) -> list[int]:
    """Offsets [0, ..., total] of `size` consecutive chunks of a buffer of `numel` elements:
    `sizes`, or numel // size each."""
    if sizes is None:
        if numel % size:
            raise ValueError(f"{numel} elements do not split into {size} equal chunks")
        sizes = [numel // size] * size
    if len(sizes) != size or min(sizes, default=0) < 0:
        raise ValueError(f"need {size} chunk sizes >= 0, got {list(sizes)}")
    offs = [0]
    for n in sizes:
        offs.append(offs[-1] + int(n))
    if offs[-1] > numel:
        raise ValueError(f"chunks of {offs[-1]} elements in a buffer of {numel}")
    return offs


class Done:
    """A Handle of something already finished."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        return None


# --- torch.distributed ---------------------------------------------------------------------------


class _Works:
    def __init__(
        self,
        works: list[Any],
        keep: tuple[torch.Tensor, ...],
        then: Callable[[], None] | None = None,
    ) -> None:
        self._works = works
        self._keep = keep  # buffers stay alive until the transfer completes
        self._then = then  # runs once, after the transfers (e.g. copy out of a staging buffer)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        then, self._then = self._then, None
        self._works, self._keep = [], ()
        if then is not None:
            then()


def _finish(handle: _Works, async_op: bool) -> Handle | None:
    if async_op:
        return handle
    handle.wait()
    return None


# torch >= 2.14 names the single-tensor collectives *_single (the *_tensor names are deprecated)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or getattr(
    dist, "reduce_scatter_tensor", None
)
_all_gather_single = getattr(dist, "all_gather_single", None) or getattr(
    dist, "all_gather_into_tensor", None
)


class TorchComm:
    """Communicator over a torch.distributed process group (default: the world). `native`: use
    the backend's single-tensor reduce-scatter / all-gather for equal chunks (default: on NCCL
    only, see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None = None, native: bool | None = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self._global = [dist.get_global_rank(self.group, r) for r in range(self.size)]
        nccl = dist.get_backend(self.group) == "nccl"
        self._native = (nccl if native is None else native) and _reduce_scatter_single is not None
        self._nccl = nccl

    def send_recv(
        self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, tag: int = 0
    ) -> Handle:
        if not send.is_contiguous() or not recv.is_contiguous():
            raise ValueError("send_recv needs contiguous tensors")
        ops = [
            dist.P2POp(dist.isend, send, self._global[dst], self.group, tag),
            dist.P2POp(dist.irecv, recv, self._global[src], self.group, tag),
        ]
        return _Works(dist.batch_isend_irecv(ops), (send, recv))

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Handle | None:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        return _Works([work], (tensor,)) if async_op else None

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor.contiguous(), group=self.group)
        return out

    def reduce_scatter(
        self,
        flat: torch.Tensor,
        out: torch.Tensor,
        sizes: Sequence[int] | None = None,
        async_op: bool = False,
    ) -> Handle | None:
        offs = chunk_offsets(flat.numel(), self.size, sizes)
        mine = flat[offs[self.rank] : offs[self.rank + 1]]
        if out.numel() != mine.numel() or not (flat.is_contiguous() and out.is_contiguous()):
            raise ValueError("reduce_scatter needs contiguous buffers and out of the chunk's size")
        n = [b - a for a, b in zip(offs[:-1], offs[1:])]
        in_place = out.data_ptr() == mine.data_ptr()
        if self._native and n[0] > 0 and len(set(n)) == 1:
            # one backend reduce-scatter; the output must not alias the input
            dst = torch.empty_like(out) if in_place else out
            work = _reduce_scatter_single(
                dst, flat[: offs[-1]], op=dist.ReduceOp.SUM, group=self.group, async_op=True
            )
            then = (lambda: out.copy_(dst)) if in_place else None
            return _finish(_Works([work], (flat, out, dst), then), async_op)
        # uneven: a reduce to each chunk's owner (the result lands in the owner's chunk)
        works = [
            dist.reduce(flat[a:b], dst=self._global[r], group=self.group, async_op=True)
            for r, (a, b) in enumerate(zip(offs[:-1], offs[1:]))
            if b > a
        ]
        then = None if in_place or out.numel() == 0 else (lambda: out.copy_(mine))
        return _finish(_Works(works, (flat, out), then), async_op)

    def all_gather_into(
        self, flat: torch.Tensor, sizes: Sequence[int] | None = None, async_op: bool = False
    ) -> Handle | None:
        offs = chunk_offsets(flat.numel(), self.size, sizes)
        if not flat.is_contiguous():
            raise ValueError("all_gather_into needs a contiguous buffer")
        n = [b - a for a, b in zip(offs[:-1], offs[1:])]
        if self._native and n[0] > 0 and len(set(n)) == 1 and _all_gather_single is not None:
            mine = flat[offs[self.rank] : offs[self.rank + 1]]
            if not self._nccl:
                mine = mine.clone()  # in-place all-gather is an NCCL guarantee only
            work = _all_gather_single(flat[: offs[-1]], mine, group=self.group, async_op=True)
            return _finish(_Works([work], (flat, mine)), async_op)
        works = [
            dist.broadcast(flat[a:b], src=self._global[r], group=self.group, async_op=True)
            for r, (a, b) in enumerate(zip(offs[:-1], offs[1:]))
            if b > a
        ]
        return _finish(_Works(works, (flat,)), async_op)


# --- one-rank island and accounting --------------------------------------------------------------


class SoloComm:
    """The communicator of a one-rank island (no process group needed)."""

    rank, size = 0, 1

    def send_recv(
        self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, tag: int = 0
    ) -> Handle:
        raise RuntimeError("a one-rank island has no ring peers")

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Handle | None:
        return Done() if async_op else None

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.clone()]

    def reduce_scatter(
        self,
        flat: torch.Tensor,
        out: torch.Tensor,
        sizes: Sequence[int] | None = None,
        async_op: bool = False,
    ) -> Handle | None:
        n = chunk_offsets(flat.numel(), 1, sizes)[1]
        if out.data_ptr() != flat.data_ptr():
            out.copy_(flat[:n].view_as(out))
        return Done() if async_op else None

    def all_gather_into(
        self, flat: torch.Tensor, sizes: Sequence[int] | None = None, async_op: bool = False
    ) -> Handle | None:
        chunk_offsets(flat.numel(), 1, sizes)
        return Done() if async_op else None


class _TimedHandle:
    def __init__(self, inner: Handle, owner: CountingComm) -> None:
        self._inner, self._owner = inner, owner

    def wait(self) -> None:
        t0 = time.perf_counter()
        self._inner.wait()
        self._owner.wait_s += time.perf_counter() - t0


class CountingComm:
    """A Communicator wrapper counting ring bytes sent and time blocked in ring hops (the executor
    times its collectives itself)."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self.rank, self.size = inner.rank, inner.size
        self.p2p_bytes = 0  # bytes this rank sent point-to-point (ring hops)
        self.wait_s = 0.0  # time blocked in P2P waits

    def reset(self) -> None:
        self.p2p_bytes = 0
        self.wait_s = 0.0

    def send_recv(
        self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, tag: int = 0
    ) -> Handle:
        self.p2p_bytes += send.numel() * send.element_size()
        return _TimedHandle(self.inner.send_recv(send, dst, recv, src, tag), self)

    def __getattr__(self, name: str) -> Any:
        """The collectives (all_reduce, all_gather, reduce_scatter, all_gather_into) pass through."""
        if name.startswith("_") or name == "inner":  # no recursion while half-built (copy, pickle)
            raise AttributeError(name)
        return getattr(self.inner, name)


def free_port() -> int:
    """A free TCP port on localhost (for single-node test and benchmark process groups)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_local_gloo(rank: int, world: int, port: int, timeout_s: float = 60.0) -> None:
    """One torch thread per rank and a gloo process group over localhost TCP, with a timeout so
    a deadlock fails instead of hanging."""
    import datetime

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


# Modules spawn's forkserver imports once, before it forks the first worker (set_spawn_preload)
_SPAWN_PRELOAD: list[str] = ["torch"]


def set_spawn_preload(modules: Sequence[str]) -> None:
    """Have spawn's workers start with `modules` imported: its forkserver imports them once and
    forks each worker from itself (the test suite adds the streaming library: ~9 s a process
    otherwise). No effect once the forkserver runs (this process's first spawn)."""
    _SPAWN_PRELOAD[:] = list(dict.fromkeys(["torch", *modules]))


def _start_method() -> str:
    """The start method: "forkserver" where the platform has it (its preload set), else "spawn"."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(list(_SPAWN_PRELOAD))
    return "forkserver"


def start_spawn_server() -> None:
    """Start spawn's forkserver now, without waiting: its imports run beside the caller's work
    instead of in the first spawn."""
    if _start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _run_then_exit(rank: int, env: dict[str, str], fn: Callable[..., None], *args: Any) -> None:
    """A spawned worker: the parent's environment at spawn time (a forked worker holds its
    forkserver's), fn(rank, *args), then leave without interpreter finalization
    (trainer.parallel.procexit); an exception propagates to torch.multiprocessing's report."""
    from trainer.parallel.procexit import exit_now

    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)
    exit_now(0)


def spawn(fn: Callable[..., None], world: int, args: tuple, timeout: float) -> None:
    """Start `world` spawned processes running fn(rank, *args); raise the first worker's error,
    or TimeoutError after `timeout` seconds (the workers are terminated either way). A worker
    imports with this process's sys.path (multiprocessing's spawn hands it over before it
    unpickles `fn`), so it finds the packages this process found: the working directory comes
    first only where it did here (`python -m` run in it; `mixlen` and torchrun's ranks started
    by tools.launch leave it out)."""
    import torch.multiprocessing as mp

    # forked from a forkserver that imported _SPAWN_PRELOAD once (a fresh interpreter each would
    # import torch again); sys.path, the working directory and __main__ come from this process
    # as with "spawn"
    job = (dict(os.environ), fn, *args)
    ctx = mp.start_processes(
        _run_then_exit, args=job, nprocs=world, join=False, start_method=_start_method()
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=2):  # raises ProcessRaisedException if a worker failed
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} workers did not finish in {timeout} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.terminate()
