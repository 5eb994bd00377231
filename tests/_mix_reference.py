"""A plain-Python mixture stream written from the documented rules (datapipe/mix/stream.py,
fill.py and state.py docstrings, docs/ARCHITECTURE.md), sharing nothing with datapipe.mix but the
sources' lengths: the tests' reference for `MixtureStream`.

Rules it implements, in the words of the documentation:
- each source walks its epochs: epoch e is the permutation of its training ids drawn from
  PCG64(SeedSequence([seed, crc32(name), e])), a sample whose stored length reaches a
  `length_boost` threshold (the highest reached applies) repeated floor(f) times plus once more
  when a uniform from PCG64(SeedSequence([seed, crc32(name), e, 1])) is below frac(f);
- a unit is a whole sample, or under `max_sample_tokens` M its consecutive pieces of at most M;
- island step t is optimizer step t + 1, formed of I global batches in the stage in force at
  step t + 1 (the last stage whose start_step <= t + 1, each stage's keys overriding those before);
- a segment (counts since it began) starts at the first step, at a stage change and when a
  source runs out; its weights are the stage's, normalised over the sources not run out;
- per unit: the eligible sources have weight > 0 and are not ahead of their share
  (taken_s <= w_s * total; if none, the one most behind); if an eligible source has nothing left
  (no deferred unit, its order consumed) the first such starts its next epoch, or, past
  max_epochs, runs out (a new segment); else the eligible source whose head unit (oldest
  deferred, else next in order) finishes first, (taken_s + len) / w_s, ties to the first, gives
  its first deferred unit that fits the batch's room, else the first fitting of the next
  W - deferred units of its epoch's order (W = max(1, lookahead)), deferring those it passes;
  into an empty batch its first candidate goes whatever its size; if nothing fits (its order
  consumed: it starts its next epoch if it may, and the choice is made again) the batch closes;
  a batch also closes when its room is used up;
- at a stage change that cuts units, deferred units longer than the cut become its pieces;
- a resume with other settings applies them from the resume step: a source whose epoch index
  reached a lowered max_epochs is out from there; the segment continues only when the stage in
  force, its settings and the sources run out are all unchanged.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np

MAX_EMPTY = 100


class RanOut(Exception):
    """No source with weight is left at optimizer step `step`."""

    def __init__(self, step: int) -> None:
        super().__init__(f"ran out at step {step}")
        self.step = step


@dataclass
class Src:
    """A source: name, every sample's length, the training ids, boosts, max_epochs, weight."""

    name: str
    lengths: list[int]
    ids: list[int]
    boosts: list[tuple[int, float]] = field(default_factory=list)
    max_epochs: int = 0
    weight: float = 1.0


@dataclass
class Stg:
    """A stage: start step, weights by name, max_sample_tokens, global_batch_tokens."""

    start: int
    weights: dict[str, float] = field(default_factory=dict)
    unit: int | None = None
    budget: int | None = None


def epoch_order(src: Src, seed: int, epoch: int) -> list[int]:
    """The source's sample ids in epoch `epoch`, boosted samples repeated."""
    key = zlib.crc32(src.name.encode("utf-8"))
    ids = list(src.ids)
    if src.boosts:
        factors = []
        for i in ids:
            f = 1.0
            for t, x in sorted(src.boosts):
                if src.lengths[i] >= t:
                    f = x
            factors.append(f)
        u = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, key, epoch, 1])))
        draws = u.random(len(ids))
        rep = []
        for i, f, d in zip(ids, factors, draws):
            rep += [i] * (int(np.floor(f)) + (1 if d < f - np.floor(f) else 0))
        ids = rep
    g = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, key, epoch])))
    return [int(x) for x in g.permutation(np.array(ids, dtype=np.int64))]


class Reference:
    """The mixture's batches, island step by island step (`step()`)."""

    def __init__(
        self,
        sources: list[Src],
        stages: list[Stg],
        budget: int,
        seed: int = 0,
        lookahead: int = 64,
        islands: int = 1,
    ) -> None:
        self.sources, self.stages, self.budget = sources, stages, budget
        self.seed, self.window, self.islands = seed, max(1, lookahead), islands
        n = len(sources)
        self.epoch = [0] * n
        self.order = [epoch_order(s, seed, 0) for s in sources]
        self.pos = [0] * n  # next sample of the order
        self.off = [0] * n  # tokens of it already taken
        self.deferred: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
        self.out = [False] * n
        self.taken = [0] * n
        self.total = 0
        self.w = [0.0] * n
        self.segment: tuple | None = None
        self.t = 0
        self.keys = 0

    # --- settings
    def stage_at(self, step: int) -> tuple[int, tuple[float, ...], int, int]:
        """(index, normalised weights, unit, budget) in force at optimizer step `step`."""
        w = {s.name: s.weight for s in self.sources}
        index, unit, budget = -1, 0, self.budget
        for i, st in enumerate(self.stages):
            if st.start > step:
                break
            index = i
            w.update(st.weights)
            unit = st.unit if st.unit is not None else unit
            budget = st.budget if st.budget is not None else budget
        total = math.fsum(w[s.name] for s in self.sources)
        return index, tuple(w[s.name] / total for s in self.sources), unit, budget

    def may_refill(self, s: int) -> bool:
        m = self.sources[s].max_epochs
        return m == 0 or self.epoch[s] + 1 < m

    def new_segment(self, stage: tuple) -> None:
        live = [0.0 if o else x for x, o in zip(stage[1], self.out)]
        if sum(live) <= 0:
            raise RanOut(self.t + 1)
        self.w = [x / sum(live) for x in live]
        self.taken = [0] * len(self.sources)
        self.total = 0
        unit = stage[2]
        if unit:
            for s, units in enumerate(self.deferred):
                cut = []
                for sid, a, n in units:
                    cut += [(sid, a + k, min(unit, n - k)) for k in range(0, n, unit)]
                self.deferred[s] = cut
        self.segment = stage

    # --- supply
    def unit_len(self, s: int, pos: int, off: int) -> int:
        rest = self.sources[s].lengths[self.order[s][pos]] - off
        unit = self.segment[2]
        return min(rest, unit) if unit else rest

    def refill(self, s: int) -> None:
        for _ in range(MAX_EMPTY):
            self.epoch[s] += 1
            self.order[s] = epoch_order(self.sources[s], self.seed, self.epoch[s])
            self.pos[s] = self.off[s] = 0
            if self.order[s] or not self.may_refill(s):
                return
        raise AssertionError("boosts drew nothing")

    def consumed(self, s: int) -> bool:
        return self.pos[s] == len(self.order[s])

    def candidates(self, s: int):
        """Source s's next units of its order (within its window): (k, sid, start, len)."""
        pos, off = self.pos[s], self.off[s]
        for k in range(self.window - len(self.deferred[s])):
            if pos == len(self.order[s]):
                return
            n = self.unit_len(s, pos, off)
            yield k, self.order[s][pos], off, n
            off += n
            if off >= self.sources[s].lengths[self.order[s][pos]]:
                pos, off = pos + 1, 0

    def advance(self, s: int, k: int) -> tuple[int, int, int]:
        """Take the k-th unit ahead, deferring the k before it."""
        for j in range(k + 1):
            sid, off = self.order[s][self.pos[s]], self.off[s]
            n = self.unit_len(s, self.pos[s], off)
            if j < k:
                self.deferred[s].append((sid, off, n))
            if off + n >= self.sources[s].lengths[sid]:
                self.pos[s], self.off[s] = self.pos[s] + 1, 0
            else:
                self.off[s] = off + n
        return sid, off, n

    # --- the fill
    def choose(self, room: int, empty: bool):
        """(source, unit) to take, or None: the batch closes."""
        while True:
            active = [s for s in range(len(self.w)) if self.w[s] > 0]
            elig = [s for s in active if self.w[s] * self.total - self.taken[s] >= 0]
            if not elig:
                elig = [max(active, key=lambda s: (self.w[s] * self.total - self.taken[s], -s))]
            dry = [s for s in elig if not self.deferred[s] and self.consumed(s)]
            if dry:
                s = dry[0]
                if self.may_refill(s):
                    self.refill(s)
                else:
                    self.out[s] = True
                    self.new_segment(self.segment)
                continue

            def tag(s: int) -> float:
                d = self.deferred[s]
                head = d[0][2] if d else self.unit_len(s, self.pos[s], self.off[s])
                return (self.taken[s] + head) / self.w[s]

            best = min(elig, key=lambda s: (tag(s), s))
            for i, unit in enumerate(self.deferred[best]):
                if empty or unit[2] <= room:
                    return best, self.deferred[best].pop(i)
            if self.consumed(best):
                if self.may_refill(best):
                    self.refill(best)
                    continue
                return None
            for k, _, _, n in self.candidates(best):
                if empty or n <= room:
                    return best, self.advance(best, k)
            return None

    def step(self) -> list[list[tuple[int, int, int, int]]]:
        """The next island step's global batches: units (source, sample, start, length)."""
        stage = self.stage_at(self.t + 1)
        if stage != self.segment:
            self.new_segment(stage)
        batches = []
        for _ in range(self.islands):
            units: list[tuple[int, int, int, int]] = []
            room = stage[3]
            while True:
                got = self.choose(room, not units)
                if got is None:
                    break
                s, (sid, a, n) = got
                units.append((s, sid, a, n))
                self.taken[s] += n
                self.total += n
                room -= n
                if room <= 0:
                    break
            batches.append(units)
        self.t += 1
        return batches

    def batch_epoch(self) -> int:
        """The epoch a batch reports: the lowest of the sources not run out."""
        live = [e for e, o in zip(self.epoch, self.out) if not o]
        return min(live) if live else max(self.epoch)

    # --- a resume with other settings
    def resume_with(self, sources: list[Src], stages: list[Stg], budget: int) -> None:
        """Continue from here with other weights, max_epochs, stages or budget."""
        was_out = list(self.out)
        self.sources, self.stages, self.budget = sources, stages, budget
        for s, src in enumerate(sources):
            m = src.max_epochs
            self.out[s] = (was_out[s] and not self.may_refill(s)) or (m > 0 and self.epoch[s] >= m)
        now, seg = self.stage_at(self.t + 1), self.segment
        same = seg is not None and now[::2] == seg[::2] and now[3] == seg[3]
        same = same and all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(now[1], seg[1]))
        if not same or self.out != was_out:  # weights scaled by one factor: the same mixture
            self.segment = None
