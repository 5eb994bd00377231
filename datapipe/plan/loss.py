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
from functools import cache

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
        sid, lo, hi = (np.ascontiguousarray(x, dtype=np.int64) for x in (sid, lo, hi))
        hi = np.maximum(hi, lo)
        if self.offsets is None or self.values is None:
            return hi - lo
        out = np.zeros(sid.shape[0], np.int64)
        _kernel()(self.offsets, self.values, sid, lo, hi, out)
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


@cache
def _kernel():
    """`_trained_between` compiled by numba, imported only when a mask is counted (profiling
    and planning a dataset without one never load numba)."""
    from datapipe.jit import njit

    return njit(cache=True, nogil=True)(_trained_between)


def _trained_between(
    offsets: np.ndarray,
    values: np.ndarray,
    sid: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    out: np.ndarray,
) -> None:
    """out[k]: tokens of sample sid[k]'s spans inside [lo[k], hi[k])."""
    for k in range(sid.shape[0]):
        s, a, b = sid[k], lo[k], hi[k]
        total = 0
        for q in range(offsets[s], offsets[s + 1], 2):
            x = max(values[q], a)
            y = min(values[q + 1], b)
            if y > x:
                total += y - x
        out[k] = total
