"""hdp's balance scheduler for a fixed set of micro-batches: group micro-batches (rings) placed
first on the ranks furthest below the maximum (or by list scheduling), local micro-batches filling
the idle gaps before them and then going to the least-loaded rank, then a local-move improvement
pass. The numba kernels it drives are in datapipe.plan.schedule.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from datapipe.plan.buckets import group_by_bucket_kernel
from datapipe.plan.common import Layout, group_times, local_times
from datapipe.plan.cost import CostModel
from datapipe.plan.packing import sort_desc_kernel
from datapipe.plan.schedule import (
    fill_gaps,
    improve_local,
    list_schedule_groups,
    place_groups,
    place_local,
    spread_samples,
)


class Placement(NamedTuple):
    """One order/placement rule's assignment (before the improvement pass)."""

    makespan: int
    g_order: np.ndarray  # group micro-batches in placement order
    g_ranks_sorted: np.ndarray  # their ranks, concatenated in that order
    b_rank: np.ndarray  # rank of each local micro-batch
    b_key: np.ndarray  # its slot key (2g: gap filler before group g; 2G: tail)
    fills: int  # local micro-batches placed in gaps
    tail: np.ndarray  # local micro-batches placed after all groups
    tail_rank: np.ndarray  # their ranks
    load: np.ndarray  # rank finish times


class Schedule(NamedTuple):
    """hdp's final assignment of a layout."""

    makespan: int
    g_order: np.ndarray
    g_ranks_sorted: np.ndarray
    b_rank: np.ndarray
    b_key: np.ndarray
    fills: int
    moves: int  # improvement-pass moves
    load: np.ndarray
    rule: tuple[int, bool]  # (group order, backfill) that won


def hdp_schedule(
    kg: np.ndarray,
    g_time: np.ndarray,
    b_time: np.ndarray,
    n_ranks: int,
    budget: int,
    rules: tuple[tuple[int, bool], ...] | None = None,
) -> Schedule:
    """hdp's balance for fixed micro-batches: three group orders x two placements (`rules`, all by
    default) through balance(), the smallest makespan kept, then the improvement pass on its
    tail."""
    n_g, n_bins = kg.shape[0], b_time.shape[0]
    orders = [np.lexsort((np.arange(n_g), -kg, -g_time))]
    if n_g > 1:
        orders.append(np.lexsort((np.arange(n_g), -g_time, -kg)))
        orders.append(np.lexsort((np.arange(n_g), -kg, -g_time * kg)))
    if rules is None or n_g <= 1:
        rules = tuple(
            (o, bf) for o in range(len(orders)) for bf in ((False, True)[: 1 + (n_g > 1)])
        )
    best, best_rule = None, None
    b_order = np.lexsort((np.arange(n_bins), -b_time)).astype(np.int64)
    for rule in rules:
        g_order = orders[rule[0]].astype(np.int64)
        cand = balance(g_order, kg, g_time, b_time, b_order, n_ranks, rule[1])
        if best is None or cand.makespan < best.makespan:
            best, best_rule = cand, rule
    assert best is not None and best_rule is not None
    _, g_order, g_ranks_sorted, b_rank, b_key, fills, tail, tail_rank, load = best
    moves = improve_local(tail_rank, b_time[tail], load, budget)
    b_rank[tail] = tail_rank
    # Tail micro-batches run after every group, so their rank's order among them is free.
    b_key[tail] = 2 * n_g + tail_rank
    makespan = int(load.max()) if n_ranks else 0
    return Schedule(
        makespan, g_order, g_ranks_sorted, b_rank, b_key, fills, int(moves), load, best_rule
    )


def balance(
    g_order: np.ndarray,
    kg: np.ndarray,
    g_time: np.ndarray,
    b_time: np.ndarray,
    b_order: np.ndarray,
    n_ranks: int,
    backfill: bool,
) -> Placement:
    """hdp's assignment for one order of the group micro-batches: rings first, each on the k ranks
    furthest below the maximum (or, with backfill, list scheduling: whenever ranks free up, the
    first group in the order that fits starts on them); local micro-batches fill the idle gaps before groups, then go by
    decreasing time to the least-loaded rank."""
    n_g, n_bins = g_order.shape[0], b_time.shape[0]
    if backfill:
        placed, g_ranks_sorted, load, gap_rank, gap_group, gap_size = list_schedule_groups(
            kg[g_order], g_time[g_order], n_ranks
        )
        g_order = g_order[placed]
    else:
        g_ranks_sorted, load, gap_rank, gap_group, gap_size = place_groups(
            kg[g_order], g_time[g_order], n_ranks
        )
    t_sorted = b_time[b_order]
    in_gap = fill_gaps(t_sorted, gap_size)
    filled = in_gap >= 0
    tail = np.flatnonzero(~filled)
    tail_rank = place_local(t_sorted[tail], load)
    sorted_rank = np.empty(n_bins, dtype=np.int64)
    sorted_rank[filled] = gap_rank[in_gap[filled]]
    sorted_rank[tail] = tail_rank
    # Slot keys: a gap filler just before its group (2g), group g at 2g+1, tails after all groups.
    sorted_key = np.empty(n_bins, dtype=np.int64)
    sorted_key[filled] = 2 * gap_group[in_gap[filled]]
    sorted_key[tail] = 2 * n_g
    b_rank = np.empty(n_bins, dtype=np.int64)
    b_rank[b_order] = sorted_rank
    b_key = np.empty(n_bins, dtype=np.int64)
    b_key[b_order] = sorted_key
    makespan = int(load.max()) if n_ranks else 0
    tail_orig = b_order[tail]
    return Placement(
        makespan,
        g_order,
        g_ranks_sorted,
        b_rank,
        b_key,
        int(filled.sum()),
        tail_orig,
        tail_rank,
        load,
    )


def rebalance_tail(
    layout: Layout,
    sched: Schedule,
    lengths: np.ndarray,
    cost: CostModel,
    cap: int,
    budget: int,
) -> tuple[Layout, Schedule]:
    """The local micro-batches after all groups (the tail), formed again sample by sample: each
    sample (longest time first) goes to the rank that is free first, into its open micro-batch
    while that has room, so the tail balances to one sample's time instead of one capacity-sized
    micro-batch's, and no rank idles while another runs two samples. Then the improvement pass.
    Kept unless the schedule it replaces is estimated faster (gap fillers stay as they were)."""
    n_g = layout.kg.shape[0]
    tail = sched.b_key >= 2 * n_g
    if not tail.any():
        return fill_idle(layout, sched, lengths, cost)
    b_off, b_items = layout.b_off, layout.b_items
    base = sched.load.copy()  # each rank's finish before its tail (tails run last)
    np.subtract.at(base, sched.b_rank[tail], layout.b_time[tail])
    in_tail = np.zeros(lengths.shape[0], dtype=bool)  # the tail's samples, by index
    in_tail[b_items[np.repeat(tail, np.diff(b_off))]] = True
    samples = np.flatnonzero(in_tail)
    w = cost.work_ns(lengths[samples], 1)
    order = sort_desc_kernel(w)  # longest first, ties by sample index
    load = base.copy()
    size_x, size_f = cost.size_table_ns()
    mb_sorted, t_rank = spread_samples(
        w[order], lengths[samples[order]], cap, cost.c_ns, cost.d * 1e9, size_x, size_f, load
    )
    mb_of = np.empty(samples.shape[0], dtype=np.int64)
    mb_of[order] = mb_sorted
    pos, t_off = group_by_bucket_kernel(mb_of, t_rank.shape[0])  # by micro-batch, then sample
    t_items = samples[pos]
    t_time = local_times(cost, lengths, t_off, t_items)
    load = base.copy()
    np.add.at(load, t_rank, t_time)
    moves = improve_local(t_rank, t_time, load, budget)
    makespan = int(load.max())
    if makespan > sched.makespan:
        return fill_idle(layout, sched, lengths, cost)
    keep = np.flatnonzero(~tail)  # gap fillers, in their order
    k_off = np.zeros(keep.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.diff(b_off)[keep], out=k_off[1:])
    k_items = b_items[np.repeat(~tail, np.diff(b_off))]
    new = layout._replace(
        b_off=np.concatenate([k_off, k_off[-1] + t_off[1:]]),
        b_items=np.concatenate([k_items, t_items]),
        b_time=np.concatenate([layout.b_time[keep], t_time]),
    )
    sched = sched._replace(
        makespan=makespan,
        b_rank=np.concatenate([sched.b_rank[keep], t_rank]),
        b_key=np.concatenate([sched.b_key[keep], 2 * n_g + t_rank]),
        moves=sched.moves + int(moves),
        load=load,
    )
    return fill_idle(new, sched, lengths, cost)


def fill_idle(
    layout: Layout, sched: Schedule, lengths: np.ndarray, cost: CostModel
) -> tuple[Layout, Schedule]:
    """Give each rank that runs nothing a local micro-batch: the longest tail one on a rank that
    runs two or more, else the longest gap filler on such a rank (its group starts when it did),
    else the shortest sample of a tail micro-batch of several, else a short sample widen filled
    into a ring (if it takes no longer alone than the step). None raises the makespan: the idle
    rank's time is at most the step's, and the donor's finish does not grow. Rarely needed after
    rebalance_tail (when that schedule was not kept, or rings left a rank out)."""
    n, n_g = sched.load.shape[0], layout.kg.shape[0]
    busy = np.bincount(sched.g_ranks_sorted, minlength=n) + np.bincount(sched.b_rank, minlength=n)
    idle = np.flatnonzero(busy == 0)
    if idle.size == 0:
        return layout, sched
    items = np.split(layout.b_items, layout.b_off[1:-1]) if layout.b_items.size else []
    groups = np.split(layout.g_items, layout.g_off[1:-1]) if n_g else []
    g_time = layout.g_time.copy()
    b_time, b_rank, b_key = layout.b_time.copy(), sched.b_rank.copy(), sched.b_key.copy()
    load = sched.load.copy()
    for r in idle.tolist():
        tail = b_key >= 2 * n_g
        donors = np.flatnonzero(tail & (busy[b_rank] >= 2))
        if donors.size == 0:
            donors = np.flatnonzero(busy[b_rank] >= 2)  # gap fillers
        if donors.size:  # move a whole micro-batch
            m = int(donors[np.argmax(b_time[donors])])
            if b_key[m] >= 2 * n_g:  # a tail one: its rank finishes earlier
                load[b_rank[m]] -= b_time[m]
            busy[b_rank[m]] -= 1
        else:
            one = _split_local(items, b_time, tail, load, b_rank, lengths, cost)
            if one is None:
                one = _split_group(groups, g_time, layout, lengths, cost, int(load.max()))
            if one is None:
                break
            items.append(one)
            b_time = np.append(b_time, local_times(cost, lengths, np.array([0, 1]), one))
            b_rank, b_key = np.append(b_rank, r), np.append(b_key, 0)
            m = b_time.shape[0] - 1
        b_rank[m], b_key[m] = r, 2 * n_g + r
        load[r] += b_time[m]
        busy[r] += 1
    b_off = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum([x.size for x in items], out=b_off[1:])
    g_off = np.zeros(n_g + 1, dtype=np.int64)
    np.cumsum([x.size for x in groups], out=g_off[1:])
    layout = layout._replace(
        g_off=g_off,
        g_items=np.concatenate(groups).astype(np.int64) if n_g else layout.g_items,
        g_time=g_time,
        b_off=b_off,
        b_items=np.concatenate(items).astype(np.int64) if items else layout.b_items,
        b_time=b_time,
    )
    return layout, sched._replace(makespan=int(load.max()), b_rank=b_rank, b_key=b_key, load=load)


def _split_local(
    items: list,
    b_time: np.ndarray,
    tail: np.ndarray,
    load: np.ndarray,
    b_rank: np.ndarray,
    lengths: np.ndarray,
    cost: CostModel,
) -> np.ndarray | None:
    """Take the shortest sample off the longest tail micro-batch of several (items, b_time and
    its rank's load updated in place); None if there is none."""
    multi = np.flatnonzero(tail & (np.array([x.size for x in items]) >= 2))
    if multi.size == 0:
        return None
    m = int(multi[np.argmax(b_time[multi])])
    out = int(np.argmin(cost.work_ns(lengths[items[m]], 1)))
    one = items[m][out : out + 1]
    items[m] = np.delete(items[m], out)
    t = int(local_times(cost, lengths, np.array([0, items[m].size]), items[m])[0])
    load[b_rank[m]] -= b_time[m] - t
    b_time[m] = t
    return one


def _split_group(
    groups: list,
    g_time: np.ndarray,
    layout: Layout,
    lengths: np.ndarray,
    cost: CostModel,
    makespan: int,
) -> np.ndarray | None:
    """Take the shortest of the short samples widen filled into a ring off the longest such ring
    (groups and g_time updated in place; the members' loads are left as they were, an upper
    bound), if alone it takes no longer than the step; else None."""
    multi = [g for g, x in enumerate(groups) if x.size >= 2]
    if not multi:
        return None
    g = max(multi, key=lambda x: (g_time[x], -x))
    out = 1 + int(np.argmin(cost.work_ns(lengths[groups[g][1:]], 1)))
    one = groups[g][out : out + 1]
    if local_times(cost, lengths, np.array([0, 1]), one)[0] > makespan:
        return None
    groups[g] = np.delete(groups[g], out)
    k, j = layout.kg[g : g + 1], layout.jg[g : g + 1]
    g_time[g] = group_times(cost, lengths, np.array([0, groups[g].size]), groups[g], k, j)[0]
    return one
