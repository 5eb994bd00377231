"""Best-fit kernels behind datapipe.plan.packing.bfd_kernel (its docstring has the packing rules):
`bfd_dense` indexes free space directly (capacities up to packing.DENSE_MAX_CAPACITY),
`bfd_blocks` keeps sorted (free space, bin) keys in blocks of about sqrt(bins) for any capacity.
Both take the items' visiting order and a bound `m` on the bins (packing._max_bins).

Hot loops here call no other kernel with array arguments: numba increments and decrements the
reference count of every array such a call passes (atomic operations in NRT_incref/NRT_decref),
which costs more than the bitset and heap work itself.
"""

from __future__ import annotations

import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros

from datapipe.jit import njit


@njit(cache=True)
def _bitset_levels(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Word offsets and word counts of a 64-ary bitset over 0..size-1: level 0 one bit per value,
    each level above one bit per word below, the top level a single word."""
    offs = np.zeros(12, np.int64)
    nwords = np.zeros(12, np.int64)
    nlev = 0
    total = 0
    while True:
        words = (size + 63) >> 6
        offs[nlev] = total
        nwords[nlev] = words
        total += words
        nlev += 1
        if words == 1:
            return offs[:nlev].copy(), nwords[:nlev].copy()
        size = words


@njit(cache=True)
def bfd_dense(lengths: np.ndarray, order: np.ndarray, capacity: int, m: int) -> np.ndarray:
    """Best fit with free space indexed directly: a 64-ary bitset of the free-space values some
    bin has (successor by trailing-zero counts) and, per such value, a skew heap of its bins
    (lowest bin number at the root). The bitset and heap steps are written out in the loop, not
    called: numba increments and decrements, atomically, the reference count of every array a
    call passes, which took ~80% of this kernel's time when they were helper functions."""
    offs, nwords = _bitset_levels(capacity + 1)
    nlev = offs.shape[0]
    bits = np.zeros(offs[-1] + nwords[-1], np.int64)
    heap_root = np.empty(capacity + 1, np.int32)  # valid only where the value's bit is set
    left = np.empty(m, np.int64)
    right = np.empty(m, np.int64)
    sorted_lengths = lengths[order]
    sorted_bins = np.empty(lengths.size, np.int64)
    nbins = 0
    for k in range(lengths.size):
        length = sorted_lengths[k]
        # r: smallest free space >= length that a bin has (-1: none); climb until a word holds a
        # set bit at or after the position, then descend by trailing zeros
        r = -1
        lev = 0
        idx = length
        while lev < nlev and (idx >> 6) < nwords[lev]:
            word = bits[offs[lev] + (idx >> 6)] & (np.int64(-1) << (idx & 63))
            if word != 0:
                r = (idx & ~63) + trailing_zeros(word)
                while lev > 0:
                    lev -= 1
                    r = (r << 6) + trailing_zeros(bits[offs[lev] + r])
                break
            lev += 1
            idx = (idx >> 6) + 1
        b = nbins if r < 0 else np.int64(heap_root[r])  # a new bin, or the lowest-numbered at r
        sorted_bins[k] = b
        if r < 0:
            nbins += 1
        elif length == 0:
            continue
        # b leaves the heap of r (its subtrees merge), then joins the heap of its new free space
        # (merged with b alone); a value's bit flips when its heap empties or stops being empty
        for step in range(0 if r >= 0 else 1, 2):
            if step == 0:
                v, root, c = r, left[b], right[b]
            else:
                v = capacity - length if r < 0 else r - length
                left[b] = -1
                right[b] = -1
                had = (bits[v >> 6] >> (v & 63)) & 1
                root, c = (np.int64(heap_root[v]) if had else -1), b
            if root < 0 or 0 <= c < root:  # skew-heap merge, smaller root first
                root, c = c, root
            cur = root
            while c >= 0:
                nxt = right[cur]
                right[cur] = left[cur]
                if nxt < 0 or c < nxt:
                    nxt, c = c, nxt
                left[cur] = nxt
                cur = nxt
            if root >= 0:
                heap_root[v] = root
            if (root >= 0) != ((bits[v >> 6] >> (v & 63)) & 1 == 1):
                x = v
                for lev in range(nlev):  # flip, and up while a word became or was empty
                    w = offs[lev] + (x >> 6)
                    old = bits[w]
                    bits[w] = old ^ (np.int64(1) << (x & 63))
                    if old != 0 and bits[w] != 0:
                        break
                    x >>= 6
    assert nbins <= m
    bins = np.empty(lengths.size, np.int64)
    bins[order] = sorted_bins
    return bins


@njit(cache=True)
def _blocks_rebuild(kr: np.ndarray, kb: np.ndarray, cnt: np.ndarray, nb: int, per: int) -> int:
    """Redistribute the sorted keys evenly, `per` per block; returns the new block count."""
    total = 0
    for j in range(nb):
        total += cnt[j]
    fr = np.empty(total, np.int64)
    fb = np.empty(total, np.int64)
    t = 0
    for j in range(nb):
        for q in range(cnt[j]):
            fr[t] = kr[j, q]
            fb[t] = kb[j, q]
            t += 1
    new_nb = max(1, (total + per - 1) // per)
    for j in range(new_nb):
        lo = j * per
        hi = min(total, lo + per)
        cnt[j] = hi - lo
        for q in range(lo, hi):
            kr[j, q - lo] = fr[q]
            kb[j, q - lo] = fb[q]
    return new_nb


@njit(cache=True)
def bfd_blocks(lengths: np.ndarray, order: np.ndarray, capacity: int, m: int) -> np.ndarray:
    """Best fit for any capacity: sorted (free space, bin) keys in blocks of ~sqrt(bins)."""
    n = lengths.size
    bins = np.empty(n, np.int64)
    half = 8
    while half * half < m:
        half += 1
    bcap = 2 * half  # a block holding bcap keys triggers a rebuild to `half` per block
    nb_max = m // half + 2
    kr = np.empty((nb_max, bcap), np.int64)
    kb = np.empty((nb_max, bcap), np.int64)
    cnt = np.zeros(nb_max, np.int64)
    nb = 1
    nbins = 0
    for k in range(n):
        i = order[k]
        length = lengths[i]
        # Lower bound: first key with free space >= length.
        j = 0
        while j < nb and (cnt[j] == 0 or kr[j, cnt[j] - 1] < length):
            j += 1
        if j == nb:
            b = nbins
            nbins += 1
            new_r = capacity - length
        else:
            lo = 0
            hi = cnt[j] - 1
            while lo < hi:
                mid = (lo + hi) >> 1
                if kr[j, mid] < length:
                    lo = mid + 1
                else:
                    hi = mid
            r = kr[j, lo]
            b = kb[j, lo]
            if length == 0:
                bins[i] = b
                continue
            for q in range(lo, cnt[j] - 1):
                kr[j, q] = kr[j, q + 1]
                kb[j, q] = kb[j, q + 1]
            cnt[j] -= 1
            new_r = r - length
        bins[i] = b
        # Insert (new_r, b): into the first non-empty block whose last key is >= it, else
        # into the last non-empty block (or block 0 when all are empty).
        target = -1
        last_nonempty = 0
        for jj in range(nb):
            c = cnt[jj]
            if c == 0:
                continue
            last_nonempty = jj
            lr = kr[jj, c - 1]
            if lr > new_r or (lr == new_r and kb[jj, c - 1] > b):
                target = jj
                break
        if target < 0:
            target = last_nonempty
        c = cnt[target]
        q = c
        while q > 0 and (
            kr[target, q - 1] > new_r or (kr[target, q - 1] == new_r and kb[target, q - 1] > b)
        ):
            kr[target, q] = kr[target, q - 1]
            kb[target, q] = kb[target, q - 1]
            q -= 1
        kr[target, q] = new_r
        kb[target, q] = b
        cnt[target] = c + 1
        if c + 1 == bcap:
            nb = _blocks_rebuild(kr, kb, cnt, nb, half)
    assert nbins <= m
    return bins
