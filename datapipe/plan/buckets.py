"""Length buckets: power-of-two (bucket k holds 2^(k-1) < length <= 2^k, bucket 0 holds 0 and 1)
or given boundaries (bucket i holds boundaries[i-1] < length <= boundaries[i], one overflow bucket
past the last), plus a stable grouping of items by bucket id. Numba kernels (exported for other
`@njit` code) behind validating public functions; references in `_packing_ref`.
"""

from __future__ import annotations

import operator

import numpy as np
from numba.cpython.unsafe.numbers import leading_zeros

from datapipe.errors import MixlenError
from datapipe.jit import njit
from datapipe.plan.packing import as_lengths

__all__ = [
    "boundary_bucket_kernel",
    "boundary_buckets",
    "group_by_bucket",
    "group_by_bucket_kernel",
    "length_buckets",
    "pow2_bucket_kernel",
    "pow2_buckets",
]


@njit(cache=True)
def pow2_bucket_kernel(lengths: np.ndarray) -> np.ndarray:
    """Power-of-two bucket ids: 0 for lengths <= 1, else k with 2^(k-1) < length <= 2^k."""
    n = lengths.size
    ids = np.empty(n, np.int64)
    for i in range(n):
        v = lengths[i]
        ids[i] = 0 if v <= 1 else 64 - leading_zeros(v - 1)
    return ids


@njit(cache=True)
def boundary_bucket_kernel(lengths: np.ndarray, boundaries: np.ndarray) -> np.ndarray:
    """Bucket i holds boundaries[i-1] < length <= boundaries[i]; past the last: len(boundaries)."""
    n = lengths.size
    nbnd = boundaries.size
    ids = np.empty(n, np.int64)
    for i in range(n):
        v = lengths[i]
        lo = 0
        hi = nbnd
        while lo < hi:
            mid = (lo + hi) >> 1
            if boundaries[mid] < v:
                lo = mid + 1
            else:
                hi = mid
        ids[i] = lo
    return ids


@njit(cache=True)
def group_by_bucket_kernel(ids: np.ndarray, n_buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """Stable grouping: items of bucket j are order[offsets[j]:offsets[j+1]], by index."""
    offsets = np.zeros(n_buckets + 1, np.int64)
    for i in range(ids.size):
        d = ids[i]
        if d < 0 or d >= n_buckets:
            raise ValueError("group_by_bucket_kernel: bucket id out of range")
        offsets[d + 1] += 1
    for j in range(n_buckets):
        offsets[j + 1] += offsets[j]
    pos = offsets[:-1].copy()
    order = np.empty(ids.size, np.int64)
    for i in range(ids.size):
        d = ids[i]
        order[pos[d]] = i
        pos[d] += 1
    return order, offsets


def pow2_buckets(lengths: np.ndarray) -> np.ndarray:
    """Bucket id k for 2^(k-1) < length <= 2^k (id 0 for lengths 0 and 1)."""
    return pow2_bucket_kernel(as_lengths(lengths))


def boundary_buckets(lengths: np.ndarray, boundaries: np.ndarray) -> np.ndarray:
    """Bucket id i for boundaries[i-1] < length <= boundaries[i]; len(boundaries) past the last.

    `boundaries` must be strictly increasing integers.
    """
    a = as_lengths(lengths)
    bnd = as_lengths(boundaries, "boundaries")
    if bnd.size and np.any(np.diff(bnd) <= 0):
        i = int(np.flatnonzero(np.diff(bnd) <= 0)[0]) + 1
        raise MixlenError(f"boundaries must be strictly increasing (boundaries[{i}] = {bnd[i]})")
    return boundary_bucket_kernel(a, bnd)


def length_buckets(lengths: np.ndarray, boundaries: np.ndarray | None = None) -> np.ndarray:
    """Bucket ids: power-of-two buckets when `boundaries` is None, else `boundary_buckets`."""
    if boundaries is None:
        return pow2_buckets(lengths)
    return boundary_buckets(lengths, boundaries)


def group_by_bucket(ids: np.ndarray, n_buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, offsets): bucket j's item indices, ascending, are order[offsets[j]:offsets[j+1]]."""
    a = as_lengths(ids, "bucket ids")
    nb = operator.index(n_buckets)
    if a.size and a.max() >= nb:
        i = int(np.flatnonzero(a >= nb)[0])
        raise MixlenError(f"bucket id {int(a[i])} of item {i} is not below n_buckets = {nb}")
    return group_by_bucket_kernel(a, nb)
