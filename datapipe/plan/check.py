"""Reference checker of a StepPlan's invariants (docs/ARCHITECTURE.md "Invariants"), plain Python
that shares no code with the planners: exact coverage, capacities, group agreement, total slot
order, deadlock freedom under blocking rendezvous, and the recorded finish times.
"""

from __future__ import annotations

from collections import deque

from datapipe.plan.stepplan import PlannedMicroBatch, StepPlan


class PlanError(AssertionError):
    """A plan violates an invariant (raised by check_plan)."""


def _zigzag_chunks(start: int, end: int, k: int, p: int) -> list[tuple[int, int]]:
    """Independent reference: 2k chunks of [start, end), sizes differ by <= 1, first ones larger
    (chunk c starts after c chunks of n // 2k positions and min(c, n % 2k) larger ones)."""
    q, r = divmod(end - start, 2 * k)

    def bound(c: int) -> int:
        return start + c * q + min(c, r)

    return [(bound(c), bound(c + 1)) for c in (p, 2 * k - 1 - p)]


def _capacity_ok(capacity: int, c: int, ratio: float) -> bool:
    """A micro-batch's capacity is C without offload; with offload ratio r it may be more, never
    more than C / (1 - r) (Eq. 3, l*C / (2 + (1-r)(l-2)), is below that for every layer count l)."""
    if ratio == 0.0:
        return capacity == c
    return capacity >= c and (ratio >= 1.0 or capacity * (1.0 - ratio) <= c * (1 + 1e-12))


def check_plan(plan: StepPlan, check_times: bool = True) -> None:
    """Raise PlanError unless the plan satisfies the contract's invariants, seen through the per-rank
    view the trainer uses: exact coverage, capacities, group agreement, total slot order, no
    deadlock under blocking rendezvous, and (if check_times) the recorded finish times."""

    def fail(msg: str) -> None:
        raise PlanError(msg)

    n_ranks = plan.num_ranks
    lengths = [int(x) for x in plan.lengths]
    ids = [int(x) for x in plan.sample_ids]
    if len(lengths) != len(ids):
        fail("sample_ids and lengths differ in size")
    pos_of: dict[int, int] = {}
    for i, s in enumerate(ids):
        if s in pos_of:
            fail(f"sample id {s} appears twice in the batch")
        pos_of[s] = i
    views = [plan.microbatches(r) for r in range(n_ranks)]
    by_slot: dict[int, dict[int, PlannedMicroBatch]] = {}
    covered: list[list[tuple[int, int]]] = [[] for _ in ids]
    for r, mbs in enumerate(views):
        last = -1
        for mb in mbs:
            if mb.slot <= last:
                fail(f"rank {r}: slots not increasing ({last} then {mb.slot})")
            last = mb.slot
            k = len(mb.group)
            if len(set(mb.group)) != k or any(not 0 <= g < n_ranks for g in mb.group):
                fail(f"slot {mb.slot}: bad group {mb.group}")
            if not 0 <= mb.group_index < k or mb.group[mb.group_index] != r:
                fail(f"rank {r} slot {mb.slot}: group_index {mb.group_index} does not name it")
            if not 0.0 <= mb.offload_ratio <= 1.0:
                fail(f"slot {mb.slot}: offload ratio {mb.offload_ratio}")
            # single's micro-batch of one sample longer than C has that sample's length
            alone = plan.policy == "single" and len(mb.pieces) == 1
            alone = alone and mb.capacity == mb.pieces[0][2] - mb.pieces[0][1] > plan.capacity
            if not (alone or _capacity_ok(mb.capacity, plan.capacity, mb.offload_ratio)):
                fail(
                    f"slot {mb.slot}: capacity {mb.capacity} at offload ratio {mb.offload_ratio} "
                    f"for C = {plan.capacity}"
                )
            by_slot.setdefault(mb.slot, {})[r] = mb
            expect: list[tuple[int, int, int]] = []
            for sid, s, e in mb.group_pieces:
                if sid not in pos_of or not 0 <= s <= e <= lengths[pos_of[sid]]:
                    fail(f"slot {mb.slot}: piece ({sid}, {s}, {e}) outside its sample")
                if k == 1:
                    chunks = [(s, e)]
                else:
                    chunks = _zigzag_chunks(s, e, k, mb.group_index)
                expect += [(sid, a, b) for a, b in chunks if b > a]
            if list(mb.pieces) != expect:
                fail(
                    f"rank {r} slot {mb.slot}: pieces {mb.pieces} are not the zigzag split {expect}"
                )
            used = sum(e - s for _, s, e in mb.pieces)
            if used > mb.capacity:
                fail(f"rank {r} slot {mb.slot}: {used} positions > capacity {mb.capacity}")
            for sid, s, e in mb.pieces:
                covered[pos_of[sid]].append((s, e))
    _check_coverage(covered, ids, lengths)
    _check_groups(by_slot)
    clock = rendezvous_replay(
        [[(mb.slot, mb.group) for mb in mbs] for mbs in views],
        {s: int(plan.mb_time_ns[s]) for s in by_slot},
    )
    if clock is None:
        fail("deadlock: some micro-batches never start under blocking rendezvous")
    if check_times:
        if [int(x) for x in plan.rank_time_ns] != clock:
            fail("recorded rank times differ from the blocking-rendezvous replay")
        if plan.makespan_ns != max(clock, default=0):
            fail("recorded makespan is not the largest rank time")


def _check_coverage(
    covered: list[list[tuple[int, int]]], ids: list[int], lengths: list[int]
) -> None:
    """Every position of every sample computed exactly once (covered: its computed ranges)."""
    for i, iv in enumerate(covered):
        iv.sort()
        at = 0
        for s, e in iv:
            if s != at:
                raise PlanError(
                    f"sample {ids[i]}: tokens from {min(s, at)} computed {'twice' if s < at else 'never'}"
                )
            at = e
        if at != lengths[i]:
            raise PlanError(f"sample {ids[i]}: covered up to {at} of {lengths[i]} tokens")


def _check_groups(by_slot: dict[int, dict[int, PlannedMicroBatch]]) -> None:
    """Each slot is run by exactly its group, whose members agree on group, pieces, capacity and
    offload ratio."""
    for slot, members in by_slot.items():
        ref = next(iter(members.values()))
        if set(members) != set(ref.group):
            raise PlanError(f"slot {slot}: run by {sorted(members)} but its group is {ref.group}")
        for mb in members.values():
            if (mb.group, mb.group_pieces, mb.capacity, mb.offload_ratio) != (
                ref.group,
                ref.group_pieces,
                ref.capacity,
                ref.offload_ratio,
            ):
                raise PlanError(f"slot {slot}: group members disagree")


def rendezvous_replay(
    sequences: list[list[tuple[int, tuple[int, ...]]]], times: dict[int, int]
) -> list[int] | None:
    """Execute each rank's (slot, group) sequence with blocking rendezvous (a micro-batch starts
    when all of its group has reached it); finish time per rank, or None on deadlock."""
    n = len(sequences)
    ptr = [0] * n
    clock = [0] * n
    arrived: dict[int, int] = {}
    ready: deque[int] = deque()
    groups: dict[int, tuple[int, ...]] = {}

    def arrive(r: int) -> None:
        if ptr[r] < len(sequences[r]):
            s, g = sequences[r][ptr[r]]
            groups[s] = g
            arrived[s] = arrived.get(s, 0) + 1
            if arrived[s] == len(g):
                ready.append(s)

    for r in range(n):
        arrive(r)
    while ready:
        s = ready.popleft()
        group = groups[s]
        start = max(clock[g] for g in group)
        for g in group:
            clock[g] = start + times[s]
            ptr[g] += 1
        for g in group:
            arrive(g)
    if any(ptr[r] != len(sequences[r]) for r in range(n)):
        return None
    return clock
