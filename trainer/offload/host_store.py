"""Host memory for offloaded activations: a bounded pool of byte buffers and the copy engines.

`HostPool` hands out byte buffers by power-of-two size class (the class torch's pinned allocator
rounds to anyway, so the pool's count is what is really pinned) and takes them back for reuse across
micro-batches and steps. It never owns more than `max_bytes`: a request it cannot serve from an idle
buffer or from fresh room under the bound gets an ordinary (pageable) buffer outside the pool,
counted in `overflow_bytes`. Nothing is evicted automatically (a freed pinned block would only move
into torch's own pinned cache, which nothing bounds); `trim()` returns the idle buffers.

Copy engines move one storage's bytes between the compute device and a host buffer:

- `SyncCopies` (CPU compute): plain copies. The "device" and the host are the same RAM, but the
  code path is the one CUDA takes: the bytes really leave the saved tensor's storage and come back.
- `CudaCopies`: pinned buffers; device-to-host copies on a side stream that first waits for the
  compute stream (the kernels that produced the tensor are queued there), the source storage
  marked with `record_stream(side)` so the caching allocator cannot hand its memory to a new tensor
  before the copy has read it; host-to-device copies on the same side stream into memory allocated
  on the compute stream (the side stream waits for the compute stream first, so earlier users of
  that memory are done), with an event the compute stream waits on before the tensor is used. No
  call synchronises the host with a stream. A host buffer is reused only by a later copy on the
  same side stream, so stream order keeps a copy-out from overwriting bytes a copy-in still reads;
  torch's pinned allocator also records an event for every non-blocking copy from or to a pinned
  block before that block can be freed.
"""

from __future__ import annotations

import torch

__all__ = ["CudaCopies", "HostBuffer", "HostPool", "SyncCopies", "copy_engine", "size_class"]

MIN_CLASS = 4096  # smallest buffer the pool hands out
MAX_CLASS_STRETCH = 4  # an idle buffer up to this many times larger may serve a request


def size_class(nbytes: int) -> int:
    """Power-of-two size class of a request (at least MIN_CLASS)."""
    return max(MIN_CLASS, 1 << max(int(nbytes) - 1, 0).bit_length())


class HostBuffer:
    """One host byte buffer; `size_class` 0 marks a buffer from outside the pool."""

    __slots__ = ("data", "size_class")

    def __init__(self, data: torch.Tensor, size_class: int) -> None:
        self.data = data
        self.size_class = size_class


class HostPool:
    """Host byte buffers reused by size class, owning at most `max_bytes` (pinned when `pin`)."""

    def __init__(self, max_bytes: int, pin: bool = False) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.pin = pin
        self._idle: dict[int, list[torch.Tensor]] = {}
        self.pooled_bytes = 0  # bytes of every buffer the pool owns (idle or handed out)
        self.live_bytes = 0  # bytes of pooled buffers handed out now
        self.peak_live_bytes = 0
        self.allocations = 0  # buffers ever allocated for the pool
        self.overflow_bytes = 0  # bytes ever served from outside the pool (over max_bytes)
        self.outside = 0  # buffers from outside the pool handed out and not yet given back

    @property
    def idle_bytes(self) -> int:
        return self.pooled_bytes - self.live_bytes

    def take(self, nbytes: int) -> HostBuffer:
        """A buffer of at least `nbytes` bytes (uint8, 1-D)."""
        cls = size_class(nbytes)
        c = cls
        while c <= cls * MAX_CLASS_STRETCH:  # the smallest idle buffer that fits, not far larger
            idle = self._idle.get(c)
            if idle:
                return self._hand_out(HostBuffer(idle.pop(), c))
            c *= 2
        if self.pooled_bytes + cls <= self.max_bytes:
            data = torch.empty(cls, dtype=torch.uint8, pin_memory=self.pin)
            self.pooled_bytes += cls
            self.allocations += 1
            return self._hand_out(HostBuffer(data, cls))
        self.overflow_bytes += int(nbytes)
        self.outside += 1
        return HostBuffer(torch.empty(int(nbytes), dtype=torch.uint8), 0)

    def _hand_out(self, buf: HostBuffer) -> HostBuffer:
        self.live_bytes += buf.size_class
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        return buf

    def give(self, buf: HostBuffer) -> None:
        """Return a buffer taken from this pool (its bytes may be overwritten from now on)."""
        if buf.size_class == 0:
            self.outside -= 1
            return
        self.live_bytes -= buf.size_class
        assert self.live_bytes >= 0, "a buffer was given back twice"
        self._idle.setdefault(buf.size_class, []).append(buf.data)

    def trim(self) -> None:
        """Free the idle buffers (on CUDA also torch's pinned cache, which synchronises the device:
        call between steps, not inside one)."""
        for bufs in self._idle.values():
            self.pooled_bytes -= sum(b.numel() for b in bufs)
        self._idle.clear()
        if self.pin and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()


class SyncCopies:
    """Copies for CPU compute: plain, synchronous."""

    def __init__(self, device: torch.device, pool: HostPool) -> None:
        self.device, self.pool = device, pool

    def copy_out(self, src: torch.Tensor) -> HostBuffer:
        """Copy the bytes of `src` (uint8, 1-D, on the device) into a host buffer."""
        buf = self.pool.take(src.numel())
        buf.data[: src.numel()].copy_(src)
        return buf

    def copy_in(self, buf: HostBuffer, nbytes: int) -> tuple[torch.Tensor, object | None]:
        """A new device byte tensor holding the first `nbytes` of `buf`, and its ready event."""
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dev.copy_(buf.data[:nbytes])
        return dev, None

    def wait(self, ready: object | None) -> None:
        """Make the compute stream wait until a copy-in is complete (nothing to do on CPU)."""


class CudaCopies:  # pragma: no cover - needs CUDA
    """Copies for CUDA compute on a side stream (see the module docstring)."""

    def __init__(self, device: torch.device, pool: HostPool) -> None:
        self.device, self.pool = device, pool
        self.side = torch.cuda.Stream(device=device)

    def copy_out(self, src: torch.Tensor) -> HostBuffer:
        buf = self.pool.take(src.numel())
        compute = torch.cuda.current_stream(self.device)
        self.side.wait_stream(compute)  # the kernels producing `src` are queued on compute
        with torch.cuda.stream(self.side):
            buf.data[: src.numel()].copy_(src, non_blocking=True)
        src.record_stream(self.side)  # its memory is not reused before the side stream read it
        return buf

    def copy_in(self, buf: HostBuffer, nbytes: int) -> tuple[torch.Tensor, object | None]:
        compute = torch.cuda.current_stream(self.device)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)  # on the compute stream
        self.side.wait_stream(compute)  # earlier users of that memory are done with it
        with torch.cuda.stream(self.side):
            dev.copy_(buf.data[:nbytes], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.side)
        dev.record_stream(self.side)  # freed early (an error), it still waits for the copy
        return dev, ready

    def wait(self, ready: object | None) -> None:
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)


def copy_engine(device: torch.device, pool: HostPool) -> SyncCopies | CudaCopies:
    """The copy engine for a compute device."""
    if device.type == "cuda":
        return CudaCopies(device, pool)
    if device.type != "cpu":
        raise ValueError(f"activation offload supports cpu and cuda devices, not {device.type}")
    return SyncCopies(device, pool)
