"""Test support: an in-process fake of the communicator (trainer.parallel.comm), one thread per
rank exchanging tensors through queues, so ring attention, executors, the sharded optimizer and
CO2 can be tested in one process. Production code never imports this module."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainer.parallel.comm import Handle, chunk_offsets

__all__ = ["ThreadComm", "ThreadWorld", "run_islands", "run_threads"]


class ThreadWorld:
    """Shared state of `size` fake ranks running as threads of one process."""

    def __init__(self, size: int, timeout: float = 60.0) -> None:
        self.size = size
        self.timeout = timeout
        self._lock = threading.Lock()
        self._queues: dict[tuple[int, int, int], queue.Queue[torch.Tensor]] = {}
        self._slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout)

    def channel(self, src: int, dst: int, tag: int) -> queue.Queue[torch.Tensor]:
        with self._lock:
            return self._queues.setdefault((src, dst, tag), queue.Queue())

    def comm(self, rank: int) -> ThreadComm:
        return ThreadComm(self, rank)


class _ThreadRecv:
    def __init__(self, chan: queue.Queue[torch.Tensor], out: torch.Tensor, timeout: float) -> None:
        self._chan, self._out, self._timeout = chan, out, timeout
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        try:
            t = self._chan.get(timeout=self._timeout)
        except queue.Empty:
            raise TimeoutError(f"no message within {self._timeout} s (deadlock?)") from None
        if t.shape != self._out.shape:
            raise ValueError(f"received shape {tuple(t.shape)}, buffer {tuple(self._out.shape)}")
        self._out.copy_(t)
        self._done = True


class _ThreadWork:
    """A collective queued on a fake rank's worker thread."""

    def __init__(self, fn: Callable[[], Any], timeout: float) -> None:
        self._fn, self._timeout = fn, timeout
        self._event = threading.Event()
        self._error: BaseException | None = None
        self.result: Any = None

    def run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by wait()
            self._error = e
        finally:
            self._event.set()

    def is_completed(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        if not self._event.wait(self._timeout):
            raise TimeoutError(f"collective not finished within {self._timeout} s (deadlock?)")
        if self._error is not None:
            raise self._error


class ThreadComm:
    """Fake communicator for one thread-rank of a `ThreadWorld`. Collectives run in issue order on
    a worker thread of the rank (started on demand, gone when idle), so an async collective
    proceeds while its rank computes, as on a real process group."""

    _IDLE_S = 0.5

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world, self.rank, self.size = world, rank, world.size
        self._jobs: queue.Queue[_ThreadWork] = queue.Queue()
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None

    def send_recv(
        self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, tag: int = 0
    ) -> Handle:
        self.world.channel(self.rank, dst, tag).put(send.detach().clone())
        return _ThreadRecv(self.world.channel(src, self.rank, tag), recv, self.world.timeout)

    # -- the worker --------------------------------------------------------------------------------

    def _work_loop(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._jobs.empty():
                        self._worker = None
                        return
                continue
            job.run()

    def _submit(self, fn: Callable[[], Any]) -> _ThreadWork:
        job = _ThreadWork(fn, self.world.timeout)
        with self._lock:
            self._jobs.put(job)
            if self._worker is None:
                self._worker = threading.Thread(target=self._work_loop, daemon=True)
                self._worker.start()
        return job

    def _issue(self, fn: Callable[[], Any], async_op: bool) -> Handle | None:
        job = self._submit(fn)
        if async_op:
            return job
        job.wait()
        return None

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        w = self.world
        w.barrier.wait()  # previous collective fully read
        w._slots[self.rank] = tensor.detach().clone()
        w.barrier.wait()
        got = [s for s in w._slots if s is not None]
        w.barrier.wait()
        return got

    # -- collectives -------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Handle | None:
        def job() -> None:
            got = self._exchange(tensor)
            total = got[0].clone()
            for t in got[1:]:
                total += t
            tensor.copy_(total)

        return self._issue(job, async_op)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        job = self._submit(lambda: self._exchange(tensor))
        job.wait()
        return job.result

    def reduce_scatter(
        self,
        flat: torch.Tensor,
        out: torch.Tensor,
        sizes: Sequence[int] | None = None,
        async_op: bool = False,
    ) -> Handle | None:
        offs = chunk_offsets(flat.numel(), self.size, sizes)
        a, b = offs[self.rank], offs[self.rank + 1]
        if out.numel() != b - a:
            raise ValueError(f"reduce_scatter: out has {out.numel()} elements, chunk {b - a}")

        def job() -> None:
            got = self._exchange(flat[: offs[-1]])
            total = got[0][a:b].clone()
            for t in got[1:]:
                total += t[a:b]
            out.copy_(total.view_as(out))

        return self._issue(job, async_op)

    def all_gather_into(
        self, flat: torch.Tensor, sizes: Sequence[int] | None = None, async_op: bool = False
    ) -> Handle | None:
        offs = chunk_offsets(flat.numel(), self.size, sizes)

        def job() -> None:
            got = self._exchange(flat[: offs[-1]])
            for r in range(self.size):
                if r != self.rank:
                    flat[offs[r] : offs[r + 1]].copy_(got[r][offs[r] : offs[r + 1]])

        return self._issue(job, async_op)


def _run(
    size: int,
    make: Callable[[int], tuple],
    fn: Callable[..., Any],
    worlds: Sequence[ThreadWorld],
    timeout: float,
) -> list[Any]:
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def body(i: int) -> None:
        try:
            # each rank's backward in its own thread: on CUDA autograd otherwise runs every
            # backward on one worker thread per device, and a rank waiting there for a ring hop
            # blocks the backward of the peer that would send it (a deadlock on one GPU)
            with torch.autograd.set_multithreading_enabled(False):
                results[i] = fn(*make(i))
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors[i] = e
            for w in worlds:
                w.barrier.abort()

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5.0)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"fake ranks still running after {timeout} s")
    for e in errors:
        if e is not None and not isinstance(e, threading.BrokenBarrierError):
            raise e
    for e in errors:
        if e is not None:
            raise e
    return results


def run_threads(size: int, fn: Callable[[ThreadComm], Any], timeout: float = 60.0) -> list[Any]:
    """Run fn(comm) for ranks 0..size-1 in threads; return results in rank order, re-raising the
    first failure (other ranks are released from barriers and time out of receives)."""
    world = ThreadWorld(size, timeout)
    return _run(size, lambda r: (world.comm(r),), fn, [world], timeout)


def run_islands(
    islands: int,
    ranks: int,
    fn: Callable[[ThreadComm, ThreadComm], Any],
    timeout: float = 60.0,
) -> list[Any]:
    """Run fn(island_comm, cross_comm) for `islands` x `ranks` fake ranks in threads: island_comm
    joins the ranks of one island, cross_comm rank i of every island (its rank is the island
    index). Results in order island * ranks + rank."""
    island_worlds = [ThreadWorld(ranks, timeout) for _ in range(islands)]
    cross_worlds = [ThreadWorld(islands, timeout) for _ in range(ranks)]

    def make(g: int) -> tuple[ThreadComm, ThreadComm]:
        j, r = divmod(g, ranks)
        return island_worlds[j].comm(r), cross_worlds[r].comm(j)

    return _run(islands * ranks, make, fn, island_worlds + cross_worlds, timeout)
