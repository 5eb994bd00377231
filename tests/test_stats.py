"""trainer.parallel.stats: a step's statistics packed by every rank, summed as the island's
all-reduce sums them, and unpacked, against the values each rank put in, field by field."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.parallel.stats import RANK_FIELDS, StepStats

INTS = ("microbatches", "p2p_bytes", "offload_bytes", "act_peak_bytes")
FLOATS = ("busy_s", "ring_wait_s")
_float = st.floats(min_value=0.0, max_value=1e9, allow_nan=False, allow_infinity=False)
_int = st.integers(min_value=0, max_value=(1 << 53) - 1)  # exact in float64
_rank = st.fixed_dictionaries(
    {"loss": st.floats(-1e12, 1e12, allow_nan=False), **{f: _float for f in FLOATS}}
    | {f: _int for f in INTS}
)


def test_layout_is_the_dataclass_s_fields() -> None:
    """The packed rows are StepStats' fields after the loss, each once, ints and floats typed."""
    names = [f.name for f in dataclasses.fields(StepStats)]
    assert names == ["loss_sum", *RANK_FIELDS]
    assert sorted(RANK_FIELDS) == sorted(INTS + FLOATS)


@settings(max_examples=60, deadline=None)
@given(st.lists(_rank, min_size=1, max_size=8))
def test_pack_sum_unpack_round_trip(ranks: list[dict]) -> None:
    size = len(ranks)
    bufs = []
    for rank, mine in enumerate(ranks):
        loss = torch.tensor(mine["loss"], dtype=torch.float64)
        buf = StepStats.pack(loss, rank, size, mine, torch.device("cpu"))
        assert buf.dtype == torch.float64 and buf.numel() * 8 == StepStats.nbytes(size)
        # a rank writes the loss and its own column of each row, nothing else
        own = {0} | {1 + j * size + rank for j in range(len(RANK_FIELDS))}
        assert all(v == 0.0 for i, v in enumerate(buf.tolist()) if i not in own)
        bufs.append(buf)
    total = bufs[0].clone()
    for buf in bufs[1:]:  # the all-reduce's sum, in rank order
        total += buf
    got = StepStats.unpack(total.tolist(), size)
    want_loss = 0.0
    for mine in ranks:
        want_loss += mine["loss"]
    assert got.loss_sum == want_loss
    for name in RANK_FIELDS:
        values = getattr(got, name)
        assert values == [mine[name] for mine in ranks], name
        kind = int if name in INTS else float
        assert all(type(v) is kind for v in values), name
    assert got == StepStats(want_loss, **{n: [m[n] for m in ranks] for n in RANK_FIELDS})


def test_hidden_fraction_is_the_span_not_waited_on() -> None:
    """1 - wait / span: 0.25 s waited of a 1 s span is 75% hidden; no span, nothing hidden."""
    from trainer.parallel.stats import ReduceStats

    assert ReduceStats(3, 2, 0.25, 100, span_s=1.0).hidden_fraction == 0.75
    assert ReduceStats(3, 2, 1.0, 100, span_s=1.0).hidden_fraction == 0.0
    assert ReduceStats(1, 0, 0.0, 100).hidden_fraction == 0.0
