"""A mixture's settings: `[data] sources = [...]` (datasets and their token shares) and
`[[data.stages]]` (what changes from a given step on). Declared once here; the trainer's `[data]`
holds them (trainer.data.DataConfig), `mixlen plan` / `mixlen profile` read them from `--mix
FILE.toml` or `DIR@WEIGHT` arguments. Errors name the key as written: `data.sources[1].weight`.
"""

from __future__ import annotations

import math
import posixpath
from dataclasses import dataclass
from typing import Any

from datapipe.errors import ConfigError
from datapipe.settings import MAX_INT, Names, setting

__all__ = [
    "MAX_BOOST",
    "MAX_WEIGHT",
    "SourceConfig",
    "StageConfig",
    "Stage",
    "check_mixture",
    "source_name",
    "stage_at",
    "weight_problem",
]

MAX_WEIGHT = 1e12  # weights are relative; this keeps their sum finite
MAX_BOOST = 1e6  # the largest length_boost factor


def source_name(path: str) -> str:
    """A source's default name: the last component of its path or URI."""
    return posixpath.basename(str(path).replace("\\", "/").rstrip("/")) or str(path)


@dataclass
class SourceConfig:
    """One dataset of a mixture (an item of `data.sources`)."""

    path: str = setting("", help="a dataset written by `mixlen preprocess` (directory or URI)")
    weight: float = setting(
        1.0,
        help="its share of the tokens, normalised over the sources (>= 0; weight 0: none until a "
        "stage gives it weight)",
        lo=0.0,
        hi=MAX_WEIGHT,
    )
    name: str = setting("", help="its name in metrics and reports (default: the path's last part)")
    max_epochs: int = setting(
        0, help="passes over it before its weight goes to the other sources (0: endless)", lo=0
    )
    length_boost: dict = setting(
        factory=dict,
        help="{MIN_TOKENS = FACTOR, ...}: its samples of at least MIN_TOKENS tokens are drawn "
        "FACTOR times as often within it (the highest threshold reached applies)",
    )

    def validate(self, names: Names) -> None:
        if not self.path:
            raise ConfigError(
                f"{names('path')}: required (a directory written by `mixlen preprocess`)"
            )
        self.boosts(names)

    def boosts(self, names: Names | None = None) -> list[tuple[int, float]]:
        """`length_boost` as (threshold, factor) pairs, thresholds increasing."""
        names = names or Names()
        out = []
        for key, factor in self.length_boost.items():
            where = f"{names('length_boost')}.{key}"
            try:
                threshold = int(str(key).replace("_", ""))
            except ValueError:
                raise ConfigError(
                    f"{where}: the key must be a token count (e.g. 16384 = 4.0), got {key!r}"
                ) from None
            if not 1 <= threshold <= MAX_INT:
                raise ConfigError(f"{where}: the token count must be in [1, {MAX_INT:,}]")
            ok = isinstance(factor, (int, float)) and not isinstance(factor, bool)
            if not ok or not math.isfinite(factor) or factor <= 0 or factor > MAX_BOOST:
                raise ConfigError(
                    f"{where}: the factor must be a number in (0, {MAX_BOOST:g}], got {factor!r}"
                )
            if threshold in [t for t, _ in out]:
                raise ConfigError(f"{where}: the token count {threshold} is given twice")
            out.append((threshold, float(factor)))
        return sorted(out)


@dataclass
class StageConfig:
    """One `[[data.stages]]` table: settings that apply from `start_step` on; a key left out
    keeps the value in force before the stage (at first `[data]`'s weights, whole samples,
    `[train]`'s global_batch_tokens)."""

    start_step: int | None = setting(
        None, help="the first optimizer step of the stage (required, >= 1)", lo=1
    )
    weights: dict = setting(
        factory=dict,
        help=f"{{SOURCE = WEIGHT, ...}}: the sources' weights in this stage (each in [0, "
        f"{MAX_WEIGHT:g}], one > 0)",
    )
    max_sample_tokens: int | None = setting(
        None,
        help="samples longer than this are trained as consecutive pieces of at most this many "
        "tokens, each with positions from 0",
        lo=2,
    )
    global_batch_tokens: int | None = setting(
        None, help="tokens per optimizer step, per island, in this stage", lo=1
    )

    def validate(self, names: Names) -> None:
        if self.start_step is None:
            raise ConfigError(f"{names('start_step')}: required, an optimizer step >= 1")


@dataclass(frozen=True)
class Stage:
    """What the stream uses from one step on: normalised weights (by source), the longest unit
    (0: whole samples), the batch budget; `index` -1 is the base (no stage yet)."""

    index: int
    start_step: int
    weights: tuple[float, ...]
    max_sample_tokens: int
    global_batch_tokens: int


def weight_problem(v: Any) -> str:
    """What is wrong with a weight ('' if nothing): the rule of `data.sources[i].weight` (a
    number in [0, MAX_WEIGHT]), for stage weights, in the same words."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"expected a number, got {type(v).__name__} {v!r}"
    if not math.isfinite(v):
        return f"must be finite, got {v!r}"
    if v < 0:
        return f"must be >= 0, got {v!r}"
    if v > MAX_WEIGHT:
        return f"must be <= {MAX_WEIGHT:g}, got {v!r}"
    return ""


def check_mixture(
    sources: list[SourceConfig], stages: list[StageConfig], names: Names
) -> list[str]:
    """The sources' names (defaults filled in); ConfigError naming the key for duplicate names,
    stages out of order, unknown stage weights, or a stage (the first steps included) in which
    every source has weight 0."""
    out: list[str] = []
    for i, src in enumerate(sources):
        name = src.name or source_name(src.path)
        if name in out:
            j = out.index(name)
            raise ConfigError(
                f"{names('sources')}[{i}]: name {name!r} is also source {j}'s; give each a "
                f'distinct name (name = "...")'
            )
        out.append(name)
    if sources and not any(s.weight > 0 for s in sources):
        raise ConfigError(
            f"{names('sources')}: every source has weight 0; give one a weight > 0 (a source may "
            f"have weight 0 until a stage of {names('stages')} gives it one)"
        )
    prev = 0
    weights = {n: s.weight for n, s in zip(out, sources)}
    for i, st in enumerate(stages):
        key = f"{names('stages')}[{i}]"
        if st.start_step is None or st.start_step <= prev:
            raise ConfigError(
                f"{key}.start_step: {st.start_step}, but stages must start at increasing steps "
                f"(the stage before starts at {prev})"
                if i
                else f"{key}.start_step: required, an optimizer step >= 1, got {st.start_step}"
            )
        prev = st.start_step
        for k, v in st.weights.items():
            if k not in out:
                raise ConfigError(
                    f"{key}.weights.{k}: no source of that name (sources: {', '.join(out)})"
                )
            problem = weight_problem(v)
            if problem:
                raise ConfigError(f"{key}.weights.{k}: {problem}")
        weights.update(st.weights)
        if not any(v > 0 for v in weights.values()):
            raise ConfigError(f"{key}.weights: every source has weight 0 in this stage")
    return out


def _normalised(w: list[float]) -> tuple[float, ...]:
    total = math.fsum(w)
    return tuple(x / total for x in w)


def stage_at(
    step: int,
    sources: list[SourceConfig],
    names: list[str],
    stages: list[StageConfig],
    global_batch_tokens: int,
) -> Stage:
    """The settings in force at optimizer step `step` (1-based)."""
    weights = [s.weight for s in sources]
    unit, budget, index, start = 0, int(global_batch_tokens), -1, 1
    for i, st in enumerate(stages):
        if st.start_step > step:
            break
        index, start = i, st.start_step
        weights = [float(st.weights.get(n, w)) for n, w in zip(names, weights)]
        if st.max_sample_tokens is not None:
            unit = int(st.max_sample_tokens)
        if st.global_batch_tokens is not None:
            budget = int(st.global_batch_tokens)
    return Stage(index, start, _normalised(weights), unit, budget)


def as_dicts(items: list[Any]) -> list[dict[str, Any]]:
    """Source or stage configs as plain dicts (state and reports)."""
    from datapipe.settings import values

    return [values(x) for x in items]
