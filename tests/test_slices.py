"""Flat layout and slices (trainer.parallel.slices) and the slice collectives of trainer.parallel.comm."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.parallel.comm import SoloComm
from trainer.parallel.slices import FlatLayout, ParamChunks, Place, boxes
from trainer.testing.threads import ThreadWorld, run_threads

SHAPES = [(7, 3), (5,), (64, 2), (1,), (3, 3, 3), (130,)]  # 367 elements


def _numel(shapes):
    return int(sum(np.prod(s, dtype=np.int64) for s in shapes))


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("align", [1, 16, 64])
def test_slices_cover_the_flat_vector_once_aligned(ranks, align):
    lay = FlatLayout(SHAPES, ranks, align)
    n = _numel(SHAPES)
    assert lay.numel == n
    hits = np.zeros(n, dtype=np.int64)
    prev_end = 0
    for r in range(ranks):
        a, b = lay.slice(r)
        assert a == prev_end  # contiguous, in rank order
        assert a % align == 0 or a == n  # every non-empty slice starts aligned
        assert b - a <= lay.slice_len and lay.slice_len % align == 0
        hits[a:b] += 1
        prev_end = b
        pa, pb = lay.padded_slice(r)
        assert pb - pa == lay.slice_len and b <= pb
        assert a == pa or a == b == n  # a non-empty slice starts at its padded chunk
    assert prev_end == n and (hits == 1).all()
    assert sum(lay.sizes()) == n and lay.padded_numel >= n
    # only the trailing slices may be shorter than the padded length
    sizes = lay.sizes()
    short = [r for r in range(ranks) if sizes[r] < lay.slice_len]
    assert short == list(range(ranks - len(short), ranks))  # the trailing ones (or none)


def test_tiny_model_has_empty_slices():
    lay = FlatLayout([(3,), (2,)], ranks=4, align=64)
    assert lay.sizes() == [5, 0, 0, 0]
    assert lay.slice_parts(2) == [] and lay.bytes_per_rank(torch.float32, 3) == 0
    assert lay.bytes_per_rank(torch.float64, 0) == 40


@pytest.mark.parametrize("ranks,align", [(3, 16), (4, 1), (5, 8)])
def test_parts_and_views_match_an_elementwise_reference(ranks, align):
    lay = FlatLayout(SHAPES, ranks, align)
    params = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
    # reference: owner parameter and offset of every flat element, by enumeration
    owner = np.concatenate([np.full(int(np.prod(s)), i) for i, s in enumerate(SHAPES)])
    offset = np.concatenate([np.arange(int(np.prod(s))) for s in SHAPES])
    flat_ref = torch.cat([p.reshape(-1) for p in params])
    for r in range(ranks):
        a, b = lay.slice(r)
        seen = []
        for p in lay.slice_parts(r):
            for k in range(p.length):
                seen.append((p.param, p.param_start + k, p.range_start + k))
        assert seen == [(owner[e], offset[e], e - a) for e in range(a, b)]
        # views into a slice tensor hold the parameter's elements and write through
        st = flat_ref[a:b].clone()
        for i, sl, view in lay.slice_views(st, r):
            assert torch.equal(view, params[i].reshape(-1)[sl])
            view.fill_(-1.0)
        assert (st == -1.0).all()


def test_params_flat_round_trip_and_binding():
    lay = FlatLayout(SHAPES, 3, 16)
    params = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in SHAPES]
    want = torch.cat([p.detach().reshape(-1) for p in params])
    flat = lay.params_to_flat(params, lay.new_flat(torch.float64))
    assert flat.numel() == lay.padded_numel
    assert torch.equal(flat[: lay.numel], want) and (flat[lay.numel :] == 0).all()
    others = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    lay.flat_to_params(flat, others)
    assert all(torch.equal(o, p) for o, p in zip(others, params))
    # bound parameters are views: writing the flat buffer changes them, values kept
    bound = lay.new_flat(torch.float64)
    lay.bind_params(params, bound)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in params]), want)
    bound[: lay.numel] = torch.arange(lay.numel, dtype=torch.float64)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in params]), bound[: lay.numel])
    with pytest.raises(ValueError, match="shapes"):
        lay.params_to_flat(params[:-1], flat)


@pytest.mark.parametrize("bucket", [1, 40, 100, 10_000])
def test_buckets_tile_each_slice_in_backward_order(bucket):
    lay = FlatLayout(SHAPES, 3, 16)
    bs = lay.buckets(bucket)
    assert [b.index for b in bs] == list(range(len(bs)))
    assert [b.start for b in bs] == sorted((b.start for b in bs), reverse=True)
    hits = np.zeros(lay.numel, dtype=np.int64)
    for b in bs:
        a, e = lay.slice(b.owner)
        assert a <= b.start < b.end <= e  # inside its owner's slice
        assert b.numel <= max(16, bucket // 16 * 16) and (b.start - a) % 16 == 0
        hits[b.start : b.end] += 1
    assert (hits == 1).all()


# --- collectives on slices -------------------------------------------------------------------------


def _inputs(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, generator=g, dtype=torch.float64)


def _reference_sum(size: int, n: int) -> torch.Tensor:
    total = torch.zeros(n, dtype=torch.float64)
    for r in range(size):
        total += _inputs(r, n)
    return total


SIZES = {  # chunk sizes per world size: equal, uneven, with empty chunks
    3: [None, [5, 9, 2], [0, 7, 0], [4, 0, 6]],
    4: [None, [3, 3, 3, 4], [0, 0, 0, 5], [2, 0, 8, 1]],
}


def _chunk_run(comm, sizes_list, async_op):
    out = []
    for sizes in sizes_list:
        n = 12 if sizes is None else sum(sizes)
        bounds = np.cumsum([0] + (sizes or [n // comm.size] * comm.size))
        a, b = int(bounds[comm.rank]), int(bounds[comm.rank + 1])
        flat = _inputs(comm.rank, n)
        res = torch.full((b - a,), float("nan"), dtype=torch.float64)
        h1 = comm.reduce_scatter(flat, res, sizes, async_op=async_op)
        flat2 = _inputs(comm.rank, n)  # in place: out is this rank's chunk of flat
        h2 = comm.reduce_scatter(flat2, flat2[a:b], sizes, async_op=async_op)
        gath = torch.full((n,), float("nan"), dtype=torch.float64)
        gath[a:b] = _inputs(comm.rank, n)[a:b] * 10
        h3 = comm.all_gather_into(gath, sizes, async_op=async_op)
        red = _inputs(comm.rank, n)
        h4 = comm.all_reduce(red, async_op=async_op)
        for h in (h1, h2, h3, h4):
            assert (h is None) != async_op
            if h is not None:
                h.wait()
        out.append((res, flat2[a:b].clone(), gath, red, (a, b)))
    return out


def _check_chunk_results(size, sizes_list, results):
    """`results`: what _chunk_run returned on some of the ranks."""
    for got in results:
        for sizes, (res, inplace, gath, red, (a, b)) in zip(sizes_list, got):
            n = gath.numel()
            total = _reference_sum(size, n)
            torch.testing.assert_close(res, total[a:b], rtol=1e-14, atol=0)
            torch.testing.assert_close(inplace, total[a:b], rtol=1e-14, atol=0)
            torch.testing.assert_close(red, total, rtol=1e-14, atol=0)
            bounds = np.cumsum([0] + (sizes or [n // size] * size))
            want = torch.cat([_inputs(r, n)[bounds[r] : bounds[r + 1]] * 10 for r in range(size)])
            assert torch.equal(gath, want)


@pytest.mark.parametrize("size", [3, 4])
@pytest.mark.parametrize("async_op", [False, True])
def test_slice_collectives_threads(size, async_op):
    sizes_list = SIZES[size]
    res = run_threads(size, lambda c: _chunk_run(c, sizes_list, async_op), timeout=30)
    _check_chunk_results(size, sizes_list, res)


def test_async_collectives_keep_issue_order_while_the_rank_computes():
    """Several collectives in flight per rank, waited in reverse order: each gets its own data."""

    def run(comm):
        ts = [torch.full((4,), float(10 * k + comm.rank)) for k in range(5)]
        hs = [comm.all_reduce(t, async_op=True) for t in ts]
        for h in reversed(hs):
            h.wait()
        return [t.tolist() for t in ts]

    for got in run_threads(3, run, timeout=30):
        assert got == [[float(3 * 10 * k + 3)] * 4 for k in range(5)]


def test_solo_comm_slice_collectives():
    comm = SoloComm()
    flat = torch.arange(6.0)
    out = torch.zeros(6)
    comm.reduce_scatter(flat, out)
    assert torch.equal(out, flat)
    assert comm.all_reduce(flat, async_op=True) is not None
    comm.all_gather_into(flat, [6], async_op=True).wait()
    assert torch.equal(flat, torch.arange(6.0))


def test_bad_chunk_sizes_refused():
    comm = ThreadWorld(2).comm(0)
    with pytest.raises(ValueError, match="equal chunks"):
        comm.reduce_scatter(torch.zeros(5), torch.zeros(2))
    with pytest.raises(ValueError, match="chunk"):
        comm.all_gather_into(torch.zeros(5), [3, 3])


# -- checkpoints by whole parameter ----------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    data=st.data(),
)
def test_boxes_cover_a_flat_range_in_order(shape, data) -> None:
    """Every element of [start, end) of a row-major tensor lies in exactly one box, in order
    (reference: np.unravel_index of each element)."""
    n = int(np.prod(shape))
    start = data.draw(st.integers(0, n - 1))
    end = data.draw(st.integers(start + 1, n))
    got = []
    for off, size in boxes(shape, start, end):
        idx = np.stack(np.meshgrid(*[np.arange(o, o + z) for o, z in zip(off, size)],
                                   indexing="ij"), -1).reshape(-1, len(shape))  # fmt: skip
        got.extend(np.ravel_multi_index(tuple(idx.T), shape).tolist())
    assert got == list(range(start, end))
    assert len(boxes(shape, start, end)) <= 2 * len(shape) - 1


def _whole_reference(shapes, places, layout, ranks_values):
    """The whole parameters assembled element by element from each rank's flat slice values."""
    whole = {p.name: np.full(p.shape, np.nan) for p in places}
    for (start, end), values in ranks_values:
        for part in layout.parts(start, end):
            local = tuple(layout.shapes[part.param])
            place = places[part.param]
            for k in range(part.length):
                idx = np.unravel_index(part.param_start + k, local)
                g = tuple(i + o for i, o in zip(idx, place.offset))
                whole[place.name][g] = values[part.range_start + k]
    return whole


def _tp_places(tp, t, wholes):
    """Places and local shapes of member t of tp: "col" split on dim 0, "row" on dim 1,
    "rep" whole."""
    places, local = [], []
    for name, (kind, shape) in wholes.items():
        shape = tuple(shape)
        off, loc = [0] * len(shape), list(shape)
        d = {"col": 0, "row": 1}.get(kind)
        if d is not None:
            loc[d] //= tp
            off[d] = t * loc[d]
        places.append(Place(name, shape, tuple(off)))
        local.append(tuple(loc))
    return places, local


WHOLES = {"emb": ("col", (8, 6)), "wq": ("col", (4, 6)), "wo": ("row", (6, 4)),
          "norm": ("rep", (6,)), "w2": ("row", (6, 8)), "b": ("col", (4,))}  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("ranks", [1, 3])
def test_param_chunks_pack_whole_parameters(tp, ranks) -> None:
    """What `pack` marks as boxes of the whole parameters is what an element-by-element
    reference puts there, for every TP member and rank; `unpack` restores the slice."""
    ref = {}
    for t in range(tp):
        places, local = _tp_places(tp, t, WHOLES)
        lay = FlatLayout(local, ranks, align=4)
        for r in range(ranks):
            s0, s1 = lay.slice(r)
            vals = torch.randn(s1 - s0, dtype=torch.float64)
            chunks = ParamChunks(lay, s0, s1, places)
            packed = chunks.pack(vals)
            for p in places:
                got = ref.setdefault(p.name, np.full(p.shape, np.nan))
                if p.name not in packed:
                    continue
                tt = packed[p.name]
                assert tt.global_shape == p.shape
                for g, lo, z in zip(tt.global_offsets, tt.local_offsets, tt.local_sizes):
                    src = tt[tuple(slice(a, a + b) for a, b in zip(lo, z))]
                    got[tuple(slice(a, a + b) for a, b in zip(g, z))] = src.numpy()
            want = _whole_reference(local, places, lay, [((s0, s1), vals.numpy())])
            for name, w in want.items():
                m = ~np.isnan(w)
                np.testing.assert_array_equal(ref[name][m], w[m])
            back = torch.zeros_like(vals)
            chunks.unpack({k: v.clone() for k, v in packed.items()}, back)
            assert torch.equal(back, vals)
    for name, w in ref.items():
        assert not np.isnan(w).any(), name  # the ranks and members cover every element


def _layouts(tp: int, ranks: int):
    for t in range(tp):
        places, local = _tp_places(tp, t, WHOLES)
        lay = FlatLayout(local, ranks, align=4)
        for r in range(ranks):
            yield lay, places, lay.slice(r)


@pytest.mark.parametrize("before,after", [((2, 3), (1, 2)), ((1, 2), (2, 3)), ((2, 1), (2, 2))])
def test_param_chunks_reshard_through_dcp(tmp_path, before, after) -> None:
    """A state saved at tp x ranks through DCP loads at another tp and rank count: every
    element of every new slice is the saved value of its place in the whole parameters."""
    import torch.distributed.checkpoint as dcp
    from _dcp_join import save_as_ranks

    whole = {n: torch.randn(s, dtype=torch.float64).numpy() for n, (_, s) in WHOLES.items()}

    def slice_values(lay, places, s0, s1) -> np.ndarray:
        out = np.zeros(s1 - s0)
        for part in lay.parts(s0, s1):
            p, local = places[part.param], lay.shapes[part.param]
            for k in range(part.length):
                idx = np.unravel_index(part.param_start + k, tuple(local))
                out[part.range_start + k] = whole[p.name][
                    tuple(i + o for i, o in zip(idx, p.offset))
                ]
        return out

    packs = []
    for lay, places, (s0, s1) in _layouts(*before):
        vals = torch.from_numpy(slice_values(lay, places, s0, s1))
        packs.append(ParamChunks(lay, s0, s1, places).pack(vals))
    save_as_ranks(str(tmp_path), packs)
    for lay, places, (s0, s1) in _layouts(*after):
        chunks = ParamChunks(lay, s0, s1, places)
        vals = torch.zeros(s1 - s0, dtype=torch.float64)
        packed = chunks.pack(vals)
        dcp.load(packed, checkpoint_id=str(tmp_path), no_dist=True)
        chunks.unpack(packed, vals)
        np.testing.assert_array_equal(vals.numpy(), slice_values(lay, places, s0, s1))
