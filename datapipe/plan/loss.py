"""The loss rule's facts, beside the StepPlan contract (docs/ARCHITECTURE.md, "Loss and
exactness"): a step's loss is the sum of its token losses divided by its labelled positions,
whichever rank computed which token. A sample's last position has no next token: its label is
IGNORE_INDEX.

With a loss mask (instruction data, docs/instruction-data.md) only the *trained* tokens are
targets: position i of a sample is labelled iff token i + 1 is trained. A sample's trained tokens
are its `trained_spans` (token ranges [start, end), sorted and disjoint); its `loss_tokens` are
its labelled positions, the trained tokens at index >= 1. Without a mask every token is trained
and a sample of L tokens has L - 1. `LossMask` holds a dataset's spans (from index.parquet) and
counts the labelled positions of any token range, so a step's denominator and each sample's
weight are known from the index before any token is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "IGNORE_INDEX",
    "LOSS_NORMALIZATIONS",
    "LossMask",
    "labelled_positions",
    "sequence_divisor",
    "spans_of_mask",
]

IGNORE_INDEX = -100  # the label of a position without a next token (torch's cross-entropy default)
# `[train] loss_normalization`: "token" divides a step's loss by its labelled positions; "sequence"
# averages each sample's mean over its own labelled positions over the step's samples
LOSS_NORMALIZATIONS = ("token", "sequence")


def labelled_positions(lengths: np.ndarray) -> int:
    """Loss denominator of a step without a loss mask: sum of L-1 over its non-empty samples."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return int(np.maximum(lengths - 1, 0).sum())


def sequence_divisor(loss_tokens: np.ndarray) -> int:
    """The "sequence" rule's divisor of a step: its samples with at least one labelled position."""
    return int(np.count_nonzero(np.asarray(loss_tokens, dtype=np.int64) > 0))


def spans_of_mask(mask: np.ndarray) -> np.ndarray:
    """[start, end) pairs (int64 [2K], flat) of the runs of true values of a boolean mask."""
    m = np.concatenate([[False], np.asarray(mask, dtype=bool), [False]])
    edges = np.flatnonzero(m[1:] != m[:-1])
    return edges.astype(np.int64)


@dataclass(frozen=True)
class LossMask:
    """A dataset's trained tokens: sample i's spans are ``values[offsets[i]:offsets[i+1]]``, flat
    [start, end) pairs relative to the sample. `offsets` None: every token is trained (a dataset
    without a mask)."""

    offsets: np.ndarray | None = None  # int64 [N + 1], into `values`
    values: np.ndarray | None = None  # int64 [2K]

    @property
    def masked(self) -> bool:
        return self.offsets is not None

    def trained(self, sid: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Trained tokens of sample `sid[k]` in [lo[k], hi[k]) (int64 per k; 0 where hi <= lo)."""
        sid, lo, hi = (np.asarray(x, np.int64) for x in (sid, lo, hi))
        hi = np.maximum(hi, lo)
        if self.offsets is None:
            return hi - lo
        return self._upto(sid, hi) - self._upto(sid, lo)

    def _upto(self, sid: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Trained tokens of each sample before token x (vectorised over spans)."""
        assert self.offsets is not None and self.values is not None
        a, b = self.offsets[sid], self.offsets[sid + 1]
        n = (b - a) // 2
        out = np.zeros(sid.shape[0], np.int64)
        rows = np.repeat(np.arange(sid.shape[0]), n)
        if rows.size == 0:
            return out
        k = np.arange(rows.size) - np.repeat(np.cumsum(n) - n, n)
        first = np.repeat(a, n) + 2 * k
        s, e = self.values[first], self.values[first + 1]
        x_r = x[rows]
        np.add.at(out, rows, np.clip(np.minimum(e, x_r) - s, 0, None))
        return out

    def unit_tokens(self, sid: np.ndarray, start: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Labelled positions of units: `length[k]` tokens of sample `sid[k]` from token
        `start[k]`, a sample of their own (their first token is no target)."""
        start = np.asarray(start, np.int64)
        return self.trained(sid, start + 1, start + np.asarray(length, np.int64))

    def spans(self, sid: int) -> np.ndarray:
        """Sample `sid`'s spans as a [K, 2] array (the whole sample's range is not known here:
        None-mask datasets raise)."""
        if self.offsets is None or self.values is None:
            raise ValueError("every token is trained: no spans are stored")
        return self.values[self.offsets[sid] : self.offsets[sid + 1]].reshape(-1, 2)
