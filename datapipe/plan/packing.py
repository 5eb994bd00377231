"""Bin packing of sequence lengths: first-fit / best-fit decreasing (length bucketing is in
datapipe.plan.buckets).

Public functions validate their input and call numba kernels; the kernels themselves
(`ffd_kernel`, `bfd_kernel`, `sort_desc_kernel`) are exported so other `@njit` code (the planner)
can call them directly with contiguous int64 arrays.

Conventions shared by both packers and by the pure-Python references in `_packing_ref`:

- Items are visited in decreasing length; equal lengths in increasing index (stable). The order
  comes from a counting sort (lengths up to `max(65536, 8 n)`) or an LSD radix sort, not argsort.
- Bins are numbered from 0 in the order they are opened; an item opens a new bin only when no
  open bin has room for it.
- First fit: the lowest-numbered open bin with room. Best fit: the open bin with the least free
  space that still has room; among bins with equal free space, the lowest-numbered one.
- Zero-length items are allowed (they go where the rule puts them; they open bin 0 if they are
  all there is). An item longer than the capacity or a negative length is an error.

Data structures (no O(items x bins) scan):

- FFD: a max segment tree over bins' free space whose unopened leaves hold the full capacity, so
  the leftmost leaf with room is either the first-fit bin or the next new bin: O(log bins).
- BFD (datapipe.plan.bestfit): free space values index a 64-ary bitset hierarchy (3 levels for
  C = 131072; successor query by trailing-zero counts) and each free-space value keeps a skew heap
  of its bins keyed by bin number: O(log_64 C + amortized log bins). For capacities above
  `DENSE_MAX_CAPACITY` a sorted list of (free space, bin) keys in blocks of about sqrt(bins) is
  used instead: O(sqrt(bins)); that only gets slow with very many bins of over 16M tokens each
  (~1e11 tokens in one call).

Any-fit packings never leave two bins whose contents together fit in one, so neither packer
opens more than `2 * (sum // capacity) + 2` bins; the kernels size their structures by that.
"""

from __future__ import annotations

import operator
import time

import numpy as np

from datapipe.errors import MixlenError
from datapipe.jit import njit
from datapipe.plan.bestfit import bfd_blocks, bfd_dense

__all__ = [
    "DENSE_MAX_CAPACITY",
    "best_fit_decreasing",
    "bfd_kernel",
    "ffd_kernel",
    "first_fit_decreasing",
    "sort_desc",
    "sort_desc_kernel",
    "warmup",
]

# Largest capacity for which best fit indexes free space directly (arrays of capacity + 1).
DENSE_MAX_CAPACITY = 1 << 24

_RADIX_BITS = 11
_RADIX_MASK = (1 << _RADIX_BITS) - 1


# ----------------------------------------------------------------------------- sorting


@njit(cache=True)
def sort_desc_kernel(lengths: np.ndarray) -> np.ndarray:
    """Indices of `lengths` (int64, >= 0) by decreasing length, ties by increasing index."""
    n = lengths.size
    order = np.empty(n, np.int64)
    if n == 0:
        return order
    mx = 0
    for i in range(n):
        v = lengths[i]
        if v < 0:
            raise ValueError("sort_desc_kernel: negative length")
        if v > mx:
            mx = v
    if mx < max(65536, 8 * n):
        # Counting sort: start[v] = number of items longer than v.
        start = np.zeros(mx + 1, np.int64)
        for i in range(n):
            start[lengths[i]] += 1
        pos = 0
        for v in range(mx, -1, -1):
            c = start[v]
            start[v] = pos
            pos += c
        for i in range(n):
            v = lengths[i]
            order[start[v]] = i
            start[v] += 1
        return order
    # LSD radix sort of key = mx - length (ascending key = descending length), stable per pass.
    keys = np.empty(n, np.int64)
    for i in range(n):
        keys[i] = mx - lengths[i]
        order[i] = i
    tmp = np.empty(n, np.int64)
    counts = np.empty(_RADIX_MASK + 2, np.int64)
    shift = 0
    while shift < 63 and (mx >> shift) > 0:
        counts[:] = 0
        for k in range(n):
            counts[((keys[order[k]] >> shift) & _RADIX_MASK) + 1] += 1
        for d in range(1, _RADIX_MASK + 2):
            counts[d] += counts[d - 1]
        for k in range(n):
            i = order[k]
            d = (keys[i] >> shift) & _RADIX_MASK
            tmp[counts[d]] = i
            counts[d] += 1
        order, tmp = tmp, order
        shift += _RADIX_BITS
    return order


@njit(cache=True)
def _max_bins(lengths: np.ndarray, capacity: int) -> int:
    """Check 0 <= length <= capacity and bound the bins any any-fit packer opens."""
    if capacity < 1:
        raise ValueError("packing kernel: capacity must be >= 1")
    q = 0
    acc = 0
    for i in range(lengths.size):
        v = lengths[i]
        if v < 0 or v > capacity:
            raise ValueError("packing kernel: every length must be in [0, capacity]")
        acc += v
        if acc >= capacity:
            acc -= capacity
            q += 1
    return max(1, min(lengths.size, 2 * q + 2))


# ----------------------------------------------------------------------------- first fit


@njit(cache=True)
def ffd_kernel(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """First-fit decreasing: bin index (int64, numbered by opening) of every item."""
    n = lengths.size
    bins = np.empty(n, np.int64)
    if n == 0:
        return bins
    m = _max_bins(lengths, capacity)
    order = sort_desc_kernel(lengths)
    size = 1
    while size < m:
        size *= 2
    # Max tree over free space; unopened bins are leaves holding the full capacity, so the
    # leftmost leaf with room is the first-fit bin or, if none, the next bin to open.
    tree = np.full(2 * size, capacity, np.int64)
    sorted_lengths = lengths[order]
    sorted_bins = np.empty(n, np.int64)
    nbins = 0
    for k in range(n):
        length = sorted_lengths[k]
        node = 1
        while node < size:
            node = 2 * node + (tree[2 * node] < length)
        b = node - size
        if b == nbins:
            nbins += 1
        sorted_bins[k] = b
        if length == 0:
            continue
        tree[node] -= length
        node >>= 1
        while node >= 1:
            left = tree[2 * node]
            right = tree[2 * node + 1]
            best = left if left >= right else right
            if tree[node] == best:
                break
            tree[node] = best
            node >>= 1
    assert nbins <= m
    bins[order] = sorted_bins
    return bins


# ----------------------------------------------------------------------------- best fit


@njit(cache=True)
def _bfd(lengths: np.ndarray, capacity: int, dense: bool) -> np.ndarray:
    n = lengths.size
    if n == 0:
        return np.empty(0, np.int64)
    m = _max_bins(lengths, capacity)
    order = sort_desc_kernel(lengths)
    if dense:
        return bfd_dense(lengths, order, capacity, m)
    return bfd_blocks(lengths, order, capacity, m)


@njit(cache=True)
def bfd_kernel(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Best-fit decreasing: bin index (int64, numbered by opening) of every item."""
    return _bfd(lengths, capacity, capacity <= DENSE_MAX_CAPACITY)


# ----------------------------------------------------------------------------- public API


def as_lengths(lengths: np.ndarray, what: str = "lengths") -> np.ndarray:
    """A contiguous int64 copy/view of a 1-D integer array of non-negative lengths."""
    a = np.asarray(lengths)
    if a.ndim != 1:
        raise MixlenError(f"{what} must be a 1-D array, got shape {a.shape}")
    if a.size == 0:
        return np.empty(0, np.int64)
    if a.dtype.kind not in "iu":
        raise MixlenError(f"{what} must be an integer array, got dtype {a.dtype}")
    if a.dtype.kind == "u" and a.dtype.itemsize == 8 and int(a.max()) > np.iinfo(np.int64).max:
        i = int(np.argmax(a))
        raise MixlenError(f"{what}[{i}] = {int(a[i])} does not fit in int64")
    a = np.ascontiguousarray(a, dtype=np.int64)
    if a.min() < 0:
        i = int(np.flatnonzero(a < 0)[0])
        raise MixlenError(f"{what}[{i}] = {int(a[i])} is negative")
    return a


def _as_capacity(capacity: int) -> int:
    if isinstance(capacity, (bool, np.bool_)):
        raise MixlenError(f"capacity must be an integer, got {capacity!r}")
    try:
        c = operator.index(capacity)
    except TypeError:
        raise MixlenError(f"capacity must be an integer, got {capacity!r}") from None
    if c < 1:
        raise MixlenError(f"capacity must be >= 1, got {c}")
    if c > np.iinfo(np.int64).max // 4:
        raise MixlenError(f"capacity {c} is too large (limit 2**61)")
    return c


def _checked(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    a = as_lengths(lengths)
    c = _as_capacity(capacity)
    if a.size and a.max() > c:
        i = int(np.flatnonzero(a > c)[0])
        raise MixlenError(f"item {i} has length {int(a[i])}, longer than the capacity {c}")
    return a, c


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """First-fit decreasing packing; returns the int64 bin index of every item.

    Items go longest first (ties by index) into the lowest-numbered bin with room; bins are
    numbered in order of opening. Raises MixlenError (a ValueError) for an item longer than
    `capacity`, a negative length, or a capacity below 1.
    """
    a, c = _checked(lengths, capacity)
    return ffd_kernel(a, c)


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Best-fit decreasing packing; returns the int64 bin index of every item.

    Items go longest first (ties by index) into the bin with the least room that still fits
    them (ties by lowest bin number); bins are numbered in order of opening. Raises
    MixlenError (a ValueError) for an item longer than `capacity`, a negative length, or a
    capacity below 1.
    """
    a, c = _checked(lengths, capacity)
    return bfd_kernel(a, c)


def sort_desc(lengths: np.ndarray) -> np.ndarray:
    """Indices by decreasing length, ties by increasing index (the packers' visiting order)."""
    return sort_desc_kernel(as_lengths(lengths))


def warmup() -> float:
    """Compile (or load from the on-disk cache) every kernel on tiny inputs; returns seconds."""
    t0 = time.perf_counter()
    x = np.array([3, 1, 2, 0, 3], np.int64)
    ffd_kernel(x, 4)
    bfd_kernel(x, 4)
    _bfd(x, 4, False)
    sort_desc_kernel(np.array([1 << 20, 5], np.int64))
    return time.perf_counter() - t0
