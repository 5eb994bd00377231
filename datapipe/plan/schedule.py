"""Scheduling kernels of the planners (numba): placing group micro-batches on ranks, filling idle
gaps, list scheduling, the local-move improvement pass and naive-hdp's waves.

All take and return flat int64 arrays; loads are rank times in integer nanoseconds, so every
process makes the same decisions.
"""

from __future__ import annotations

import numpy as np

from datapipe.jit import njit


# --- binary min-heap over ranks keyed by (load, rank) ----------------------------------------------
@njit(cache=True)
def _less(load: np.ndarray, a: int, b: int) -> bool:
    return load[a] < load[b] or (load[a] == load[b] and a < b)


@njit(cache=True)
def _sift_down(heap: np.ndarray, size: int, i: int, load: np.ndarray) -> None:
    while True:
        left = 2 * i + 1
        if left >= size:
            return
        c = left
        if left + 1 < size and _less(load, heap[left + 1], heap[left]):
            c = left + 1
        if _less(load, heap[c], heap[i]):
            heap[c], heap[i] = heap[i], heap[c]
            i = c
        else:
            return


@njit(cache=True)
def _sift_up(heap: np.ndarray, i: int, load: np.ndarray) -> None:
    while i > 0:
        p = (i - 1) // 2
        if _less(load, heap[i], heap[p]):
            heap[i], heap[p] = heap[p], heap[i]
            i = p
        else:
            return


@njit(cache=True)
def _make_heap(load: np.ndarray) -> np.ndarray:
    n = load.shape[0]
    heap = np.arange(n).astype(np.int64)
    for i in range(n // 2 - 1, -1, -1):
        _sift_down(heap, n, i, load)
    return heap


@njit(cache=True)
def place_groups(
    k: np.ndarray, t: np.ndarray, n_ranks: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each group (in the given order) on the k least-loaded ranks, starting when the last of them
    is free. Returns (ranks flat, ascending within a group; loads after; and the idle gaps a member
    waits before a group: gap rank, gap group, gap size)."""
    load = np.zeros(n_ranks, dtype=np.int64)
    heap = _make_heap(load)
    total = 0
    for g in range(k.shape[0]):
        total += k[g]
    out = np.empty(total, dtype=np.int64)
    gap_rank = np.empty(total, dtype=np.int64)
    gap_group = np.empty(total, dtype=np.int64)
    gap_size = np.empty(total, dtype=np.int64)
    n_gaps = 0
    pos = 0
    for g in range(k.shape[0]):
        kg = k[g]
        size = n_ranks
        start = np.int64(0)
        for q in range(kg):  # pop the kg least-loaded ranks to the heap's tail
            r = heap[0]
            out[pos + q] = r
            if load[r] > start:
                start = load[r]
            size -= 1
            heap[0] = heap[size]
            heap[size] = r
            _sift_down(heap, size, 0, load)
        end = start + t[g]
        for q in range(kg):
            r = out[pos + q]
            if load[r] < start:
                gap_rank[n_gaps] = r
                gap_group[n_gaps] = g
                gap_size[n_gaps] = start - load[r]
                n_gaps += 1
            load[r] = end
        for _ in range(kg):  # push back
            _sift_up(heap, size, load)
            size += 1
        _sort_small(out, pos, pos + kg)
        pos += kg
    return out, load, gap_rank[:n_gaps], gap_group[:n_gaps], gap_size[:n_gaps]


@njit(cache=True)
def list_schedule_groups(
    k: np.ndarray, t: np.ndarray, n_ranks: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Greedy list scheduling with backfilling: at each moment ranks are free, start the first
    group in the given order whose size fits the free ranks; otherwise advance to the next finish.
    Returns (placement order as indices into the input, ranks flat in placement order, loads,
    gap rank, gap group (placement index), gap size) like place_groups."""
    g_n = k.shape[0]
    load = np.zeros(n_ranks, dtype=np.int64)
    # min segment tree over the list: leftmost group with k <= free
    size = 1
    while size < max(g_n, 1):
        size *= 2
    big = n_ranks + 1
    tree = np.full(2 * size, big, dtype=np.int64)
    for i in range(g_n):
        tree[size + i] = k[i]
    for i in range(size - 1, 0, -1):
        tree[i] = min(tree[2 * i], tree[2 * i + 1])
    # busy ranks: min-heap by (load, rank); free ranks: a stack
    busy = np.empty(n_ranks, dtype=np.int64)
    n_busy = 0
    free = np.arange(n_ranks - 1, -1, -1).astype(np.int64)
    n_free = n_ranks
    total = 0
    for i in range(g_n):
        total += k[i]
    out = np.empty(total, dtype=np.int64)
    placed = np.empty(g_n, dtype=np.int64)
    gap_rank = np.empty(total, dtype=np.int64)
    gap_group = np.empty(total, dtype=np.int64)
    gap_size = np.empty(total, dtype=np.int64)
    n_gaps = 0
    pos = 0
    now = np.int64(0)
    for g in range(g_n):
        while tree[1] > n_free:  # nothing fits: advance to the next finish
            r = busy[0]
            now = load[r]
            while n_busy > 0 and load[busy[0]] <= now:
                r = busy[0]
                n_busy -= 1
                busy[0] = busy[n_busy]
                _sift_down(busy, n_busy, 0, load)
                free[n_free] = r
                n_free += 1
        # leftmost group with k <= n_free
        i = 1
        while i < size:
            i = 2 * i if tree[2 * i] <= n_free else 2 * i + 1
        x = i - size
        placed[g] = x
        kx = k[x]
        tree[i] = big
        i //= 2
        while i >= 1:
            tree[i] = min(tree[2 * i], tree[2 * i + 1])
            i //= 2
        end = now + t[x]
        for q in range(kx):
            n_free -= 1
            r = free[n_free]
            out[pos + q] = r
            if load[r] < now:
                gap_rank[n_gaps] = r
                gap_group[n_gaps] = g
                gap_size[n_gaps] = now - load[r]
                n_gaps += 1
            load[r] = end
            busy[n_busy] = r
            _sift_up(busy, n_busy, load)
            n_busy += 1
        _sort_small(out, pos, pos + kx)
        pos += kx
    return placed, out, load, gap_rank[:n_gaps], gap_group[:n_gaps], gap_size[:n_gaps]


@njit(cache=True)
def _sort_small(a: np.ndarray, lo: int, hi: int) -> None:
    """Sort a[lo:hi] in place (insertion sort for short runs, numpy's sort otherwise)."""
    if hi - lo > 32:
        a[lo:hi] = np.sort(a[lo:hi])
        return
    for i in range(lo + 1, hi):
        x = a[i]
        j = i - 1
        while j >= lo and a[j] > x:
            a[j + 1] = a[j]
            j -= 1
        a[j + 1] = x


@njit(cache=True)
def max_tree(values: np.ndarray) -> np.ndarray:
    """Max segment tree over `values` (leaves at len(tree) // 2 + i; padding leaves 0)."""
    n = values.shape[0]
    size = 1
    while size < n:
        size *= 2
    tree = np.zeros(2 * size, dtype=np.int64)
    for i in range(n):
        tree[size + i] = values[i]
    for i in range(size - 1, 0, -1):
        tree[i] = max(tree[2 * i], tree[2 * i + 1])
    return tree


@njit(cache=True)
def max_tree_first(tree: np.ndarray, x: int) -> int:
    """Index of the first leaf >= x (caller checks tree[1] >= x), O(log n)."""
    size = tree.shape[0] // 2
    i = 1
    while i < size:
        i = 2 * i if tree[2 * i] >= x else 2 * i + 1
    return i - size


@njit(cache=True)
def max_tree_set(tree: np.ndarray, leaf: int, value: int) -> None:
    """Set a leaf and restore the maxima above it."""
    i = tree.shape[0] // 2 + leaf
    tree[i] = value
    i //= 2
    while i >= 1:
        tree[i] = max(tree[2 * i], tree[2 * i + 1])
        i //= 2


@njit(cache=True)
def fill_gaps(t: np.ndarray, gap_size: np.ndarray) -> np.ndarray:
    """First fit of micro-batches (decreasing time) into idle gaps: gap index per item or -1.
    A max segment tree over remaining gap sizes finds the first gap with room in O(log gaps)."""
    out = -np.ones(t.shape[0], dtype=np.int64)
    if gap_size.shape[0] == 0:
        return out
    tree = max_tree(gap_size)
    size = tree.shape[0] // 2
    for b in range(t.shape[0]):
        if t[b] > tree[1]:
            continue
        g = max_tree_first(tree, t[b])
        out[b] = g
        max_tree_set(tree, g, tree[size + g] - t[b])
    return out


@njit(cache=True)
def winner_tree(load: np.ndarray) -> np.ndarray:
    """Tournament tree over ranks: node j holds the less loaded of its children's winners (the
    lower rank on ties), so tree[1] is the least-loaded rank; leaves at len(tree) // 2 + rank,
    padding -1. After load[r] changes, recompute the path from leaf r's parent to the root (the
    callers write that loop out)."""
    n = load.shape[0]
    size = 1
    while size < n:
        size *= 2
    tree = np.empty(2 * size, dtype=np.int64)
    for j in range(size):
        tree[size + j] = j if j < n else -1
    for j in range(size - 1, 0, -1):
        a, b = tree[2 * j], tree[2 * j + 1]
        tree[j] = a if b < 0 or (a >= 0 and load[a] <= load[b]) else b
    return tree


@njit(cache=True)
def place_local(t: np.ndarray, load: np.ndarray) -> np.ndarray:
    """List scheduling by decreasing time: each micro-batch on the least-loaded rank (the lowest
    on ties; load updated), found by a winner tree in O(log N)."""
    tree = winner_tree(load)
    size = tree.shape[0] // 2
    out = np.empty(t.shape[0], dtype=np.int64)
    for i in range(t.shape[0]):
        r = tree[1]
        out[i] = r
        load[r] += t[i]
        j = (size + r) >> 1
        while j >= 1:
            a, b = tree[2 * j], tree[2 * j + 1]
            tree[j] = a if b < 0 or load[a] <= load[b] else b
            j >>= 1
    return out


@njit(cache=True)
def _tree_update(tmax: np.ndarray, tmin: np.ndarray, load: np.ndarray, size: int, r: int) -> None:
    i = (size + r) // 2
    while i >= 1:
        a, b = tmax[2 * i], tmax[2 * i + 1]
        tmax[i] = a if (b < 0 or (a >= 0 and load[a] >= load[b])) else b
        a, b = tmin[2 * i], tmin[2 * i + 1]
        tmin[i] = a if (b < 0 or (a >= 0 and load[a] <= load[b])) else b
        i //= 2


@njit(cache=True)
def improve_local(b_rank: np.ndarray, t: np.ndarray, load: np.ndarray, budget: int) -> int:
    """Move or swap tail micro-batches between the most and the least loaded rank while that lowers
    the larger of the two; tail work never delays a group, so only these two ranks change.
    Segment trees give the arg-max/arg-min rank in O(log N) per move."""
    n = load.shape[0]
    nb = t.shape[0]
    moves = 0
    if nb == 0 or n < 2:
        return 0
    head = -np.ones(n, dtype=np.int64)
    nxt = -np.ones(nb, dtype=np.int64)
    prv = -np.ones(nb, dtype=np.int64)
    for b in range(nb):
        r = b_rank[b]
        nxt[b] = head[r]
        if head[r] >= 0:
            prv[head[r]] = b
        head[r] = b
    size = 1
    while size < n:
        size *= 2
    tmax = -np.ones(2 * size, dtype=np.int64)
    tmin = -np.ones(2 * size, dtype=np.int64)
    for r in range(n):
        tmax[size + r] = r
        tmin[size + r] = r
    for i in range(size - 1, 0, -1):
        a, b = tmax[2 * i], tmax[2 * i + 1]
        tmax[i] = a if (b < 0 or (a >= 0 and load[a] >= load[b])) else b
        a, b = tmin[2 * i], tmin[2 * i + 1]
        tmin[i] = a if (b < 0 or (a >= 0 and load[a] <= load[b])) else b
    for _ in range(budget):
        hi = tmax[1]
        lo = tmin[1]
        if load[hi] - load[lo] <= 0:
            break
        best = load[hi]
        best_a = -1
        best_b = -1
        a = head[hi]
        while a >= 0:
            m = max(load[hi] - t[a], load[lo] + t[a])
            if m < best:
                best, best_a, best_b = m, a, -1
            b = head[lo]
            while b >= 0:
                d = t[a] - t[b]
                if d > 0:
                    m = max(load[hi] - d, load[lo] + d)
                    if m < best:
                        best, best_a, best_b = m, a, b
                b = nxt[b]
            a = nxt[a]
        if best_a < 0:
            break
        moves += 1
        for x, src, dst in ((best_a, hi, lo), (best_b, lo, hi)):
            if x < 0:
                continue
            if prv[x] >= 0:
                nxt[prv[x]] = nxt[x]
            else:
                head[src] = nxt[x]
            if nxt[x] >= 0:
                prv[nxt[x]] = prv[x]
            prv[x] = -1
            nxt[x] = head[dst]
            if head[dst] >= 0:
                prv[head[dst]] = x
            head[dst] = x
            b_rank[x] = dst
            load[src] -= t[x]
            load[dst] += t[x]
        _tree_update(tmax, tmin, load, size, hi)
        _tree_update(tmax, tmin, load, size, lo)
    return moves


@njit(cache=True)
def place_waves(k: np.ndarray, n_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """First fit of micro-batches (given order) into waves of n_ranks rank slots; ranks are taken
    in increasing order within a wave. Returns (ranks flat, wave of each micro-batch)."""
    m = k.shape[0]
    used = np.zeros(max(m, 1), dtype=np.int64)  # ranks taken per wave
    n_waves = 0
    total = 0
    for i in range(m):
        total += k[i]
    out = np.empty(total, dtype=np.int64)
    wave = np.empty(m, dtype=np.int64)
    first = 0  # waves before `first` are full
    pos = 0
    for i in range(m):
        w = first
        while w < n_waves and used[w] + k[i] > n_ranks:
            w += 1
        if w == n_waves:
            n_waves += 1
        wave[i] = w
        for q in range(k[i]):
            out[pos + q] = used[w] + q
        used[w] += k[i]
        pos += k[i]
        while first < n_waves and used[first] == n_ranks:
            first += 1
    return out, wave


@njit(cache=True, inline="always")
def size_term(t: int, d_ns: float, size_x: np.ndarray, size_f: np.ndarray) -> np.int64:
    """CostModel.size_ns of one micro-batch of t positions (ns, rounded), from size_table_ns."""
    x = float(t)
    return np.int64(d_ns * x * x + x * np.interp(x, size_x, size_f) + 0.5)


@njit(cache=True)
def spread_samples(
    w: np.ndarray,
    s: np.ndarray,
    cap: int,
    c_ns: int,
    d_ns: float,
    size_x: np.ndarray,
    size_f: np.ndarray,
    load: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Samples, in the given order (by decreasing time), each onto the least-loaded rank (ties:
    the lowest), into that rank's newest micro-batch if it has room for the sample's s positions
    (at most `cap`), else into the fullest of its older ones with room, else into a new one.
    `load` is updated: w per sample, c_ns per new micro-batch, size_term(T) for a micro-batch of T
    positions (d_ns*T^2 + T*interp(T, size_x, size_f): CostModel.size_ns in ns; skipped when both
    are 0). Returns (micro-batch of each sample, numbered by opening; rank of each micro-batch).
    The least-loaded rank comes from a winner tree, written out here (a call passing arrays costs
    numba atomic reference counting per sample). Older micro-batches are searched only when a
    bound on their room (kept per rank) admits the sample."""
    n = load.shape[0]
    m = w.shape[0]
    tree = winner_tree(load)
    size = tree.shape[0] // 2
    last = -np.ones(n, dtype=np.int64)  # each rank's newest micro-batch (then `prev` links)
    old_room = np.zeros(n, dtype=np.int64)  # at least the most room of its older ones
    prev = np.empty(m, dtype=np.int64)
    pos = np.empty(m, dtype=np.int64)  # positions per micro-batch
    mb_of = np.empty(m, dtype=np.int64)
    mb_rank = np.empty(m, dtype=np.int64)
    n_mb = 0
    sized = d_ns > 0.0 or size_f[-1] > 0.0  # rates never fall: the last is the largest
    for i in range(m):
        r = tree[1]
        best = last[r]
        if best >= 0 and pos[best] + s[i] > cap:
            best = -1
            if old_room[r] >= s[i]:  # best fit among the older ones
                room = 0  # their most room before this sample: a bound for the next search
                b = prev[last[r]]
                while b >= 0:
                    if pos[b] + s[i] <= cap and (best < 0 or pos[b] > pos[best]):
                        best = b
                    room = max(room, cap - pos[b])
                    b = prev[b]
                old_room[r] = room
        if best >= 0:
            p = pos[best]
            q = p + s[i]
            load[r] += w[i]
            if sized:
                load[r] += size_term(q, d_ns, size_x, size_f) - size_term(p, d_ns, size_x, size_f)
            pos[best] = q
        else:
            load[r] += c_ns + w[i]
            if sized:
                load[r] += size_term(s[i], d_ns, size_x, size_f)
            if last[r] >= 0:
                old_room[r] = max(old_room[r], cap - pos[last[r]])
            best = n_mb
            pos[best] = s[i]
            prev[best] = last[r]
            last[r] = best
            mb_rank[best] = r
            n_mb += 1
        mb_of[i] = best
        j = (size + r) >> 1  # the grown rank's path to the root
        while j >= 1:
            a, b = tree[2 * j], tree[2 * j + 1]
            tree[j] = a if b < 0 or load[a] <= load[b] else b
            j >>= 1
    return mb_of, mb_rank[:n_mb]
