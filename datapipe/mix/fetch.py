"""A mixture's fetch: one reader per source, pieces of units read as token ranges.

Two kinds of piece arrays go in:
- ``[P, 3]`` ``(sample, a, b)`` in the mixture's *global* sample ids (source s's sample i is
  ``offsets[s] + i``): whole samples, as the held-out sets use them;
- ``[P, 7]`` ``(key, a, b, source, sample, start, length)``: positions a..b-1 of a unit of
  `length` tokens that begins `start` tokens into a sample (the training batches; made by
  `unit_pieces`). The unit is a sample of its own: positions from 0, its last position
  unlabelled, whatever follows it in the document.

A source with a loss mask brings its trained tokens with its tokens (datapipe.fetch); in a
mixture with one, the other sources' tokens are all trained.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from datapipe.fetch import Fetcher, PackedMicroBatch, Prefetcher, as_pieces, pack_pieces
from datapipe.stream import GlobalBatch

__all__ = ["MixtureFetcher", "unit_pieces"]


def unit_pieces(plan: Any, batch: GlobalBatch, rank: int) -> list[np.ndarray]:
    """`rank`'s pieces of a mixture batch's plan, per micro-batch in slot order, as [P, 7]
    arrays (module docstring)."""
    assert batch.units is not None
    key0 = int(batch.sample_ids[0]) if batch.sample_ids.size else 0
    out = []
    for m in plan.microbatches(rank):
        p = as_pieces(m.pieces)
        row = p[:, 0] - key0
        out.append(np.concatenate([p, batch.units[row], batch.lengths[row, None]], axis=1))
    return out


class MixtureFetcher:
    """Reads units and samples of several sources (their Fetchers); the Fetcher interface
    (`fetch_step`, `prefetch`, `lengths` in global ids, `index` of the first source)."""

    def __init__(self, fetchers: Sequence[Fetcher]) -> None:
        self.fetchers = list(fetchers)
        sizes = np.array([len(f.lengths) for f in self.fetchers], np.int64)
        self.offsets = np.zeros(len(sizes) + 1, np.int64)
        np.cumsum(sizes, out=self.offsets[1:])
        self.lengths = np.concatenate([f.lengths for f in self.fetchers]).astype(np.int64)
        self.index = self.fetchers[0].index
        self.config = self.fetchers[0].config

    def to_units(self, pieces: np.ndarray) -> np.ndarray:
        """[P, 3] global-id pieces as [P, 7] unit pieces (a whole sample is a unit)."""
        g = pieces[:, 0]
        src = np.searchsorted(self.offsets, g, side="right") - 1
        sid = g - self.offsets[src]
        zero = np.zeros_like(g)
        return np.stack([g, pieces[:, 1], pieces[:, 2], src, sid, zero, self.lengths[g]], axis=1)

    def fetch_step(self, microbatches: Sequence[Any]) -> list[PackedMicroBatch]:
        """Micro-batches for a list of piece arrays ([P, 3] or [P, 7] each)."""
        plist = []
        for p in microbatches:
            arr = np.asarray(p, np.int64)
            if arr.size == 0:
                arr = np.zeros((0, 7), np.int64)
            elif arr.shape[1] == 3:
                arr = self.to_units(arr)
            plist.append(arr)
        allp = np.concatenate(plist) if plist else np.zeros((0, 7), np.int64)
        a, b, src, sid, start, n = (allp[:, i] for i in range(1, 7))
        bad = (a < 0) | (b <= a) | (b > n) | (src < 0) | (src >= len(self.fetchers))
        if bad.any():
            raise ValueError(f"piece {allp[bad][0].tolist()}: outside its unit")
        lo, hi = start + a, start + np.minimum(b + 1, n)  # the labels' extra token, inside the unit
        # each source's ranges, read once; their tokens side by side in one array
        parts: list[np.ndarray] = []
        masks: list[np.ndarray | None] = []
        span = np.zeros(len(allp), np.int64)
        base = 0
        sources = np.unique(src)
        for s in sources:
            f = self.fetchers[int(s)]
            idx = np.flatnonzero(src == s)
            f._check(np.stack([sid[idx], lo[idx], hi[idx]], axis=1))
            flat, where, trained = f.read_ranges(sid[idx], lo[idx], hi[idx])
            parts.append(flat)
            masks.append(trained)
            span[idx] = where + base
            base += flat.shape[0]
        dtype = np.result_type(*[p.dtype for p in parts]) if parts else np.uint16
        flat = (
            np.concatenate([p.astype(dtype, copy=False) for p in parts])
            if parts
            else np.zeros(0, dtype)
        )
        trained = None
        if any(m is not None for m in masks):
            trained = np.concatenate(
                [np.ones(p.shape[0], np.uint8) if m is None else m for p, m in zip(parts, masks)]
            )
        counts = np.zeros(len(allp), np.int64)
        out, p0 = [], 0
        for p in plist:
            p1 = p0 + len(p)
            part = counts[p0:p1]
            out.append(pack_pieces(p[:, :3], p[:, 6], flat, span[p0:p1], trained, part))
            p0 = p1
        for s, m in zip(sources, masks):  # the labels each masked source's pieces got
            if m is not None:
                idx = np.flatnonzero(src == s)
                f = self.fetchers[int(s)]
                f.check_labels(sid[idx], lo[idx] + 1, hi[idx], counts[idx])
        return out

    def fetch(self, pieces: Any) -> PackedMicroBatch:
        """One micro-batch."""
        return self.fetch_step([pieces])[0]

    def prefetch(self, steps: Iterable[tuple[Any, Sequence[Any]]]) -> Prefetcher:
        """Background fetch, as `Fetcher.prefetch`."""
        return Prefetcher(self, steps, self.config.prefetch_depth)  # type: ignore[arg-type]

    def close(self) -> None:
        for f in self.fetchers:
            f.close()
