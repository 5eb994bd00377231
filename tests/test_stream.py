"""LengthAwareStream: fill rule, islands, oversize policy, determinism and resume across processes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from datapipe.errors import ConfigError
from datapipe.index import write_index
from datapipe.stream import (
    GlobalBatch,
    LengthAwareStream,
    StreamConfig,
    epoch_order,
    greedy_boundaries,
    lookahead_fill,
)

REPO = Path(__file__).resolve().parents[1]


def write_length_index(root: Path, lengths: np.ndarray, chunk_tokens: int = 1024) -> None:
    """manifest.json + index.parquet (FORMAT.md) for `lengths`, one fake shard: enough for the stream."""
    root.mkdir(parents=True, exist_ok=True)
    rows = -(-lengths // chunk_tokens)
    first = np.concatenate([[0], np.cumsum(rows)[:-1]])
    write_index(
        str(root / "index.parquet"),
        lengths,
        np.zeros(len(lengths), np.int32),
        first,
        rows,
        [f"fake:{i}" for i in range(len(lengths))],
    )
    manifest = {
        "mixlen_version": "0.1.0",
        "format": "mds",
        "dtype": "uint16",
        "chunk_tokens": chunk_tokens,
        "num_samples": len(lengths),
        "num_tokens": int(lengths.sum()),
        "num_rows": int(rows.sum()),
        "shards": [{"name": "shard.00000.mds", "rows": int(rows.sum()), "samples": len(lengths)}],
    }
    (root / "manifest.json").write_text(json.dumps(manifest))


def lognormal_lengths(n: int, seed: int = 0, median: float = 400.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(np.log(median), 1.0, n)).astype(np.int64)


def reference_batches(lengths_in_order: list[int], budget: int) -> list[list[int]]:
    """Per-sample greedy fill, written the obvious way: positions of each batch."""
    batches: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, n in enumerate(lengths_in_order):
        if cur and total + n > budget:
            batches.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += n
    if cur:
        batches.append(cur)
    return batches


@settings(deadline=None, max_examples=150)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=200),
    st.integers(1, 600),
)
def test_greedy_boundaries_match_reference(lengths: list[int], budget: int) -> None:
    bounds = greedy_boundaries(np.asarray(lengths, np.int64), budget)
    got = [list(range(bounds[i], bounds[i + 1])) for i in range(len(bounds) - 1)]
    assert got == reference_batches(lengths, budget)


def reference_lookahead(lengths: list[int], budget: int, window: int) -> list[list[int]]:
    """First fit with a look-ahead window, one sample at a time: positions of each batch."""
    n, p = len(lengths), 0
    deferred: list[int] = []
    batches: list[list[int]] = []
    while p < n or deferred:
        cur: list[int] = []
        room = budget
        for q in list(deferred):
            if not cur or lengths[q] <= room:
                cur.append(q)
                deferred.remove(q)
                room -= lengths[q]
        while room >= 0 and p < n and (lengths[p] <= room or not cur):
            cur.append(p)
            room -= lengths[p]
            p += 1
        stop = min(n, p + window - len(deferred))
        while room > 0 and p < stop:
            if lengths[p] <= room:
                cur.append(p)
                room -= lengths[p]
            else:
                deferred.append(p)
            p += 1
        batches.append(cur)
    return merge_empty_reference(lengths, batches)


def merge_empty_reference(lengths: list[int], batches: list[list[int]]) -> list[list[int]]:
    """Batches with no tokens joined to the previous batch (to the next one at the start)."""
    out: list[list[int]] = []
    pending: list[int] = []  # leading empty batches, waiting for the first batch with tokens
    for b in batches:
        if sum(lengths[i] for i in b) == 0 and any(lengths):
            if out:
                out[-1] = out[-1] + b
            else:
                pending += b
        else:
            out.append(pending + b)
            pending = []
    return out if any(lengths) else batches


@settings(deadline=None, max_examples=200)
@given(
    st.lists(st.just(0) | st.integers(1, 300), min_size=0, max_size=200),
    st.integers(1, 600),
    st.integers(0, 8),
)
@example([3, 10, 1, 1, 0], 5, 4)  # budget met exactly in the window, a zero-length sample next
@example([10, 0, 0], 5, 4)  # zero-length samples after an oversize one
@example([0, 2], 1, 1)  # an oversize sample after a zero-length one
def test_lookahead_fill_matches_reference(lengths: list[int], budget: int, window: int) -> None:
    pos, bounds = lookahead_fill(np.asarray(lengths, np.int64), budget, window)
    got = [pos[bounds[i] : bounds[i + 1]].tolist() for i in range(len(bounds) - 1)]
    ref = reference_lookahead(lengths, budget, window)
    assert got == ref
    assert sorted(pos.tolist()) == list(range(len(lengths)))
    arr = np.asarray(lengths, np.int64)
    for b in got:  # within budget, unless one oversize sample (with zero-length ones)
        assert arr[b].sum() <= budget or int((arr[b] > 0).sum()) == 1
    if arr.any():  # never an empty step
        assert all(arr[b].sum() > 0 for b in got), got
    if window == 0:  # the greedy fill, empty batches folded
        want = merge_empty_reference(lengths, reference_batches(lengths, budget))
        assert got == want if lengths else got == []


def waits(positions: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Per position q of the fill's input: batches between the first batch that holds a position
    beyond q (the fill has gone past q) and the batch that holds q; 0 if none went past first."""
    n = positions.shape[0]
    batch_of = np.empty(n, dtype=np.int64)
    reach = np.full(n, -1, dtype=np.int64)  # reach[q]: the first batch holding a position > q
    furthest = -1
    for b in range(bounds.shape[0] - 1):
        members = positions[bounds[b] : bounds[b + 1]]
        batch_of[members] = b
        top = int(members.max()) if members.size else -1
        for q in range(furthest, top):  # positions q < top, first passed by batch b
            if q >= 0 and reach[q] < 0:
                reach[q] = b
        furthest = max(furthest, top)
    return np.where(reach >= 0, np.maximum(batch_of - reach, 0), 0)


# Budgets of a few samples, n samples (n uniform up to 150: hypothesis' own list sizes stay short)
# of lengths in [lo, budget + 3]: with lo near budget / 2 most samples are deferred and the window
# fills up; a few are oversize.
fill_cases = st.tuples(st.integers(2, 40), st.integers(0, 150)).flatmap(
    lambda bn: st.integers(0, bn[0]).flatmap(
        lambda lo: st.tuples(
            st.lists(st.integers(lo, bn[0] + 3), min_size=bn[1], max_size=bn[1]),
            st.just(bn[0]),
            st.integers(0, 8),
        )
    )
)


@settings(deadline=None, max_examples=200)
@given(fill_cases)
@example(([2, 17, 17, 2, 17, 17, 0], 18, 2))  # a window that ignores the deferred makes 3 waits
@example(([0, 7, 0, 0, 6, 6, 12, 0, 3], 10, 3))  # zero-length and oversize samples
def test_lookahead_fill_property(case: tuple[list[int], int, int]) -> None:
    """The documented guarantee itself (stream.py rule 2), not a re-implementation: every sample
    once, no batch over the budget unless it is one oversize sample, and no sample waits more
    than W batches after the fill went past it (none at all with W = 0)."""
    lengths, budget, window = case
    arr = np.asarray(lengths, np.int64)
    pos, bounds = lookahead_fill(arr, budget, window)
    assert sorted(pos.tolist()) == list(range(len(lengths)))
    for b in range(len(bounds) - 1):
        batch = arr[pos[bounds[b] : bounds[b + 1]]]
        assert batch.sum() <= budget or int((batch > 0).sum()) == 1
    if lengths:
        assert int(waits(pos, bounds).max()) <= window
    if window == 0:
        assert pos.tolist() == list(range(len(lengths)))


def test_lookahead_waits_are_bounded_in_the_stream() -> None:
    """Through the stream: the epoch's batches hold the documented permutation's samples, each
    at most W batches after the fill went past it, and some sample really is deferred."""
    lengths = lognormal_lengths(2000, seed=6, median=1500)
    for window in (4, 64):
        s = _stream(lengths, 8000, seed=5, lookahead=window)
        for epoch in range(2):
            order = documented_order(len(lengths), 5, epoch)
            rank = np.empty(len(lengths), dtype=np.int64)
            rank[order] = np.arange(len(lengths))  # position of each sample in the epoch's order
            batches = [s.batch(epoch, k).sample_ids for k in range(s.steps_in_epoch(epoch))]
            pos = rank[np.concatenate(batches)]
            bounds = np.cumsum([0] + [len(b) for b in batches])
            assert sorted(pos.tolist()) == list(range(len(lengths)))
            w = waits(pos, bounds)
            assert 0 < int(w.max()) <= window


def test_lookahead_fills_batches_nearly_full() -> None:
    """The demo's case: budget = the longest sample, so greedy leaves ragged batches."""
    lengths = np.minimum(lognormal_lengths(3000, seed=4, median=2000), 16384)
    fill = {}
    for w in (0, 64):
        pos, bounds = lookahead_fill(lengths, 16384, w)
        sums = np.add.reduceat(lengths[pos], bounds[:-1])
        fill[w] = sums.sum() / (16384 * sums.shape[0])
        assert sums.max() <= 16384
    assert fill[64] > 0.97 and fill[64] > fill[0] + 0.05, fill


def _stream(lengths: np.ndarray, budget: int, **kw) -> LengthAwareStream:
    settings = {k: kw.pop(k) for k in ("seed", "lookahead", "oversize") if k in kw}
    return StreamConfig(**settings).build(lengths, budget, **kw)


@pytest.mark.parametrize("lookahead", [0, 64])
def test_one_island_epoch_covers_every_sample_once_within_budget(lookahead: int) -> None:
    lengths = lognormal_lengths(3000, seed=1)
    budget = 20_000
    s = _stream(lengths, budget, seed=7, lookahead=lookahead)
    for epoch in range(3):
        steps = s.steps_in_epoch(epoch)
        batches = [next(s) for _ in range(steps)]
        assert all(b.epoch == epoch for b in batches)
        ids = np.concatenate([b.sample_ids for b in batches])
        assert np.array_equal(np.sort(ids), np.arange(len(lengths)))
        for b in batches:
            assert np.array_equal(b.lengths, lengths[b.sample_ids])
            assert b.num_tokens <= budget
        if lookahead == 0:  # greedy: the next batch's first sample did not fit in this one
            for a, b in zip(batches, batches[1:], strict=False):
                assert a.num_tokens + int(b.lengths[0]) > budget
        else:  # fewer, fuller batches than the greedy fill of the same order
            greedy = greedy_boundaries(lengths[epoch_order(len(lengths), 7, epoch)], budget)
            assert len(batches) < len(greedy) - 1
        assert len(s.skipped_samples(epoch)) == 0
    assert next(s).epoch == 3


def documented_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's permutation as datapipe/stream.py documents it (rule 1)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch]))).permutation(
        n
    )


@pytest.mark.parametrize(("seed", "epoch"), [(0, 0), (0, 1), (1, 0), (7, 3), (987654321, 12)])
def test_epoch_order_is_the_documented_permutation(seed: int, epoch: int) -> None:
    lengths = lognormal_lengths(700, seed=3)
    want = documented_order(len(lengths), seed, epoch)
    assert np.array_equal(epoch_order(len(lengths), seed, epoch), want)
    # the greedy fill keeps the order: the epoch's batches, concatenated, are that permutation
    s = _stream(lengths, 5000, seed=seed, lookahead=0)
    got = np.concatenate([s.batch(epoch, k).sample_ids for k in range(s.steps_in_epoch(epoch))])
    assert np.array_equal(got, want)


def _epoch_ids(s: LengthAwareStream, epoch: int) -> np.ndarray:
    return np.concatenate([s.batch(epoch, k).sample_ids for k in range(s.steps_in_epoch(epoch))])


def test_epoch_orders_differ_by_seed_and_epoch() -> None:
    """(seed, epoch) pairs are not folded into one number: (s, e + 1) and (s + 1, e) differ, as do
    (s, e) and (e, s), besides (s, e) against (s, e + 1) and (s + 1, e)."""
    lengths = lognormal_lengths(500)
    n = len(lengths)
    for s, e in ((0, 0), (3, 5), (10, 1)):
        assert not np.array_equal(epoch_order(n, s, e + 1), epoch_order(n, s + 1, e))
        assert not np.array_equal(epoch_order(n, s, e), epoch_order(n, s, e + 1))
        assert not np.array_equal(epoch_order(n, s, e), epoch_order(n, s + 1, e))
        if s != e:
            assert not np.array_equal(epoch_order(n, s, e), epoch_order(n, e, s))
    # and through the stream's batches (look-ahead fill)
    a, b = _stream(lengths, 5000, seed=0), _stream(lengths, 5000, seed=1)
    assert not np.array_equal(_epoch_ids(a, 1), _epoch_ids(b, 0))
    assert not np.array_equal(_epoch_ids(a, 0), _epoch_ids(a, 1))
    assert not np.array_equal(_epoch_ids(a, 0), _epoch_ids(b, 0))


@pytest.mark.parametrize("num_islands", [2, 3, 5])
def test_islands_are_disjoint_and_cover_the_epoch(num_islands: int) -> None:
    lengths = lognormal_lengths(2000, seed=2)
    budget = 15_000
    whole = _stream(lengths, budget, seed=3)  # one island: the reference sequence of batches
    for epoch in range(2):
        ref = [whole.batch(epoch, k).sample_ids for k in range(whole.steps_in_epoch(epoch))]
        per_island = []
        for isl in range(num_islands):
            s = _stream(lengths, budget, seed=3, island=isl, num_islands=num_islands)
            s.load_state_dict({**s.state_dict(), "epoch": epoch})
            steps = s.steps_in_epoch(epoch)
            assert steps == len(ref) // num_islands
            got = [next(s).sample_ids for _ in range(steps)]
            # island isl gets the reference batches isl, isl+I, ...
            for k, ids in enumerate(got):
                assert np.array_equal(ids, ref[k * num_islands + isl])
            per_island.append(np.concatenate(got))
        used = np.concatenate(per_island)
        skipped = s.skipped_samples(epoch)
        assert len(np.unique(used)) == len(used)  # disjoint
        assert np.array_equal(np.sort(np.concatenate([used, skipped])), np.arange(len(lengths)))
        n_skipped_batches = len(ref) % num_islands
        assert len(skipped) == sum(len(b) for b in ref[len(ref) - n_skipped_batches :])


def test_oversize_policy() -> None:
    lengths = np.array([100, 5000, 200, 300, 9000, 50], np.int64)
    with pytest.raises(ConfigError, match="sample 4"):
        _stream(lengths, 1000, oversize="error")
    s = _stream(lengths, 1000, oversize="own_step")
    batches = [next(s) for _ in range(s.steps_in_epoch(0))]
    ids = np.concatenate([b.sample_ids for b in batches])
    assert np.array_equal(np.sort(ids), np.arange(6))  # nothing dropped
    for b in batches:
        if b.num_tokens > 1000:
            assert len(b.sample_ids) == 1 and int(b.lengths[0]) > 1000
    with pytest.raises(ConfigError, match="oversize"):
        _stream(lengths, 1000, oversize="drop")
    # a sample of exactly the budget fits a step: not oversize
    exact = _stream(np.array([1000, 5], np.int64), 1000, oversize="error")
    assert sorted(int(n) for b in (next(exact), next(exact)) for n in b.lengths) == [5, 1000]


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    lengths = np.array([10, 20], np.int64)
    with pytest.raises(ConfigError, match="island"):
        _stream(lengths, 100, island=2, num_islands=2)
    with pytest.raises(ConfigError, match="global_batch_tokens"):
        _stream(lengths, 0)
    with pytest.raises(ConfigError, match="num_islands"):
        next(_stream(lengths, 100, num_islands=3))  # fewer batches than islands
    with pytest.raises(ConfigError, match="path: dataset directory"):
        StreamConfig().open(str(tmp_path / "missing"), 10)


def test_global_batch_digest_covers_contents() -> None:
    """Each of step, epoch, sample ids and lengths changes the digest on its own; equal contents
    give equal digests whatever the arrays' dtype."""
    ids, lens = np.array([1, 2], np.int64), np.array([5, 6], np.int64)
    base = GlobalBatch(3, 1, ids, lens).digest()
    assert len(base) == 16
    assert GlobalBatch(3, 1, ids.astype(np.int32), lens.astype(np.uint16)).digest() == base
    others = {
        "step": GlobalBatch(4, 1, ids, lens),
        "epoch": GlobalBatch(3, 2, ids, lens),
        "step and epoch swapped": GlobalBatch(1, 3, ids, lens),
        "ids": GlobalBatch(3, 1, np.array([1, 7], np.int64), lens),
        "ids permuted": GlobalBatch(3, 1, ids[::-1], lens),
        "lengths": GlobalBatch(3, 1, ids, np.array([5, 7], np.int64)),
        "lengths permuted": GlobalBatch(3, 1, ids, lens[::-1]),
        "one sample fewer": GlobalBatch(3, 1, ids[:1], lens[:1]),
    }
    digests = {name: b.digest() for name, b in others.items()}
    for name, d in digests.items():
        assert d != base, name
    assert len(set(digests.values())) == len(digests)


def test_global_batch_digest_covers_mixture_units() -> None:
    """A mixture batch's units (source, sample id in it, first token) enter the digest: two
    batches of the same step, epoch, unit keys and lengths whose units differ in any one column
    digest differently, a batch without units differs from one with them, and equal units in
    another integer dtype give the same digest."""
    ids, lens = np.array([4, 9], np.int64), np.array([5, 6], np.int64)
    units = np.array([[0, 4, 0], [1, 2, 128]], np.int64)
    base = GlobalBatch(3, 1, ids, lens, units).digest()
    assert GlobalBatch(3, 1, ids, lens, units.astype(np.int32)).digest() == base
    assert GlobalBatch(3, 1, ids, lens).digest() != base
    for col in range(3):
        other = units.copy()
        other[1, col] += 1
        assert GlobalBatch(3, 1, ids, lens, other).digest() != base, col
