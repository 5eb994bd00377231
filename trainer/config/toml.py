"""`mixlen train`'s config as TOML: read a file with `--set section.key=value` overrides into a
validated trainer.config.job.TrainerConfig, and write one back."""

from __future__ import annotations

import os
import re
import textwrap
from typing import Any

from datapipe.errors import ConfigError, InputError
from datapipe.files import CONFIG_FILE_LIMIT, read_bounded_text
from datapipe.settings import Names, check, from_mapping, rows
from trainer.config.job import TrainerConfig, from_dict

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def _parse_value(text: str) -> Any:
    """A --set value: a TOML value (1e-3, true, "x", [1, 2]) or else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` overrides to a parsed config dict (copied)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not section or not name:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        out.setdefault(section, {})
        if not isinstance(out[section], dict):
            raise ConfigError(f"--set {item!r}: {section} is not a section")
        out[section][name] = _parse_value(value.strip())
    return out


def _read(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed TOML file (ConfigError naming the file): a regular file of at most 16 MiB,
    refused before reading otherwise (a device or a FIFO would never end)."""
    try:
        return tomllib.loads(read_bounded_text(path, CONFIG_FILE_LIMIT, "a config file"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: cannot read config (No such file or directory)") from None
    except InputError as exc:
        if "UTF-8" in str(exc) or "utf-8" in str(exc):
            raise ConfigError(f"{path}: not a text (TOML) file") from None
        raise ConfigError(str(exc)) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None


def load_config(
    path: str | os.PathLike | None, overrides: list[str] | None = None
) -> TrainerConfig:
    """Read a TOML file (None: defaults only), apply overrides, validate. Relative paths in
    `[data]`, `[checkpoint]`, `[metrics]` and a `.json` cost stay relative to the working dir."""
    d = _read(path) if path is not None else {}
    try:
        return from_dict(apply_overrides(d, overrides or []))
    except ConfigError as exc:
        # say where the bad value was written: the file, or a --set override
        msg = str(exc)
        key = msg.split(":", 1)[0]
        given = {o.partition("=")[0].strip() for o in overrides or []}
        if key in given or msg.startswith("--set"):
            raise ConfigError(msg if msg.startswith("--set") else f"--set {msg}") from None
        # a message about several keys (`a and b: give one`): name each source of its values
        named = sorted(k for k in given if re.search(rf"(?<![\w.]){re.escape(k)}(?![\w])", msg))
        where = [str(path)] if path is not None else []
        where += [f"--set {', '.join(named)}"] if named else []
        if where:
            raise ConfigError(f"{' and '.join(where)}: {msg}") from None
        raise


def load_model_config(path: str | os.PathLike, overrides: list[str] | None = None) -> TrainerConfig:
    """A config whose `[model]` and `[train]` are validated, the rest read but not checked (for
    `mixlen calibrate CONFIG.toml`, which writes the cost file the config may name)."""
    cfg = from_mapping(TrainerConfig, apply_overrides(_read(path), overrides or []))
    check(cfg.model, Names("model"))
    check(cfg.train, Names("train"))
    return cfg


def _toml_key(k: Any) -> str:
    k = str(k)
    bare = k and all(c.isalnum() or c in "_-" for c in k) and k.isascii()
    return k if bare else _toml_value(k)


# TOML's escapes in basic strings; other control characters (U+0000-U+001F, U+007F) as \uXXXX
_ESCAPES = {c: f"\\u{c:04x}" for c in (*range(0x20), 0x7F)} | str.maketrans(
    {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
)


def _toml_value(v: Any) -> str:
    """`v` as a TOML value: inline tables and arrays for dicts and lists (keys left at None
    omitted from inline tables)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.translate(_ESCAPES) + '"'
    if isinstance(v, dict):
        items = (f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items() if x is not None)
        return "{" + ", ".join(items) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def to_toml(cfg: TrainerConfig, comments: bool = False) -> str:
    """The resolved config as TOML (keys left at None are shown as comments); `comments`: each
    key's help text above it (`--print-config`)."""
    helps = {r.key: r.help for r in rows(TrainerConfig)} if comments else {}
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            if helps.get(f"{section}.{k}"):
                lines.extend("# " + h for h in textwrap.wrap(helps[f"{section}.{k}"], 96))
            lines.append(f"# {k} = (unset)" if v is None else f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)
