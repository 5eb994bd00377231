"""CO2's outer update across islands, on this rank's slice of the flat weights.

World = islands x N ranks. Every rank of an island owns slice i of `trainer.parallel.slices.FlatLayout`
(the slices ZeRO shards by) and keeps only that slice of the outer state: the anchor a, the outer
momentum m, the previous applied average D_prev and one in-flight buffer. Rank i of every island
averages slice i across islands on the cross-island communicator (N parallel streams); norms are
over the whole model (squared slice norms summed over the island), so every rank of every island
computes the same penalty and clipping. The rule (docs/ARCHITECTURE.md, "CO2 across islands"):

- round t starts every island at x = a_t and runs tau local steps;
- at its end, delta_t = a_t - x goes into the in-flight buffer (never the live weights) and its
  cross-island average starts asynchronously;
- the previous round's average D = avg(delta_{t-1}), which travelled while round t computed, is
  applied one round stale::

      penalty = 1 + lambda * ||D - D_prev|| / (||D|| + eps)   (adaptive, mixlen's; D_prev = D at
                                                                the first application)
              = 1 + lambda                                    (constant: CO2's code's form)
      m       = clip(beta * m + D / penalty)                  (clip: none, element-wise to [-c, c],
                                                                or to global norm c)
      step    = m                     (heavy-ball)  or  D / penalty + beta * m  (Nesterov)
      a_{t+1} = a_t - alpha * step

- round t+1 starts from a_{t+1}. At the end of the first round nothing is pending (a_2 = a_1);
  every delta is applied exactly once, one round late (`flush` applies the last one at the end).

The first `warmup_rounds` rounds (0: none) wait for their own average and apply it at once with
`warmup_outer_lr` instead of alpha: early on a round's delta changes fastest, so its one-round
staleness costs most there; the first overlapped round then applies nothing at its end, and every
delta is still applied exactly once. Only a stale average is penalised (penalty 1 otherwise);
D_prev is the last applied average, stale or not.

`overlap = False` waits for this round's own average and applies it at once with alpha (DiLoCo's
schedule; with lambda 0 and no clipping it is DiLoCo with heavy-ball or Nesterov outer momentum;
with tau 1, beta 0, alpha 1 it is parameter averaging every step). Here the previous round's
average is awaited before this round's is launched: collectives on the cross-island group run in
issue order, so the new one could not travel earlier anyway, and the in-flight buffer is reused
(4 slices of outer state per rank instead of 5).

`x` below is this rank's slice of the accumulation-dtype weights (`ZeroOptimizer.outer_slice()`),
changed in place; the caller then all-gathers it over the island (`publish_outer_slice()`).
`LinkEmulator` delays cross-island collectives by bytes / bandwidth so the overlap is measurable on
one machine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from trainer.islands.config import CLIPS
from trainer.islands.config import STALENESS_RULES as RULES
from trainer.parallel.comm import Communicator, Handle
from trainer.parallel.slices import FlatLayout, ParamChunks, Place, plain_places
from trainer.parallel.tensor import tp_sum

__all__ = ["LinkEmulator", "OuterConfig", "OuterStats", "OuterSync"]


@dataclass(frozen=True)
class OuterConfig:
    """The outer update's settings, all given (the `[co2]` section maps onto these; its defaults,
    per mode, are `trainer.islands.config.MODE_DEFAULTS`)."""

    tau: int  # local steps per round
    outer_lr: float  # alpha
    momentum: float  # beta
    nesterov: bool
    staleness_lambda: float  # lambda of the staleness gap penalty (0: off)
    staleness_rule: str | None  # adaptive (1 + lambda ||D - D_prev|| / ||D||) | constant (1 +
    # lambda); None with lambda 0 (diloco: no penalty)
    clip: str  # none | value | norm
    clip_value: float  # c
    overlap: bool  # False: wait for this round's average and apply it now (DiLoCo)
    warmup_rounds: int  # with overlap: the first rounds wait for their own average
    warmup_outer_lr: float  # alpha of those rounds' (own, not stale) averages
    eps: float = 1e-8  # guards ||D|| = 0 in the adaptive penalty (not a setting)

    def __post_init__(self) -> None:
        assert self.tau >= 1 and 0.0 <= self.momentum < 1.0 and self.clip in CLIPS
        assert self.staleness_lambda >= 0
        assert self.staleness_rule in RULES or not self.staleness_lambda
        assert self.warmup_rounds >= 0 and self.warmup_outer_lr > 0
        assert self.clip == "none" or self.clip_value > 0


class OuterStats(NamedTuple):
    """What one round boundary did (identical on every rank of every island but `wait_s`)."""

    round: int  # round boundaries passed, this one included
    applied: bool  # an average was applied
    update_norm: float  # ||alpha * step|| over the whole model (0 when nothing was applied)
    penalty: float  # the staleness gap penalty (1 when nothing was applied)
    clipped_fraction: float  # elements clipped (value) or 1.0 if m was rescaled (norm)
    wait_s: float  # time this rank blocked waiting for the cross-island average


# --- link emulator -------------------------------------------------------------------------------


class _LinkHandle:
    def __init__(self, inner: Handle | None, done_at: float, link: LinkEmulator) -> None:
        self._inner, self._done_at, self._link = inner, done_at, link

    def is_completed(self) -> bool:
        inner = getattr(self._inner, "is_completed", lambda: True)()
        return inner and self._link.clock() >= self._done_at

    def wait(self) -> None:
        if self._inner is not None:
            self._inner.wait()
            self._inner = None
        left = self._done_at - self._link.clock()
        if left > 0:
            self._link.sleep(left)
            self._link.delayed_s += left


class LinkEmulator:
    """A cross-island communicator over a slow link: each collective completes no earlier than
    its bytes / bandwidth after the link is free (transfers queue behind each other), enforced on
    the waiting side, so compute that runs meanwhile overlaps it. Bytes are the ring traffic per
    rank: 2(k-1)/k of the payload for an all-reduce, (k-1)/k for reduce-scatter and all-gather."""

    def __init__(
        self,
        inner: Communicator,
        gbps: float,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not gbps > 0:
            raise ValueError(f"link bandwidth must be > 0 Gbit/s, got {gbps}")
        self.inner, self.rank, self.size = inner, inner.rank, inner.size
        self.bytes_per_s = gbps * 1e9 / 8
        self.clock, self.sleep = clock, sleep
        self._free_at = -math.inf
        self.bytes_sent = 0.0
        self.delayed_s = 0.0  # time slept in waits beyond the real collective

    def _delay(self, payload: int, factor: float, inner: Handle | None, async_op: bool) -> Any:
        nbytes = payload * factor
        start = max(self.clock(), self._free_at)
        self._free_at = start + nbytes / self.bytes_per_s
        self.bytes_sent += nbytes
        h = _LinkHandle(inner, self._free_at, self)
        if async_op:
            return h
        h.wait()
        return None

    def _ring(self, allreduce: bool) -> float:
        k = self.size
        return (2.0 if allreduce else 1.0) * (k - 1) / k

    def send_recv(
        self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, tag: int = 0
    ) -> Handle:
        h = self.inner.send_recv(send, dst, recv, src, tag)
        return self._delay(send.numel() * send.element_size(), 1.0, h, True)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Handle | None:
        h = self.inner.all_reduce(tensor, async_op=True)
        return self._delay(tensor.numel() * tensor.element_size(), self._ring(True), h, async_op)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = self.inner.all_gather(tensor)
        self._delay(
            tensor.numel() * tensor.element_size() * self.size, self._ring(False), None, False
        )
        return out

    def reduce_scatter(
        self,
        flat: torch.Tensor,
        out: torch.Tensor,
        sizes: Sequence[int] | None = None,
        async_op: bool = False,
    ) -> Handle | None:
        h = self.inner.reduce_scatter(flat, out, sizes, async_op=True)
        return self._delay(flat.numel() * flat.element_size(), self._ring(False), h, async_op)

    def all_gather_into(
        self, flat: torch.Tensor, sizes: Sequence[int] | None = None, async_op: bool = False
    ) -> Handle | None:
        h = self.inner.all_gather_into(flat, sizes, async_op=True)
        return self._delay(flat.numel() * flat.element_size(), self._ring(False), h, async_op)


# --- the outer update ----------------------------------------------------------------------------


class OuterSync:
    """Rounds, the cross-island average and the outer update of one rank's slice."""

    def __init__(
        self,
        cfg: OuterConfig,
        layout: FlatLayout,
        island: Communicator,
        cross: Communicator,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        clock: Callable[[], float] = time.perf_counter,
        places: Sequence[Place] | None = None,
        tp: Communicator | None = None,
        replicated: Sequence[bool] | None = None,
    ) -> None:
        if layout.ranks != island.size:
            raise ValueError(f"{layout} for an island of {island.size} ranks")
        self.cfg, self.layout, self.island, self.cross, self.clock = (
            cfg,
            layout,
            island,
            cross,
            clock,
        )
        s0, s1 = layout.slice(island.rank)
        places = list(places) if places is not None else plain_places(layout.shapes)
        self.chunks = ParamChunks(layout, s0, s1, places)  # the checkpoint's view
        # tensor parallelism: sums also over the TP group, a parameter every member holds whole
        # counted once (its pieces in this slice weigh 1/tp)
        self.tp = tp if tp is not None and tp.size > 1 else None
        self._tp_size = self.tp.size if self.tp else 1
        self._rep = list(replicated) if replicated else [False] * len(layout.shapes)
        self._parts = layout.parts(s0, s1)
        whole = sum(s.numel() for i, s in enumerate(layout.shapes) if not self._rep[i])
        self.model_numel = whole * self._tp_size + layout.numel - whole

        def buf() -> torch.Tensor:
            return torch.zeros(s1 - s0, dtype=dtype, device=device)

        self.anchor, self.momentum, self.d_prev, self.inflight = buf(), buf(), buf(), buf()
        self.round = 0  # round boundaries passed
        self.local_steps = 0  # steps into the current round
        self.has_prev = False  # d_prev holds the last applied average
        self.pending = False  # the in-flight buffer holds (or awaits) an average to apply
        self._averaged = False  # the in-flight buffer already holds the average, not a sum
        self._handle: Handle | None = None
        self._counters = torch.zeros(4, dtype=torch.int64)

    # -- rounds ------------------------------------------------------------------------------------

    def start(self, x: torch.Tensor) -> None:
        """The first anchor: this rank's slice of the initial weights (identical on all islands)."""
        self.anchor.copy_(x)

    def after_step(self, x: torch.Tensor) -> OuterStats | None:
        """Count one local step; at the end of a round run the boundary (returns its stats; the
        caller then all-gathers the changed `x` over the island)."""
        self.local_steps += 1
        if self.local_steps < self.cfg.tau:
            return None
        self.local_steps = 0
        return self.boundary(x)

    @torch.no_grad()
    def boundary(self, x: torch.Tensor) -> OuterStats:
        """End of a round: snapshot delta = anchor - x, average it across islands, apply the
        previous (overlap) or this (no overlap) round's average, and set x to the new anchor."""
        assert x.shape == self.anchor.shape
        alpha = self.cfg.outer_lr
        stats = (1.0, 0.0, 0.0)
        wait_s, applied = 0.0, False
        if self.overlapped:
            if self.pending:
                wait_s = self._receive()
                stats = self._prepare(True, alpha)
                applied = True
            x.neg_().add_(self.anchor)  # delta_t = a_t - x (x becomes the anchor below)
            if applied:
                self.anchor.sub_(self.inflight, alpha=alpha)
            self.inflight.copy_(x)
            self._launch()
            self.pending = True
        else:
            if self.cfg.overlap:  # a warm-up round: its own average, nothing stale
                alpha = self.cfg.warmup_outer_lr
            torch.sub(self.anchor, x, out=self.inflight)
            self._launch()
            wait_s = self._receive()
            stats = self._prepare(False, alpha)
            applied = True
            self.anchor.sub_(self.inflight, alpha=alpha)
        x.copy_(self.anchor)
        self.round += 1
        penalty, update_norm, clipped = stats
        return OuterStats(self.round, applied, update_norm, penalty, clipped, wait_s)

    @torch.no_grad()
    def flush(self, x: torch.Tensor) -> OuterStats | None:
        """At the end of training: apply the round still in flight (so no delta is lost) and set
        x to the final anchor; None if nothing was pending."""
        if not self.pending:
            return None
        wait_s = self._receive()
        penalty, update_norm, clipped = self._prepare(True, self.cfg.outer_lr)
        self.anchor.sub_(self.inflight, alpha=self.cfg.outer_lr)
        x.copy_(self.anchor)
        self.pending = False
        return OuterStats(self.round, True, update_norm, penalty, clipped, wait_s)

    @torch.no_grad()
    def finish(self, x: torch.Tensor) -> tuple[OuterStats | None, OuterStats | None]:
        """At the end of training: end the current round early if it has local steps (its
        delta is averaged and applied too), then `flush`; the stats of both (None: not run)."""
        s = None
        if self.local_steps:
            self.local_steps = 0
            s = self.boundary(x)
        return s, self.flush(x)

    @property
    def overlapped(self) -> bool:
        """Does the round now ending travel during the next one (overlap, past the warm-up)?"""
        return self.cfg.overlap and self.round >= self.cfg.warmup_rounds

    # -- pieces ------------------------------------------------------------------------------------

    def _launch(self) -> None:
        self._averaged = False
        self._handle = None
        if self.inflight.numel() and self.cross.size > 1:
            self._handle = self.cross.all_reduce(self.inflight, async_op=True)

    def _receive(self) -> float:
        """Wait for the cross-island sum and turn it into the average; returns the time waited."""
        t0 = self.clock()
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        waited = self.clock() - t0
        if not self._averaged:
            if self.cross.size > 1:
                self.inflight.div_(self.cross.size)
            self._averaged = True
        return waited

    def _island_sum(self, values: list[float | torch.Tensor]) -> list[float]:
        """Sums over the island (and the TP group) of per-slice values."""
        dev = self.anchor.device  # NCCL reduces device tensors only
        t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=dev) for v in values])
        if self.island.size > 1:
            self.island.all_reduce(t)
        if self.tp is not None:
            self.tp.all_reduce(t)
        return t.tolist()

    def _tp_sum(self, t: torch.Tensor, f: Callable) -> torch.Tensor:
        """f over this slice `t` (trainer.parallel.tensor.tp_sum: replicated pieces 1/tp)."""
        if not t.numel():
            return torch.zeros((), dtype=torch.float64, device=t.device)
        return tp_sum(t, self._parts, self._rep, self._tp_size, f).double()

    def _sq(self, t: torch.Tensor) -> torch.Tensor:
        return self._tp_sum(t, lambda x: torch.dot(x, x).double())

    def _penalty(self, stale: bool) -> float:
        """The staleness gap penalty of the average D in the in-flight buffer: 1 unless it is
        one round stale and lambda > 0; then 1 + lambda (constant) or 1 + lambda * ||D - D_prev||
        / (||D|| + eps) (adaptive, with D_prev = D at the first application)."""
        cfg = self.cfg
        if not (stale and cfg.staleness_lambda > 0):
            return 1.0
        if cfg.staleness_rule == "constant":
            return 1.0 + cfg.staleness_lambda
        d = self.inflight
        zero = torch.zeros((), dtype=torch.float64, device=d.device)
        diff_sq = self._sq(d - self.d_prev) if self.has_prev else zero
        diff2, d2 = self._island_sum([diff_sq, self._sq(d)])
        return 1.0 + cfg.staleness_lambda * math.sqrt(diff2) / (math.sqrt(d2) + cfg.eps)

    def _prepare(self, stale: bool, alpha: float) -> tuple[float, float, float]:
        """With D in the in-flight buffer (`stale`: one round late): penalty, momentum and
        clipping; leaves the step in the in-flight buffer and D in d_prev. Returns (penalty,
        ||alpha * step||, clipped fraction)."""
        cfg, d, m = self.cfg, self.inflight, self.momentum
        zero = torch.zeros((), dtype=torch.float64, device=d.device)
        penalty = self._penalty(stale)
        m.mul_(cfg.momentum).add_(d, alpha=1.0 / penalty)
        count = zero
        rescaled = False
        if cfg.clip == "value":
            count = self._tp_sum(m, lambda x: (x.abs() > cfg.clip_value).sum().double())
            m.clamp_(-cfg.clip_value, cfg.clip_value)
        elif cfg.clip == "norm":
            (m2,) = self._island_sum([self._sq(m)])
            rescaled = math.sqrt(m2) > cfg.clip_value
            if rescaled:
                m.mul_(cfg.clip_value / math.sqrt(m2))
        self.d_prev.copy_(d)
        self.has_prev = True
        if cfg.nesterov:
            d.mul_(1.0 / penalty).add_(m, alpha=cfg.momentum)
        else:
            d.copy_(m)
        s2, clipped = self._island_sum([self._sq(d), count])
        fraction = float(rescaled) if cfg.clip == "norm" else clipped / max(self.model_numel, 1)
        return penalty, alpha * math.sqrt(s2), fraction

    # -- checkpoints and accounting ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The outer state of this rank's slice with global offsets (identical on every island,
        so DCP keeps one copy). A round in flight is finished first and saved as its average, so a
        resume applies it exactly once."""
        if self.pending:
            self._receive()
        self._counters.copy_(
            torch.tensor([self.round, self.local_steps, int(self.has_prev), int(self.pending)])
        )
        return self._tensors()

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {
            "anchor": self.chunks.pack(self.anchor),
            "momentum": self.chunks.pack(self.momentum),
            "d_prev": self.chunks.pack(self.d_prev),
            "inflight": self.chunks.pack(self.inflight),
            "counters": self._counters,
        }

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore from a dict shaped like `state_dict()` (tensors `dcp.load` filled in place
        need no copy)."""
        bufs = {"anchor": self.anchor, "momentum": self.momentum, "d_prev": self.d_prev}
        bufs["inflight"] = self.inflight
        if set(sd) != {*bufs, "counters"}:
            raise ValueError(f"outer state keys {sorted(sd)}, expected {sorted(bufs)} + counters")
        for k, t in bufs.items():
            self.chunks.unpack(sd[k], t)
        if sd["counters"] is not self._counters:
            self._counters.copy_(torch.as_tensor(sd["counters"]).reshape(4))
        r, steps, has_prev, pending = (int(v) for v in self._counters.tolist())
        self.round, self.local_steps = r, steps
        self.has_prev, self.pending = bool(has_prev), bool(pending)
        self._handle, self._averaged = None, True

    def memory_bytes(self) -> int:
        """Outer-state bytes of this rank (compare `datapipe.plan.memory.outer_state_bytes`)."""
        bufs = (self.anchor, self.momentum, self.d_prev, self.inflight)
        return sum(t.numel() * t.element_size() for t in bufs)
