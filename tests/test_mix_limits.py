"""The mixture keys' limits, each exactly at the limit (accepted) and just past it (refused, with
the key and the rule the user may write): weights, start_step, max_sample_tokens, a stage's
global_batch_tokens, max_epochs, length_boost (its factor, its threshold, and the draws it may
add to an epoch), and a --mix file's stream keys and val_fraction."""

from __future__ import annotations

import math

import numpy as np
import pytest

from datapipe.errors import ConfigError
from datapipe.mix import stream as mix_stream
from datapipe.mix.config import MAX_BOOST, MAX_WEIGHT, check_mixture
from datapipe.mix.report import read_mixture
from datapipe.mix.stream import MixSource, MixtureStream, source_epoch_order
from datapipe.settings import MAX_INT, Names, check, from_mapping
from datapipe.stream import StreamConfig

DATA = Names("data")


def _mixture(sources: list[dict], stages: list[dict] | None = None) -> None:
    """Build and check `[data] sources` and `stages` as a training config does."""
    from datapipe.mix.config import SourceConfig, StageConfig

    srcs, stgs = [], []
    for i, item in enumerate(sources):
        names = Names(f"data.sources[{i}]")
        cfg = from_mapping(SourceConfig, item, names)
        check(cfg, names)
        srcs.append(cfg)
    for i, item in enumerate(stages or []):
        names = Names(f"data.stages[{i}]")
        cfg = from_mapping(StageConfig, item, names)
        check(cfg, names)
        stgs.append(cfg)
    check_mixture(srcs, stgs, DATA)


def _refused(msg: str, sources: list[dict], stages: list[dict] | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        _mixture(sources, stages)
    assert msg in str(err.value), str(err.value)
    return str(err.value)


TINY = 5e-324  # the smallest positive float
ABOVE_MAX_WEIGHT = math.nextafter(MAX_WEIGHT, math.inf)


def test_source_weights_one_rule_at_both_limits() -> None:
    other = {"path": "y"}
    _mixture([{"path": "x", "weight": 0}, other])  # 0: none until a stage gives it weight
    _mixture([{"path": "x", "weight": MAX_WEIGHT}, other])
    for bad in (-TINY, -1):
        _refused(f"data.sources[0].weight: must be >= 0, got {float(bad)!r}",
                 [{"path": "x", "weight": bad}, other])  # fmt: skip
    _refused(
        "data.sources[0].weight: must be <= 1e+12", [{"path": "x", "weight": ABOVE_MAX_WEIGHT}]
    )
    _refused("data.sources: every source has weight 0", [{"path": "x", "weight": 0}])
    # a stage gives the weight-0 source its weight from its step on
    _mixture([{"path": "x", "weight": 0}, other], [{"start_step": 3, "weights": {"x": 2}}])


def test_stage_weights_follow_the_same_rule_in_the_same_words() -> None:
    src = [{"path": "x"}, {"path": "y"}]
    _mixture(src, [{"start_step": 2, "weights": {"x": 0}}])
    _mixture(src, [{"start_step": 2, "weights": {"x": MAX_WEIGHT}}])
    _refused(f"data.stages[0].weights.x: must be >= 0, got {-TINY!r}",
             src, [{"start_step": 2, "weights": {"x": -TINY}}])  # fmt: skip
    _refused("data.stages[0].weights.x: must be <= 1e+12",
             src, [{"start_step": 2, "weights": {"x": ABOVE_MAX_WEIGHT}}])  # fmt: skip
    _refused("data.stages[0].weights: every source has weight 0 in this stage",
             src, [{"start_step": 2, "weights": {"x": 0, "y": 0}}])  # fmt: skip
    for bad, said in ((True, "bool True"), ("2", "str '2'"), (None, "NoneType None")):
        _refused(f"data.stages[0].weights.x: expected a number, got {said}",
                 src, [{"start_step": 2, "weights": {"x": bad}}])  # fmt: skip
    _refused("data.stages[0].weights.x: must be finite, got nan",
             src, [{"start_step": 2, "weights": {"x": math.nan}}])  # fmt: skip


def test_a_stages_weights_are_shares_of_their_sum() -> None:
    """The weights in force (a stage's over the sources' or the stage before's) as shares of
    their sum: proportional weights are the same mixture."""
    from datapipe.mix.config import SourceConfig, StageConfig, stage_at

    srcs = [SourceConfig(path="x", weight=1.0), SourceConfig(path="y", weight=3.0)]
    stages = [StageConfig(start_step=3, weights={"x": 6.0}), StageConfig(start_step=5, weights={})]
    got = [stage_at(t, srcs, ["x", "y"], stages, 100).weights for t in (1, 3, 5)]
    assert got == [(0.25, 0.75), (6 / 9, 3 / 9), (6 / 9, 3 / 9)]
    twice = [SourceConfig(path="x", weight=2.0), SourceConfig(path="y", weight=6.0)]
    assert stage_at(1, twice, ["x", "y"], [], 100).weights == got[0]


def test_start_step_names_what_the_user_may_write() -> None:
    src = [{"path": "x"}]
    _mixture(src, [{"start_step": 1}])
    _mixture(src, [{"start_step": MAX_INT}])
    for bad in (0, -1, -3):
        msg = _refused(f"data.stages[0].start_step: must be >= 1, got {bad}", src,
                       [{"start_step": bad}])  # fmt: skip
        assert "-1" not in msg.replace(f"got {bad}", "")  # no internal sentinel
    _refused(f"data.stages[0].start_step: must be <= {MAX_INT:,}", src,
             [{"start_step": MAX_INT + 1}])  # fmt: skip
    _refused("data.stages[0].start_step: required, an optimizer step >= 1", src, [{}])
    _refused("data.stages[1].start_step: 4, but stages must start at increasing steps", src,
             [{"start_step": 4}, {"start_step": 4}])  # fmt: skip
    _mixture(src, [{"start_step": 4}, {"start_step": 5}])


def test_stage_units_budgets_and_max_epochs_at_their_limits() -> None:
    src = [{"path": "x"}]
    _mixture(src, [{"start_step": 1, "max_sample_tokens": 2, "global_batch_tokens": 1}])
    _refused("data.stages[0].max_sample_tokens: must be >= 2, got 1", src,
             [{"start_step": 1, "max_sample_tokens": 1}])  # fmt: skip
    _refused("data.stages[0].global_batch_tokens: must be >= 1, got 0", src,
             [{"start_step": 1, "global_batch_tokens": 0}])  # fmt: skip
    _mixture([{"path": "x", "max_epochs": 0}])
    _mixture([{"path": "x", "max_epochs": MAX_INT}])
    _refused("data.sources[0].max_epochs: must be >= 0, got -1", [{"path": "x", "max_epochs": -1}])
    _refused("data.sources[0].max_epochs: must be <=", [{"path": "x", "max_epochs": MAX_INT + 1}])


def test_length_boost_factor_and_threshold_at_their_limits() -> None:
    def boost(b: dict) -> list[dict]:
        return [{"path": "x", "length_boost": b}]

    _mixture(boost({"1": MAX_BOOST, str(MAX_INT): TINY}))
    _refused("data.sources[0].length_boost.1: the factor must be a number in (0, 1e+06]",
             boost({"1": math.nextafter(MAX_BOOST, math.inf)}))  # fmt: skip
    _refused("data.sources[0].length_boost.5: the factor must be", boost({"5": 0}))
    _refused("data.sources[0].length_boost.0: the token count must be in [1,", boost({"0": 2}))
    _refused(f"length_boost.{MAX_INT + 1}: the token count", boost({str(MAX_INT + 1): 2}))


def _boosted(n: int, factor: float) -> MixtureStream:
    from datapipe.mix.config import SourceConfig

    src = MixSource("b", np.full(n, 100), np.arange(n), ((1, factor),))
    cfg = [SourceConfig(path="b")]
    return MixtureStream(StreamConfig(), [src], cfg, [], 1000, names=Names("data"))


def test_the_draws_a_boost_adds_to_an_epoch_are_bounded(monkeypatch) -> None:
    """`length_boost = {1 = 1e6}` on a 188-sample source would hold 188 million draws in
    memory: refused by key, before any order is drawn; the bound is exact."""
    with pytest.raises(ConfigError) as err:
        _boosted(188, 1e6)
    assert str(err.value).startswith(
        "data.sources[0].length_boost: an epoch of source 'b' would draw up to 188,000,000 "
        "samples (188 samples, 187,999,812 more from its factors); the boosts may add at most "
        "16,777,216 draws"
    )
    monkeypatch.setattr(mix_stream, "MAX_BOOST_DRAWS", 50)
    s = _boosted(10, 6.0)  # 10 samples x 6: exactly 50 more
    assert next(s).units.shape[0] > 0
    with pytest.raises(ConfigError, match="at most 50 draws"):
        _boosted(10, math.nextafter(6.0, 7.0))  # up to 7 each: 60 more


def test_a_mix_file_refuses_unknown_keys_and_checks_its_stream_keys(tmp_path) -> None:
    from trainer.data import DataConfig

    def mix(body: str) -> str:
        path = tmp_path / "m.toml"
        path.write_text('[data]\nsources = [{path = "x"}]\n' + body)
        return str(path)

    m = read_mixture([], mix("lookahead = 0\nval_fraction = 0.0\n"), DataConfig)
    assert m.stream == {"lookahead": 0} and m.val_fraction == 0.0
    m = read_mixture([], mix(f"lookahead = {1 << 20}\nval_fraction = 0.999999\n"), DataConfig)
    assert m.keys == ["data.sources[0]"] and m.where.startswith("--mix ")
    for body, msg in [
        ("lookahed = 5\n", "data.lookahed: unknown key (known: "),
        (f"lookahead = {(1 << 20) + 1}\n", "data.lookahead: must be <= 1,048,576"),
        ("lookahead = -1\n", "data.lookahead: must be >= 0"),
        ("val_fraction = 1.0\n", "data.val_fraction: must be in [0, 1)"),
        ("val_fraction = -5e-324\n", "data.val_fraction"),
        ("[[data.stages]]\nstart_step = 0\n", "data.stages[0].start_step: must be >= 1, got 0"),
    ]:
        with pytest.raises(ConfigError) as err:
            read_mixture([], mix(body), DataConfig)
        assert str(err.value).startswith(f"--mix {tmp_path / 'm.toml'}: {msg}"), str(err.value)
    top = tmp_path / "top.toml"  # a bare mixture file: the keys at the top
    top.write_text('sources = [{path = "x"}]\nseed = 3\nlokahead = 1\n')
    with pytest.raises(ConfigError, match=r"top.toml: lokahead: unknown key"):
        read_mixture([], str(top), DataConfig)


def test_length_boost_keys_in_any_order_the_highest_reached_applies() -> None:
    """`length_boost = {1_000 = 4.0, 100 = 2.0}` (thresholds written decreasing): a sample of at
    least 1,000 tokens is drawn 4 times an epoch, one of 100..999 twice, a shorter one once."""
    from datapipe.mix.config import SourceConfig
    from datapipe.mix.sources import LoadedSource, mix_sources

    cfg = SourceConfig(path="d", length_boost={"1_000": 4.0, "100": 2.0})
    lengths = np.array([50, 99, 100, 999, 1000, 5000], np.int64)
    src = mix_sources([LoadedSource(cfg, "d", "d", None, {}, lengths, "f", "data.path")])[0]
    assert src.repeats().tolist() == [1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    order = source_epoch_order(src, 0, 0)
    assert np.bincount(order, minlength=6).tolist() == [1, 1, 2, 2, 4, 4]


def test_oversize_error_takes_a_unit_of_exactly_the_budget() -> None:
    """`oversize = "error"` refuses only a unit longer than its stage's batch budget: a sample of
    exactly the budget (or a stage's cut equal to its budget) fills a batch on its own."""
    from datapipe.mix.config import SourceConfig, StageConfig

    def stream(budget: int, stages: tuple = ()) -> MixtureStream:
        src = MixSource("a", np.array([64, 10, 30, 100]), np.arange(3))  # sample 3 held out
        cfg = StreamConfig(oversize="error")
        return MixtureStream(cfg, [src], [SourceConfig(path="a")], list(stages), budget, names=DATA)

    s = stream(64)
    batches = [next(s).lengths.tolist() for _ in range(6)]
    assert [64] in batches and all(sum(b) <= 64 for b in batches)
    cut = StageConfig(start_step=2, max_sample_tokens=40, global_batch_tokens=40)
    s = stream(64, (cut,))
    next(s)  # step 1: the base budget
    assert all(next(s).lengths.sum() <= 40 for _ in range(3))
    with pytest.raises(ConfigError, match="global_batch_tokens: 63 is smaller than a 64-token"):
        stream(63)
