"""Selective activation offload (ByteScale Eq. 3) and activation checkpointing, per micro-batch.

`ActivationManager.microbatch(model, offload_ratio)` wraps the forward of every transformer block
(`model.layers`) for one micro-batch, from outside the model: each block runs under
`torch.autograd.graph.saved_tensors_hooks`, and optionally under `torch.utils.checkpoint` (non-
reentrant: the block's forward is recomputed in backward and only its inputs are saved, so with
checkpointing on, offload moves the block inputs).

Which blocks offload. Ranks keep at most two blocks' activations in flight: the block computing and
the one whose copy is in transit (copied out while the next block runs forward, copied in one block
ahead of its backward). With j of l blocks offloaded (the first j, never the last), the device holds
``l - j`` blocks' saved activations at its peak (2 for j >= l-2; offloading block l-2 frees nothing:
its copy-out overlaps the last block, whose backward comes at once). ByteScale's Eq. 3 budgets
``2 + (1-r)(l-2)`` blocks, which is exactly ``l - j`` for ``j = r*(l-2)``;
`trainer.offload.plan.offload_blocks` therefore offloads ``ceil(r*(l-2))`` blocks (0 for l <= 2,
where Eq. 3's offload term vanishes), so the device holds at most what the planner's capacity
C_eff(r) assumes.

What moves. Tensors saved by a block's forward, except parameters and buffers, tensors on other
devices, subclasses, storages under `min_bytes`, and the block's shared inputs (every tensor argument
but the hidden state: rope tables and the like, alive for the whole forward anyway). Saved tensors
are grouped by storage: views of one base move once (the whole storage) and are rebuilt as the same
views (dtype, offset, sizes, strides) on unpack, so gradients are bitwise those without offload.

Accounting (every device, what the tests check): per micro-batch the bytes kept on the device, the
bytes moved (each way), the bytes first saved by each block, and the peak of saved-activation bytes
resident on the device: a moved block leaves the device when its own forward ends (its copy-out,
queued on a side stream on CUDA, keeps its memory from reuse until read), and comes back when the
backward of the block after it begins, resident then beside that block (the two blocks in flight
that Eq. 3 budgets). The host store is emptied when the backward ends (an autograd callback) or
when the context exits, also on an exception. One micro-batch, one backward, inside the context,
per manager at a time.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from datapipe.errors import ConfigError
from datapipe.settings import Names, check
from datapipe.shapes import ModelConfig
from trainer.offload.config import (
    SELECTIVE,
    SELECTIVE_OFFLOAD,
    OffloadConfig,
    checkpoint_every,
)
from trainer.offload.host_store import HostBuffer, HostPool, copy_engine
from trainer.offload.plan import (
    HostNeed,
    PlanOffload,
    check_host_budget,
    offload_blocks,
    plan_offload,
)
from trainer.offload.selective import SelectiveBlock

if TYPE_CHECKING:
    from datapipe.plan.stepplan import StepPlan

__all__ = [
    "ActivationManager",
    "ActivationPolicy",
    "MicrobatchStats",
    "activation_manager",
]


@dataclass(frozen=True)
class ActivationPolicy:
    """`[train] activation_checkpoint` and the `[offload]` section (trainer.offload.config)."""

    checkpoint: str = "none"  # "none" | "full" | "selective" | "every:K" (blocks 0, K, 2K, ...)
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    def __post_init__(self) -> None:
        checkpoint_every(self.checkpoint)
        check(self.offload, Names("offload"))
        if self.selective and self.offload.enabled:
            raise ConfigError(SELECTIVE_OFFLOAD)

    @property
    def selective(self) -> bool:
        """Are blocks checkpointed selectively (trainer.offload.selective)?"""
        return self.checkpoint == SELECTIVE

    def checkpointed(self, n_layers: int) -> list[bool]:
        """Per block: is its forward recomputed in backward?"""
        k = checkpoint_every(self.checkpoint)
        return [k > 0 and i % k == 0 for i in range(n_layers)]

    def build(
        self, device: torch.device | str = "cpu", need: HostNeed | None = None
    ) -> ActivationManager:
        return ActivationManager(self, device, need)


def activation_manager(
    offload: OffloadConfig,
    checkpoint: str,
    shape: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
) -> ActivationManager | None:
    """The run's manager (`[offload]` and `train.activation_checkpoint` for a model of `shape`),
    or None when it neither offloads nor checkpoints (plain forward)."""
    if not offload.enabled and checkpoint_every(checkpoint) == 0:
        return None
    policy = ActivationPolicy(checkpoint, offload)
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    return policy.build(
        device, HostNeed.of(shape, dtype_bytes, policy.checkpointed(shape.n_layers))
    )


# --- per micro-batch state -------------------------------------------------------------------------


@dataclass
class MicrobatchStats:
    """What one micro-batch kept, moved and held (saved activations of the wrapped blocks)."""

    offload_ratio: float
    offloaded_blocks: int
    checkpointed_blocks: int
    block_bytes: list[int]  # bytes of the storages each block saved first
    kept_bytes: int = 0  # saved bytes that stayed on the compute device
    moved_bytes: int = 0  # bytes copied to host (and the same back)
    peak_bytes: int = 0  # peak saved bytes resident on the device (see the module docstring)
    host_peak_bytes: int = 0  # peak bytes in the host store
    late_fetches: int = 0  # copy-ins issued at use instead of one block ahead


class _Entry:
    """One saved storage of the micro-batch."""

    __slots__ = (
        "nbytes",
        "top",
        "weak",
        "moved",
        "source",
        "host",
        "device",
        "ready",
        "pending",
        "resident",
    )

    def __init__(self, nbytes: int, block: int, weak: StorageWeakRef) -> None:
        self.nbytes = nbytes
        self.top = block  # last block that saved it: needed first in backward
        self.weak = weak  # tells a live storage from a dead one at the same address
        self.moved = False
        self.source: torch.Tensor | None = None  # device bytes while the copy-out is in transit
        self.host: HostBuffer | None = None
        self.device: torch.Tensor | None = None  # device bytes after the copy-in
        self.ready: object | None = None  # the copy-in's event (CUDA)
        self.pending = 0  # saved references not yet unpacked
        self.resident = False  # counted as on the device (accounting)


class _Ref:
    """What a pack hook returns: the tensor itself (kept), or where to rebuild it from (moved)."""

    __slots__ = ("block", "tensor", "entry", "meta")

    def __init__(
        self,
        block: int,
        tensor: torch.Tensor | None,
        entry: _Entry | None = None,
        meta: tuple | None = None,
    ) -> None:
        self.block, self.tensor, self.entry, self.meta = block, tensor, entry, meta


class _Wrapped:
    """A saved DTensor: its local tensor's reference and the spec that rebuilds it."""

    __slots__ = ("inner", "spec", "requires_grad")

    def __init__(self, inner: _Ref, spec: Any, requires_grad: bool) -> None:
        self.inner, self.spec, self.requires_grad = inner, spec, requires_grad


def _unwrap(t: torch.Tensor) -> tuple[torch.Tensor, Any] | None:
    """(local tensor, DTensor spec) of a tensor-parallel activation; (the waited result, None)
    of an async collective's; None for any other tensor."""
    if isinstance(t, DTensor):
        return t._local_tensor, t._spec
    if isinstance(t, AsyncCollectiveTensor):
        return t.trigger_wait(), None
    return None


def _byte_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class _Microbatch:
    """Hooks and bookkeeping of one micro-batch."""

    def __init__(
        self, mgr: ActivationManager, model: nn.Module, n_blocks: int, ratio: float
    ) -> None:
        self.mgr = mgr
        self.device = mgr.device
        self.min_bytes = mgr.policy.offload.min_bytes
        j = offload_blocks(ratio, n_blocks)
        self.offload = [i < j for i in range(n_blocks)]
        self.checkpointed = mgr.policy.checkpointed(n_blocks)
        self.selective = mgr.policy.selective
        from trainer.parallel.tensor import local_tensor  # a DTensor parameter's own shard

        self.frozen = {local_tensor(t).untyped_storage().data_ptr() for t in model.parameters()}
        self.frozen |= {t.untyped_storage().data_ptr() for t in model.buffers()}
        self.stats = MicrobatchStats(ratio, j, sum(self.checkpointed), [0] * n_blocks)
        self.entries: dict[int, _Entry] = {}  # by storage address
        self.owned: list[list[_Entry]] = [[] for _ in range(n_blocks)]  # by first saver
        self.by_top: list[list[_Entry]] = [[] for _ in range(n_blocks)]  # moved, by last saver
        self.in_transit: list[_Entry] = []  # copied out, device bytes still held
        self.shared: set[int] = set()
        self.fwd_block = -1
        self.bwd_block: int | None = None  # the lowest block whose backward has begun
        self.resident = 0
        self.store_bytes = 0
        self.callback_queued = False
        self.closed = False

    # -- accounting --
    def _set_resident(self, e: _Entry, on: bool) -> None:
        if e.resident != on:
            e.resident = on
            self.resident += e.nbytes if on else -e.nbytes
            self.stats.peak_bytes = max(self.stats.peak_bytes, self.resident)

    # -- forward --
    def run_block(self, index: int, fn: Callable, *args: object, **kwargs: object) -> object:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        if self.selective:  # no offload with it (refused): SAC keeps tensors outside the hooks
            sel = SelectiveBlock()
            out = sel(fn, *args, **kwargs)
            n = sel.nbytes()
            self.stats.block_bytes[index] = n
            self.stats.kept_bytes += n
            self.resident += n
            self.stats.peak_bytes = max(self.stats.peak_bytes, self.resident)
            return out
        self.fwd_block = index
        self.shared = {
            a.untyped_storage().data_ptr()
            for a in (*args[1:], *kwargs.values())
            if isinstance(a, torch.Tensor)
        }
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            if self.checkpointed[index]:
                out = checkpoint(fn, *args, use_reentrant=False, **kwargs)
            else:
                out = fn(*args, **kwargs)
        for e in self.in_transit:  # this block's moved bytes leave the device (on CUDA the
            e.source = None  # allocator reuses them once the side stream's copy-out read them)
            self._set_resident(e, False)
        self.in_transit = []
        return out

    def pack(self, t: torch.Tensor) -> _Ref | _Wrapped:
        b = self.fwd_block
        wrapped = _unwrap(t)
        if wrapped is not None:  # tensor parallelism: the local tensor moves, the wrapper stays
            local, spec = wrapped
            return _Wrapped(self.pack(local), spec, t.requires_grad) if spec else self.pack(local)
        if (
            type(t) not in (torch.Tensor, nn.Parameter)
            or t.layout != torch.strided
            or t.device != self.device
            or t.is_conj()
            or t.is_neg()
        ):
            return _Ref(b, t)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.frozen:  # empty, or a parameter / buffer
            return _Ref(b, t)
        e = self.entries.get(key)
        if e is None or e.weak.expired():
            e = self._register(storage, key, b)
        if not e.moved:
            return _Ref(b, t)
        if b > e.top:  # a later block saved it too: it is needed back before that block
            e.top = b
            self.by_top[b].append(e)
        e.pending += 1
        return _Ref(b, None, e, (t.dtype, t.storage_offset(), tuple(t.shape), t.stride()))

    def _register(self, storage: torch.UntypedStorage, key: int, b: int) -> _Entry:
        n = storage.nbytes()
        e = _Entry(n, b, StorageWeakRef(storage))
        self.entries[key] = e
        self.owned[b].append(e)
        self.stats.block_bytes[b] += n
        self._set_resident(e, True)
        if self.offload[b] and n >= self.min_bytes and key not in self.shared:
            e.moved = True
            e.source = _byte_view(storage, self.device)
            e.host = self.mgr.copies.copy_out(e.source)
            self.in_transit.append(e)
            self.by_top[b].append(e)
            self.stats.moved_bytes += n
            self.store_bytes += n
            self.stats.host_peak_bytes = max(self.stats.host_peak_bytes, self.store_bytes)
        else:
            self.stats.kept_bytes += n
        return e

    # -- backward --
    def unpack(self, ref: _Ref | _Wrapped) -> torch.Tensor:
        if isinstance(ref, _Wrapped):
            return DTensor(self.unpack(ref.inner), ref.spec, requires_grad=ref.requires_grad)
        e = ref.entry
        if e is None:
            assert ref.tensor is not None
            if not self.closed:
                self._enter_backward(ref.block)
            return ref.tensor
        if self.closed or e.host is None and e.device is None and e.source is None:
            raise RuntimeError(
                "an offloaded activation was used after its micro-batch ended (run the backward "
                "once, inside `with manager.microbatch(...)`; retain_graph is not supported)"
            )
        self._enter_backward(ref.block)
        dev = self._on_device(e)
        dtype, offset, shape, stride = ref.meta
        out = torch.empty(0, dtype=dtype, device=dev.device)
        out.set_(dev.untyped_storage(), offset, shape, stride)
        e.pending -= 1
        if e.pending == 0:
            self._release(e)
        return out

    def _on_device(self, e: _Entry) -> torch.Tensor:
        if e.source is not None:  # still in transit: the device bytes were never dropped
            return e.source
        if e.device is None:
            self.stats.late_fetches += 1
            self._fetch(e)
        assert e.device is not None
        self.mgr.copies.wait(e.ready)
        return e.device

    def _fetch(self, e: _Entry) -> None:
        assert e.host is not None
        e.device, e.ready = self.mgr.copies.copy_in(e.host, e.nbytes)
        self._set_resident(e, True)

    def _enter_backward(self, b: int) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        cur = self.bwd_block
        if cur is not None and b >= cur:
            return
        for x in range(b + 1, len(self.owned) if cur is None else cur + 1):
            for e in self.owned[x]:  # their backward is over: the device lets go
                self._set_resident(e, False)
        self.bwd_block = b
        for x in (b, b - 1):  # needed by this block or the next one: copy in now (one ahead)
            for e in self.by_top[x] if x >= 0 else ():
                if e.top == x and e.host is not None and e.device is None and e.source is None:
                    self._fetch(e)

    def _release(self, e: _Entry) -> None:
        if e.host is not None:
            self.mgr.pool.give(e.host)
            self.store_bytes -= e.nbytes
        e.host = e.device = e.source = e.ready = None

    def finish(self) -> None:
        """End of backward (autograd callback) or of the context: empty the store."""
        for owned in self.owned:
            for e in owned:
                self._set_resident(e, False)
                self._release(e)
        self.entries.clear()
        self.in_transit = []
        assert self.store_bytes == 0, "host store accounting is off"


# --- the manager -----------------------------------------------------------------------------------


class ActivationManager:
    """Runs micro-batches under an `ActivationPolicy` on one compute device (one per rank)."""

    def __init__(
        self,
        policy: ActivationPolicy,
        device: torch.device | str = "cpu",
        need: HostNeed | None = None,
    ) -> None:
        self.policy = policy
        self.need = need  # host bytes per position of each block (for the plan check)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pool = HostPool(policy.offload.pool_bound, pin=self.device.type == "cuda")
        self.copies = copy_engine(self.device, self.pool)
        self.last: MicrobatchStats | None = None
        self._active: _Microbatch | None = None

    def check_plan(self, plan: StepPlan, step: int) -> PlanOffload:
        """Every rank's micro-batches of `plan` as this policy runs them; refuses (ConfigError) a
        plan over `offload.host_budget_bytes` (every rank checks every rank: all refuse)."""
        assert self.need is not None, "build the manager with a HostNeed to check plans"
        po = plan_offload(plan, self.need, self.policy.offload.force_ratio)
        if po.ratio.size and float(po.ratio.max()) > 0 and not self.policy.offload.enabled:
            self.policy.offload.ratio(float(po.ratio.max()))  # raises: offload.enabled = false
        where = f"step {step}" if step >= 0 else "the validation set"
        check_host_budget(po, self.policy.offload.host_budget_bytes, self.need.n_layers, where)
        return po

    @property
    def store_bytes(self) -> int:
        """Bytes the host store holds now (0 between micro-batches and after each backward)."""
        return self._active.store_bytes if self._active is not None else 0

    @contextlib.contextmanager
    def microbatch(
        self,
        model: nn.Module,
        offload_ratio: float = 0.0,
        blocks: Sequence[nn.Module] | None = None,
    ) -> Iterator[MicrobatchStats]:
        """Run the forward and backward of one micro-batch inside this context; `offload_ratio`
        is the plan's (`offload.force_ratio` overrides it). `blocks` default to
        `model.layers`. Yields the micro-batch's stats, complete when the context exits."""
        if self._active is not None:
            raise RuntimeError("micro-batches of one ActivationManager cannot nest")
        blocks = list(model.layers if blocks is None else blocks)  # type: ignore[arg-type]
        ratio = self.policy.offload.ratio(offload_ratio)
        mb = _Microbatch(self, model, len(blocks), ratio)
        saved = [blk.__dict__.get("forward") for blk in blocks]
        self._active = mb
        try:
            for i, blk in enumerate(blocks):
                orig = saved[i] if saved[i] is not None else type(blk).forward.__get__(blk)
                blk.forward = functools.partial(mb.run_block, i, orig)
            yield mb.stats
        finally:
            for blk, prev in zip(blocks, saved):
                if prev is None:
                    blk.__dict__.pop("forward", None)
                else:
                    blk.forward = prev
            mb.closed = True
            mb.finish()
            self._active = None
            self.last = mb.stats
