"""Packing kernels against plain-Python references and a brute-force optimum."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datapipe.errors import MixlenError
from datapipe.plan import _packing_ref as ref
from datapipe.plan import buckets, packing

PACKERS = [
    ("ffd", packing.first_fit_decreasing, ref.first_fit_decreasing_ref),
    ("bfd", packing.best_fit_decreasing, ref.best_fit_decreasing_ref),
]
SETTINGS = settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def instances(draw: st.DrawFn, max_items: int = 80, max_capacity: int = 1 << 17):
    """(lengths, capacity); sometimes few distinct lengths (ties), sometimes many long items."""
    capacity = draw(st.integers(1, max_capacity))
    kind = draw(st.sampled_from(["any", "ties", "stacked", "long", "small"]))
    if kind == "stacked":
        # Many bins with equal free space (best fit must then take the lowest-numbered).
        long = draw(st.integers(capacity // 2, capacity))
        smalls = draw(st.lists(st.integers(0, capacity - long), min_size=1, max_size=3))
        n_long = draw(st.integers(0, max_items // 2))
        rest = draw(st.lists(st.sampled_from(smalls), max_size=max_items - n_long))
        order = draw(st.permutations([long] * n_long + rest))
        return np.array(order, dtype=np.int64), capacity
    if kind == "ties":
        pool = draw(st.lists(st.integers(0, capacity), min_size=1, max_size=4))
        elems = st.sampled_from(pool)
    elif kind == "long":
        elems = st.integers(capacity // 3, capacity)
    elif kind == "small":
        elems = st.integers(0, max(0, capacity // 10))
    else:
        elems = st.integers(0, capacity)
    lengths = draw(st.lists(elems, max_size=max_items))
    return np.array(lengths, dtype=np.int64), capacity


def check_packing(lengths: np.ndarray, capacity: int, bins: np.ndarray) -> None:
    """Valid packing: one bin per item, no bin over capacity, bins numbered in visiting order."""
    assert bins.dtype == np.int64 and bins.shape == lengths.shape
    if lengths.size == 0:
        return
    assert bins.min() >= 0
    nbins = int(bins.max()) + 1
    loads = np.zeros(nbins, np.int64)
    np.add.at(loads, bins, lengths)  # exact (bincount weights are float64)
    assert np.all(loads <= capacity)
    assert np.all(np.bincount(bins, minlength=nbins) > 0)  # no empty bin
    # Bins are opened in the order the items are visited (decreasing length, stable).
    first_seen = []
    for i in ref.sort_desc_ref(lengths.tolist()):
        if bins[i] not in first_seen:
            first_seen.append(int(bins[i]))
    assert first_seen == list(range(nbins))
    total = int(lengths.sum())
    assert nbins >= -(-total // capacity)
    # Any-fit: no two bins fit together in one, hence at most 2 * (sum // C) + 2 bins.
    assert nbins <= max(1, 2 * (total // capacity) + 2)
    if nbins >= 2:
        two_emptiest = np.sort(loads)[:2]
        assert two_emptiest.sum() > capacity


@pytest.mark.parametrize("name,pack,pack_ref", PACKERS)
@SETTINGS
@given(inst=instances())
def test_matches_reference(name, pack, pack_ref, inst) -> None:
    lengths, capacity = inst
    bins = pack(lengths, capacity)
    check_packing(lengths, capacity, bins)
    assert bins.tolist() == pack_ref(lengths.tolist(), capacity)


@SETTINGS
@given(inst=instances())
def test_bfd_block_structure_matches_reference(inst) -> None:
    """The large-capacity best-fit structure, forced on ordinary inputs."""
    lengths, capacity = inst
    bins = packing._bfd(lengths, capacity, False) if lengths.size else np.empty(0, np.int64)
    assert bins.tolist() == ref.best_fit_decreasing_ref(lengths.tolist(), capacity)


@settings(deadline=None, max_examples=40)
@given(inst=instances(max_items=60, max_capacity=packing.DENSE_MAX_CAPACITY), data=st.data())
def test_bfd_dense_deep_bitset_matches_reference(inst, data) -> None:
    """The direct-index structure up to its largest capacity (4-5 bitset levels), items scaled up
    so free-space values spread over the whole range."""
    lengths, capacity = inst
    scale = data.draw(st.integers(1, max(1, packing.DENSE_MAX_CAPACITY // max(capacity, 1))))
    lengths, capacity = lengths * scale, capacity * scale
    bins = packing._bfd(lengths, capacity, True) if lengths.size else np.empty(0, np.int64)
    assert bins.tolist() == ref.best_fit_decreasing_ref(lengths.tolist(), capacity)


@pytest.mark.parametrize("name,pack,pack_ref", PACKERS)
@settings(deadline=None, max_examples=40)
@given(inst=instances(max_items=60, max_capacity=1 << 50))
def test_huge_capacity(name, pack, pack_ref, inst) -> None:
    """Capacities past DENSE_MAX_CAPACITY (best fit switches structure) still match."""
    lengths, capacity = inst
    bins = pack(lengths, capacity)
    check_packing(lengths, capacity, bins)
    assert bins.tolist() == pack_ref(lengths.tolist(), capacity)


@pytest.mark.parametrize("name,pack,pack_ref", PACKERS)
@settings(deadline=None, max_examples=200)
@given(
    inst=st.integers(1, 60).flatmap(
        lambda c: st.tuples(st.lists(st.integers(0, c), max_size=10), st.just(c))
    )
)
def test_small_inputs_within_ffd_bound_of_optimum(name, pack, pack_ref, inst) -> None:
    """At most 11/9 OPT + 6/9 bins (Dosa's tight FFD bound), OPT by exhaustive search."""
    lengths, capacity = inst
    bins = pack(np.array(lengths, dtype=np.int64), capacity)
    used = int(bins.max()) + 1 if lengths else 0
    opt = ref.optimal_bins_ref(lengths, capacity)
    assert opt <= used
    assert 9 * used <= 11 * opt + 6


def test_decreasing_packers_can_miss_optimum() -> None:
    """The brute force finds packings both packers miss: 4+3+3 twice vs 4+4, 3+3+3, 3."""
    lengths = [4, 4, 3, 3, 3, 3]
    assert ref.optimal_bins_ref(lengths, 10) == 2
    assert int(packing.first_fit_decreasing(np.array(lengths), 10).max()) + 1 == 3
    assert int(packing.best_fit_decreasing(np.array(lengths), 10).max()) + 1 == 3


@pytest.mark.parametrize("name,pack,pack_ref", PACKERS)
def test_large_lognormal_matches_reference(name, pack, pack_ref) -> None:
    rng = np.random.default_rng(7)
    capacity = 16384
    lengths = np.minimum(rng.lognormal(np.log(256), 1.6, 4000).astype(np.int64), capacity)
    bins = pack(lengths, capacity)
    check_packing(lengths, capacity, bins)
    assert bins.tolist() == pack_ref(lengths.tolist(), capacity)


def test_bfd_many_bins_block_rebuilds() -> None:
    """Mostly long items: thousands of bins, many block rebuilds in the large-capacity path."""
    rng = np.random.default_rng(3)
    capacity = 1000
    lengths = np.concatenate([rng.integers(400, 1001, 1500), rng.integers(0, 200, 500)])
    expect = ref.best_fit_decreasing_ref(lengths.tolist(), capacity)
    assert packing._bfd(lengths, capacity, False).tolist() == expect
    assert packing.best_fit_decreasing(lengths, capacity).tolist() == expect
    assert packing.best_fit_decreasing(lengths << 30, capacity << 30).tolist() == expect


def test_zero_lengths_and_empty() -> None:
    for pack in (packing.first_fit_decreasing, packing.best_fit_decreasing):
        out = pack(np.array([], dtype=np.int64), 5)
        assert out.dtype == np.int64 and out.size == 0
        assert pack([], 5).size == 0
        assert pack(np.zeros(4, np.int64), 1).tolist() == [0, 0, 0, 0]
        assert pack(np.array([0, 5, 0, 5]), 5).tolist() == [0, 0, 0, 1]  # zeros fill bin 0


def test_accepts_other_integer_dtypes_and_lists() -> None:
    lengths = [5, 3, 7, 1, 4]
    expect = ref.best_fit_decreasing_ref(lengths, 8)
    for arr in (lengths, np.array(lengths, np.int32), np.array(lengths, np.uint16)):
        assert packing.best_fit_decreasing(arr, np.int64(8)).tolist() == expect


@pytest.mark.parametrize("pack", [packing.first_fit_decreasing, packing.best_fit_decreasing])
def test_errors(pack) -> None:
    with pytest.raises(ValueError, match=r"item 2 has length 9, longer than the capacity 8"):
        pack(np.array([1, 8, 9, 10]), 8)
    with pytest.raises(MixlenError, match=r"lengths\[1\] = -3 is negative"):
        pack(np.array([1, -3, 2]), 8)
    for bad_capacity in (0, -1, 2.5, True, "8"):
        with pytest.raises(MixlenError, match="capacity"):
            pack(np.array([1]), bad_capacity)
    with pytest.raises(MixlenError, match="1-D"):
        pack(np.ones((2, 2), np.int64), 8)
    with pytest.raises(MixlenError, match="integer"):
        pack(np.array([1.0, 2.0]), 8)
    with pytest.raises(MixlenError, match="int64"):
        pack(np.array([2**64 - 1], np.uint64), 8)


def test_kernels_reject_invalid_input() -> None:
    x = np.array([1, 9], np.int64)
    for kernel in (packing.ffd_kernel, packing.bfd_kernel):
        with pytest.raises(ValueError):
            kernel(x, 8)
        with pytest.raises(ValueError):
            kernel(np.array([1, -1], np.int64), 8)
        with pytest.raises(ValueError):
            kernel(x, 0)


@settings(deadline=None, max_examples=100)
@given(
    st.one_of(
        st.lists(st.integers(0, 50), max_size=200),
        st.lists(st.integers(0, 2**62), max_size=200),  # radix path
        st.lists(st.integers(2**62, 2**63 - 1), max_size=50),  # all radix passes
        st.lists(st.sampled_from([0, 70000, 2**40, 2**40 + 1]), max_size=200),
    )
)
def test_sort_desc_matches_stable_sort(values) -> None:
    assert packing.sort_desc(np.array(values, dtype=np.int64)).tolist() == ref.sort_desc_ref(values)


@settings(deadline=None, max_examples=100)
@given(
    st.lists(st.integers(0, 2**62), max_size=100),
    st.lists(st.integers(0, 2**20), max_size=8, unique=True),
)
def test_buckets_match_reference(values, boundaries) -> None:
    boundaries = sorted(boundaries)
    lengths = np.array(values, dtype=np.int64)
    assert buckets.pow2_buckets(lengths).tolist() == ref.pow2_bucket_ref(values)
    assert buckets.length_buckets(lengths).tolist() == ref.pow2_bucket_ref(values)
    got = buckets.length_buckets(lengths, np.array(boundaries, dtype=np.int64))
    assert got.tolist() == ref.boundary_bucket_ref(values, boundaries)
    n_buckets = len(boundaries) + 1
    order, offsets = buckets.group_by_bucket(got, n_buckets)
    expect_order = sorted(range(len(values)), key=lambda i: int(got[i]))
    assert order.tolist() == expect_order
    counts = np.bincount(got, minlength=n_buckets) if values else np.zeros(n_buckets, np.int64)
    assert offsets.tolist() == [0, *np.cumsum(counts).tolist()]


def test_bucket_errors() -> None:
    with pytest.raises(MixlenError, match="strictly increasing"):
        buckets.boundary_buckets(np.array([1, 2]), np.array([4, 4]))
    with pytest.raises(MixlenError, match="n_buckets"):
        buckets.group_by_bucket(np.array([0, 3]), 3)


def test_warmup_returns_seconds() -> None:
    seconds = packing.warmup()
    assert isinstance(seconds, float) and seconds >= 0.0


def test_kernels_callable_from_njit_code() -> None:
    """The planner calls the kernels from its own @njit functions."""
    from numba import njit

    @njit
    def pack_both(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
        return packing.ffd_kernel(lengths, capacity), packing.bfd_kernel(lengths, capacity)

    rng = np.random.default_rng(11)
    lengths = rng.integers(0, 500, 300)
    ffd, bfd = pack_both(lengths, 1000)
    assert ffd.tolist() == ref.first_fit_decreasing_ref(lengths.tolist(), 1000)
    assert bfd.tolist() == ref.best_fit_decreasing_ref(lengths.tolist(), 1000)
