"""The sharded optimizer (ZeRO-1/2) of an island: AdamW on this rank's slice of the flat weights.

Weights stay replicated in the compute dtype, the parameters views of one padded flat buffer
(`trainer.parallel.slices.FlatLayout`). Each step:

1. Micro-batches put their gradients into accumulation-dtype buckets (pieces of the per-rank
   slices) from post-accumulate-grad hooks (`install_hooks`; `.grad` freed at once) or
   `accumulate_grads()`: a step's first gradient copied, later ones added (no zeroing pass);
   what got none is zeroed before its reduction (AdamW steps it, as torch's `zero_grad(False)`).
2. After the rank's last micro-batch the buckets are reduced to their owners: with hooks each is
   launched (async) once its parameters have their final gradients, in one fixed order (a ready
   bucket waits for those before it) so every rank issues the same collectives, overlapping the
   rest of that backward; `finish_backward()` launches the rest (everything, on a rank without
   micro-batches). Without hooks one reduce-scatter (zero 1) or all-reduce (zero 0) runs.
3. `step(scale)` = `reduce(scale)` (wait; all-reduce across islands in `sync`; the global norm
   from squared slice norms, times `scale` = 1 / labelled positions) then `apply(norm)`: one pass
   multiplies by `scale` and the clipping coefficient, AdamW steps the slice (`self.optimizer` IS
   a torch AdamW over it: element-wise, so exactly the whole model's step), and the new weights
   are all-gathered by bucket in forward order (`async_gather=True` waits later).

Levels: zero 0 keeps everything on every rank; zero 1 shards master weights and moments; zero 2
also the gradient buffer where HDP allows it (trainer/parallel/README.md). `state_dict()` gives
the slices by whole parameter (`ParamChunks`): DCP reshards them to any rank count, level and tp.
Tensor parallelism: one optimizer per TP index over its HDP ranks, on the DTensor parameters'
local shards (`params`; `leaves` get the hooks); `square_norm` makes the global norm.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from datapipe.plan.memory import ModelStateBytes
from trainer.attention.local import accum_dtype
from trainer.parallel.comm import Communicator, Handle
from trainer.parallel.slices import FlatLayout, ParamChunks, Place, plain_places
from trainer.parallel.stats import ReduceStats
from trainer.parallel.tensor import local_grad, square_norm

__all__ = ["ZeroOptimizer"]


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class ZeroOptimizer:
    """AdamW over an island with sharded state (see the module docstring).

    `params`: the compute model's trainable parameters in a fixed order (rebound as views of
    `flat_params`); `master_params`: same shapes, the accumulation-dtype initial values when the
    compute dtype is lower (default: `params`); `layout`: the island's slice ownership (shared with
    CO2; default built here); `cross_comm`: when given, the reduced slice is also summed across
    islands (`sync` mode).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        comm: Communicator,
        *,
        level: int = 1,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        grad_clip: float = 0.0,
        master_params: Sequence[torch.Tensor] | None = None,
        layout: FlatLayout | None = None,
        bucket_bytes: int = 16 << 20,
        grad_comm: Communicator | None = None,
        cross_comm: Communicator | None = None,
        async_gather: bool = False,
        leaves: Sequence[torch.Tensor] | None = None,
        tp_comm: Communicator | None = None,
        replicated: Sequence[bool] | None = None,
        places: Sequence[Place] | None = None,
    ) -> None:
        if level not in (0, 1, 2):
            raise ValueError(f"zero level must be 0, 1 or 2, got {level!r}")
        self.params = list(params)
        if not self.params:
            raise ValueError("no parameters to optimize")
        self.leaves = list(leaves) if leaves is not None else self.params
        self.tp_comm = tp_comm if tp_comm is not None and tp_comm.size > 1 else None
        self.replicated = list(replicated) if replicated else [False] * len(self.params)
        assert len(self.leaves) == len(self.replicated) == len(self.params)
        self.comm, self.level, self.rank = comm, level, comm.rank
        self.grad_comm = grad_comm if grad_comm is not None else comm
        self.cross_comm = cross_comm
        self.grad_clip, self.async_gather = float(grad_clip), async_gather
        lay = layout if layout is not None else FlatLayout.from_params(self.params, comm.size)
        self.layout = lay
        if lay.ranks != comm.size or lay.shapes != [p.shape for p in self.params]:
            raise ValueError(f"{lay} does not fit {len(self.params)} parameters on {comm.size}")
        dev = self.params[0].device
        self.compute_dtype = self.params[0].dtype
        self.acc_dtype = accum_dtype(self.compute_dtype)
        # weights: one padded flat buffer the parameters are views of
        self.flat_params = lay.new_flat(self.compute_dtype, dev)
        lay.bind_params(self.params, self.flat_params)
        # the range this rank's optimizer steps: everything at zero 0, its slice otherwise
        self.own = (0, lay.numel) if level == 0 else lay.slice(self.rank)
        self.places = list(places) if places is not None else plain_places(lay.shapes)
        self.chunks = ParamChunks(lay, *self.own, self.places)  # the checkpoint's view
        self._init_master(master_params, dev)
        self._init_buckets(bucket_bytes, dev)
        self._init_adamw(lr, betas, eps, weight_decay)
        self._hooks: list[Any] = []
        self._gather_handles: list[Handle] = []
        self._grad_peak = 0
        self._scale = 1.0  # reduce's scale, applied with the clipping coefficient in `apply`
        self.last_reduce = ReduceStats(0, 0, 0.0, 0)
        self.begin_step()

    def _init_master(self, master_params: Sequence[torch.Tensor] | None, dev: torch.device) -> None:
        """The owned range's accumulation-dtype master weights (or the weights themselves)."""
        lay, acc, (o0, o1) = self.layout, self.acc_dtype, self.own
        self.separate_master = self.compute_dtype != acc
        self._master_flat: torch.Tensor | None = None
        if not self.separate_master:
            self.master = self.flat_params[o0:o1]  # the weights are the master weights
            return
        if self.level == 0:
            self._master_flat = lay.new_flat(acc, dev)
            self.master = self._master_flat[o0:o1]
        else:
            self.master = torch.zeros(o1 - o0, dtype=acc, device=dev)
        src = list(master_params) if master_params is not None else self.params
        for part in lay.parts(o0, o1):
            flat_p = src[part.param].detach().reshape(-1)
            seg = flat_p[part.param_start : part.param_start + part.length]
            self.master[part.range_start : part.range_start + part.length].copy_(seg)

    def _init_buckets(self, bucket_bytes: int, dev: torch.device) -> None:
        """Gradient buckets of the slices, in launch (backward) order, and the gradient buffer."""
        lay, acc, (o0, o1) = self.layout, self.acc_dtype, self.own
        esize = torch.empty(0, dtype=acc).element_size()
        self.buckets = lay.buckets(max(1, bucket_bytes // esize))
        self.grad_flat = lay.new_flat(acc, dev) if self.level < 2 else None
        if self.grad_flat is not None:
            self.grad = self.grad_flat[o0:o1]
        else:
            self.grad = torch.zeros(o1 - o0, dtype=acc, device=dev)
        self._tmp: dict[int, torch.Tensor] = {}  # zero 2: non-owned buckets alive in this step
        self._parts: list[list[tuple[int, int, int, int]]] = [[] for _ in self.params]
        self._count = [0] * len(self.buckets)
        for b in self.buckets:
            for part in lay.parts(b.start, b.end):
                self._parts[part.param].append(
                    (b.index, part.param_start, part.range_start, part.length)
                )
                self._count[b.index] += 1

    def _init_adamw(
        self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
    ) -> None:
        """The inner AdamW over the slice, its state allocated now (checkpoints load into it)."""
        fused = self.master.is_cuda and self.master.dtype == torch.float32  # one launch, on CUDA
        self.optimizer = torch.optim.AdamW(
            [self.master], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused
        )
        state = self.optimizer.state[self.master]
        dt = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        state["step"] = torch.zeros((), dtype=dt, device=self.master.device if fused else "cpu")
        state["exp_avg"] = torch.zeros_like(self.master)
        state["exp_avg_sq"] = torch.zeros_like(self.master)
        self.exp_avg, self.exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, comm: Communicator, *, master: Any = None, **kwargs: Any
    ) -> ZeroOptimizer:
        """Over `model`'s trainable parameters in registration order (forward order for
        trainer.model.transformer); `master`: the same in the accumulation dtype (bfloat16)."""
        from trainer.parallel.tensor import optimizer_params

        params, leaves, masters, replicated, places = optimizer_params(model, master)
        kwargs.setdefault("replicated", replicated)
        kwargs.setdefault("places", places)
        return cls(params, comm, master_params=masters, leaves=leaves, **kwargs)

    # -- gradient accumulation ---------------------------------------------------------------------

    def install_hooks(self) -> None:
        """Gradients from post-accumulate-grad hooks (`.grad` freed at once), each bucket launched
        once final; held weakly (the garbage collector cannot see a cycle through tensor hooks)."""
        ref = weakref.ref(self)
        if not self._hooks:
            self._hooks = [
                p.register_post_accumulate_grad_hook(
                    lambda p, i=i: None if (opt := ref()) is None else opt._on_grad(i, p)
                )
                for i, p in enumerate(self.leaves)
            ]

    def remove_hooks(self) -> None:
        while self._hooks:
            self._hooks.pop().remove()

    def begin_step(self) -> None:
        """Before a step's first micro-batch: wait for the weights, reset the bookkeeping."""
        self.wait_weights()
        self._remaining = list(self._count)
        self._handles: list[tuple[int, Handle]] = []
        self._next = self._polled = self._early = 0
        self._t_first = 0.0
        self._last = False
        self._fresh = [True] * len(self.params)  # no gradient in the buffer yet this step
        self._grad_peak = self._grad_bytes()

    def begin_microbatch(self, last: bool) -> None:
        """Before a micro-batch's backward; `last`: the rank's last this step (hooks launch)."""
        self._last = last

    def accumulate_grads(self) -> None:
        """Move every parameter's `.grad` into the buckets (the path without hooks)."""
        for i, p in enumerate(self.leaves):
            if p.grad is not None:
                self._add(i, p.grad)
                p.grad = None

    def finish_backward(self) -> None:
        """After the rank's last micro-batch (or none): launch every reduction not launched."""
        self._early = len(self._handles)
        for i in (i for i, fresh in enumerate(self._fresh) if fresh):  # got no gradient: zeroed
            for b, _, bs, n in self._parts[i]:
                if b >= self._next:  # a launched bucket's parameters all had theirs
                    self._bucket_buf(b)[bs : bs + n].zero_()
            self._fresh[i] = False
        if not self._hooks and self.level < 2 and not self._handles:
            self._reduce_whole()
            return
        self._remaining = [0] * len(self.buckets)
        self._launch_ready()

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        self._add(i, p.grad)
        p.grad = None
        if self._last:
            for b, *_ in self._parts[i]:
                self._remaining[b] -= 1
            self._launch_ready()
        self._poll()

    @torch.no_grad()
    def _add(self, i: int, grad: torch.Tensor) -> None:
        if hasattr(grad, "to_local"):  # a DTensor parameter's: this process's shard of it
            grad = local_grad(grad, self.leaves[i])
        g = grad.detach().reshape(-1)
        first, self._fresh[i] = self._fresh[i], False
        for b, ps, bs, n in self._parts[i]:
            dst = self._bucket_buf(b)[bs : bs + n]
            (dst.copy_ if first else dst.add_)(g[ps : ps + n])

    def _bucket_buf(self, b: int) -> torch.Tensor:
        bucket = self.buckets[b]
        if self.grad_flat is not None:
            return self.grad_flat[bucket.start : bucket.end]
        if bucket.owner == self.rank:
            return self.grad[bucket.start - self.own[0] : bucket.end - self.own[0]]
        buf = self._tmp.get(b)
        if buf is None:  # zero 2: allocated on first use in the step
            buf = torch.zeros(bucket.numel, dtype=self.acc_dtype, device=self.grad.device)
            self._tmp[b] = buf
            self._grad_peak = max(self._grad_peak, self._grad_bytes())
        return buf

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._remaining[self._next] <= 0:
            b = self.buckets[self._next]
            buf = self._bucket_buf(b.index)
            if self.level == 0:
                h = self.grad_comm.all_reduce(buf, async_op=True)
            else:
                sizes = [0] * self.layout.ranks
                sizes[b.owner] = b.numel
                out = buf if b.owner == self.rank else buf[:0]
                h = self.grad_comm.reduce_scatter(buf, out, sizes, async_op=True)
            assert h is not None
            if not self._handles:
                self._t_first = time.perf_counter()
            self._handles.append((b.index, h))
            self._next += 1

    def _reduce_whole(self) -> None:
        assert self.grad_flat is not None
        if self.level == 0:
            h = self.grad_comm.all_reduce(self.grad_flat, async_op=True)
        else:
            a, b = self.layout.padded_slice(self.rank)
            h = self.grad_comm.reduce_scatter(self.grad_flat, self.grad_flat[a:b], async_op=True)
        assert h is not None
        self._t_first = time.perf_counter()
        self._handles.append((-1, h))
        self._next = len(self.buckets)

    def _poll(self) -> None:
        """zero 2: free the sent non-owned buckets, oldest first, up to one in flight."""
        if self.level < 2:
            return
        while self._polled < len(self._handles):
            b, h = self._handles[self._polled]
            if b in self._tmp:
                if not getattr(h, "is_completed", lambda: False)():
                    return
                h.wait()
                del self._tmp[b]
            self._polled += 1

    def _grad_bytes(self) -> int:
        if self.grad_flat is not None:
            return _nbytes(self.grad_flat)
        return _nbytes(self.grad) + sum(_nbytes(t) for t in self._tmp.values())

    # -- the optimizer step ------------------------------------------------------------------------

    def step(self, scale: float = 1.0) -> float:
        """`reduce(scale)` then `apply(norm)`: one optimizer step after `finish_backward()`;
        returns the gradient's global norm before clipping."""
        norm = self.reduce(scale)
        self.apply(norm)
        return norm

    @torch.no_grad()
    def reduce(self, scale: float = 1.0) -> float:
        """Finish the reductions (summed across islands too with `cross_comm`); returns the
        global norm of the gradient times `scale`. The gradient stays in `grad` (this rank's
        slice), unscaled until `apply` (`gather_grad` shows it scaled)."""
        if self._next < len(self.buckets):
            raise RuntimeError("reduce() before finish_backward(): reductions not all launched")
        t0 = time.perf_counter()
        for b, h in self._handles:
            h.wait()
            self._tmp.pop(b, None)
        t1 = time.perf_counter()
        esize = self.grad.element_size()
        payload = self.layout.numel if self.grad_flat is None else self.grad_flat.numel()
        span = t1 - self._t_first if self._handles else 0.0
        launched, self._handles = len(self._handles), []
        g = self.grad
        cross_s = 0.0
        if self.cross_comm is not None and self.cross_comm.size > 1 and g.numel():
            self.cross_comm.all_reduce(g)
            cross_s = time.perf_counter() - t1
        self.last_reduce = ReduceStats(
            launched, self._early, t1 - t0, payload * esize, span, cross_s
        )
        self._scale = scale
        sq = square_norm(g, self.layout.parts(*self.own), self.replicated, self.tp_comm)
        if self.level > 0 and self.comm.size > 1:
            self.comm.all_reduce(sq)
        if self.tp_comm is not None:
            self.tp_comm.all_reduce(sq)
        return float(sq.sqrt()) * scale

    @torch.no_grad()
    def apply(self, norm: float) -> None:
        """Scale, clip to `grad_clip` by the global `norm` (clip_grad_norm_'s rule), step AdamW,
        all-gather the weights (in flight with `async_gather`)."""
        g = self.grad
        coef = self._scale  # reduce's scale and the clipping coefficient, in one pass
        if self.grad_clip > 0:
            coef *= min(1.0, self.grad_clip / (norm + 1e-6))
        if coef != 1.0:
            g.mul_(coef)
        self._scale = 1.0
        self.master.grad = g
        self.optimizer.step()
        self.master.grad = None  # the buffer is not zeroed: the next step copies in its first
        self.gather_weights()
        if not self.async_gather:
            self.wait_weights()

    @torch.no_grad()
    def discard(self) -> None:
        """Drop a reduced gradient without a step (a pass run only to be measured)."""
        self._scale = 1.0
        self._tmp.clear()

    @torch.no_grad()
    def gather_master(self) -> torch.Tensor:
        """A copy of the whole master weights on every rank (collective; tests, debugging)."""
        base = self._master_flat if self._master_flat is not None else self.flat_params
        return self._gather(self.master, base)

    @torch.no_grad()
    def gather_grad(self) -> torch.Tensor:
        """The whole reduced gradient times `scale` on every rank, between reduce and apply."""
        whole = self._gather(self.grad, self.grad_flat)
        return whole.mul_(self._scale) if self._scale != 1.0 else whole

    def _gather(self, own: torch.Tensor, whole: torch.Tensor | None) -> torch.Tensor:
        n = self.layout.numel
        if self.level == 0:
            assert whole is not None
            return whole[:n].clone()
        flat = self.layout.new_flat(self.acc_dtype, own.device)
        flat[self.own[0] : self.own[1]].copy_(own)
        self.comm.all_gather_into(flat)
        return flat[:n]

    def gather_weights(self) -> None:
        """Copy the stepped master slice into the compute weights and all-gather them over the
        island, bucket by bucket in forward order (wait with `wait_weights()`)."""
        o0, o1 = self.own
        if self._master_flat is not None:  # zero 0, separate master: every rank has everything
            self.flat_params.copy_(self._master_flat)
            return
        if self.separate_master:
            self.flat_params[o0:o1].copy_(self.master)
        if self.level == 0:
            return
        ranks = self.layout.ranks
        for b in reversed(self.buckets):  # forward order
            sizes = [0] * ranks
            sizes[b.owner] = b.numel
            h = self.grad_comm.all_gather_into(
                self.flat_params[b.start : b.end], sizes, async_op=True
            )
            assert h is not None
            self._gather_handles.append(h)

    def wait_weights(self) -> None:
        """Wait for the weight all-gather (before the next forward)."""
        for h in self._gather_handles:
            h.wait()
        self._gather_handles = []

    # -- CO2 hooks: the acc-dtype weights of this rank's layout slice ------------------------------

    def outer_slice(self) -> torch.Tensor:
        """The accumulation-dtype weights of this rank's slice of the layout (what CO2 updates in
        place); call `publish_outer_slice()` after changing it."""
        s0, s1 = self.layout.slice(self.rank)
        if self.level == 0:
            base = self._master_flat if self._master_flat is not None else self.flat_params
            return base[s0:s1]
        return self.master

    def publish_outer_slice(self) -> None:
        """Make every rank's weights (and zero 0's replicated master) agree after each rank
        changed its `outer_slice()`: an island all-gather."""
        self.wait_weights()
        if self.level > 0:
            self.gather_weights()
            self.wait_weights()
            return
        base = self._master_flat if self._master_flat is not None else self.flat_params
        self.comm.all_gather_into(base)
        if base is not self.flat_params:
            self.flat_params.copy_(base)

    # -- checkpoints and accounting ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's state by whole parameter (`ParamChunks`: DCP reshards it to any rank count,
        level or tp; live views where a piece is one box, so `dcp.load` restores in place)."""
        sd: dict[str, Any] = {
            "exp_avg": self.chunks.pack(self.exp_avg),
            "exp_avg_sq": self.chunks.pack(self.exp_avg_sq),
            "step": self.optimizer.state[self.master]["step"],
        }
        if self.separate_master:
            sd["master"] = self.chunks.pack(self.master)
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore from a dict shaped like `state_dict()` (`dcp.load` filled it); the compute
        weights come from the model's own checkpoint (the master weights cast)."""
        want = {"exp_avg", "exp_avg_sq", "step"} | ({"master"} if self.separate_master else set())
        if set(sd) != want:
            raise ValueError(f"optimizer state keys {sorted(sd)}, expected {sorted(want)}")
        self.chunks.unpack(sd["exp_avg"], self.exp_avg)
        self.chunks.unpack(sd["exp_avg_sq"], self.exp_avg_sq)
        if self.separate_master:
            self.chunks.unpack(sd["master"], self.master)
        step = self.optimizer.state[self.master]["step"]
        if sd["step"] is not step:
            step.copy_(torch.as_tensor(sd["step"]).reshape(step.shape))

    def memory(self) -> ModelStateBytes:
        """Bytes this rank holds (compare `datapipe.plan.memory.model_state_bytes`)."""
        own = self._master_flat if self._master_flat is not None else self.master
        master = _nbytes(own) if self.separate_master else 0
        grads = self._grad_bytes()
        return ModelStateBytes(
            weights=_nbytes(self.flat_params),
            master=master,
            moments=_nbytes(self.exp_avg) + _nbytes(self.exp_avg_sq),
            grads=grads,
            grads_peak=max(self._grad_peak, grads),
        )
