"""The mixture stream against an independent plain-Python reference (tests/_mix_reference.py,
written from the documented rules): several sources, stages with and without weights (the first
one too), look-ahead values, max_epochs with deferrals, islands, epoch orders, and a resume at
every step (mid-cut and with units deferred), also with other settings from the resume step."""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.errors import ConfigError
from datapipe.mix.config import SourceConfig, StageConfig
from datapipe.mix.fill import ST_UNITS
from datapipe.mix.stream import DataExhausted, MixSource, MixtureStream, source_epoch_order
from datapipe.stream import StreamConfig
from tests._mix_reference import RanOut, Reference, Src, Stg, epoch_order

STEPS = 12


@dataclass
class Case:
    sources: list[Src]
    stages: list[Stg]
    budget: int
    seed: int
    lookahead: int
    islands: int


def _stream(case: Case, island: int = 0, log=None) -> MixtureStream:
    srcs = [
        MixSource(s.name, np.asarray(s.lengths, np.int64), np.asarray(s.ids, np.int64),
                  tuple(s.boosts), s.max_epochs)
        for s in case.sources
    ]  # fmt: skip
    cfgs = [
        SourceConfig(path=s.name, weight=s.weight, max_epochs=s.max_epochs) for s in case.sources
    ]
    stages = [
        StageConfig(start_step=g.start, weights=dict(g.weights), max_sample_tokens=g.unit,
                    global_batch_tokens=g.budget)
        for g in case.stages
    ]  # fmt: skip
    cfg = StreamConfig(seed=case.seed, lookahead=case.lookahead)
    return MixtureStream(
        cfg, srcs, cfgs, stages, case.budget, island, case.islands, log=log or (lambda _: None)
    )


def _reference(case: Case) -> Reference:
    case = copy.deepcopy(case)
    return Reference(
        case.sources, case.stages, case.budget, case.seed, case.lookahead, case.islands
    )


def _rows(batch) -> list[tuple[int, int, int, int]]:
    return [(int(s), int(i), int(a), int(n)) for (s, i, a), n in zip(batch.units, batch.lengths)]


def _some_weight(sources: list[Src], stages: list[Stg]) -> None:
    """Every stage (the first steps included) with a source of weight > 0, as configs must."""
    if not any(s.weight > 0 for s in sources):
        sources[0].weight = 1.0
    w = {s.name: s.weight for s in sources}
    for g in stages:
        w.update(g.weights)
        if not any(v > 0 for v in w.values()):
            g.weights[sources[-1].name] = 1.0
            w.update(g.weights)


@st.composite
def _sources(draw, epochs: bool = True, zero: bool = True) -> list[Src]:
    out = []
    for i in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 20))
        top = draw(st.sampled_from([6, 60, 600, 3000]))
        lengths = draw(st.lists(st.integers(1, top), min_size=n, max_size=n))
        ids = list(range(n))
        if n > 1 and draw(st.booleans()):  # some held out
            ids = sorted(draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n - 1)))
        boosts = []
        if draw(st.booleans()):
            boosts = [(draw(st.integers(1, top)), draw(st.sampled_from([0.5, 1.5, 2.0, 3.0])))]
        m = draw(st.sampled_from([0, 0, 1, 2, 3])) if epochs else 0
        w = draw(st.sampled_from([0.0, 0.3, 1.0, 2.5] if zero else [0.3, 1.0, 2.5]))
        out.append(Src(f"s{i}", lengths, ids, boosts, m, w))
    return out


@st.composite
def _stages(draw, names: list[str], first: int = 1, last: int = STEPS) -> list[Stg]:
    k = draw(st.integers(0, 3))
    starts = sorted(draw(st.sets(st.integers(first, last), min_size=k, max_size=k)))
    out = []
    for start in starts:
        weights = {}
        for n in names:
            if draw(st.booleans()):
                weights[n] = draw(st.sampled_from([0.0, 0.5, 1.0, 4.0]))
        unit = draw(st.sampled_from([None, None, 7, 40, 700]))
        budget = draw(st.sampled_from([None, None, 50, 600, 1500]))
        out.append(Stg(start, weights, unit, budget))
    return out


@st.composite
def cases(draw, epochs: bool = True) -> Case:
    sources = draw(_sources(epochs))
    stages = draw(_stages([s.name for s in sources]))
    _some_weight(sources, stages)
    return Case(
        sources, stages, draw(st.integers(1, 1500)), draw(st.integers(0, 3)),
        draw(st.sampled_from([0, 1, 2, 3, 8, 64])), draw(st.integers(1, 3)),
    )  # fmt: skip


def _expected(case: Case, steps: int = STEPS) -> tuple[list, list[int], int | None]:
    """The reference's batches of every step (one list per island), each step's batch epoch,
    and the step it ran out at (None)."""
    ref = _reference(case)
    out, epochs = [], []
    for _ in range(steps):
        try:
            out.append(ref.step())
        except RanOut as exc:
            return out, epochs, exc.step
        epochs.append(ref.batch_epoch())
    return out, epochs, None


@pytest.mark.timeout(300)  # CPU-bound: a loaded box stretches it
@settings(deadline=None, max_examples=40)
@given(cases())
def test_the_stream_forms_the_reference_batches(case) -> None:
    """Every island's batch of every step: units, keys, step and epoch; running out at the same
    step."""
    want, epochs, ran_out = _expected(case)
    streams = [_stream(case, i) for i in range(case.islands)]
    keys = 0
    for t, batches in enumerate(want):
        for i, s in enumerate(streams):
            b = next(s)
            assert _rows(b) == batches[i], (t, i)
            assert b.step == t and b.epoch == epochs[t]
            first = keys + sum(len(x) for x in batches[:i])
            assert b.sample_ids.tolist() == list(range(first, first + len(batches[i])))
        keys += sum(len(x) for x in batches)
    if ran_out is not None:
        for s in streams:
            with pytest.raises(DataExhausted, match=f"runs out of data at step {ran_out}:"):
                next(s)


def _resume_everywhere(case: Case) -> list[dict]:
    """Resume the stream (state through JSON) after every step: the rest is the reference's
    uninterrupted run. Returns the states."""
    want, _, ran_out = _expected(case)
    s, states = _stream(case), []
    for k in range(len(want) + 1):
        state = json.loads(json.dumps(s.state_dict()))
        states.append(state)
        r = _stream(case)
        r.load_state_dict(state)
        for t in range(k, len(want)):
            assert _rows(next(r)) == want[t][0], (k, t)
        if ran_out is not None:
            with pytest.raises(DataExhausted):
                next(r)
        if k < len(want):
            next(s)
    return states


@pytest.mark.timeout(300)  # CPU-bound: a loaded box stretches it
@settings(deadline=None, max_examples=15)
@given(cases())
def test_a_resume_at_every_step_continues_the_reference(case) -> None:
    _resume_everywhere(case)


def test_a_resume_while_a_sample_is_cut_and_units_wait() -> None:
    """A resume at each step of a run whose sources are cut into pieces (a stage changes the
    cut) and defer units: states with a sample part-taken and with deferred units are among
    them, and each resumes into the reference's batches."""
    rng = np.random.default_rng(4)
    sources = [
        Src("long", rng.integers(50, 400, 12).tolist(), list(range(12)), [(300, 2.0)], 0, 1.0),
        Src("short", rng.integers(1, 60, 30).tolist(), list(range(30)), [], 2, 1.0),
        Src("mid", rng.integers(20, 200, 9).tolist(), list(range(9)), [], 0, 0.0),
    ]
    stages = [Stg(3, {"mid": 2.0}, 70, None), Stg(7, {"long": 0.5}, 25, 180)]
    case = Case(sources, stages, 300, 1, 4, 1)
    states = _resume_everywhere(case)
    cut = [st for st in states if any(v["cursor_offset"] for v in st["sources"].values())]
    waiting = [st for st in states if any(v["deferred"] for v in st["sources"].values())]
    assert len(cut) >= 3 and len(waiting) >= 3
    assert any(st in waiting for st in cut)  # a resume with both


@st.composite
def _changes(draw):
    case = draw(cases())
    k = draw(st.integers(1, STEPS - 2))
    new = copy.deepcopy(case)
    what = draw(st.sampled_from(["max_epochs", "max_epochs", "weights", "stages", "budget"]))
    if what == "max_epochs":
        for s in new.sources:
            s.max_epochs = draw(st.sampled_from([0, 1, 1, 2, s.max_epochs]))
    elif what == "weights":
        for s in new.sources:
            s.weight = draw(st.sampled_from([0.0, 0.2, 1.0, 3.0, s.weight]))
    elif what == "stages":
        new.stages = draw(_stages([s.name for s in new.sources], 1, STEPS))
    else:
        new.budget = draw(st.integers(1, 1500))
    _some_weight(new.sources, new.stages)
    return case, new, k


@pytest.mark.timeout(300)  # CPU-bound: a loaded box stretches it
@settings(deadline=None, max_examples=30)
@given(_changes())
def test_other_settings_on_resume_apply_from_the_resume_step(change) -> None:
    """Weights, max_epochs (lowered: a source past it is out from the resume step), stages and
    the batch budget changed at a resume: the reference switched at that step."""
    case, new, k = change
    ref, s = _reference(case), _stream(case)
    for _ in range(k):
        try:
            ref.step()
        except RanOut:
            return
        next(s)
    ref.resume_with(copy.deepcopy(new.sources), copy.deepcopy(new.stages), new.budget)
    r = _stream(new)
    r.load_state_dict(json.loads(json.dumps(s.state_dict())))
    for t in range(k, STEPS):
        try:
            want = ref.step()
        except RanOut as exc:
            with pytest.raises(DataExhausted, match=f"at step {exc.step}:"):
                next(r)
            return
        b = next(r)
        assert _rows(b) == want[0], t
        assert b.epoch == ref.batch_epoch()


@st.composite
def _finite(draw) -> Case:
    """Every source with weight and max_epochs, whole samples or one cut from step 1."""
    sources = draw(_sources(epochs=False, zero=False))
    for s in sources:
        s.max_epochs = draw(st.integers(1, 3))
        s.lengths = [min(x, 400) for x in s.lengths]
    unit = draw(st.sampled_from([None, 7, 90]))
    stages = [Stg(1, {}, unit, None)] if unit else []
    la = draw(st.sampled_from([2, 3, 5, 16]))
    return Case(sources, stages, draw(st.integers(400, 3000)), draw(st.integers(0, 3)), la, 1)


def _draws_match_the_passes(case: Case) -> bool:
    """Run `case` (every source stops) to its end: each sample's tokens were drawn as often as
    the documented epoch orders of its passes hold it (the units of the step the stream could
    not complete, in its unit buffer, included), and none is left waiting. Returns
    whether units were deferred on the way."""
    s = _stream(case)
    drawn = [np.zeros(len(src.lengths), np.int64) for src in case.sources]
    deferred_seen = False
    with pytest.raises(DataExhausted):
        for _ in range(20000):
            b = next(s)
            for (src, sid, _), n in zip(b.units, b.lengths):
                drawn[src][sid] += n
            deferred_seen |= bool(s.ndef.any())
    for src, sid, _, n in s.out[: s.st[ST_UNITS]]:  # the last step, left incomplete
        drawn[src][sid] += n
    for i, src in enumerate(case.sources):
        want = np.zeros(len(src.lengths), np.int64)
        for e in range(src.max_epochs):
            for sid in epoch_order(src, case.seed, e):
                want[sid] += src.lengths[sid]
        assert drawn[i].tolist() == want.tolist(), src.name
    assert not s.ndef.any()  # nothing left waiting
    return deferred_seen


@settings(deadline=None, max_examples=25)
@given(_finite())
def test_max_epochs_draws_every_token_of_each_pass_once_with_deferrals(case) -> None:
    """Sources that all stop after max_epochs passes, with look-ahead deferrals: by the time
    the stream ends, each sample's tokens were drawn as often as the epoch orders of its passes
    hold it (deferred units included), and no more."""
    _draws_match_the_passes(case)


def test_max_epochs_counts_with_units_deferred_at_the_end_of_a_pass() -> None:
    rng = np.random.default_rng(2)
    sources = [
        Src("a", rng.integers(100, 900, 25).tolist(), list(range(25)), [(600, 2.0)], 2, 1.0),
        Src("b", rng.integers(1, 300, 40).tolist(), list(range(40)), [], 3, 2.0),
    ]
    assert _draws_match_the_passes(Case(sources, [], 1000, 5, 6, 1))


@settings(deadline=None, max_examples=25)
@given(_sources(), st.integers(0, 2**32 - 1))
def test_epoch_orders_are_the_documented_permutations(sources, seed) -> None:
    """Each epoch's order is the documented draw (boosts included) and epochs differ."""
    for src in sources:
        ms = MixSource(src.name, np.asarray(src.lengths), np.asarray(src.ids), tuple(src.boosts))
        orders = [source_epoch_order(ms, seed, e).tolist() for e in range(4)]
        assert orders == [epoch_order(src, seed, e) for e in range(4)]
        if len(src.ids) >= 8 and not src.boosts:
            assert len({tuple(o) for o in orders}) == 4


def test_a_lowered_max_epochs_stops_a_source_at_the_resume_step(caplog) -> None:
    """The README's rule: max_epochs lowered on resume applies from the resume step; the log
    states the passes made."""
    small = Src("small", [30] * 10, list(range(10)), [], 0, 1.0)
    big = Src("big", [50] * 400, list(range(400)), [], 0, 1.0)
    case = Case([small, big], [], 400, 0, 4, 1)
    s = _stream(case)
    for _ in range(12):
        next(s)
    assert int(s.epoch[0]) >= 2  # small is in its third pass or later
    state = json.loads(json.dumps(s.state_dict()))
    lowered = replace(case, sources=[replace(small, max_epochs=1), big])
    with caplog.at_level(logging.INFO, logger="mixlen"):
        r = _stream(lowered, log=logging.getLogger("mixlen").info)
        r.load_state_dict(state)
        nxt = [next(r) for _ in range(5)]
    assert all((b.units[:, 0] == 1).all() for b in nxt)  # from the resume step: big only
    msgs = [m.message for m in caplog.records if "'small'" in m.message]
    passes = int(state["sources"]["small"]["epoch"])
    assert msgs == [
        f"data: source 'small' has made {passes} passes, at least its max_epochs (1, lowered on "
        f"resume): it stops at step 13, in its pass {passes + 1}; its share goes to the other "
        "sources"
    ]
    raised = _stream(replace(case, sources=[replace(small, max_epochs=passes + 2), big]))
    raised.load_state_dict(state)
    assert any((next(raised).units[:, 0] == 0).any() for _ in range(3))  # it keeps its share


def test_a_resume_with_another_length_boost_is_refused() -> None:
    """length_boost shapes the epoch in progress (its order, the cursor into it): a resume with
    other thresholds, factors or none is refused naming the key; the same boosts resume."""
    case = Case([Src("a", [5, 50, 500, 700], [0, 1, 2, 3], [(100, 2.0)])], [], 100, 0, 4, 1)
    s = _stream(case)
    next(s)
    state = json.loads(json.dumps(s.state_dict()))
    for boosts in ([(100, 3.0)], [(10, 2.0)], []):
        other = replace(case, sources=[replace(case.sources[0], boosts=boosts)])
        with pytest.raises(ConfigError, match=r"length_boost: \[\[100, 2\.0\]\] was saved"):
            _stream(other).load_state_dict(state)
    _stream(case).load_state_dict(state)


def test_check_supply_counts_from_the_resumed_state() -> None:
    """A run on an endless source resumes at step 3 with the weight on a one-pass source of 10
    samples of 10 tokens (2 a step at 20 tokens): from the resume it lasts 5 steps, so steps
    4..8 are formed and step 9 is not (counted from the state, not from step 1)."""
    endless = Src("c", [10] * 50, list(range(50)), [], 0, 1.0)
    once = Src("a", [10] * 10, list(range(10)), [], 1, 0.0)
    s = _stream(Case([endless, once], [], 20, 0, 4, 1))
    for _ in range(3):
        next(s)
    later = [replace(endless, weight=0.0), replace(once, weight=1.0)]
    r = _stream(Case(later, [], 20, 0, 4, 1))
    r.load_state_dict(json.loads(json.dumps(s.state_dict())))
    r.check_supply(8)
    with pytest.raises(DataExhausted, match="at step 9:"):
        r.check_supply(9)
    got = [next(r) for _ in range(5)]
    assert [b.units[:, 0].tolist() for b in got] == [[1, 1]] * 5
    with pytest.raises(DataExhausted, match="at step 9:"):
        next(r)


def test_tokens_above_counts_pieces_by_their_samples_stored_length() -> None:
    """Under max_sample_tokens a long sample trains as pieces shorter than a boost's threshold:
    tokens_above counts a piece by its sample's stored length (a hand count per batch)."""
    lengths = [300, 40, 250, 90, 500]
    case = Case([Src("a", lengths, list(range(5)), [(200, 1.0)])], [Stg(1, {}, 64)], 128, 0, 4, 1)
    s, seen = _stream(case), 0
    for _ in range(8):
        b = next(s)
        assert int(b.lengths.max()) <= 64
        want = sum(int(n) for (_, i, _), n in zip(b.units, b.lengths) if lengths[i] >= 200)
        assert s.tokens_above(b) == {"a": {200: want}}
        seen += want
    assert seen > 0


def _two_sources() -> tuple[list[Src], Case]:
    """Two sources of 40 samples, weights 0.7 and 0.2, and a case over them."""
    rng = np.random.default_rng(2)
    src = [Src("a", rng.integers(5, 90, 40).tolist(), list(range(40)), [], 0, 0.7),
           Src("b", rng.integers(5, 90, 40).tolist(), list(range(40)), [], 0, 0.2)]  # fmt: skip
    return src, Case(src, [], 300, 0, 4, 1)


def test_weights_scaled_by_one_factor_on_resume_are_the_same_mixture() -> None:
    """Every weight times 7 at a resume: the shares differ in their last bits only, and the run
    continues the uninterrupted run's batches (its segment is not restarted)."""
    src, case = _two_sources()
    scaled = replace(case, sources=[replace(s, weight=s.weight * 7) for s in src])
    assert 0.7 / (0.7 + 0.2) != 0.7 * 7 / (0.7 * 7 + 0.2 * 7)  # not bit for bit the same
    whole, s = _stream(case), _stream(case)
    want = [_rows(next(whole)) for _ in range(STEPS)]
    for k in range(1, STEPS - 1):
        next(s)
        r = _stream(scaled)
        r.load_state_dict(json.loads(json.dumps(s.state_dict())))
        assert [_rows(next(r)) for _ in range(k, STEPS)] == want[k:], k


def test_a_weight_changed_by_one_part_in_a_million_is_another_mixture() -> None:
    """Not only scaling: one weight moved by a relative 1e-6 at a resume starts a segment, as
    the reference does for any other weights (its batches from the resume step)."""
    src, case = _two_sources()
    nudged = [replace(src[0], weight=0.7 * (1 + 1e-6)), src[1]]
    for k in range(1, STEPS - 1):
        ref, s = _reference(case), _stream(case)
        for _ in range(k):
            ref.step()
            next(s)
        ref.resume_with(copy.deepcopy(nudged), [], case.budget)
        r = _stream(replace(case, sources=nudged))
        r.load_state_dict(json.loads(json.dumps(s.state_dict())))
        for t in range(k, STEPS):
            assert _rows(next(r)) == ref.step()[0], (k, t)
