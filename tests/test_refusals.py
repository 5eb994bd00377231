"""docs/failures.md's "Refusals" table is `tools/refusals.py`'s list, and the list is the code's:
each row's message part is in the module it names, each row's test exists in its test file."""

from __future__ import annotations

import ast
import dataclasses
import math
import typing
from pathlib import Path

import pytest

from datapipe.errors import ConfigError
from datapipe.settings import MAX_INT
from tools.refusals import BEGIN, END, REFUSALS, markdown, replace_table

ROOT = Path(__file__).resolve().parent.parent


def test_readme_table_is_the_list() -> None:
    text = (ROOT / "docs" / "failures.md").read_text()
    assert BEGIN in text and END in text
    assert text.split(BEGIN, 1)[1].split(END, 1)[0] == "\n" + markdown()
    assert replace_table(text) == text


def test_each_refusal_is_raised_where_it_says_and_tested() -> None:
    """The message part is a literal of the module (an f-string's fixed text counts), and the
    test is a function of the test file; a row left behind by a change of either fails."""
    problems = []
    for r in REFUSALS:
        if r.message not in (ROOT / r.module).read_text():
            problems.append(f"{r.module} has no {r.message!r}")
        file, _, name = r.test.partition("::")
        tree = ast.parse((ROOT / file).read_text())
        if name not in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}:
            problems.append(f"{file} has no {name}")
    assert problems == []


def test_the_check_finds_a_stale_row(monkeypatch) -> None:
    """A row whose message or test no longer exists is reported (the check can fail)."""
    stale = REFUSALS[0]._replace(message="no such message", test="tests/test_refusals.py::gone")
    monkeypatch.setitem(globals(), "REFUSALS", (stale,))
    try:
        test_each_refusal_is_raised_where_it_says_and_tested()
    except AssertionError as exc:
        assert "no 'no such message'" in str(exc) and "has no gone" in str(exc)
    else:
        raise AssertionError("a stale row passed")


# --- each limit of the train, islands and tp keys and the eval and train flags: the value at the
# limit is accepted, the nearest value past it refused naming the key ------------------------------

SECTIONS = ("train", "parallel", "co2")  # [parallel] holds the planner's keys, islands and tp
BASE = {"data": {"path": "data"}, "model": {"name": "debug"}, "checkpoint": {"dir": "ckpt"}}


def _range_keys() -> list[tuple[str, str, type, float | None, float | None]]:
    """(section, key, type, lo, hi) of every numeric key of SECTIONS with a bound in its
    declaration (an int's hi defaults to MAX_INT), inline configs' keys included."""
    from trainer.config.job import TrainerConfig

    out = []

    def walk(section: str, cls: type) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("inline"):
                walk(section, hints[f.name])
                continue
            kinds = set(typing.get_args(hints[f.name])) or {hints[f.name]}
            num = next((t for t in (int, float) if t in kinds), None)
            if num is None or bool in kinds or f.metadata.get("choices"):
                continue
            lo, hi = f.metadata.get("lo"), f.metadata.get("hi")
            if hi is None and num is int:
                hi = MAX_INT
            if lo is not None or hi is not None:
                out.append((section, f.name, num, lo, hi))

    hints = typing.get_type_hints(TrainerConfig)
    for section in SECTIONS:
        walk(section, hints[section])
    return out


def _past(value: float, num: type, up: bool) -> float:
    """The nearest value beyond `value` (an int's next integer; a float's next double)."""
    if num is int:
        return int(value) + (1 if up else -1)
    return math.nextafter(float(value), math.inf if up else -math.inf)


def _validated(section: str, key: str, value: float) -> None:
    from trainer.config.job import from_dict

    from_dict({**BASE, section: {key: value}}).validate()


RANGES = _range_keys()


def test_the_sweep_sees_the_keys_it_must() -> None:
    """The bounded keys include the ones a user sets most (a sweep that found none passes)."""
    keys = {f"{s}.{k}" for s, k, *_ in RANGES}
    assert {"train.steps", "train.global_batch_tokens", "train.seed", "parallel.capacity",
            "parallel.islands", "co2.tau", "co2.warmup_rounds"} <= keys  # fmt: skip
    # bounds written here, not read from the declarations (a bound dropped there fails here)
    bounds = {f"{s}.{k}": (lo, hi) for s, k, _, lo, hi in RANGES}
    assert bounds["train.min_lr_ratio"] == (0.0, 1.0)
    assert bounds["train.global_batch_tokens"] == (1, 1 << 40)


def test_offload_is_planned_only_for_the_policies_that_offload() -> None:
    from trainer.config.job import from_dict

    for policy in ("hdp", "naive-hdp"):
        from_dict({**BASE, "parallel": {"policy": policy}, "offload": {"enabled": True}}).validate()
    with pytest.raises(ConfigError, match=r"^offload.enabled: the static policy never offloads"):
        from_dict(
            {**BASE, "parallel": {"policy": "static"}, "offload": {"enabled": True}}
        ).validate()


@pytest.mark.parametrize(
    "section, key, num, lo, hi", RANGES, ids=[f"{s}.{k}" for s, k, *_ in RANGES]
)
def test_each_declared_limit_is_accepted_and_the_next_value_refused(section, key, num, lo, hi):
    """At `lo` and at `hi` the config validates; one past either (an int's next integer, a
    float's next double) is refused naming `section.key` and the bound."""
    for limit, up, word in ((lo, False, ">="), (hi, True, "<=")):
        if limit is None:
            continue
        _validated(section, key, num(limit))
        with pytest.raises(ConfigError, match=f"^{section}.{key}: must be {word} "):
            _validated(section, key, _past(limit, num, up))


TINY = 5e-324  # the smallest double above 0
BELOW_1 = math.nextafter(1.0, 0.0)


@pytest.mark.parametrize(
    "section, key, accepted, refused, message",
    [
        ("train", "lr", TINY, 0.0, "must be > 0"),
        ("train", "beta1", BELOW_1, 1.0, r"must be in \[0, 1\)"),
        ("train", "beta2", BELOW_1, 1.0, r"must be in \[0, 1\)"),
        ("co2", "outer_lr", TINY, 0.0, "must be > 0"),
        ("co2", "clip_value", TINY, 0.0, "must be > 0"),
        ("co2", "warmup_outer_lr", TINY, 0.0, "must be > 0"),
        ("co2", "outer_momentum", BELOW_1, 1.0, r"must be in \[0, 1\)"),
        ("parallel", "tp", 8, 16, "is not one of 1, 2, 4, 8"),
        ("parallel", "tp", 1, 0, "is not one of 1, 2, 4, 8"),
    ],
)
def test_open_and_listed_limits(section, key, accepted, refused, message) -> None:
    """The limits the declarations cannot say (> 0, < 1, one of the TP degrees): the value at
    the edge is accepted, the edge itself (or the next degree) refused naming the key."""
    shape = {"model": {"name": "debug", "vocab_size": 512, "n_heads": 8, "n_kv_heads": 8}}
    from trainer.config.job import from_dict

    from_dict({**BASE, **shape, section: {key: accepted}}).validate()
    with pytest.raises(ConfigError, match=f"^{section}.{key}: .*{message}"):
        from_dict({**BASE, **shape, section: {key: refused}}).validate()


def test_islands_and_tp_dividing_the_processes() -> None:
    """As many islands (times tp) as processes is accepted (one rank each); one island more,
    or a tp that leaves a remainder, is refused naming the key."""
    from trainer.islands.config import ranks_per_island

    assert ranks_per_island(8, 8) == 1 and ranks_per_island(4, 8, tp=2) == 1
    with pytest.raises(ConfigError, match="^parallel.islands: 9 islands do not divide the 8"):
        ranks_per_island(9, 8)
    with pytest.raises(ConfigError, match="^parallel.islands: 5 islands do not divide the 4"):
        ranks_per_island(5, 8, tp=2)
    with pytest.raises(ConfigError, match="^parallel.tp: 8 tensor-parallel processes"):
        ranks_per_island(1, 4, tp=8)


def _flag_limits() -> list[tuple[str, str, int, int]]:
    from datapipe.plan.setup import MAX_CAPACITY
    from tools.cli import MAX_NPROC

    return [
        ("eval", "--max-tokens", 1, 1 << 40),
        ("eval", "--nproc", 1, MAX_NPROC),
        ("eval", "--capacity", 1, MAX_CAPACITY),
        ("eval", "--seed", 0, (1 << 63) - 1),
        ("train", "--nproc", 1, MAX_NPROC),
        ("train", "--max-restarts", 0, 10_000),
    ]


@pytest.mark.parametrize("command, flag, lo, hi", _flag_limits())
def test_integer_flags_at_and_past_their_limits(command, flag, lo, hi, capsys) -> None:
    """`mixlen eval|train FLAG N`: N at either limit parses to N; one past it stops with
    argparse's usage error (exit 2) naming the flag and the range."""
    from tools.cli import build_parser

    parser = build_parser(command)
    head = [command, "m", "d"] if command == "eval" else [command, "c.toml"]
    dest = flag.lstrip("-").replace("-", "_")
    for value in (lo, hi):
        assert getattr(parser.parse_args([*head, flag, str(value)]), dest) == value
    for value in (lo - 1, hi + 1):
        with pytest.raises(SystemExit) as stop:
            parser.parse_args([*head, flag, str(value)])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: must be an integer in [{lo:,}, {hi:,}]" in err, err


@pytest.mark.parametrize(
    "flag, accepted, refused, message",
    [
        ("--val-fraction", [TINY, BELOW_1], [0.0, 1.0], r"must be in \(0, 1\)"),
        ("--passkey-depths", [0.0, 1.0], [-TINY, math.nextafter(1.0, 2.0)], r"in \[0, 1\]"),
        ("--passkey-lengths", [16, 1 << 36], [15, (1 << 36) + 1], r"in \[16, 2\^36\]"),
    ],
)
def test_eval_value_flags_at_and_past_their_limits(flag, accepted, refused, message, monkeypatch):
    """eval's checked flags: each value at a limit is accepted, the nearest past it refused
    naming the flag (before any data is read)."""
    import tools.cmd_eval as cmd_eval
    from tools.cli import build_parser

    monkeypatch.setattr(cmd_eval, "_datasets", lambda args: ("d", []))
    parser = build_parser("eval")
    for value in accepted:
        cmd_eval._options(parser.parse_args(["eval", "m", "d", f"{flag}={value!r}"]))
    for value in refused:
        with pytest.raises(ConfigError, match=f"^{flag}: .*{message}"):
            cmd_eval._options(parser.parse_args(["eval", "m", "d", f"{flag}={value!r}"]))


def test_a_bool_is_not_an_int_setting() -> None:
    """Python's True is an int: a config built in Python with `train.steps = True` is refused
    naming the key, as TOML's `steps = true` is (a bool setting still takes one)."""
    from datapipe.settings import Names, check
    from trainer.config.job import TrainerConfig

    cfg = TrainerConfig()
    cfg.train.steps = True  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="train.steps: expected int, got bool True"):
        check(cfg.train, Names("train"))
