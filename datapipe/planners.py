"""Step planners: `hdp` (ByteScale's balance scheduler), `naive-hdp` (dynamic groups, no balance)
and `static` (a fixed DP x CP mesh), each producing a StepPlan.

Shared rules:

- A sample of length S goes on the smallest group k whose largest zigzag chunk pair, ceil(S/k),
  fits the capacity (any k from 1 to N). With offload on, ByteScale's Eq. 3 picks the offload ratio
  r = j/l that minimises the ranks D(s) subject to the copies hiding under the forward compute
  (CostModel.offload_capacity / max_offload_layers); hdp then widens the group again while its
  member share would exceed the no-offload lower bound, so offload only frees ranks where that does
  not lengthen the critical path (naive-hdp uses the smallest D as is).
- Short samples (k = 1) are packed best-fit into micro-batches of at most C positions
  (datapipe.packing); long samples get a group micro-batch of their own.
- Zero-length samples get no micro-batch (nothing to compute). A sample that no group of N ranks can
  hold (S > N * C, or N * C_eff with offload) is an error (MixlenError naming the sample).
- Times are int64 nanoseconds from datapipe.cost; rank times come from the slot-order replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from datapipe.cost import CostModel
from datapipe.errors import ConfigError, MixlenError
from datapipe.packing import bfd_kernel, group_by_bucket_kernel
from datapipe.plan import StepPlan, replay_kernel

POLICIES = ("hdp", "naive-hdp", "static")


@dataclass(frozen=True)
class PlannerConfig:
    """Planner settings; `build(cost)` returns a Planner."""

    policy: str = "hdp"
    num_ranks: int = 8
    capacity: int = 8192
    offload: bool = False
    max_context: int | None = None  # static: the run's longest context (default: batch maximum)
    seed: int = 0
    improve_rounds: int = 4  # hdp: improvement pass budget, in multiples of N moves

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy: unknown '{self.policy}' (known: {', '.join(POLICIES)})")
        if not (isinstance(self.num_ranks, int) and self.num_ranks >= 1):
            raise ConfigError(f"num_ranks: must be an int >= 1, got {self.num_ranks!r}")
        if not (isinstance(self.capacity, int) and self.capacity >= 1):
            raise ConfigError(f"capacity: must be an int >= 1, got {self.capacity!r}")
        if self.max_context is not None and self.max_context < 1:
            raise ConfigError(f"max_context: must be >= 1, got {self.max_context!r}")

    def build(self, cost: CostModel) -> Planner:
        self.validate()
        return Planner(self, cost)


class Planner:
    """Plans steps for one configuration and cost model."""

    def __init__(self, config: PlannerConfig, cost: CostModel) -> None:
        self.config = config
        self.cost = cost

    def plan(self, lengths: np.ndarray, sample_ids: np.ndarray | None = None) -> StepPlan:
        """Plan one global batch (lengths in batch order; ids default to 0..n-1)."""
        lengths = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
        if sample_ids is None:
            sample_ids = np.arange(lengths.shape[0], dtype=np.int64)
        sample_ids = np.ascontiguousarray(sample_ids, dtype=np.int64).reshape(-1)
        if sample_ids.shape != lengths.shape:
            raise MixlenError("sample_ids and lengths must have the same size")
        if lengths.size and lengths.min() < 0:
            raise MixlenError("sample lengths must be >= 0")
        policy = self.config.policy
        if policy == "static":
            return _plan_static(self.config, self.cost, lengths, sample_ids)
        return _plan_dynamic(self.config, self.cost, lengths, sample_ids, balance=policy == "hdp")


def plan_step(
    lengths: np.ndarray,
    config: PlannerConfig,
    cost: CostModel,
    sample_ids: np.ndarray | None = None,
) -> StepPlan:
    """One-call form of PlannerConfig(...).build(cost).plan(lengths, sample_ids)."""
    return config.build(cost).plan(lengths, sample_ids)


# ------------------------------------------------------------------------------------------------
# Shared pieces
# ------------------------------------------------------------------------------------------------
def group_time_ns(
    cost: CostModel, lengths: np.ndarray, k: np.ndarray, offload_layers: np.ndarray
) -> np.ndarray:
    """Member time of a group micro-batch holding one sample: c + share + exposed comm/offload."""
    s = np.asarray(lengths, dtype=np.int64)
    k = np.asarray(k, dtype=np.int64)
    attn = cost.attn_ns(s, k)
    lin = cost.linear_ns(s, k)
    n = s.astype(np.float64) / k
    ring = cost.ring_ns(n, k)
    off = cost.offload_ns(n, np.asarray(offload_layers, dtype=np.float64) / cost.num_layers)
    return cost.c_ns + cost.work_ns(s, k) + cost.exposed_ns(attn, lin, ring, off)


def lower_bound_ns(cost: CostModel, lengths: np.ndarray, num_ranks: int, capacity: int) -> int:
    """max(total work / N, largest member share): each sample on its smallest group with no
    offload (member shares in integer ns with their exposed ring traffic, as the planners charge
    them), plus c for the fewest rank-micro-batches any plan needs (ceil(tokens / C)). A larger
    group only adds exposed traffic in total, so this bounds every hdp/naive-hdp plan without
    offload from below (static splits differently and may go under it)."""
    s = lengths[lengths > 0]
    if s.size == 0:
        return 0
    k = np.maximum(1, -(-s // capacity))
    shares = cost.work_ns(s, 1)
    long_ = np.flatnonzero(k > 1)
    shares[long_] = group_time_ns(cost, s[long_], k[long_], np.zeros_like(long_)) - cost.c_ns
    total = int((k * shares).sum()) + cost.c_ns * int(-(-int(s.sum()) // capacity))
    share = int(shares.max()) + cost.c_ns
    return max(-(-total // num_ranks), share)


def _too_long(lengths: np.ndarray, sample_ids: np.ndarray, limit: int, what: str) -> None:
    bad = np.flatnonzero(lengths > limit)
    if bad.size:
        i = int(bad[np.argmax(lengths[bad])])
        raise MixlenError(
            f"sample {int(sample_ids[i])} has {int(lengths[i])} tokens, more than {what} = {limit}: "
            "no group can hold it (raise --ranks or --capacity, enable --offload, or cap sample "
            "length at preprocess time)"
        )


def _assemble(
    policy: str,
    config: PlannerConfig,
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
    """Order micro-batches by key (the slot order), replay, and build the StepPlan."""
    n_mb = mb_k.shape[0]
    order = np.argsort(mb_key, kind="stable")
    k = mb_k[order]
    goff = np.zeros(n_mb + 1, dtype=np.int64)
    np.cumsum(k, out=goff[1:])
    src_goff = np.zeros(n_mb + 1, dtype=np.int64)
    np.cumsum(mb_k, out=src_goff[1:])
    gidx = _gather(src_goff, order, goff)
    ranks = mb_ranks[gidx].astype(np.int32)
    cnt = np.diff(mb_items_off)[order]
    poff = np.zeros(n_mb + 1, dtype=np.int64)
    np.cumsum(cnt, out=poff[1:])
    pidx = _gather(mb_items_off, order, poff)
    item = items[pidx]
    times = mb_time[order].astype(np.int64)
    finish = replay_kernel(goff, ranks.astype(np.int64), times, config.num_ranks)
    offload = mb_offload_layers[order].astype(np.float64) / cost.num_layers
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
def _gather(src_off: np.ndarray, order: np.ndarray, dst_off: np.ndarray) -> np.ndarray:
    """Flat source positions of segments `order` laid out at dst_off."""
    out = np.empty(dst_off[-1], dtype=np.int64)
    for i in range(order.shape[0]):
        s = src_off[order[i]]
        for j in range(dst_off[i + 1] - dst_off[i]):
            out[dst_off[i] + j] = s + j
    return out


def _pack_local(
    short_idx: np.ndarray, lengths: np.ndarray, capacity: int
) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit pack samples short_idx into micro-batches: (items_off [B+1], items by bin)."""
    if short_idx.size == 0:
        return np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    b = bfd_kernel(np.ascontiguousarray(lengths[short_idx]), int(capacity))
    order, off = group_by_bucket_kernel(b, int(b.max()) + 1)
    return off, short_idx[order]


def _dynamic_groups(
    cost: CostModel,
    lengths: np.ndarray,
    sample_ids: np.ndarray,
    num_ranks: int,
    capacity: int,
    offload: bool,
    target_ns: int | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Group size k and offload layers j of every sample (k = 0 for zero-length samples)."""
    s = lengths
    k = np.where(s > 0, np.maximum(1, -(-s // capacity)), 0)
    j = np.zeros_like(s)
    if not offload:
        _too_long(lengths, sample_ids, num_ranks * capacity, "N * C")
        return k, j
    l_ = cost.num_layers
    caps = cost.offload_capacity(capacity, np.arange(l_ + 1))  # nondecreasing in j
    jmax = cost.max_offload_layers(s)
    bad = np.flatnonzero(s > caps[jmax] * num_ranks)
    if bad.size:
        i = int(bad[0])
        _too_long(s[i : i + 1], sample_ids[i : i + 1], int(caps[jmax[i]]) * num_ranks, "N * C_eff")
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


# ------------------------------------------------------------------------------------------------
# hdp and naive-hdp
# ------------------------------------------------------------------------------------------------
def _plan_dynamic(
    config: PlannerConfig,
    cost: CostModel,
    lengths: np.ndarray,
    sample_ids: np.ndarray,
    balance: bool,
) -> StepPlan:
    n_ranks, cap = config.num_ranks, config.capacity
    lb = lower_bound_ns(cost, lengths, n_ranks, cap)
    target = lb if balance else None
    k, j = _dynamic_groups(cost, lengths, sample_ids, n_ranks, cap, config.offload, target)
    caps = cost.offload_capacity(cap, np.arange(cost.num_layers + 1))
    # Group micro-batches: one per sample that needs k >= 2 ranks or offload.
    grp = np.flatnonzero((k >= 2) | (j > 0))
    short = np.flatnonzero((k == 1) & (j == 0))
    g_time = group_time_ns(cost, lengths[grp], k[grp], j[grp])
    b_off, b_items = _pack_local(short, lengths, cap)
    n_bins = b_off.shape[0] - 1
    w1 = cost.work_ns(lengths, 1)
    b_time = (
        cost.c_ns + np.add.reduceat(w1[b_items], b_off[:-1]) if n_bins else np.zeros(0, np.int64)
    )
    b_tokens = np.add.reduceat(lengths[b_items], b_off[:-1]) if n_bins else np.zeros(0, np.int64)
    n_g = grp.shape[0]
    mb_k = np.concatenate([k[grp], np.ones(n_bins, dtype=np.int64)])
    mb_time = np.concatenate([g_time, b_time]).astype(np.int64)
    if balance:
        # Rings first, by decreasing member time, each on the k ranks furthest below the maximum;
        # then local micro-batches by decreasing time onto the least-loaded rank; then improve.
        kg = k[grp]
        orders = [np.lexsort((np.arange(n_g), -kg, -g_time))]
        if n_g > 1:
            orders.append(np.lexsort((np.arange(n_g), -g_time, -kg)))
            orders.append(np.lexsort((np.arange(n_g), -kg, -g_time * kg)))
        best = None
        b_order = np.lexsort((np.arange(n_bins), -b_time)).astype(np.int64)
        for g_order in orders:
            for backfill in (False, True) if n_g > 1 else (False,):
                cand = _balance(
                    g_order.astype(np.int64), kg, g_time, b_time, b_order, n_ranks, backfill
                )
                if best is None or cand[0] < best[0]:
                    best = cand
        _, g_order, g_ranks_sorted, b_rank, b_key, fills, tail, tail_rank, load = best
        budget = int(config.improve_rounds) * n_ranks
        moves = _improve_local(tail_rank, b_time[tail], load, budget)
        b_rank[tail] = tail_rank
        # Tail micro-batches run after every group, so their rank's order among them is free.
        b_key[tail] = 2 * n_g + tail_rank
        g_key = np.empty(n_g, dtype=np.int64)
        g_key[g_order] = 2 * np.arange(n_g) + 1
        g_src_off = np.zeros(n_g + 1, dtype=np.int64)
        np.cumsum(kg, out=g_src_off[1:])
        g_sorted_off = np.zeros(n_g + 1, dtype=np.int64)
        np.cumsum(kg[g_order], out=g_sorted_off[1:])
        inv = np.argsort(g_order)
        g_ranks = g_ranks_sorted[_gather(g_sorted_off, inv, g_src_off)]
        mb_key = np.concatenate([g_key, b_key])
        mb_ranks = np.concatenate([g_ranks, b_rank])
        meta = {"improve_moves": int(moves), "gap_fills": int(fills)}
    else:
        # ByteScale Alg. 1: micro-batches by decreasing tokens, first fit into waves of N ranks (one
        # micro-batch per rank per wave); no cost balancing.
        tokens = np.concatenate([lengths[grp], b_tokens]).astype(np.int64)
        order = np.lexsort((np.arange(mb_k.shape[0]), -tokens)).astype(np.int64)
        ranks_sorted, wave = _place_waves(mb_k[order], n_ranks)
        src_off = np.zeros(mb_k.shape[0] + 1, dtype=np.int64)
        np.cumsum(mb_k, out=src_off[1:])
        sorted_off = np.zeros(mb_k.shape[0] + 1, dtype=np.int64)
        np.cumsum(mb_k[order], out=sorted_off[1:])
        inv = np.argsort(order)
        mb_ranks = ranks_sorted[_gather(sorted_off, inv, src_off)]
        w = np.empty(mb_k.shape[0], dtype=np.int64)
        w[order] = wave
        first_rank = mb_ranks[src_off[:-1]]
        mb_key = w * n_ranks + first_rank
        meta = {"waves": int(wave.max()) + 1 if wave.size else 0}
    mb_cap = np.concatenate([caps[j[grp]], np.full(n_bins, cap, dtype=np.int64)])
    mb_off_layers = np.concatenate([j[grp], np.zeros(n_bins, dtype=np.int64)])
    items_off = np.concatenate([np.arange(n_g, dtype=np.int64), n_g + b_off])
    items = np.concatenate([grp, b_items]).astype(np.int64)
    meta["offload"] = bool(config.offload)
    return _assemble(
        "hdp" if balance else "naive-hdp",
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
        lb,
    )


def _balance(
    g_order: np.ndarray,
    kg: np.ndarray,
    g_time: np.ndarray,
    b_time: np.ndarray,
    b_order: np.ndarray,
    n_ranks: int,
    backfill: bool,
) -> tuple:
    """hdp's assignment for one order of the group micro-batches: rings first, each on the k ranks
    furthest below the maximum (or, with backfill, list scheduling: whenever ranks free up, the
    first group in the order that fits starts on them); local micro-batches fill the idle gaps before groups, then go by
    decreasing time to the least-loaded rank. Returns (makespan, g_order, group ranks in that
    order, rank of each local micro-batch, its slot key, gap fills, the tail micro-batches, their
    ranks, and the rank loads)."""
    n_g, n_bins = g_order.shape[0], b_time.shape[0]
    if backfill:
        placed, g_ranks_sorted, load, gap_rank, gap_group, gap_size = _list_schedule_groups(
            kg[g_order], g_time[g_order], n_ranks
        )
        g_order = g_order[placed]
    else:
        g_ranks_sorted, load, gap_rank, gap_group, gap_size = _place_groups(
            kg[g_order], g_time[g_order], n_ranks
        )
    t_sorted = b_time[b_order]
    in_gap = _fill_gaps(t_sorted, gap_size)
    filled = in_gap >= 0
    tail = np.flatnonzero(~filled)
    tail_rank = _place_local(t_sorted[tail], load)
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
    return (
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
def _place_groups(
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
def _list_schedule_groups(
    k: np.ndarray, t: np.ndarray, n_ranks: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Greedy list scheduling with backfilling: at each moment ranks are free, start the first
    group in the given order whose size fits the free ranks; otherwise advance to the next finish.
    Returns (placement order as indices into the input, ranks flat in placement order, loads,
    gap rank, gap group (placement index), gap size) like _place_groups."""
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
def _fill_gaps(t: np.ndarray, gap_size: np.ndarray) -> np.ndarray:
    """First fit of micro-batches (decreasing time) into idle gaps: gap index per item or -1.
    A max segment tree over remaining gap sizes finds the first gap with room in O(log gaps)."""
    n = gap_size.shape[0]
    out = -np.ones(t.shape[0], dtype=np.int64)
    if n == 0:
        return out
    size = 1
    while size < n:
        size *= 2
    tree = np.zeros(2 * size, dtype=np.int64)
    for i in range(n):
        tree[size + i] = gap_size[i]
    for i in range(size - 1, 0, -1):
        tree[i] = max(tree[2 * i], tree[2 * i + 1])
    for b in range(t.shape[0]):
        if t[b] > tree[1]:
            continue
        i = 1
        while i < size:
            i = 2 * i if tree[2 * i] >= t[b] else 2 * i + 1
        out[b] = i - size
        tree[i] -= t[b]
        i //= 2
        while i >= 1:
            tree[i] = max(tree[2 * i], tree[2 * i + 1])
            i //= 2
    return out


@njit(cache=True)
def _place_local(t: np.ndarray, load: np.ndarray) -> np.ndarray:
    """List scheduling by decreasing time: each micro-batch on the least-loaded rank (load updated)."""
    heap = _make_heap(load)
    out = np.empty(t.shape[0], dtype=np.int64)
    for i in range(t.shape[0]):
        r = heap[0]
        out[i] = r
        load[r] += t[i]
        _sift_down(heap, load.shape[0], 0, load)
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
def _improve_local(b_rank: np.ndarray, t: np.ndarray, load: np.ndarray, budget: int) -> int:
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
def _place_waves(k: np.ndarray, n_ranks: int) -> tuple[np.ndarray, np.ndarray]:
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


# ------------------------------------------------------------------------------------------------
# static DP x CP mesh
# ------------------------------------------------------------------------------------------------
def static_cp_degree(num_ranks: int, capacity: int, max_context: int) -> int:
    """Smallest divisor d of N whose group holds max_context (largest chunk pair ceil(S/d) <= C)."""
    for d in range(1, num_ranks + 1):
        if num_ranks % d == 0 and -(-max_context // d) <= capacity:
            return d
    raise MixlenError(
        f"max context {max_context} does not fit N * C = {num_ranks * capacity} "
        "(no CP degree dividing N holds it)"
    )


def _plan_static(
    config: PlannerConfig, cost: CostModel, lengths: np.ndarray, sample_ids: np.ndarray
) -> StepPlan:
    n_ranks, cap = config.num_ranks, config.capacity
    longest = int(lengths.max()) if lengths.size else 0
    max_ctx = config.max_context if config.max_context is not None else max(longest, 1)
    if longest > max_ctx:
        _too_long(lengths, sample_ids, max_ctx, "max_context")
    cp = static_cp_degree(n_ranks, cap, max_ctx)
    n_dp = n_ranks // cp
    live = np.flatnonzero(lengths > 0)
    share = -(-lengths[live] // cp)  # each member's positions are at most ceil(S / cp)
    b_off, b_pos = _pack_local(np.arange(live.shape[0], dtype=np.int64), share, cap)
    b_items = live[b_pos]
    n_bins = b_off.shape[0] - 1
    if n_bins:
        s = lengths[b_items]
        attn = np.add.reduceat(cost.attn_ns(s, cp), b_off[:-1])
        lin = np.add.reduceat(cost.linear_ns(s, cp), b_off[:-1])
        work = np.add.reduceat(cost.work_ns(s, cp), b_off[:-1])
        toks = np.add.reduceat(s, b_off[:-1])
        ring = cost.ring_ns(toks.astype(np.float64) / cp, cp)
        b_time = cost.c_ns + work + cost.exposed_ns(attn, lin, ring, np.zeros_like(ring))
    else:
        toks = np.zeros(0, dtype=np.int64)
        b_time = np.zeros(0, dtype=np.int64)
    order = np.lexsort((np.arange(n_bins), -toks)).astype(np.int64)
    dp_of, rnd = _deal_round_robin(toks[order], n_dp)
    dp = np.empty(n_bins, dtype=np.int64)
    dp[order] = dp_of
    rd = np.empty(n_bins, dtype=np.int64)
    rd[order] = rnd
    mb_ranks = (dp[:, None] * cp + np.arange(cp)[None, :]).reshape(-1)
    meta = {"cp": cp, "dp": n_dp, "max_context": max_ctx, "offload": False}
    return _assemble(
        "static",
        config,
        cost,
        lengths,
        sample_ids,
        rd * n_dp + dp,
        np.full(n_bins, cp, dtype=np.int64),
        mb_ranks,
        np.full(n_bins, cap, dtype=np.int64),
        np.zeros(n_bins, dtype=np.int64),
        b_off,
        b_items.astype(np.int64),
        b_time.astype(np.int64),
        meta,
        lower_bound_ns(cost, lengths, n_ranks, cap),
    )


@njit(cache=True)
def _deal_round_robin(tokens: np.ndarray, n_dp: int) -> tuple[np.ndarray, np.ndarray]:
    """Deal micro-batches (by decreasing tokens) to DP replicas: fewest micro-batches first, then
    fewest tokens (equal micro-batch counts, token balance, as a static trainer does)."""
    m = tokens.shape[0]
    cnt = np.zeros(n_dp, dtype=np.int64)
    tok = np.zeros(n_dp, dtype=np.int64)
    dp = np.empty(m, dtype=np.int64)
    rnd = np.empty(m, dtype=np.int64)
    for i in range(m):
        best = 0
        for g in range(1, n_dp):
            if cnt[g] < cnt[best] or (cnt[g] == cnt[best] and tok[g] < tok[best]):
                best = g
        dp[i] = best
        rnd[i] = cnt[best]
        cnt[best] += 1
        tok[best] += tokens[i]
    return dp, rnd


def describe_policy(policy: str) -> str:
    """One line per policy for reports."""
    return {
        "hdp": "dynamic groups, cost-balanced (rings first, LPT, improvement pass)",
        "naive-hdp": "dynamic groups, token waves, no balancing (ByteScale Alg. 1)",
        "static": "fixed DP x CP mesh, every sample split over the CP group",
    }[policy]
