"""Pieces every planning policy shares: the lower bound, group times, local packing, the group
size (and offload layers) of each sample, and the assembly of micro-batches into a StepPlan.

Times are int64 nanoseconds from datapipe.plan.cost; rank times come from the slot-order replay.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from datapipe.errors import MixlenError
from datapipe.jit import njit
from datapipe.plan.buckets import group_by_bucket_kernel
from datapipe.plan.cost import CostModel
from datapipe.plan.packing import bfd_kernel
from datapipe.plan.schedule import spread_samples
from datapipe.plan.setup import PlanSetup
from datapipe.plan.stepplan import StepPlan, replay_kernel


class Layout(NamedTuple):
    """Micro-batches of a dynamic plan before placement: group micro-batches (size k, offload
    layers j, samples g_items[g_off[g]:g_off[g+1]], member time) and local micro-batches (samples
    b_items[b_off[b]:b_off[b+1]], time)."""

    kg: np.ndarray
    jg: np.ndarray
    g_off: np.ndarray
    g_items: np.ndarray
    g_time: np.ndarray
    b_off: np.ndarray
    b_items: np.ndarray
    b_time: np.ndarray


def group_time_ns(
    cost: CostModel, lengths: np.ndarray, k: np.ndarray, offload_layers: np.ndarray
) -> np.ndarray:
    """Member time of a group micro-batch holding one sample: c + share + exposed comm/offload."""
    s = np.asarray(lengths, dtype=np.int64)
    one = np.arange(s.shape[0] + 1, dtype=np.int64)
    return group_times(
        cost, s, one, one[:-1], np.asarray(k, np.int64), np.asarray(offload_layers, np.int64)
    )


def lower_bound_ns(cost: CostModel, lengths: np.ndarray, num_ranks: int, capacity: int) -> int:
    """max(total work / N, largest member share): each sample on its smallest group with no
    offload (member shares in integer ns with their exposed ring traffic, as the planners charge
    them), plus c per rank-micro-batch: ceil(tokens / C) of them, or N when that is more (the
    busiest of u ranks runs at least (c * max(ceil(tokens / C), u) + work) / u, which falls as u
    grows to N; so the bound holds however many micro-batches a plan makes). A larger
    group only adds exposed traffic in total, so this bounds every hdp/naive-hdp plan without
    offload or widening from below (static and widen split more, offload changes group sizes:
    they may go under it)."""
    return max(lower_bound_terms(cost, lengths, num_ranks, capacity))


def lower_bound_terms(
    cost: CostModel, lengths: np.ndarray, num_ranks: int, capacity: int, best_case: bool = True
) -> tuple[int, int]:
    """(ceil(total work / N), largest member share) of lower_bound_ns. The first term also bounds
    widened plans (a wider group adds exposed traffic and overhead in total, never removes work).
    `best_case`: groups that fit in a node on the node link (a bound whatever the placement);
    else timed as the planners time them before placement (cost.spans_nodes)."""
    s = lengths[lengths > 0]
    if s.size == 0:
        return 0, 0
    if best_case:
        cost = dataclasses.replace(cost, island_ranks=0)
    k = np.maximum(1, -(-s // capacity))
    shares = cost.work_ns(s, 1)
    long_ = np.flatnonzero(k > 1)
    shares[long_] = group_time_ns(cost, s[long_], k[long_], np.zeros_like(long_)) - cost.c_ns
    # c per rank-micro-batch: at least ceil(tokens / C) of them, and at least N (whatever the
    # count: a plan using u <= N ranks takes at least (c * max(count, u) + work) / u)
    n_mb = max(-(-int(s.sum()) // capacity), num_ranks)
    total = int((k * shares).sum()) + cost.c_ns * n_mb
    share = int(shares.max()) + cost.c_ns
    return -(-total // num_ranks), share


def plan_lower_bound_ns(cost: CostModel, lengths: np.ndarray, num_ranks: int, capacity: int) -> int:
    """The lower bound every plan records for reports: no plan of this batch on N ranks without
    offload finishes sooner, whatever group it gives each sample, from the smallest one (hdp,
    naive-hdp) up to N ranks (widen, the static mesh). max of:

    - work / N: per sample, attention and linear work and the ring time no compute can hide,
      (1 - overlap) * ring, at its smallest group k (a wider group only adds attention overhead
      and traffic in total; other samples in the micro-batch may hide the rest) plus the size
      term at its widest, N ranks (a member's per-position rate only falls with fewer positions;
      T*r(T) is superadditive, so sharing a micro-batch never lowers it either), and c per
      rank-micro-batch as in lower_bound_terms (less 2 ns per sample and rank of its widest
      group, for the rounding of each member's terms);
    - the longest sample's member time (c included) on the group from its smallest up to
      min(N, S) that makes it least (every member time grows with the sample's length).

    Without a size term and with groups that only slow a sample down this is lower_bound_ns's
    value or less; the planners' own targets stay lower_bound_terms (the smallest-group rule)."""
    s = lengths[lengths > 0]
    if s.size == 0:
        return 0
    cost = dataclasses.replace(cost, island_ranks=0)  # groups in a node on the node link
    n = int(num_ranks)
    sf = s.astype(np.float64)
    # local samples' work in float (its rounding is within the slack below), rings' in ns
    is_long = s > capacity
    local = sf[~is_long]
    work = cost.a * float(local @ (local + cost.attn_n_half)) + cost.b * float(local.sum())
    total = 0
    if is_long.any():
        sl = s[is_long].astype(np.int64)
        kl = -(-sl // capacity)
        ring = np.asarray(cost.ring_ns(sl / kl, kl), dtype=np.int64)
        # only the part no compute hides: short samples packed into a ring's micro-batch (widen's
        # fill) hide more of its traffic than its own attention does
        unhidden = ring - cost.ring_hideable_ns(ring)
        total += int((kl * (cost.work_ns(sl, kl) + unhidden)).sum())
    if cost.size_knots or cost.d:  # the size term split over all N ranks, floored
        rate = np.asarray(cost.size_ns(sf / n), dtype=np.float64)
        total += int(np.maximum(np.floor(rate * n) - n, 0.0).sum())
    n_mb = max(-(-int(s.sum()) // capacity), n)
    # each term is rounded to ns per member: k members of a wider group may sum up to about k ns
    # less than k_min members did; leave that much room (at most 2 ns per sample and rank)
    slack = 2 * int(np.minimum(s, n).sum())
    total += int(np.floor(work * 1e9)) + cost.c_ns * n_mb - slack
    longest = int(s.max())
    kmin = max(1, -(-longest // capacity))  # more than N when no group holds it (plans refuse)
    widths = np.arange(kmin, max(kmin, min(n, longest)) + 1, dtype=np.int64)
    one = np.full(widths.shape, longest, dtype=np.int64)
    share = int(group_time_ns(cost, one, widths, np.zeros_like(widths)).min())
    return max(-(-total // n), share)


def too_long(
    config: PlanSetup,
    lengths: np.ndarray,
    sample_ids: np.ndarray,
    limit: int,
    what: str,
    room: str | None = None,
) -> None:
    """MixlenError naming the longest sample above `limit` (none: return), and the settings (as
    the user wrote them) that would make room."""
    bad = np.flatnonzero(lengths > limit)
    if bad.size:
        i = int(bad[np.argmax(lengths[bad])])
        if room is None:  # the group a sample needs: more ranks, capacity or offload
            room = (
                f"raise {config.key('num_ranks')} or {config.key('capacity')}, enable "
                f"{config.key('offload')}, or cap sample length at preprocess time"
            )
        raise MixlenError(
            f"sample {int(sample_ids[i])} has {int(lengths[i])} tokens, more than {what} = {limit}: "
            f"no group can hold it ({room})"
        )


def assemble(
    policy: str,
    config: PlanSetup,
    cost: CostModel,
    lengths: np.ndarray,
    sample_ids: np.ndarray,
    mb_key: np.ndarray,
    mb_k: np.ndarray,
    mb_ranks: np.ndarray,
    mb_capacity: np.ndarray,
    mb_offload_layers: np.ndarray,
    mb_items_off: np.ndarray,
    items: np.ndarray,
    mb_time: np.ndarray,
    meta: dict,
    lower_bound: int,
) -> StepPlan:
    """Order micro-batches by key (the slot order), re-time groups placed across nodes, replay,
    and build the StepPlan."""
    n_mb = mb_k.shape[0]
    order = np.argsort(mb_key, kind="stable")
    k = mb_k[order]
    goff = np.zeros(n_mb + 1, dtype=np.int64)
    np.cumsum(k, out=goff[1:])
    src_goff = np.zeros(n_mb + 1, dtype=np.int64)
    np.cumsum(mb_k, out=src_goff[1:])
    gidx = gather(src_goff, order, goff)
    ranks = mb_ranks[gidx].astype(np.int32)
    cnt = np.diff(mb_items_off)[order]
    poff = np.zeros(n_mb + 1, dtype=np.int64)
    np.cumsum(cnt, out=poff[1:])
    pidx = gather(mb_items_off, order, poff)
    item = items[pidx]
    times = mb_time[order].astype(np.int64)
    offload_layers = mb_offload_layers[order].astype(np.int64)
    times = retime_spanning(cost, lengths, goff, ranks, poff, item, offload_layers, times)
    finish = replay_kernel(goff, ranks.astype(np.int64), times, config.num_ranks)
    offload = offload_layers.astype(np.float64) / cost.num_layers
    return StepPlan(
        policy=policy,
        num_ranks=config.num_ranks,
        capacity=config.capacity,
        cost_hash=cost.hash,
        seed=config.seed,
        sample_ids=sample_ids,
        lengths=lengths,
        mb_group_offsets=goff,
        group_ranks=ranks,
        mb_capacity=mb_capacity[order].astype(np.int64),
        mb_offload=offload,
        mb_piece_offsets=poff,
        piece_item=item.astype(np.int64),
        piece_start=np.zeros(item.shape[0], dtype=np.int64),
        piece_end=lengths[item].astype(np.int64),
        mb_time_ns=times,
        rank_time_ns=finish,
        makespan_ns=int(finish.max()) if finish.size else 0,
        lower_bound_ns=lower_bound,
        meta=meta,
    )


@njit(cache=True)
def gather(src_off: np.ndarray, order: np.ndarray, dst_off: np.ndarray) -> np.ndarray:
    """Flat source positions of segments `order` laid out at dst_off."""
    out = np.empty(dst_off[-1], dtype=np.int64)
    for i in range(order.shape[0]):
        s = src_off[order[i]]
        for j in range(dst_off[i + 1] - dst_off[i]):
            out[dst_off[i] + j] = s + j
    return out


def pack_local(
    short_idx: np.ndarray, lengths: np.ndarray, capacity: int, min_bins: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit pack samples short_idx into micro-batches: (items_off [B+1], items by bin). When
    that makes fewer than min(min_bins, samples) micro-batches, the samples are spread instead,
    longest first onto the one of min_bins slots with the fewest tokens (a new micro-batch there
    when its open one has no room), so that many slots each get one or more."""
    if short_idx.size == 0:
        return np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    s = np.ascontiguousarray(lengths[short_idx])
    b = bfd_kernel(s, int(capacity))
    n_bins = int(b.max()) + 1
    if n_bins < min(min_bins, short_idx.size):
        order = np.lexsort((np.arange(s.shape[0]), -s))
        load = np.zeros(min_bins, dtype=np.int64)
        zero = np.zeros(1)  # no size term: positions only
        mb, mb_rank = spread_samples(s[order], s[order], int(capacity), 0, 0.0, zero, zero, load)
        b[order] = mb
        n_bins = mb_rank.shape[0]
    order, off = group_by_bucket_kernel(b, n_bins)
    return off, short_idx[order]


def dynamic_limit(config: PlanSetup, cost: CostModel, lengths: np.ndarray) -> np.ndarray:
    """Longest sample a group of N ranks holds, per sample: N * C, or N * C_eff(r) with offload
    (r: the largest ratio whose copies hide under the sample's forward)."""
    n, cap = config.num_ranks, config.capacity
    if not config.offload:
        return np.full(np.shape(lengths), n * cap, dtype=np.int64)
    caps = cost.offload_capacity(cap, np.arange(cost.num_layers + 1))
    return caps[cost.max_offload_layers(lengths)] * n


def dynamic_groups(
    config: PlanSetup,
    cost: CostModel,
    lengths: np.ndarray,
    sample_ids: np.ndarray,
    target_ns: int | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Group size k and offload layers j of every sample (k = 0 for zero-length samples)."""
    num_ranks, capacity = config.num_ranks, config.capacity
    s = lengths
    k = np.where(s > 0, np.maximum(1, -(-s // capacity)), 0)
    j = np.zeros_like(s)
    if not config.offload:
        too_long(config, lengths, sample_ids, num_ranks * capacity, "N * C")
        return k, j
    l_ = cost.num_layers
    caps = cost.offload_capacity(capacity, np.arange(l_ + 1))  # nondecreasing in j
    jmax = cost.max_offload_layers(s)
    bad = np.flatnonzero(s > caps[jmax] * num_ranks)
    if bad.size:
        i = int(bad[0])
        limit = int(caps[jmax[i]]) * num_ranks
        too_long(config, s[i : i + 1], sample_ids[i : i + 1], limit, "N * C_eff")
    long_idx = np.flatnonzero(s > capacity)
    sl = s[long_idx]
    d_min = -(-sl // caps[jmax[long_idx]])
    k_hi = np.maximum(k[long_idx], d_min)
    if target_ns is None:
        kk = d_min
    else:
        # Smallest k in [d_min, k_hi] whose member time fits the target (k_hi if none): time is
        # at least c + work/k, so start at the k that bound allows and step up.
        work = cost.a * sl.astype(np.float64) ** 2 + cost.b * sl
        room = max(target_ns - cost.c_ns, 1)
        kk = np.clip(np.floor(work * 1e9 / room).astype(np.int64), d_min, k_hi)
        todo = np.arange(sl.shape[0])
        while todo.size:
            kt = kk[todo]
            jt = np.searchsorted(caps, -(-sl[todo] // kt))
            t = group_time_ns(cost, sl[todo], kt, jt)
            todo = todo[(t > target_ns) & (kt < k_hi[todo])]
            kk[todo] += 1
    k[long_idx] = kk
    j[long_idx] = np.searchsorted(caps, -(-sl // kk))
    return k, j


def local_times(
    cost: CostModel, lengths: np.ndarray, b_off: np.ndarray, b_items: np.ndarray
) -> np.ndarray:
    """Time of each local micro-batch: c + the whole compute of its samples + its size term
    (CostModel.size_ns of its T positions)."""
    if b_off.shape[0] <= 1:
        return np.zeros(0, np.int64)
    s = lengths[b_items]
    w1 = np.add.reduceat(cost.work_ns(s, 1), b_off[:-1])
    return (cost.c_ns + w1 + cost.size_ns(np.add.reduceat(s, b_off[:-1]))).astype(np.int64)


def group_times(
    cost: CostModel,
    lengths: np.ndarray,
    g_off: np.ndarray,
    g_items: np.ndarray,
    kg: np.ndarray,
    jg: np.ndarray,
    spans: np.ndarray | None = None,
) -> np.ndarray:
    """Member time of group micro-batches holding one or more samples (each split zigzag over the
    group; group g holds g_items[g_off[g]:g_off[g + 1]]): c + shares (attention at its chunk
    efficiency) + the size term + exposed ring/offload of the member's positions n. `spans` (per
    group): the group's ranks are in more than one node (default: cost.spans_nodes(k))."""
    if kg.shape[0] == 0:
        return np.zeros(0, np.int64)
    per = np.repeat(kg, np.diff(g_off))
    s = lengths[g_items]
    attn = np.add.reduceat(cost.attn_ns(s, per), g_off[:-1])
    lin = np.add.reduceat(cost.linear_ns(s, per), g_off[:-1])
    work = np.add.reduceat(cost.work_ns(s, per), g_off[:-1])
    n = np.add.reduceat(s, g_off[:-1]).astype(np.float64) / kg
    ring = cost.ring_ns(n, kg, spans)
    off = cost.offload_ns(n, jg.astype(np.float64) / cost.num_layers)
    size = cost.size_ns(n)
    work, lin = work + size, lin + size
    return (cost.c_ns + work + cost.exposed_ns(attn, lin, ring, off)).astype(np.int64)


def mb_spans_nodes(cost: CostModel, mb_group_offsets: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Per placed micro-batch (in table order): do its group's ranks sit in more than one node,
    i.e. use the link between nodes (all True with one link class, ranks_per_node = 0)?"""
    n_mb = mb_group_offsets.shape[0] - 1
    if not cost.ranks_per_node:
        return np.ones(n_mb, dtype=bool)
    if n_mb == 0:
        return np.zeros(0, dtype=bool)
    node = np.asarray(ranks, dtype=np.int64) // cost.ranks_per_node
    lo = np.minimum.reduceat(node, mb_group_offsets[:-1])
    hi = np.maximum.reduceat(node, mb_group_offsets[:-1])
    return lo != hi


def retime_spanning(
    cost: CostModel,
    lengths: np.ndarray,
    goff: np.ndarray,
    ranks: np.ndarray,
    poff: np.ndarray,
    item: np.ndarray,
    offload_layers: np.ndarray,
    times: np.ndarray,
) -> np.ndarray:
    """Times of placed micro-batches (table order) on the link their ranks really use: groups
    were timed before placement (cost.spans_nodes: in an island of several nodes every group on
    the link between nodes); a group placed inside one node is re-timed on the node link."""
    if not cost.ranks_per_node:
        return times
    k = np.diff(goff)
    actual = mb_spans_nodes(cost, goff, ranks)
    fix = np.flatnonzero((k > 1) & (actual != cost.spans_nodes(k)))
    if fix.size == 0:
        return times
    cnt = np.diff(poff)[fix]
    sub_off = np.zeros(fix.shape[0] + 1, dtype=np.int64)
    np.cumsum(cnt, out=sub_off[1:])
    sub_items = item[gather(poff, fix.astype(np.int64), sub_off)]
    out = times.copy()
    out[fix] = group_times(
        cost, lengths, sub_off, sub_items, k[fix], offload_layers[fix], actual[fix]
    )
    return out


def dynamic_layout(
    config: PlanSetup,
    cost: CostModel,
    lengths: np.ndarray,
    sample_ids: np.ndarray,
    target_ns: int | None,
    spread_over: int = 0,
) -> tuple[Layout, np.ndarray]:
    """(layout, C_eff per offload layer count) of hdp and naive-hdp: one group micro-batch per
    sample that needs k >= 2 ranks or offload, the other samples packed best-fit into local
    micro-batches of at most C positions; with `spread_over` = N, into at least as many as the
    ranks the groups leave (pack_local's min_bins), so that every rank can get one."""
    cap = config.capacity
    k, j = dynamic_groups(config, cost, lengths, sample_ids, target_ns)
    caps = cost.offload_capacity(cap, np.arange(cost.num_layers + 1))
    grp = np.flatnonzero((k >= 2) | (j > 0))
    short = np.flatnonzero((k == 1) & (j == 0))
    kg, jg = k[grp], j[grp]
    b_off, b_items = pack_local(short, lengths, cap, spread_over - int(kg.sum()))
    layout = Layout(
        kg=kg,
        jg=jg,
        g_off=np.arange(grp.shape[0] + 1, dtype=np.int64),
        g_items=grp.astype(np.int64),
        g_time=group_time_ns(cost, lengths[grp], kg, jg),
        b_off=b_off,
        b_items=b_items,
        b_time=local_times(cost, lengths, b_off, b_items),
    )
    return layout, caps


def assemble_dynamic(
    policy: str,
    config: PlanSetup,
    cost: CostModel,
    lengths: np.ndarray,
    sample_ids: np.ndarray,
    layout: Layout,
    caps: np.ndarray,
    mb_key: np.ndarray,
    mb_ranks: np.ndarray,
    meta: dict,
    lower_bound: int,
) -> StepPlan:
    """The StepPlan of a placed dynamic layout: group micro-batches first, then local ones, in
    the order of `mb_key` / `mb_ranks` (ranks concatenated per micro-batch in that order)."""
    n_bins = layout.b_off.shape[0] - 1
    mb_k = np.concatenate([layout.kg, np.ones(n_bins, dtype=np.int64)])
    mb_time = np.concatenate([layout.g_time, layout.b_time]).astype(np.int64)
    mb_cap = np.concatenate([caps[layout.jg], np.full(n_bins, config.capacity, dtype=np.int64)])
    mb_off_layers = np.concatenate([layout.jg, np.zeros(n_bins, dtype=np.int64)])
    items_off = np.concatenate([layout.g_off[:-1], layout.g_off[-1] + layout.b_off])
    items = np.concatenate([layout.g_items, layout.b_items]).astype(np.int64)
    meta["offload"] = bool(config.offload)
    return assemble(
        policy,
        config,
        cost,
        lengths,
        sample_ids,
        mb_key,
        mb_k,
        mb_ranks,
        mb_cap,
        mb_off_layers,
        items_off,
        items,
        mb_time,
        meta,
        lower_bound,
    )
