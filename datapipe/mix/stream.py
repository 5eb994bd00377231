"""The mixture stream: global batches drawn from several datasets by token weight, in stages,
from their indexes alone (numpy + numba; no torch, no token reads).

- Each source walks its own epochs: epoch e is a permutation of its training samples drawn from
  ``SeedSequence([seed, crc32(name), e])``, in which a sample boosted by `length_boost` (factor f)
  appears floor(f) times, plus once more when a uniform drawn from
  ``SeedSequence([seed, crc32(name), e, 1])`` is below frac(f). The boosts may add at most
  `MAX_BOOST_DRAWS` draws to an epoch (its order is held in memory). A source that reaches the
  end of its order starts its next epoch on its own; after `max_epochs` passes (and its
  deferred units), when it is next eligible for a unit, its weight is shared out among the
  others from that unit on (logged once); when no source with weight is left the stream ends
  (`DataExhausted`; `check_supply` finds that step before training).
- Which source the next unit comes from and which batch it joins: datapipe.mix.fill.
- Island step t (0-based) is optimizer step t + 1 and is formed of global batches
  t*I .. t*I + I - 1 (I islands; island i takes batch t*I + i), all in the stage in force at
  step t + 1. A stage change or a source running out starts a new *segment*: the token counts
  the shares are kept against restart there.
- Zero-length samples carry no tokens and are left out of a mixture.

Every process computes the same batches from (indexes, settings); `state_dict` holds each
source's epoch, cursor, deferred units and counts, and the stage, so a resume (on any number of
ranks) continues with the same batches.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from datapipe.errors import ConfigError, MixlenError
from datapipe.mix.config import SourceConfig, Stage, StageConfig, stage_at
from datapipe.mix.fill import (
    DONE,
    EXHAUSTED,
    FULL,
    NUM_ST,
    REFILL,
    ST_BATCHES,
    ST_OPEN,
    ST_TOTAL,
    ST_UNITS,
    fill_kernel,
)
from datapipe.mix.state import check_state, load_state, state_of
from datapipe.settings import Names, check
from datapipe.stream import GlobalBatch, StreamConfig

__all__ = [
    "DataExhausted",
    "MAX_BOOST_DRAWS",
    "MixSource",
    "MixtureStream",
    "source_epoch_order",
]

MAX_EMPTY_EPOCHS = 100  # epochs in a row without a unit (boosts < 1) before giving up
MAX_BOOST_DRAWS = 1 << 24  # draws `length_boost` may add to an epoch of a source (8 bytes each)


class DataExhausted(MixlenError):
    """Every source with weight reached its `max_epochs`."""


@dataclass(frozen=True)
class MixSource:
    """One source as the stream sees it: its name, every sample's length (by sample id), the ids
    it trains on, its (threshold, factor) boosts and its epoch limit (0: none)."""

    name: str
    lengths: np.ndarray  # int64, by sample id
    ids: np.ndarray  # int64, the training samples (held-out ones and empty ones left out)
    boosts: tuple[tuple[int, float], ...] = ()
    max_epochs: int = 0
    key: str = ""  # its key in errors (`data.sources[1]`, `data.path`; default from the index)
    fingerprint: str = ""  # its dataset's (datapipe.index.dataset_fingerprint)

    @functools.cached_property
    def digest(self) -> str:
        """Of the training samples' ids and lengths (computed once)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(np.ascontiguousarray(self.ids, "<i8").tobytes())
        h.update(np.ascontiguousarray(self.lengths[self.ids], "<i8").tobytes())
        return h.hexdigest()

    def repeats(self) -> np.ndarray:
        """Each training sample's factor (1.0 unless boosted)."""
        f = np.ones(self.ids.shape[0])
        lens = self.lengths[self.ids]
        for threshold, factor in self.boosts:  # increasing: the highest reached wins
            f[lens >= threshold] = factor
        return f


def source_key(name: str) -> int:
    """The source's seed component (its name's CRC-32: independent of the sources' order)."""
    return zlib.crc32(name.encode("utf-8"))


def source_epoch_order(src: MixSource, seed: int, epoch: int) -> np.ndarray:
    """Source `src`'s sample ids in epoch `epoch` (boosted samples repeated), int64."""
    key = source_key(src.name)
    ids = src.ids
    if src.boosts:
        f = src.repeats()
        whole = np.floor(f)
        u = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, key, epoch, 1])))
        reps = whole.astype(np.int64) + (u.random(ids.shape[0]) < f - whole)
        ids = np.repeat(ids, reps)
    gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, key, epoch])))
    return gen.permutation(ids).astype(np.int64, copy=False)


class MixtureStream:
    """Endless iterator of :class:`GlobalBatch` of one island over a mixture; resumable.

    A batch's `sample_ids` are unit keys (a counter over every unit the stream formed, all
    islands: unique in the run); `units` says what each is: (source, sample id, first token)."""

    def __init__(
        self,
        config: StreamConfig,
        sources: list[MixSource],
        source_configs: list[SourceConfig],
        stages: list[StageConfig],
        global_batch_tokens: int,
        island: int = 0,
        num_islands: int = 1,
        names: Names | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        k = self.names = names or Names()
        check(config, k)
        if not 0 <= int(island) < int(num_islands):
            raise ConfigError(f"{k('island')}: must be in [0, {num_islands}), got {island}")
        self.config, self.sources = config, sources
        self.source_configs, self.stage_configs = source_configs, stages
        self.base_budget = int(global_batch_tokens)
        self.island, self.num_islands = int(island), int(num_islands)
        self.log = log or logging.getLogger("mixlen").info
        self.source_names = tuple(s.name for s in sources)
        self.from_path = len(sources) == 1 and sources[0].key == k("path")  # data.path + stages
        for i, (s, src) in enumerate(zip(source_configs, sources)):
            if src.ids.shape[0] == 0:
                raise ConfigError(
                    f"{self.source_key(i)}: source {src.name!r} ({s.path}) has no samples to "
                    "train on"
                )
        self._check_oversize()
        self._check_boosts()
        # kernel state
        num, w = len(sources), max(1, int(config.lookahead))
        self.window = w
        self.lengths = np.concatenate([s.lengths for s in sources]).astype(np.int64)
        self.len_off = np.zeros(num, np.int64)
        self.len_off[1:] = np.cumsum([s.lengths.shape[0] for s in sources])[:-1]
        self.epoch = np.zeros(num, np.int64)
        self.orders = [source_epoch_order(s, int(config.seed), 0) for s in sources]
        self.cur_rel = np.zeros(num, np.int64)
        self.cur_off = np.zeros(num, np.int64)
        self.dsid = np.zeros((num, w), np.int64)
        self.doff = np.zeros((num, w), np.int64)
        self.dlen = np.zeros((num, w), np.int64)
        self.ndef = np.zeros(num, np.int64)
        self.taken = np.zeros(num, np.int64)
        self.exhausted = np.zeros(num, np.bool_)
        self.st = np.zeros(NUM_ST, np.int64)
        self.out = np.zeros((4096, 4), np.int64)
        self.step = 0  # island steps formed
        self.units = 0  # units formed, all islands
        self.stage: Stage | None = None
        self.weights = np.zeros(num)  # the segment's weights (normalised over live sources)
        self._digest: str | None = None
        self._pack_orders()

    def source_key(self, s: int) -> str:
        """How the user wrote source s: `data.sources[1]`, or `data.path` for a one-source run."""
        return self.sources[s].key or f"{self.names('sources')}[{s}]"

    # --- settings in force
    def stage_at(self, step: int) -> Stage:
        """The stage in force at optimizer step `step` (1-based)."""
        return stage_at(
            step,
            self.source_configs,
            list(self.source_names),
            self.stage_configs,
            self.base_budget,
        )

    def _check_oversize(self) -> None:
        """With `oversize = "error"`, every stage's longest unit must fit its batch."""
        if self.config.oversize != "error":
            return
        k = self.names
        steps = [1] + [st.start_step for st in self.stage_configs]
        for step in steps:
            stage = self.stage_at(step)
            for src, w in zip(self.sources, stage.weights):
                if w <= 0:
                    continue
                longest = int(src.lengths[src.ids].max())
                unit = min(longest, stage.max_sample_tokens or longest)
                if unit > stage.global_batch_tokens:
                    where = "" if stage.index < 0 else f" in {k('stages')}[{stage.index}]"
                    raise ConfigError(
                        f"{k('global_batch_tokens')}: {stage.global_batch_tokens}{where} is "
                        f"smaller than a {unit}-token unit of source {src.name!r}; raise it, set "
                        f'max_sample_tokens, or set {k("oversize")} = "own_step"'
                    )

    def _check_boosts(self) -> None:
        """An epoch's order is held in memory: boosts may add at most MAX_BOOST_DRAWS draws."""
        for i, src in enumerate(self.sources):
            n = int(src.ids.shape[0])
            extra = int(np.ceil(src.repeats()).sum()) - n if src.boosts else 0
            if extra > MAX_BOOST_DRAWS:
                raise ConfigError(
                    f"{self.source_key(i)}.length_boost: an epoch of source {src.name!r} would "
                    f"draw up to {n + extra:,} samples ({n:,} samples, {extra:,} more from its "
                    f"factors); the boosts may add at most {MAX_BOOST_DRAWS:,} draws to an "
                    "epoch (its order is held in memory): lower the factors or raise the "
                    "thresholds"
                )

    def longest_unit(self) -> int:
        """The longest unit any stage can form (what every plan must hold)."""
        longest = 0
        for step in [1] + [st.start_step for st in self.stage_configs]:
            stage = self.stage_at(step)
            for src in self.sources:
                n = int(src.lengths[src.ids].max())
                longest = max(longest, min(n, stage.max_sample_tokens or n))
        return longest

    # --- kernel plumbing
    def _pack_orders(self) -> None:
        """One buffer of every source's current order (the kernel's `order`)."""
        sizes = np.array([o.shape[0] for o in self.orders], np.int64)
        self.ord_lo = np.zeros(len(self.orders), np.int64)
        self.ord_lo[1:] = np.cumsum(sizes)[:-1]
        self.ord_hi = self.ord_lo + sizes
        self.order = np.concatenate(self.orders) if self.orders else np.zeros(0, np.int64)

    def _refillable(self) -> np.ndarray:
        limit = np.array([s.max_epochs for s in self.sources], np.int64)
        return (limit == 0) | (self.epoch + 1 < limit)

    def _segment(self, stage: Stage) -> None:
        """Start a segment: the stage's weights over the sources still live, counts reset."""
        w = np.array(stage.weights) * ~self.exhausted
        if not w.sum() > 0:
            raise DataExhausted(self._exhausted_message(stage))
        self.weights = w / w.sum()
        self.taken[:] = 0
        self.st[ST_TOTAL] = 0
        if stage.max_sample_tokens:
            self._split_deferred(stage.max_sample_tokens)
        self.stage = stage

    def _exhausted_message(self, stage: Stage) -> str:
        """Why the stream ends at the step being formed: every source with weight in `stage`
        finished its passes."""
        k = self.names
        where = "the first stage" if stage.index < 0 else f"{k('stages')}[{stage.index}]"
        done = [
            f"{src.name} ({self.source_key(s)}.max_epochs = {src.max_epochs})"
            for s, (src, w) in enumerate(zip(self.sources, stage.weights))
            if w > 0
        ]
        return (
            f"data: the mixture runs out of data at step {self.step + 1}: every source with "
            f"weight in {where} finished its passes ({', '.join(done)}); raise max_epochs, give "
            f"weight to a source without it, or lower {k('steps')} to at most {self.step}"
        )

    def check_supply(self, last_step: int) -> None:
        """DataExhausted, from the indexes alone and before any step is trained, when this
        stream (from its current state) runs out before forming step `last_step`."""
        if self.step >= last_step or not any(src.max_epochs for src in self.sources):
            return
        probe = MixtureStream(
            self.config, self.sources, self.source_configs, self.stage_configs,
            self.base_budget, self.island, self.num_islands, self.names, log=lambda _: None,
        )  # fmt: skip
        probe.load_state_dict(self.state_dict())
        try:
            while probe.step < last_step:
                next(probe)
        except DataExhausted as exc:
            raise DataExhausted(
                f"{exc} (found from the indexes before step {self.step + 1} was trained)"
            ) from None

    def _split_deferred(self, unit: int) -> None:
        """Deferred units longer than a new stage's `unit` become consecutive pieces of it."""
        per = []
        for s in range(len(self.sources)):
            rows = []
            for i in range(int(self.ndef[s])):
                sid, off, n = int(self.dsid[s, i]), int(self.doff[s, i]), int(self.dlen[s, i])
                rows += [(sid, off + a, min(unit, n - a)) for a in range(0, n, unit)] or [
                    (sid, off, n)
                ]
            per.append(rows)
        for s, rows in enumerate(per):
            self.set_deferred(s, np.asarray(rows, np.int64).reshape(-1, 3))

    def _refill(self, s: int) -> None:
        """Source s's next epoch (skipping epochs its boosts below 1 left empty)."""
        src = self.sources[s]
        for _ in range(MAX_EMPTY_EPOCHS):
            self.epoch[s] += 1
            self.restart_order(s)
            if self.orders[s].size or not self._refillable()[s]:
                return
        raise ConfigError(
            f"{self.source_key(s)}.length_boost: {MAX_EMPTY_EPOCHS} epochs of source "
            f"{src.name!r} in a row drew no sample (factors below 1: {list(src.boosts)}); raise "
            "them"
        )

    def restart_order(self, s: int) -> None:
        """Source s at the start of its epoch `self.epoch[s]`."""
        self.orders[s] = source_epoch_order(
            self.sources[s], int(self.config.seed), int(self.epoch[s])
        )
        self.cur_rel[s] = 0
        self.cur_off[s] = 0
        self._pack_orders()

    def set_deferred(self, s: int, rows: np.ndarray) -> None:
        """Source s's deferred units: rows of (sample, start, length), oldest first."""
        if rows.shape[0] > self.dsid.shape[1]:
            grow = rows.shape[0] - self.dsid.shape[1]
            self.dsid, self.doff, self.dlen = (
                np.pad(x, ((0, 0), (0, grow))) for x in (self.dsid, self.doff, self.dlen)
            )
        self.ndef[s] = rows.shape[0]
        for arr, col in zip((self.dsid, self.doff, self.dlen), rows.T):
            arr[s, : rows.shape[0]] = col

    def refillable_now(self) -> np.ndarray:
        """Which sources may start another epoch (their max_epochs allows it)."""
        return self._refillable()

    def _round(self) -> tuple[np.ndarray, np.ndarray]:
        """The next island step's I global batches: (units [n, 4], bounds [I + 1])."""
        stage = self.stage_at(self.step + 1)
        if stage != self.stage:
            self._segment(stage)
        n = self.num_islands
        bounds = np.zeros(n + 1, np.int64)
        self.st[ST_BATCHES] = 0
        self.st[ST_UNITS] = 0
        self.st[ST_OPEN] = 0
        cur = self.ord_lo + self.cur_rel
        while True:
            status, which = fill_kernel(
                self.lengths, self.len_off, self.order, self.ord_hi, cur, self.cur_off,
                self._refillable(), self.dsid, self.doff, self.dlen, self.ndef, self.taken,
                self.weights, stage.global_batch_tokens, stage.max_sample_tokens, self.window, n,
                self.out, bounds, self.st,
            )  # fmt: skip
            self.cur_rel = cur - self.ord_lo
            if status == DONE:
                break
            if status == FULL:
                self.out = np.concatenate([self.out, np.zeros_like(self.out)])
            elif status == REFILL:
                self._refill(which)
            elif status == EXHAUSTED:
                self.exhausted[which] = True
                m = self.sources[which].max_epochs
                self.log(
                    f"data: source {self.source_names[which]!r} finished its {m} "
                    f"pass{'es' if m > 1 else ''} (max_epochs) at step {self.step + 1}; its "
                    "share goes to the other sources"
                )
                self._segment(stage)
            cur = self.ord_lo + self.cur_rel
        units = self.out[: self.st[ST_UNITS]].copy()
        return units, bounds

    # --- iteration
    def __iter__(self) -> Iterator[GlobalBatch]:
        return self

    def __next__(self) -> GlobalBatch:
        units, bounds = self._round()
        a, b = int(bounds[self.island]), int(bounds[self.island + 1])
        live = self.epoch[~self.exhausted]
        batch = GlobalBatch(
            step=self.step,
            epoch=int(live.min()) if live.size else int(self.epoch.max()),
            sample_ids=np.arange(self.units + a, self.units + b, dtype=np.int64),
            lengths=units[a:b, 3].copy(),
            units=units[a:b, :3].copy(),
        )
        self.units += int(bounds[-1])
        self.step += 1
        return batch

    def tokens_by_source(self, batch: GlobalBatch) -> dict[str, int]:
        """Tokens of each source in `batch` (every source named)."""
        assert batch.units is not None
        t = np.bincount(batch.units[:, 0], weights=batch.lengths, minlength=len(self.sources))
        return {n: int(x) for n, x in zip(self.source_names, t)}

    def tokens_above(self, batch: GlobalBatch) -> dict[str, dict[int, int]]:
        """Of each boosted source's tokens in `batch`, those from samples at or above each of its
        `length_boost` thresholds (the sample's stored length, whatever piece was taken)."""
        assert batch.units is not None
        out: dict[str, dict[int, int]] = {}
        for s, src in enumerate(self.sources):
            if not src.boosts:
                continue
            mine = batch.units[:, 0] == s
            whole, n = src.lengths[batch.units[mine, 1]], batch.lengths[mine]
            out[src.name] = {t: int(n[whole >= t].sum()) for t, _ in src.boosts}
        return out

    # --- resume
    def lengths_digest(self) -> str:
        """Of every source's name and training samples (a resume must see the same data)."""
        if self._digest is None:
            h = hashlib.blake2b(digest_size=16)
            for src in self.sources:
                h.update(src.name.encode() + b"\0" + src.digest.encode())
            self._digest = h.hexdigest()
        return self._digest

    def state_dict(self) -> dict[str, Any]:
        """Each source's epoch, cursor, deferred units and counts, the stage and the step
        (datapipe.mix.state)."""
        return state_of(self)

    def check_state(self, state: dict[str, Any], allow_other_dataset: bool = False) -> None:
        """ConfigError naming the key if `state` belongs to another mixture."""
        check_state(self, state, allow_other_dataset)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was saved (the stages in force from here on are this
        config's); ConfigError if it belongs to another mixture."""
        load_state(self, state)
