"""A mixture on the command line (`mixlen profile` / `mixlen plan`): `[NAME=]DIR[@WEIGHT]`
arguments or `--mix FILE.toml`, per-source length profiles, the token shares a stream realises against its
targets, the share of tokens in samples above each `length_boost` threshold, and one figure of
every source's length histogram."""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

import numpy as np

from datapipe.errors import ConfigError
from datapipe.files import CONFIG_FILE_LIMIT, read_bounded_text
from datapipe.index import is_remote
from datapipe.mix.config import SourceConfig, StageConfig, check_mixture, source_name
from datapipe.mix.sources import LoadedSource, load_sources
from datapipe.settings import Names, check, from_mapping, keys
from datapipe.stream import GlobalBatch, StreamConfig

__all__ = [
    "CliMixture",
    "is_mixture_args",
    "load_mixture",
    "mixture_profile",
    "parse_mixture",
    "read_mixture",
    "plot_mixture",
    "share_report",
    "format_shares",
]

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def is_mixture_args(dirs: list[str], mix: str | None) -> bool:
    """Do these arguments name a mixture (several datasets, a name, a weight, or --mix)?"""
    return bool(mix) or len(dirs) > 1 or any(_read_arg(d)[::2] != ("", None) for d in dirs)


def _readings(arg: str) -> list[tuple[str, str, float | None]]:
    """The ways `[NAME=]DIR[@WEIGHT]` can be read: (name, path, weight), the most split first."""
    out: list[tuple[str, str, float | None]] = []
    name, sep, rest = arg.partition("=")
    named = bool(sep and name and rest) and not any(c in name for c in "/\\@:")
    for n, text in ([(name, rest)] if named else []) + [("", arg)]:
        path, at, tail = text.rpartition("@")
        try:
            weight = float(tail) if at and path else None
        except ValueError:
            weight = None
        if weight is not None:
            out.append((n, path, weight))
        out.append((n, text, None))
    out.sort(key=lambda r: (r[0] == "", r[2] is None))  # name and weight, ..., the whole text
    return out


def _spelt(name: str, path: str, weight: float | None, tail: str) -> str:
    """An argument that reads only as (name, path, weight)."""
    head = f"{name}=" if name else ("./" if "=" in path and not os.path.isabs(path) else "")
    return f"{head}{path.rstrip('/')}/@{tail}" if weight is not None else f"{head}{path}@1"


def _read_arg(arg: str) -> tuple[str, str, float | None]:
    """(name, path, weight) of a command-line source `[NAME=]DIR[@WEIGHT]` ('' name: the path's
    last part; None weight: 1). A reading whose local path exists wins (a folder may be named
    `x@0.5`); ConfigError when several do."""
    readings = _readings(arg)
    found = [r for r in readings if not is_remote(r[1]) and os.path.exists(r[1])]
    if len(found) > 1:
        tail = arg.rpartition("@")[2]
        each = "; ".join(
            f"{_spelt(n, p, w, tail)} for {p!r}"
            + (f" with weight {w:g}" if w is not None else "")
            + (f" named {n!r}" if n else "")
            for n, p, w in found
        )
        raise ConfigError(f"{arg}: names {len(found)} existing paths; write {each}")
    return found[0] if found else readings[0]


class CliMixture(NamedTuple):
    """A mixture as a command line gave it: sources, stages, each source's key in errors (the
    argument as typed, or `data.sources[1]` in the file), how the file writes its keys, its
    stream settings as given (`seed`, `lookahead`, `oversize`), its `val_fraction`, and the
    prefix of its errors (`--mix FILE: `, or '')."""

    sources: list[SourceConfig]
    stages: list[StageConfig]
    keys: list[str]
    names: Names
    stream: dict[str, Any]
    val_fraction: float
    where: str


def parse_mixture(dirs: list[str], mix: str | None) -> tuple[list[SourceConfig], list[StageConfig]]:
    """Sources and stages of `read_mixture`."""
    m = read_mixture(dirs, mix)
    return m.sources, m.stages


def read_mixture(dirs: list[str], mix: str | None, table: type | None = None) -> CliMixture:
    """A mixture from `[NAME=]DIR[@WEIGHT]` arguments (weight 1 when left out) or a --mix TOML
    file (`sources = [...]` and `[[stages]]`, at the top or under `[data]` as in a training
    config; relative paths are read from the current folder, as `mixlen train` reads them).
    `table`: the config class of that table (the trainer's `[data]`): its keys are the only ones
    a file may hold, checked as training checks them. ConfigError naming the argument or key."""
    if mix and dirs:
        raise ConfigError("--mix FILE.toml and DIR arguments: give one")
    if not mix:
        return _from_args(dirs)
    where = f"--mix {mix}: "
    try:
        doc = tomllib.loads(read_bounded_text(mix, CONFIG_FILE_LIMIT, "a mixture file"))
    except FileNotFoundError:
        raise ConfigError(f"--mix {mix}: no such file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--mix {mix}: not valid TOML ({exc})") from None
    data = doc.get("data", doc) if isinstance(doc.get("data"), dict) else doc
    names = Names("data" if data is not doc else "")
    # a [data] table and top-level keys beside it (a training config's other tables aside):
    # one of the two would be silently ignored
    stray = sorted(k for k, v in doc.items() if not isinstance(v, dict)) if data is not doc else []
    if stray:
        raise ConfigError(
            f"{where}{', '.join(stray)} at the top and a [data] table: give the mixture in one "
            "of them"
        )
    try:
        if table is not None:
            _check_table(table, data, names)
        if not isinstance(data.get("sources", []), list) or not data.get("sources"):
            raise ConfigError(f"{names('sources')}: required, an array of tables")
        sources, stages = (_items(data, key, cls, names) for key, cls in SECTIONS)
        check_mixture(sources, stages, names)
        stream = {k: data[k] for k in STREAM_KEYS if k in data}
        check(from_mapping(StreamConfig, stream, names), names)
        frac = data.get("val_fraction", 0.0)
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac < 1:
            raise ConfigError(f"{names('val_fraction')}: must be in [0, 1), got {frac!r}")
    except ConfigError as exc:
        raise ConfigError(f"{where}{exc}") from None
    keys = [f"{names('sources')}[{i}]" for i in range(len(sources))]
    return CliMixture(sources, stages, keys, names, stream, float(frac), where)


SECTIONS = (("sources", SourceConfig), ("stages", StageConfig))
STREAM_KEYS = keys(StreamConfig)  # what a mixture file may set of the stream


def _check_table(table: type, data: dict[str, Any], names: Names) -> None:
    """The file's table holds only `table`'s keys, with values training accepts."""
    known = keys(table)
    for key in data:
        if key not in known:
            raise ConfigError(f"{names(key)}: unknown key (known: {', '.join(sorted(known))})")
    check(from_mapping(table, data, names), names)


def _items(data: dict[str, Any], key: str, cls: type, names: Names) -> list[Any]:
    items = data.get(key, [])
    if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
        raise ConfigError(f"{names(key)}: expected an array of tables")
    built = []
    for i, item in enumerate(items):
        item_names = Names(f"{names(key)}[{i}]")
        cfg = from_mapping(cls, item, item_names)
        check(cfg, item_names)
        built.append(cfg)
    return built


def _from_args(dirs: list[str]) -> CliMixture:
    """Sources from `[NAME=]DIR[@WEIGHT]` arguments, named after their argument in errors."""
    sources: list[SourceConfig] = []
    for i, arg in enumerate(dirs):
        name, path, weight = _read_arg(arg)
        src = SourceConfig(path=path, weight=1.0 if weight is None else weight, name=name)
        try:
            check(src, Names(f"DIR[{i}]"))
        except ConfigError as exc:
            raise ConfigError(f"{arg}: {str(exc).split(': ', 1)[-1]}") from None
        given = [s.name or source_name(s.path) for s in sources]
        mine = name or source_name(path)
        if mine in given:
            other = dirs[given.index(mine)]
            named = f"{mine}{i + 1}={arg.partition('=')[2] if name else arg}"
            raise ConfigError(
                f"{arg}: its name {mine!r} (a source is named after its path's last part) is also "
                f"{other}'s; name them with NAME=DIR@WEIGHT, e.g. {named}"
            )
        sources.append(src)
    cli = Names(flags=True).using(sources="DIR")
    if sources and not any(s.weight > 0 for s in sources):
        raise ConfigError(f"{' '.join(dirs)}: every source has weight 0; give one a weight > 0")
    check_mixture(sources, [], cli)
    return CliMixture(sources, [], list(dirs), cli, {}, 0.0, "")


def load_mixture(m: CliMixture, names: Names, cache_dir: str | None = None) -> list[LoadedSource]:
    """`load_sources` of a command line's mixture, its errors naming the argument or the file's
    key."""
    try:
        return load_sources(m.sources, names, cache_dir, m.keys)
    except ConfigError as exc:
        raise ConfigError(f"{m.where}{exc}") from None


def describe(loaded: list[LoadedSource]) -> str:
    """`name@weight+...` (normalised weights)."""
    total = math.fsum(s.config.weight for s in loaded)
    return "+".join(f"{s.name}@{s.config.weight / total:.3g}" for s in loaded)


def mixture_profile(loaded: list[LoadedSource], capacity: int | None = None) -> dict[str, Any]:
    """Each source's length profile, its weight (normalised), its natural share of all tokens,
    and for each `length_boost` threshold its share of tokens in samples at or above it: in the
    index, and expected once boosted."""
    from datapipe.index import read_loss_tokens
    from datapipe.profile import length_profile

    total_w = math.fsum(s.config.weight for s in loaded)
    all_tokens = sum(int(s.lengths.sum()) for s in loaded) or 1
    out = []
    for src in loaded:
        kept = src.lengths > 0
        lens = src.lengths[kept]
        # a source with a loss mask: its trained tokens, from the index already loaded
        trained = read_loss_tokens(src.local, src.manifest, src.lengths)
        prof = length_profile(lens, capacity, None if trained is None else trained[kept])
        prof.update(
            name=src.name,
            path=src.config.path,
            weight=src.config.weight / total_w,
            natural_share=int(lens.sum()) / all_tokens,
            boosts=_boost_shares(lens, src.config.boosts()),
        )
        out.append(prof)
    return {"sources": out}


def _boost_shares(lens: np.ndarray, boosts: list[tuple[int, float]]) -> list[dict[str, Any]]:
    factor = np.ones(lens.shape[0])
    for t, f in boosts:
        factor[lens >= t] = f
    tokens, boosted = lens.sum(), (lens * factor).sum()
    return [
        {
            "threshold": t,
            "factor": f,
            "index_share": float(lens[lens >= t].sum() / tokens) if tokens else 0.0,
            "expected_share": float((lens * factor)[lens >= t].sum() / boosted) if boosted else 0.0,
        }
        for t, f in boosts
    ]


def share_report(
    loaded: list[LoadedSource], batches: list[GlobalBatch], targets: list[np.ndarray]
) -> list[dict[str, Any]]:
    """Per source over `batches`: tokens, realised share, target share (`targets[k]`: the
    normalised weights batch k was drawn with), and per boost threshold the realised share of
    its tokens in samples at or above it."""
    num = len(loaded)
    tokens = np.zeros(num)
    target = np.zeros(num)
    above: list[dict[int, float]] = [dict() for _ in loaded]
    for b, w in zip(batches, targets):
        assert b.units is not None
        src = b.units[:, 0]
        t = np.bincount(src, weights=b.lengths, minlength=num)
        tokens += t
        target += np.asarray(w) * t.sum()
        for s, ls in enumerate(loaded):
            mine = src == s
            whole = ls.lengths[b.units[mine, 1]]  # the sample each unit comes from
            for thr, _ in ls.config.boosts():
                above[s][thr] = above[s].get(thr, 0.0) + float(b.lengths[mine][whole >= thr].sum())
    total = tokens.sum() or 1.0
    return [
        {
            "name": ls.name,
            "tokens": int(tokens[s]),
            "realised_share": float(tokens[s] / total),
            "target_share": float(target[s] / total),
            "above": [
                {"threshold": thr, "realised_share": v / tokens[s] if tokens[s] else 0.0}
                for thr, v in sorted(above[s].items())
            ],
        }
        for s, ls in enumerate(loaded)
    ]


def format_shares(rows: list[dict[str, Any]]) -> str:
    """A markdown table of `share_report`."""
    lines = [
        "| source | tokens | realised share | target share | share in samples >= threshold |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        above = ", ".join(f">={a['threshold']:,}: {a['realised_share']:.3f}" for a in r["above"])
        lines.append(
            f"| {r['name']} | {r['tokens']:,} | {r['realised_share']:.4f} | "
            f"{r['target_share']:.4f} | {above or '-'} |"
        )
    return "\n".join(lines)


def format_mixture_profile(prof: dict[str, Any]) -> str:
    """Terminal tables of `mixture_profile`: each source's profile, then the shares."""
    from datapipe.profile import format_profile

    parts = []
    for p in prof["sources"]:
        parts.append(format_profile(p, title=f"source {p['name']} ({p['path']})"))
        for b in p["boosts"]:
            parts.append(
                f"  length_boost {b['threshold']:,} = {b['factor']:g}: tokens in samples >= it "
                f"{100 * b['index_share']:.2f}% in the index, {100 * b['expected_share']:.2f}% "
                "expected once boosted"
            )
        parts.append("")
    parts.append("| source | weight (token share) | natural share of all tokens |")
    parts.append("| --- | ---: | ---: |")
    for p in prof["sources"]:
        parts.append(f"| {p['name']} | {p['weight']:.4f} | {p['natural_share']:.4f} |")
    return "\n".join(parts)


def plot_mixture(loaded: list[LoadedSource], path: str, capacity: int | None = None) -> None:
    """PNG: every source's length histogram (log x) on one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from datapipe.profile import save_figure

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    top = max(2, max(int(s.lengths.max()) for s in loaded))
    bins = np.logspace(0, np.log10(top) + 0.01, 60)
    for src in loaded:
        lens = src.lengths[src.lengths > 0]
        ax.hist(lens, bins=bins, histtype="step", lw=1.6, label=f"{src.name} ({lens.size:,})")
    if capacity:
        ax.axvline(capacity, color="k", ls="--", lw=1, label=f"capacity {capacity:,}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("sample length (tokens, log scale)")
    ax.set_ylabel("samples")
    ax.set_title(f"length histograms of {len(loaded)} sources")
    ax.legend(loc="upper right")
    save_figure(fig, path)
