"""StepPlan: who computes which tokens with which peers in one step (the contract between the
data layer and the trainer, docs/ARCHITECTURE.md "The StepPlan").

A plan is flat numpy arrays with offsets. Micro-batches are rows of a table in slot order (the slot of
a micro-batch is its row number, a total order over all micro-batches); each row has a group (ranks in
group_index order), a capacity (positions each member may compute), an offload ratio, and pieces
``(sample, start, end)`` shared by the whole group: every piece of a group micro-batch is split zigzag
over the group (member p computes chunks p and 2k-1-p of the piece's range), a local micro-batch
(group of one) computes its pieces whole.

Also here: JSON serialisation, a short digest for the per-step agreement check and the slot-order
replay that estimates each rank's finish time (numba). The invariants are checked by
:func:`datapipe.plan.check.check_plan`, a plain-Python reference that shares no code with the
planners.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from datapipe.jit import njit

PLAN_SCHEMA = "mixlen-plan/1"

_ARRAYS: dict[str, Any] = {
    "sample_ids": np.int64,
    "lengths": np.int64,
    "mb_group_offsets": np.int64,
    "group_ranks": np.int32,
    "mb_capacity": np.int64,
    "mb_offload": np.float64,
    "mb_piece_offsets": np.int64,
    "piece_item": np.int64,
    "piece_start": np.int64,
    "piece_end": np.int64,
    "mb_time_ns": np.int64,
    "rank_time_ns": np.int64,
}
_SCALARS = ("policy", "num_ranks", "capacity", "cost_hash", "seed", "makespan_ns", "lower_bound_ns")


@dataclass(frozen=True)
class PlannedMicroBatch:
    """One rank's view of one micro-batch: what the trainer runs."""

    slot: int
    group: tuple[int, ...]
    group_index: int
    capacity: int
    offload_ratio: float
    pieces: tuple[tuple[int, int, int], ...]  # this rank's (sample_id, start, end), non-empty
    group_pieces: tuple[tuple[int, int, int], ...]  # the group's (sample_id, start, end) ranges


@dataclass(eq=False)
class StepPlan:
    """One step's plan; rows of the micro-batch table are in slot order."""

    policy: str
    num_ranks: int
    capacity: int
    cost_hash: str
    seed: int
    sample_ids: np.ndarray  # int64 [n]
    lengths: np.ndarray  # int64 [n]
    mb_group_offsets: np.ndarray  # int64 [M+1]
    group_ranks: np.ndarray  # int32 [sum of group sizes]
    mb_capacity: np.ndarray  # int64 [M]
    mb_offload: np.ndarray  # float64 [M]
    mb_piece_offsets: np.ndarray  # int64 [M+1]
    piece_item: np.ndarray  # int64 [P]: position in samples
    piece_start: np.ndarray  # int64 [P]
    piece_end: np.ndarray  # int64 [P]
    mb_time_ns: np.ndarray  # int64 [M]: estimated time of one member
    rank_time_ns: np.ndarray  # int64 [N]: estimated finish time (slot-order replay)
    makespan_ns: int
    lower_bound_ns: int
    meta: dict = field(default_factory=dict)  # reports only (not in digest)

    # --- sizes -----------------------------------------------------------------------------------
    @property
    def num_microbatches(self) -> int:
        return int(self.mb_capacity.shape[0])

    @property
    def group_sizes(self) -> np.ndarray:
        return np.diff(self.mb_group_offsets)

    # --- per-rank view ---------------------------------------------------------------------------
    @cached_property
    def _rank_index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rank_offsets [N+1], mb of each membership, group_index of each), by rank then slot."""
        k = self.group_sizes
        mb = np.repeat(np.arange(self.num_microbatches, dtype=np.int64), k)
        gidx = np.arange(self.group_ranks.shape[0], dtype=np.int64) - np.repeat(
            self.mb_group_offsets[:-1], k
        )
        order = np.lexsort((mb, self.group_ranks))
        counts = np.bincount(self.group_ranks, minlength=self.num_ranks)
        offsets = np.zeros(self.num_ranks + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return offsets, mb[order], gidx[order]

    def rank_slots(self, rank: int) -> np.ndarray:
        """Slots (micro-batch rows) of one rank, increasing."""
        off, mbs, _ = self._rank_index
        return mbs[off[rank] : off[rank + 1]]

    def microbatch_counts(self) -> np.ndarray:
        """Number of micro-batches each rank runs."""
        return np.diff(self._rank_index[0])

    def microbatches(self, rank: int) -> list[PlannedMicroBatch]:
        """Rank `rank`'s micro-batches in run order, with its own zigzag pieces."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} outside 0..{self.num_ranks - 1}")
        off, mbs, gidxs = self._rank_index
        out = []
        for j in range(off[rank], off[rank + 1]):
            m, p = int(mbs[j]), int(gidxs[j])
            group = tuple(
                int(x)
                for x in self.group_ranks[self.mb_group_offsets[m] : self.mb_group_offsets[m + 1]]
            )
            k = len(group)
            gp, mine = [], []
            for q in range(self.mb_piece_offsets[m], self.mb_piece_offsets[m + 1]):
                sid = int(self.sample_ids[self.piece_item[q]])
                s, e = int(self.piece_start[q]), int(self.piece_end[q])
                gp.append((sid, s, e))
                if k == 1:
                    if e > s:
                        mine.append((sid, s, e))
                    continue
                base, extra = divmod(e - s, 2 * k)
                for c in (p, 2 * k - 1 - p):
                    c0 = s + c * base + min(c, extra)
                    c1 = c0 + base + (1 if c < extra else 0)
                    if c1 > c0:
                        mine.append((sid, c0, c1))
            out.append(
                PlannedMicroBatch(
                    slot=m,
                    group=group,
                    group_index=p,
                    capacity=int(self.mb_capacity[m]),
                    offload_ratio=float(self.mb_offload[m]),
                    pieces=tuple(mine),
                    group_pieces=tuple(gp),
                )
            )
        return out

    @property
    def label(self) -> str:
        """Report name of the plan's policy: hdp, hdp+offload, hdp+widen, hdp+offload+widen, ..."""
        return (
            self.policy
            + ("+offload" if self.meta.get("offload") else "")
            + ("+widen" if self.meta.get("widen") else "")
        )

    # --- digest and serialisation ----------------------------------------------------------------
    def digest(self) -> bytes:
        """16-byte digest of everything that decides execution (not timings or meta)."""
        h = hashlib.sha256()
        head = [self.policy, self.num_ranks, self.capacity, self.cost_hash, self.seed]
        h.update(json.dumps(head).encode())
        for name in (
            "sample_ids",
            "lengths",
            "mb_group_offsets",
            "group_ranks",
            "mb_capacity",
            "mb_offload",
            "mb_piece_offsets",
            "piece_item",
            "piece_start",
            "piece_end",
        ):
            a = np.ascontiguousarray(
                getattr(self, name), dtype=np.dtype(_ARRAYS[name]).newbyteorder("<")
            )
            h.update(name.encode())
            h.update(np.int64(a.size).tobytes())
            h.update(a.tobytes())
        return h.digest()[:16]

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"schema": PLAN_SCHEMA}
        for k in _SCALARS:
            v = getattr(self, k)
            d[k] = v if isinstance(v, str) else int(v)
        for k in _ARRAYS:
            d[k] = getattr(self, k).tolist()
        d["meta"] = self.meta
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> StepPlan:
        if d.get("schema") != PLAN_SCHEMA:
            raise ValueError(f"not a {PLAN_SCHEMA} plan: schema {d.get('schema')!r}")
        kw: dict[str, Any] = {k: d[k] for k in _SCALARS}
        for k, dt in _ARRAYS.items():
            kw[k] = np.asarray(d[k], dtype=dt).reshape(-1)
        kw["meta"] = d.get("meta", {})
        return cls(**kw)

    @classmethod
    def from_json(cls, s: str) -> StepPlan:
        return cls.from_dict(json.loads(s))

    def dump_step(self) -> dict:
        """The `mixlen plan --dump` form of this step (docs/PLAN.md): per-rank micro-batch lists."""
        ranks = []
        for r in range(self.num_ranks):
            mbs = [
                {
                    "slot": mb.slot,
                    "group": list(mb.group),
                    "group_index": mb.group_index,
                    "capacity": mb.capacity,
                    "offload_ratio": mb.offload_ratio,
                    "pieces": [list(p) for p in mb.pieces],
                }
                for mb in self.microbatches(r)
            ]
            ranks.append(
                {"rank": r, "est_time_s": int(self.rank_time_ns[r]) / 1e9, "microbatches": mbs}
            )
        return {
            "policy": self.policy,
            "widen": bool(self.meta.get("widen", False)),
            "num_ranks": self.num_ranks,
            "capacity": self.capacity,
            "cost_hash": self.cost_hash,
            "digest": self.digest().hex(),
            "makespan_s": self.makespan_ns / 1e9,
            "lower_bound_s": self.lower_bound_ns / 1e9,
            "samples": [[int(s), int(n)] for s, n in zip(self.sample_ids, self.lengths)],
            "ranks": ranks,
        }


# --- slot-order replay ----------------------------------------------------------------------------
@njit(cache=True)
def replay_timeline_kernel(
    mb_group_offsets: np.ndarray, group_ranks: np.ndarray, mb_time: np.ndarray, num_ranks: int
) -> tuple[np.ndarray, np.ndarray]:
    """(finish time of every rank, start time of every micro-batch) when micro-batches run in
    slot order and a group waits for its slowest member (blocking rendezvous)."""
    finish = np.zeros(num_ranks, dtype=np.int64)
    starts = np.zeros(mb_time.shape[0], dtype=np.int64)
    for m in range(mb_time.shape[0]):
        lo, hi = mb_group_offsets[m], mb_group_offsets[m + 1]
        start = np.int64(0)
        for j in range(lo, hi):
            if finish[group_ranks[j]] > start:
                start = finish[group_ranks[j]]
        starts[m] = start
        for j in range(lo, hi):
            finish[group_ranks[j]] = start + mb_time[m]
    return finish, starts


@njit(cache=True)
def replay_kernel(
    mb_group_offsets: np.ndarray, group_ranks: np.ndarray, mb_time: np.ndarray, num_ranks: int
) -> np.ndarray:
    """Finish time of every rank in the slot-order replay (replay_timeline_kernel)."""
    return replay_timeline_kernel(mb_group_offsets, group_ranks, mb_time, num_ranks)[0]


def replay(plan: StepPlan) -> np.ndarray:
    """Each rank's estimated finish time (int64 ns) from the slot-order replay."""
    return replay_kernel(
        plan.mb_group_offsets.astype(np.int64),
        plan.group_ranks.astype(np.int64),
        plan.mb_time_ns.astype(np.int64),
        int(plan.num_ranks),
    )


def replay_starts(plan: StepPlan) -> np.ndarray:
    """Each micro-batch's estimated start time (int64 ns) in the slot-order replay (reports)."""
    return replay_timeline_kernel(
        plan.mb_group_offsets.astype(np.int64),
        plan.group_ranks.astype(np.int64),
        plan.mb_time_ns.astype(np.int64),
        int(plan.num_ranks),
    )[1]
