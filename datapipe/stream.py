"""Length-aware stream of global batches: sample ids and lengths from the index, never tokens.

Fill rule (per island, per epoch):

1. The epoch's order is a permutation of all sample ids drawn from
   ``Generator(PCG64(SeedSequence([seed, epoch])))``: the same bits in every process.
2. Global batches are filled along that order over the *whole* dataset, first fit with a bounded
   look-ahead (``lookahead`` = W, default 64): a batch first takes the samples deferred by earlier
   batches (oldest first, each if it still fits), then consecutive samples while their token sum
   stays <= ``global_batch_tokens``; when the next one does not fit, the following W - D samples
   (D = samples already deferred) are scanned and each that fits the room left joins the batch,
   the others are deferred to the next batches. The oldest deferred sample always opens the next
   batch, so a sample waits at most W batches and the epoch still holds every sample once. A
   batch of only zero-length samples is folded into its neighbour: no step is empty.
   ``lookahead = 0`` is the plain greedy fill (the first sample that does not fit closes the
   batch). Cost: one searchsorted per batch plus O(W) per batch, independent of batch size.
3. A sample longer than ``global_batch_tokens`` is, with ``oversize="own_step"``, a batch on its own
   (a step with more tokens than the budget); with ``oversize="error"`` the stream refuses to start.
   Never a silent drop.
4. Islands: batch j of the epoch goes to island ``j % num_islands``. The last ``B mod num_islands``
   batches of an epoch (B = batches in the epoch) are *skipped for that epoch* so that every island
   runs the same number of steps; their samples appear again in the next epoch's shuffle. With one
   island nothing is skipped: every sample is in exactly one batch per epoch.

Every process computes the same sequence from (index, config) alone, without communication.
This module imports numpy and pyarrow (through ``datapipe.index``) only; a remote dataset's
``manifest.json`` and ``index.parquet`` are downloaded by ``datapipe.index.resolve_dataset``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from datapipe.errors import ConfigError
from datapipe.index import read_index, resolve_dataset
from datapipe.settings import MAX_INT, Names, check, setting

STATE_VERSION = 2
DEFAULT_LOOKAHEAD = 64
OVERSIZE_POLICIES = ("own_step", "error")


# ----------------------------------------------------------------------------- batch formation


def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's permutation of sample ids (int64), identical in every process."""
    gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return gen.permutation(num_samples).astype(np.int64, copy=False)


def greedy_boundaries(lengths: np.ndarray, budget: int) -> np.ndarray:
    """Batch boundaries (int64, B+1 offsets from 0 to n) of the greedy fill of `lengths` in order.

    A batch holds consecutive samples while their sum stays <= budget; a sample that does not fit
    closes the batch. A sample longer than the budget alone forms a batch.
    """
    n = int(lengths.shape[0])
    csum = np.cumsum(lengths, dtype=np.int64)
    bounds = [0]
    start, base = 0, 0
    while start < n:
        end = int(np.searchsorted(csum, base + budget, side="right"))
        if end <= start:  # the sample at `start` alone exceeds the budget: its own batch
            end = start + 1
        bounds.append(end)
        base = int(csum[end - 1])
        start = end
    return np.asarray(bounds, dtype=np.int64)


def lookahead_fill(
    lengths: np.ndarray, budget: int, lookahead: int
) -> tuple[np.ndarray, np.ndarray]:
    """First-fit fill of `lengths` (in order) with a look-ahead window (module docstring, rule 2).

    Returns (positions, bounds): batch b holds ``positions[bounds[b]:bounds[b + 1]]``, positions
    into `lengths`; every position appears exactly once. ``lookahead = 0`` is the greedy fill.
    Batches of zero tokens are folded into a neighbour (merge_empty_batches).
    """
    n = int(lengths.shape[0])
    if lookahead <= 0 or n == 0:
        bounds = merge_empty_batches(lengths, greedy_boundaries(lengths, budget))
        return np.arange(n, dtype=np.int64), bounds
    lens = lengths.tolist()
    csum = np.cumsum(lengths, dtype=np.int64)
    chunks: list[np.ndarray] = []
    bounds = [0]
    deferred: list[int] = []  # positions, oldest first
    p = 0  # next position of the run not yet taken or deferred
    while p < n or deferred:
        room = budget
        head: list[int] = []  # deferred samples taken
        keep: list[int] = []
        for q in deferred:
            if lens[q] <= room or not head:  # the oldest always opens the batch
                head.append(q)
                room -= lens[q]
            else:
                keep.append(q)
        deferred = keep
        run_start = run_end = p
        tail: list[int] = []  # samples taken from the look-ahead window
        if room >= 0 and p < n:
            base = int(csum[p - 1]) if p else 0
            end = int(np.searchsorted(csum, base + room, side="right"))
            if end == p and not head:  # an oversize sample: a batch on its own
                end = p + 1
            run_end = end
            if end > p:
                room -= int(csum[end - 1]) - base
                p = end
            stop = min(n, p + lookahead - len(deferred))
            while room > 0 and p < stop:
                if lens[p] <= room:
                    tail.append(p)
                    room -= lens[p]
                else:
                    deferred.append(p)
                p += 1
        batch = np.concatenate(
            [np.asarray(head, np.int64), np.arange(run_start, run_end), np.asarray(tail, np.int64)]
        )
        chunks.append(batch)
        bounds.append(bounds[-1] + batch.shape[0])
    positions = np.concatenate(chunks).astype(np.int64, copy=False)
    assert positions.shape[0] == n
    return positions, merge_empty_batches(lengths[positions], np.asarray(bounds, dtype=np.int64))


def merge_empty_batches(lengths: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Fold batches of zero tokens (only zero-length samples) into the batch before them (the
    first non-empty one for leading ones), so no step is empty unless every sample is."""
    if bounds.shape[0] < 3:
        return bounds
    tokens = np.add.reduceat(lengths, bounds[:-1])
    empty = tokens == 0
    if not empty.any() or empty.all():
        return bounds
    first = int(np.argmax(~empty))
    drop = np.flatnonzero(empty)  # batch j > first merges into j - 1: drop its start bounds[j]
    drop = np.where(drop < first, drop + 1, drop)  # leading ones merge forward: drop their ends
    keep = np.ones(bounds.shape[0], dtype=bool)
    keep[drop] = False
    return bounds[keep]


def held_out_mask(sample_ids: np.ndarray, seed: int, fraction: float) -> np.ndarray:
    """True for held-out samples: splitmix64(id ^ seed) / 2^64 < fraction (stable across runs,
    datasets sizes and ranks)."""
    with np.errstate(over="ignore"):
        z = np.asarray(sample_ids, dtype=np.uint64) ^ np.uint64(seed)
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)) < fraction


@dataclass(frozen=True)
class GlobalBatch:
    """One optimizer step of one island: which samples, how long. ``step`` counts island steps.

    From a mixture (datapipe.mix.stream) `sample_ids` are unit keys and `units` says what each
    is: (source, sample id in it, first token); None from one dataset (the ids are sample ids)."""

    step: int
    epoch: int
    sample_ids: np.ndarray  # int64
    lengths: np.ndarray  # int64
    units: np.ndarray | None = None  # int64 [n, 3]

    @property
    def num_tokens(self) -> int:
        """Tokens in the batch."""
        return int(self.lengths.sum())

    def digest(self) -> bytes:
        """16-byte digest of (step, epoch, ids, lengths), for cross-rank agreement checks."""
        h = hashlib.blake2b(digest_size=16)
        h.update(np.asarray([self.step, self.epoch], dtype="<i8").tobytes())
        h.update(np.ascontiguousarray(self.sample_ids, dtype="<i8").tobytes())
        h.update(np.ascontiguousarray(self.lengths, dtype="<i8").tobytes())
        if self.units is not None:
            h.update(np.ascontiguousarray(self.units, dtype="<i8").tobytes())
        return h.digest()


@dataclass(frozen=True)
class StreamConfig:
    """The length-aware stream's settings (in a training config: `[data]`). The batch size, the
    island and the number of islands are `build()` arguments."""

    seed: int = setting(0, help="seed of the epochs' sample order", lo=0, hi=(1 << 63) - 1)
    oversize: str = setting(
        "own_step",
        help="a sample longer than a global batch: own_step (a step of its own) or error",
        choices=OVERSIZE_POLICIES,
    )
    lookahead: int = setting(
        DEFAULT_LOOKAHEAD,
        help="first-fit window of the batch fill, in samples (0: plain greedy)",
        lo=0,
        hi=1 << 20,
    )

    def build(
        self,
        lengths: np.ndarray,
        global_batch_tokens: int,
        island: int = 0,
        num_islands: int = 1,
        names: Names | None = None,
    ) -> LengthAwareStream:
        """The stream of island `island` of `num_islands` over samples of `lengths`, in global
        batches of `global_batch_tokens` tokens (per island). `names` spells the settings and the
        runtime values in errors as the caller took them."""
        return LengthAwareStream(self, lengths, global_batch_tokens, island, num_islands, names)

    def open(
        self,
        path: str,
        global_batch_tokens: int,
        cache_dir: str | None = None,
        island: int = 0,
        num_islands: int = 1,
        names: Names | None = None,
    ) -> LengthAwareStream:
        """`build()` over a dataset's lengths, read from its index (downloaded first if remote)."""
        names = names or Names()
        local, _ = resolve_dataset(path, cache_dir, names("path"))
        lengths = read_index(local).num_tokens
        if np.asarray(lengths).size == 0:
            raise ConfigError(f"{names('path')}: dataset {path!r} has no samples")
        return self.build(lengths, global_batch_tokens, island, num_islands, names)


class LengthAwareStream:
    """Endless iterator of :class:`GlobalBatch` for one island; resumable via state_dict()."""

    def __init__(
        self,
        config: StreamConfig,
        lengths: np.ndarray,
        global_batch_tokens: int,
        island: int = 0,
        num_islands: int = 1,
        names: Names | None = None,
    ) -> None:
        k = self.names = names or Names()
        check(config, k)
        for key, value, lo in (
            ("global_batch_tokens", global_batch_tokens, 1),
            ("num_islands", num_islands, 1),
        ):
            if not (isinstance(value, (int, np.integer)) and lo <= int(value) <= MAX_INT):
                raise ConfigError(
                    f"{k(key)}: must be an integer in [{lo}, {MAX_INT}], got {value!r}"
                )
        if not 0 <= int(island) < int(num_islands):
            raise ConfigError(f"{k('island')}: must be in [0, {num_islands}), got {island}")
        self.config = config
        self.lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        self.budget = int(global_batch_tokens)
        self.num_islands = int(num_islands)
        self.island = int(island)
        if self.lengths.size == 0:
            raise ConfigError("the stream has no samples")
        if config.oversize == "error":
            longest = int(self.lengths.argmax())
            if int(self.lengths[longest]) > self.budget:
                raise ConfigError(
                    f"{k('global_batch_tokens')}: {self.budget} is smaller than sample {longest} "
                    f"({int(self.lengths[longest])} tokens); raise it or set "
                    f'{k("oversize")} = "own_step"'
                )
        self._digest: str | None = None
        self._plan: tuple[int, np.ndarray, np.ndarray] | None = None
        self.epoch = 0
        self.batch_in_epoch = 0  # island-local position of the next batch in the epoch
        self.step = 0

    # --- epoch plan
    def _epoch_plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(order, boundaries) of the epoch's global batches over all islands (cached)."""
        if self._plan is None or self._plan[0] != epoch:
            order = epoch_order(self.lengths.shape[0], int(self.config.seed), epoch)
            pos, bounds = lookahead_fill(
                self.lengths[order], self.budget, int(self.config.lookahead)
            )
            order = order[pos]
            self._plan = (epoch, order, bounds)
        return self._plan[1], self._plan[2]

    def steps_in_epoch(self, epoch: int) -> int:
        """Batches each island runs in `epoch` (the same for all islands)."""
        _, bounds = self._epoch_plan(epoch)
        steps = (bounds.shape[0] - 1) // self.num_islands
        if steps == 0:
            k = self.names
            raise ConfigError(
                f"{k('num_islands')}: {self.num_islands} islands, but the dataset makes only "
                f"{bounds.shape[0] - 1} global batches of {self.budget} tokens per epoch; "
                f"lower {k('global_batch_tokens')} or the number of islands"
            )
        return steps

    def skipped_samples(self, epoch: int) -> np.ndarray:
        """Sample ids skipped in `epoch` by the island remainder policy (empty with one island)."""
        order, bounds = self._epoch_plan(epoch)
        used = self.steps_in_epoch(epoch) * self.num_islands
        return order[bounds[used] :]

    def batch(self, epoch: int, k: int, island: int | None = None) -> GlobalBatch:
        """The k-th batch of `island` (default: this stream's) in `epoch`; its step is not set."""
        isl = self.island if island is None else int(island)
        order, bounds = self._epoch_plan(epoch)
        j = k * self.num_islands + isl
        ids = order[bounds[j] : bounds[j + 1]]
        return GlobalBatch(step=-1, epoch=epoch, sample_ids=ids, lengths=self.lengths[ids])

    # --- iteration
    def __iter__(self) -> Iterator[GlobalBatch]:
        return self

    def __next__(self) -> GlobalBatch:
        while self.batch_in_epoch >= self.steps_in_epoch(self.epoch):
            self.epoch += 1
            self.batch_in_epoch = 0
        b = self.batch(self.epoch, self.batch_in_epoch)
        out = GlobalBatch(self.step, b.epoch, b.sample_ids, b.lengths)
        self.batch_in_epoch += 1
        self.step += 1
        return out

    # --- resume
    def lengths_digest(self) -> str:
        """Hex digest of the length column, to refuse resuming on a different dataset."""
        if self._digest is None:
            self._digest = hashlib.blake2b(self.lengths.tobytes(), digest_size=16).hexdigest()
        return self._digest

    def state_dict(self) -> dict[str, Any]:
        """Position of the stream plus what it depends on (plain ints and strings)."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "step": self.step,
            "seed": int(self.config.seed),
            "global_batch_tokens": self.budget,
            "lookahead": int(self.config.lookahead),
            "island": self.island,
            "num_islands": self.num_islands,
            "num_samples": int(self.lengths.shape[0]),
            "lengths_digest": self.lengths_digest(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was saved; ConfigError if it belongs to another setup."""
        if state.get("kind") == "mixture":
            raise ConfigError(
                f"stream state: saved by a run on a mixture ({self.names('sources')} or "
                f"{self.names('stages')}), this run reads one dataset ({self.names('path')})"
            )
        if state.get("version") == 1 and "lookahead" not in state:
            # saved before the look-ahead fill existed: its batches are the greedy fill's
            state = {**state, "version": STATE_VERSION, "lookahead": 0}
        mine = self.state_dict()
        for key in (
            "version",
            "seed",
            "global_batch_tokens",
            "lookahead",
            "island",
            "num_islands",
            "num_samples",
            "lengths_digest",
        ):
            if key not in state:
                raise ConfigError(f"stream state: missing key {key!r}")
            if state[key] != mine[key]:
                settable = key in ("seed", "lookahead", "global_batch_tokens", "num_islands")
                name = self.names(key)
                raise ConfigError(
                    f"stream state: {name}={state[key]!r} was saved, but this stream has "
                    f"{name}={mine[key]!r}" + (" (set it to match)" if settable else "")
                )
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
        self.step = int(state["step"])
