"""A mixture on the command line (`mixlen profile` / `mixlen plan`): `DIR@WEIGHT` arguments or
`--mix FILE.toml`, per-source length profiles, the token shares a stream realises against its
targets, the share of tokens in samples above each `length_boost` threshold, and one figure of
every source's length histogram."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from datapipe.errors import ConfigError
from datapipe.files import CONFIG_FILE_LIMIT, read_bounded_text
from datapipe.mix.config import SourceConfig, StageConfig, check_mixture
from datapipe.mix.sources import LoadedSource
from datapipe.settings import Names, check, from_mapping
from datapipe.stream import GlobalBatch

__all__ = [
    "is_mixture_args",
    "mixture_profile",
    "parse_mixture",
    "plot_mixture",
    "share_report",
    "format_shares",
]

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def is_mixture_args(dirs: list[str], mix: str | None) -> bool:
    """Do these arguments name a mixture (several datasets, a weight, or --mix)?"""
    return bool(mix) or len(dirs) > 1 or any(_split_weight(d)[1] is not None for d in dirs)


def _split_weight(arg: str) -> tuple[str, float | None]:
    path, sep, tail = arg.rpartition("@")
    if not sep:
        return arg, None
    try:
        return path, float(tail)
    except ValueError:
        return arg, None  # an @ inside the path


def parse_mixture(dirs: list[str], mix: str | None) -> tuple[list[SourceConfig], list[StageConfig]]:
    """Sources and stages from `DIR@WEIGHT` arguments (weight 1 when left out) or a --mix TOML
    file (`sources = [...]` and `[[stages]]`, at the top or under `[data]` as in a training
    config). ConfigError naming the argument or key."""
    if mix and dirs:
        raise ConfigError("--mix FILE.toml and DIR arguments: give one")
    names = Names(flags=False)
    if not mix:
        sources = []
        for i, arg in enumerate(dirs):
            path, weight = _split_weight(arg)
            src = SourceConfig(path=path, weight=1.0 if weight is None else weight)
            try:
                check(src, Names(f"DIR[{i}]"))
            except ConfigError as exc:
                raise ConfigError(f"{arg}: {str(exc).split(': ', 1)[-1]}") from None
            sources.append(src)
        check_mixture(sources, [], Names(flags=True).using(sources="DIR"))
        return sources, []
    try:
        doc = tomllib.loads(read_bounded_text(mix, CONFIG_FILE_LIMIT, "a mixture file"))
    except FileNotFoundError:
        raise ConfigError(f"--mix {mix}: no such file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--mix {mix}: not valid TOML ({exc})") from None
    table = doc.get("data", doc) if isinstance(doc.get("data"), dict) else doc
    prefix = "data" if table is not doc else ""
    names = Names(prefix)
    if not isinstance(table.get("sources", []), list) or not table.get("sources"):
        raise ConfigError(f"--mix {mix}: {names('sources')}: required, an array of tables")
    out = []
    for key, cls in (("sources", SourceConfig), ("stages", StageConfig)):
        items = table.get(key, [])
        if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
            raise ConfigError(f"--mix {mix}: {names(key)}: expected an array of tables")
        built = []
        for i, item in enumerate(items):
            item_names = Names(f"{names(key)}[{i}]")
            try:
                cfg = from_mapping(cls, item, item_names)
                check(cfg, item_names)
            except ConfigError as exc:
                raise ConfigError(f"--mix {mix}: {exc}") from None
            built.append(cfg)
        out.append(built)
    try:
        check_mixture(out[0], out[1], names)
    except ConfigError as exc:
        raise ConfigError(f"--mix {mix}: {exc}") from None
    return out[0], out[1]


STREAM_KEYS = ("seed", "lookahead", "oversize")


def mixture_settings(mix: str | None) -> tuple[dict[str, Any], float]:
    """A --mix file's stream settings (`seed`, `lookahead`, `oversize`, as a StreamConfig takes
    them) and `val_fraction` (0 when absent), so a plan draws the batches training will."""
    if not mix:
        return {}, 0.0
    doc = tomllib.loads(read_bounded_text(mix, CONFIG_FILE_LIMIT, "a mixture file"))
    table = doc["data"] if isinstance(doc.get("data"), dict) else doc
    names = Names("data" if table is not doc else "")
    from datapipe.stream import StreamConfig

    keys = {k: table[k] for k in STREAM_KEYS if k in table}
    try:
        check(from_mapping(StreamConfig, keys, names), names)
    except ConfigError as exc:
        raise ConfigError(f"--mix {mix}: {exc}") from None
    frac = table.get("val_fraction", 0.0)
    ok = isinstance(frac, (int, float)) and not isinstance(frac, bool) and 0 <= frac < 1
    if not ok:
        raise ConfigError(f"--mix {mix}: {names('val_fraction')}: must be in [0, 1), got {frac!r}")
    return keys, float(frac)


def describe(loaded: list[LoadedSource]) -> str:
    """`name@weight+...` (normalised weights)."""
    total = math.fsum(s.config.weight for s in loaded)
    return "+".join(f"{s.name}@{s.config.weight / total:.3g}" for s in loaded)


def mixture_profile(loaded: list[LoadedSource], capacity: int | None = None) -> dict[str, Any]:
    """Each source's length profile, its weight (normalised), its natural share of all tokens,
    and for each `length_boost` threshold its share of tokens in samples at or above it: in the
    index, and expected once boosted."""
    from datapipe.profile import length_profile

    total_w = math.fsum(s.config.weight for s in loaded)
    all_tokens = sum(int(s.lengths.sum()) for s in loaded) or 1
    out = []
    for src in loaded:
        lens = src.lengths[src.lengths > 0]
        prof = length_profile(lens, capacity)
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
