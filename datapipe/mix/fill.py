"""The mixture's fill: which source the next unit comes from, and which global batch it joins.

A *unit* is what the planner sees as one sample: a whole sample, or, under a stage's
`max_sample_tokens` M, one of its consecutive pieces of at most M tokens (positions from 0).
Each source walks its own order (its epoch's permutation, datapipe.mix.stream); this kernel only
consumes it.

Rule, per unit (token counts since the segment began: a segment is a stretch of constant
weights, i.e. a stage, or the part of it after a source ran out):

1. *Eligible* sources: weight w_s > 0 and ``taken_s <= w_s * total`` (not ahead of their
   share). Some source always is, since the shares sum to the total.
2. Among them, the source whose *head* unit (its oldest deferred unit, else the next of its
   order) has the smallest finish tag ``(taken_s + len) / w_s`` is chosen (ties: the first
   source). This is WF2Q's choice (Bennett and Zhang, 1996), with tokens for bytes.
3. The chosen source gives its first unit that fits the batch's room, looking at its deferred
   units (oldest first), then at most ``W - deferred`` units ahead in its order (W =
   `lookahead`); the units of its order it skipped are deferred. Into an empty batch its head
   unit goes whatever its size (a unit longer than the budget is a batch on its own). If
   nothing of it fits, the batch closes (a batch also closes when its room is used up); no other
   source takes its turn, which is what keeps the share bound (docs/ARCHITECTURE.md).

Batches are consecutive runs of the unit sequence, so a bound on every prefix of the sequence
holds on every prefix of the batches. `fill_reference` is the same rule in plain Python (tests).
"""

from __future__ import annotations

import numpy as np

from datapipe.jit import njit

DONE = 0  # n_batches batches completed
REFILL = 1  # source `which` consumed its order: give it its next epoch's and call again
EXHAUSTED = 2  # source `which` has no unit left and may not start another epoch
FULL = 3  # `out` is full: give a larger one (rows kept) and call again

# scalar state, one int64 array `st` (in and out)
ST_BATCHES = 0  # batches completed in this call's output
ST_UNITS = 1  # units written to the output
ST_ROOM = 2  # room of the batch in progress
ST_OPEN = 3  # 1: a batch is in progress
ST_TOTAL = 4  # tokens taken in the segment, all sources
NUM_ST = 5


@njit(cache=True)
def _unit_len(lengths, base, order, p, off, max_unit):
    """Length of the unit starting `off` tokens into sample order[p]."""
    rest = lengths[base + order[p]] - off
    if max_unit > 0 and rest > max_unit:
        return max_unit
    return rest


@njit(cache=True)
def _peek(s, lengths, len_off, order, ord_hi, cur, cur_off, dlen, ndef, room, empty, max_unit, w):
    """Source s's candidate: (kind, index, length); kind 1: deferred unit `index`, 2: the
    `index`-th unit ahead in its order, 0: none fits, -1: its order is consumed."""
    for i in range(ndef[s]):
        if empty or dlen[s, i] <= room:
            return 1, i, dlen[s, i]
    p, off = cur[s], cur_off[s]
    if p == ord_hi[s]:
        return -1, 0, 0
    base = len_off[s]
    for k in range(w - ndef[s]):
        if p == ord_hi[s]:
            break
        n = _unit_len(lengths, base, order, p, off, max_unit)
        if empty or n <= room:
            return 2, k, n
        off += n
        if off >= lengths[base + order[p]]:
            p += 1
            off = 0
    return 0, 0, 0


@njit(cache=True)
def _head(s, lengths, len_off, order, cur, cur_off, dlen, ndef, max_unit):
    """Source s's head unit's length: its oldest deferred unit, else the next of its order."""
    if ndef[s] > 0:
        return dlen[s, 0]
    return _unit_len(lengths, len_off[s], order, cur[s], cur_off[s], max_unit)


@njit(cache=True)
def _choose(
    lengths, len_off, order, ord_hi, cur, cur_off, refillable, dlen, ndef, taken, weight, total,
    room, empty, max_unit, w,
):  # fmt: skip
    """The unit to take: (status, source, kind, index, length); status 0 with source -1 when the
    chosen source has nothing that fits (the batch closes), REFILL / EXHAUSTED with the source
    that needs it."""
    num = weight.shape[0]
    # the eligible sources (rounding aside, at least one; else the most behind one)
    lag_best, lag_src = -1e300, -1
    any_eligible = False
    for s in range(num):
        if weight[s] > 0.0:
            lag = weight[s] * total - taken[s]
            if lag >= 0.0:
                any_eligible = True
            if lag > lag_best:
                lag_best, lag_src = lag, s
    # WF2Q: the eligible source whose head unit would finish first
    best, best_tag = -1, 0.0
    for s in range(num):
        if weight[s] <= 0.0:
            continue
        if any_eligible:
            if weight[s] * total - taken[s] < 0.0:
                continue
        elif s != lag_src:
            continue
        if ndef[s] == 0 and cur[s] == ord_hi[s]:
            return (REFILL if refillable[s] else EXHAUSTED), s, 0, 0, 0
        tag = (
            taken[s] + _head(s, lengths, len_off, order, cur, cur_off, dlen, ndef, max_unit)
        ) / weight[s]
        if best < 0 or tag < best_tag:
            best, best_tag = s, tag
    # it gives its first unit that fits the room (its look-ahead window), else the batch closes
    kind, idx, n = _peek(
        best, lengths, len_off, order, ord_hi, cur, cur_off, dlen, ndef, room, empty, max_unit, w
    )
    if kind == -1 and refillable[best]:
        return REFILL, best, 0, 0, 0
    if kind <= 0:
        return 0, -1, 0, 0, 0
    return 0, best, kind, idx, n


@njit(cache=True)
def _take(
    s, kind, idx, n, lengths, len_off, order, cur, cur_off, dsid, doff, dlen, ndef, row, max_unit
):
    """Write source s's candidate (`_peek`'s kind and index) to `row`; the units of its order it
    skipped are deferred."""
    row[0] = s
    if kind == 1:
        row[1], row[2], row[3] = dsid[s, idx], doff[s, idx], n
        for i in range(idx, ndef[s] - 1):
            dsid[s, i], doff[s, i], dlen[s, i] = dsid[s, i + 1], doff[s, i + 1], dlen[s, i + 1]
        ndef[s] -= 1
        return
    base = len_off[s]
    for k in range(idx + 1):
        p, off = cur[s], cur_off[s]
        m = _unit_len(lengths, base, order, p, off, max_unit)
        if k < idx:
            j = ndef[s]
            dsid[s, j], doff[s, j], dlen[s, j] = order[p], off, m
            ndef[s] += 1
        else:
            row[1], row[2], row[3] = order[p], off, m
        off += m
        if off >= lengths[base + order[p]]:
            cur[s] = p + 1
            cur_off[s] = 0
        else:
            cur_off[s] = off


@njit(cache=True)
def fill_kernel(
    lengths: np.ndarray,
    len_off: np.ndarray,
    order: np.ndarray,
    ord_hi: np.ndarray,
    cur: np.ndarray,
    cur_off: np.ndarray,
    refillable: np.ndarray,
    dsid: np.ndarray,
    doff: np.ndarray,
    dlen: np.ndarray,
    ndef: np.ndarray,
    taken: np.ndarray,
    weight: np.ndarray,
    budget: int,
    max_unit: int,
    w: int,
    n_batches: int,
    out: np.ndarray,
    bounds: np.ndarray,
    st: np.ndarray,
) -> tuple[int, int]:
    """Fill up to `n_batches` batches (see the module docstring); returns (status, source).

    `lengths[len_off[s] + i]`: sample i of source s; its order is
    ``order[cur[s]:ord_hi[s]]``, the first `cur_off[s]` tokens of order[cur[s]] already taken.
    Deferred units of s: ``(dsid, doff, dlen)[s, :ndef[s]]``. Units go to `out` rows
    (source, sample, start, length), batch b is rows ``bounds[b]:bounds[b + 1]``; `st` holds the
    scalar state, so a call that returns REFILL, EXHAUSTED or FULL continues where it stopped.
    """
    while st[ST_BATCHES] < n_batches:
        if st[ST_OPEN] == 0:
            st[ST_OPEN] = 1
            st[ST_ROOM] = budget
            bounds[st[ST_BATCHES]] = st[ST_UNITS]
        if st[ST_UNITS] == out.shape[0]:
            return FULL, -1
        room, total = st[ST_ROOM], st[ST_TOTAL]
        empty = st[ST_UNITS] == bounds[st[ST_BATCHES]]
        status, s, kind, idx, n = _choose(
            lengths, len_off, order, ord_hi, cur, cur_off, refillable, dlen, ndef, taken, weight,
            total, room, empty, max_unit, w,
        )  # fmt: skip
        if status != 0:
            return status, s
        if s >= 0:
            u = st[ST_UNITS]
            _take(
                s, kind, idx, n, lengths, len_off, order, cur, cur_off, dsid, doff, dlen, ndef,
                out[u], max_unit,
            )  # fmt: skip
            st[ST_UNITS] = u + 1
            taken[s] += n
            st[ST_TOTAL] = total + n
            st[ST_ROOM] = room - n
        if s < 0 or st[ST_ROOM] <= 0:  # nothing fits, or full (or one oversize unit): it closes
            st[ST_OPEN] = 0
            st[ST_BATCHES] += 1
            bounds[st[ST_BATCHES]] = st[ST_UNITS]
    return DONE, -1


def fill_reference(
    lengths: list[list[int]],
    orders: list[list[int]],
    weights: list[float],
    budget: int,
    max_unit: int,
    lookahead: int,
    n_batches: int,
) -> tuple[list[tuple[int, int, int, int]], list[int], bool]:
    """The same rule in plain Python over fixed orders (each source's order is its whole unit
    supply; no epochs): (units (source, sample, start, length), bounds of the completed batches,
    whether it stopped because an eligible source ran out) after at most `n_batches` batches."""
    num = len(weights)
    queues = []  # each source's units in order
    for s in range(num):
        q = []
        for sid in orders[s]:
            n, off = lengths[s][sid], 0
            while True:
                m = min(n - off, max_unit) if max_unit > 0 else n - off
                q.append((sid, off, m))
                off += m
                if off >= n:
                    break
        queues.append(q)
    head = [0] * num  # next unit of the queue not yet taken or deferred
    deferred: list[list[tuple[int, int, int]]] = [[] for _ in range(num)]
    taken = [0] * num
    total = 0
    units: list[tuple[int, int, int, int]] = []
    bounds = [0]
    room, empty = budget, True
    while len(bounds) <= n_batches:
        active = [s for s in range(num) if weights[s] > 0]
        elig = [s for s in active if weights[s] * total - taken[s] >= 0.0]
        if not elig:  # rounding: the most behind one (the first of equals)
            elig = [max(active, key=lambda s: (weights[s] * total - taken[s], -s))]
        # WF2Q: the eligible source whose head unit would finish first
        best = None
        for s in elig:
            if not deferred[s] and head[s] >= len(queues[s]):
                return units, bounds, True
            first = deferred[s][0] if deferred[s] else queues[s][head[s]]
            tag = (taken[s] + first[2]) / weights[s]
            if best is None or tag < best[0]:
                best = (tag, s)
        # it gives its first unit that fits (deferred ones first, then its window), else close
        s = best[1]
        cand = None
        for i, unit in enumerate(deferred[s]):
            if empty or unit[2] <= room:
                cand = ("d", i, unit)
                break
        if cand is None:
            for k in range(lookahead - len(deferred[s])):
                if head[s] + k >= len(queues[s]):
                    break
                unit = queues[s][head[s] + k]
                if empty or unit[2] <= room:
                    cand = ("q", k, unit)
                    break
        if cand is None:
            bounds.append(len(units))
            room, empty = budget, True
            continue
        kind, i, unit = cand
        if kind == "d":
            deferred[s].pop(i)
        else:
            deferred[s].extend(queues[s][head[s] : head[s] + i])
            head[s] += i + 1
        units.append((s, *unit))
        taken[s] += unit[2]
        total += unit[2]
        room -= unit[2]
        empty = False
        if room <= 0:
            bounds.append(len(units))
            room, empty = budget, True
    return units, bounds, False
