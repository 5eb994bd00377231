"""Loss by position and by sample length: every labelled position's loss summed into
power-of-two buckets of its position in its sample (0-1K, 1K-2K, 2K-4K, ...) and of its sample's
length, on each rank, then summed over the island. Whether far positions were learned shows as the
far buckets' loss falling."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from trainer.parallel.comm import Communicator
from trainer.parallel.executor import TokenLosses

__all__ = ["FIRST", "NUM_BUCKETS", "BucketLosses", "bucket_bounds", "bucket_of"]

FIRST = 1024  # the first bucket's end; each next one doubles
NUM_BUCKETS = 40  # [2^39 K, 2^40 K) is the last


def bucket_of(values: np.ndarray) -> np.ndarray:
    """Bucket of each value: 0 for [0, 1024), k for [1024 * 2^(k-1), 1024 * 2^k)."""
    v = np.asarray(values, dtype=np.int64) // FIRST
    out = np.zeros(v.shape, dtype=np.int64)
    big = v > 0
    out[big] = np.floor(np.log2(v[big])).astype(np.int64) + 1
    # float log2 is exact for powers of two; guard the values just below one
    low = big & (np.left_shift(np.int64(1), out - 1) > v)
    out[low] -= 1
    return out


def bucket_bounds(k: int) -> tuple[int, int]:
    """[start, end) of bucket k."""
    return (0, FIRST) if k == 0 else (FIRST << (k - 1), FIRST << k)


class BucketLosses:
    """Sums of losses and counts of positions by position bucket and by sample-length bucket,
    plus the samples per length bucket; `add` per micro-batch, `reduce` over the island."""

    def __init__(self) -> None:
        self.pos_sum = np.zeros(NUM_BUCKETS)
        self.pos_n = np.zeros(NUM_BUCKETS, dtype=np.int64)
        self.len_sum = np.zeros(NUM_BUCKETS)
        self.len_n = np.zeros(NUM_BUCKETS, dtype=np.int64)
        self.len_samples = np.zeros(NUM_BUCKETS, dtype=np.int64)

    def add(self, parts: Sequence[TokenLosses], lengths_by_id: dict[int, int]) -> None:
        """This rank's micro-batches of one plan (`lengths_by_id`: its samples' lengths)."""
        for t in parts:
            pb = bucket_of(t.position)
            self.pos_sum += np.bincount(pb, t.loss, minlength=NUM_BUCKETS)
            self.pos_n += np.bincount(pb, minlength=NUM_BUCKETS)
            uniq, inv = np.unique(t.sample, return_inverse=True)
            lens = np.array([lengths_by_id[int(s)] for s in uniq], dtype=np.int64)  # per sample
            lb = bucket_of(lens)[inv]
            self.len_sum += np.bincount(lb, t.loss, minlength=NUM_BUCKETS)
            self.len_n += np.bincount(lb, minlength=NUM_BUCKETS)

    def merged(self, other: BucketLosses) -> BucketLosses:
        """The sums of both (two held-out sets pooled: a mixture's sources)."""
        out = BucketLosses()
        for key in ("pos_sum", "pos_n", "len_sum", "len_n", "len_samples"):
            setattr(out, key, getattr(self, key) + getattr(other, key))
        return out

    def count_samples(self, lengths: np.ndarray) -> None:
        """Count a plan's samples by length bucket (once per plan, on one rank)."""
        self.len_samples += np.bincount(bucket_of(lengths), minlength=NUM_BUCKETS)

    def reduce(self, comm: Communicator) -> None:
        """Sum every rank's buckets (one all-reduce)."""
        parts = (self.pos_sum, self.pos_n, self.len_sum, self.len_n, self.len_samples)
        t = torch.from_numpy(np.concatenate([p.astype(np.float64) for p in parts]))
        comm.all_reduce(t)
        v = t.numpy().reshape(5, NUM_BUCKETS)
        self.pos_sum, self.len_sum = v[0].copy(), v[2].copy()
        self.pos_n, self.len_n, self.len_samples = (
            np.rint(v[i]).astype(np.int64) for i in (1, 3, 4)
        )

    @property
    def loss(self) -> float:
        """Summed token losses over labelled positions."""
        n = int(self.pos_n.sum())
        return float(self.pos_sum.sum() / n) if n else float("nan")

    @property
    def tokens(self) -> int:
        return int(self.pos_n.sum())

    def by_position(self) -> list[dict[str, Any]]:
        """[{start, end, loss, tokens}] of the non-empty position buckets."""
        return _rows(self.pos_sum, self.pos_n)

    def by_length(self) -> list[dict[str, Any]]:
        """[{start, end, loss, tokens, samples}] of the sample-length buckets holding a sample
        (loss NaN where none of them has a labelled position: samples of one token)."""
        out = []
        for k in np.flatnonzero((self.len_n > 0) | (self.len_samples > 0)):
            start, end = bucket_bounds(int(k))
            n = int(self.len_n[k])
            loss = float(self.len_sum[k] / n) if n else float("nan")
            out.append({"start": start, "end": end, "loss": loss, "tokens": n,
                        "samples": int(self.len_samples[k])})  # fmt: skip
        return out


def _rows(sums: np.ndarray, counts: np.ndarray) -> list[dict[str, Any]]:
    out = []
    for k in np.flatnonzero(counts):
        start, end = bucket_bounds(int(k))
        n = int(counts[k])
        out.append({"start": start, "end": end, "loss": float(sums[k] / n), "tokens": n})
    return out
