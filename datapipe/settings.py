"""Settings: each component's Config dataclass declares its keys once, here in field form.

`setting(default, help=..., lo=..., hi=..., choices=...)` is a dataclass field carrying its help
text and its bounds; `check(cfg, names)` validates every field from that metadata and then calls
the config's own `validate(names)` for rules between fields. `names` (`Names`) spells a field the
way the user wrote it: `data.seed` in a TOML config (the section is the path to the config in the
tree), `--seed` on a command line. Configs nest: a field declared with `inline=True` holds a
sub-config whose keys sit in the parent's section (the stream's `seed` is `data.seed`); a field
holding a dataclass without `inline` is a nested table. `from_mapping` builds a config tree from
parsed TOML, refusing unknown keys with the known ones listed; `rows` lists every key with its
default and help text (`--print-config`, the README's key tables).

Every integer setting has an upper bound (`hi`, default `MAX_INT`) that the planner's int64
arithmetic can hold, so a huge number is refused at validation with its key named.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any

from datapipe.errors import ConfigError

__all__ = [
    "MAX_INT",
    "Names",
    "Row",
    "check",
    "from_mapping",
    "item_names",
    "keys",
    "rows",
    "setting",
    "values",
]

MAX_INT = 1 << 40  # default upper bound of an integer setting (tokens, steps, bytes...)


def setting(
    default: Any = MISSING,
    *,
    help: str,
    lo: float | None = None,
    hi: float | None = None,
    choices: tuple[Any, ...] | None = None,
    factory: Callable[[], Any] | None = None,
    inline: bool = False,
    free_on_resume: bool = False,
) -> Any:
    """A config field: its default (or `factory`), help text, and the bounds `lo <= v <= hi` or
    `choices` that `check` enforces (None values pass: they mean "unset"). `free_on_resume`: a
    resumed run may change it (it changes how or how long a run computes, not what)."""
    meta = {"help": help, "lo": lo, "hi": hi, "choices": choices, "inline": inline}
    meta["free_on_resume"] = free_on_resume
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Names:
    """How the user wrote a config's fields: `prefix.field` (TOML; no prefix: the bare name) or
    `--field-name` (`flags`). `given` names the runtime values a component's `build()` received
    (e.g. `global_batch_tokens` -> `train.global_batch_tokens`), as the caller took them."""

    prefix: str = ""
    flags: bool = False
    given: Mapping[str, str] = field(default_factory=dict)

    def __call__(self, name: str) -> str:
        if name in self.given:
            return self.given[name]
        if self.flags:
            return "--" + name.replace("_", "-")
        return f"{self.prefix}.{name}" if self.prefix else name

    def child(self, name: str) -> Names:
        """The names of a nested table `name` of this config."""
        return Names(self(name), self.flags)

    def using(self, **given: str) -> Names:
        """These names, with runtime values named as given."""
        return Names(self.prefix, self.flags, {**self.given, **given})


def _fields(cls_or_obj: Any) -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(cls_or_obj) if f.init)


def _is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _item_config(tp: Any) -> type | None:
    """X when `tp` is `list[X]` with X a config class (a TOML array of tables), else None."""
    if typing.get_origin(tp) is list:
        (arg,) = typing.get_args(tp) or (None,)
        return arg if _is_config(arg) else None
    return None


def item_names(names: Names, key: str, i: int) -> Names:
    """The names of item `i` of an array of tables `key`: `data.sources[1].weight`."""
    return Names(f"{names(key)}[{i}]", names.flags)


def check(cfg: Any, names: Names | None = None) -> None:
    """Validate `cfg` (a config dataclass) and its sub-configs: each field against its metadata,
    then `cfg.validate(names)` if it has one. ConfigError names the first bad key."""
    names = names or Names()
    hints = typing.get_type_hints(type(cfg))
    for f in _fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check(value, names if f.metadata.get("inline") else names.child(f.name))
            continue
        if _item_config(hints[f.name]) is not None:
            for i, item in enumerate(value):
                check(item, item_names(names, f.name, i))
            continue
        _check_type(names(f.name), value, hints[f.name])
        _check_value(names(f.name), value, f.metadata)
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        validate(names)


def _check_type(key: str, v: Any, tp: Any) -> None:
    """`v` is of the field's type (an int where a float is allowed; a bool is not an int)."""
    allowed = _allowed(tp)
    if isinstance(v, bool):
        ok = bool in allowed
    elif isinstance(v, int):
        ok = int in allowed or float in allowed
    else:
        ok = any(isinstance(v, t) for t in allowed if t is not typing.Any)
    if not ok:
        names = " or ".join("none" if t is type(None) else t.__name__ for t in allowed)
        raise ConfigError(f"{key}: expected {names}, got {type(v).__name__} {v!r}")


def _check_value(key: str, v: Any, meta: Mapping[str, Any]) -> None:
    if v is None or isinstance(v, bool):
        return
    choices = meta.get("choices")
    if choices is not None and v not in choices:
        raise ConfigError(f"{key}: {v!r} is not one of {', '.join(map(str, choices))}")
    if not isinstance(v, (int, float)):
        return
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(f"{key}: must be finite, got {v!r}")
    lo, hi = meta.get("lo"), meta.get("hi")
    if hi is None and isinstance(v, int):
        hi = MAX_INT
    if lo is not None and v < lo:
        raise ConfigError(f"{key}: must be >= {_num(lo)}, got {v!r}")
    if hi is not None and v > hi:
        raise ConfigError(f"{key}: must be <= {_num(hi)}, got {v!r}")


def _num(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


# --- building from parsed TOML -------------------------------------------------------------------


def _allowed(tp: Any) -> tuple[type, ...]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return tuple(t for a in typing.get_args(tp) for t in _allowed(a))
    return (type(None),) if tp is type(None) else (tp,)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """`value` as the field's type: ints where floats are allowed become floats; nothing else is
    converted."""
    allowed = _allowed(tp)
    if value is None and type(None) in allowed:
        return None
    if isinstance(value, bool):
        if bool in allowed:
            return value
    elif isinstance(value, int) and int in allowed:
        return value
    elif isinstance(value, (int, float)) and float in allowed:
        if not math.isfinite(float(value)):
            raise ConfigError(f"{key}: must be finite, got {value!r}")
        return float(value)
    elif isinstance(value, str) and str in allowed:
        return value
    elif isinstance(value, dict) and dict in allowed:
        return value
    names = " or ".join("none" if t is type(None) else t.__name__ for t in allowed)
    raise ConfigError(f"{key}: expected {names}, got {type(value).__name__} {value!r}")


def _keys(cls: type) -> dict[str, tuple[type, str]]:
    """Every key a table of `cls` accepts -> (the class that owns it, its field name); inline
    sub-configs contribute their keys."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[type, str]] = {}
    for f in _fields(cls):
        if f.metadata.get("inline"):
            for key, owner in _keys(hints[f.name]).items():
                out[key] = owner
        else:
            out[f.name] = (cls, f.name)
    return out


def keys(cls: type) -> tuple[str, ...]:
    """The keys a table of config class `cls` accepts (an inline sub-config's in place)."""
    return tuple(_keys(cls))


def from_mapping(cls: type, values: Mapping[str, Any], names: Names | None = None) -> Any:
    """An instance of config class `cls` from a parsed table (unknown keys refused, values
    coerced to the field types; missing keys take their defaults). Not validated: call check."""
    names = names or Names()
    if not isinstance(values, Mapping):
        where = names.prefix or "config"
        raise ConfigError(f"{where}: expected a table [{where}], got {values!r}")
    known = _keys(cls)
    for key in values:
        if key not in known:
            raise ConfigError(
                f"{names(key)}: unknown key (known: {', '.join(sorted(known))})"
                if names.prefix
                else f"{key}: unknown section (known: {', '.join(known)})"
            )
    return _build(cls, values, names)


def _build(cls: type, values: Mapping[str, Any], names: Names) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in _fields(cls):
        tp = hints[f.name]
        if f.metadata.get("inline"):
            kwargs[f.name] = _build(tp, values, names)
        elif (item := _item_config(tp)) is not None:
            if f.name in values:
                kwargs[f.name] = _build_items(item, values[f.name], names, f.name)
        elif _is_config(tp):
            kwargs[f.name] = from_mapping(tp, values.get(f.name, {}), names.child(f.name))
        elif f.name in values:
            kwargs[f.name] = _coerce(names(f.name), values[f.name], tp)
    return cls(**kwargs)


def _build_items(cls: type, value: Any, names: Names, key: str) -> list[Any]:
    """An array of tables `key` as a list of `cls` configs (each table's keys checked)."""
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise ConfigError(
            f"{names(key)}: expected an array of tables ([{{...}}, ...] or [[{names(key)}]]), "
            f"got {value!r}"
        )
    return [from_mapping(cls, v, item_names(names, key, i)) for i, v in enumerate(value)]


# --- the reference of every key ------------------------------------------------------------------


class Row(typing.NamedTuple):
    """One key of a config: as written, its default, its help text, whether a resumed run may
    change it."""

    key: str
    default: Any
    help: str
    free_on_resume: bool


def rows(cls: type, names: Names | None = None) -> Iterator[Row]:
    """Every leaf key of config class `cls` in declaration order (inline keys in place)."""
    names = names or Names()
    hints = typing.get_type_hints(cls)
    for f in _fields(cls):
        tp = hints[f.name]
        if f.metadata.get("inline"):
            yield from rows(tp, names)
        elif _is_config(tp):
            yield from rows(tp, names.child(f.name))
        else:
            if f.default is not MISSING:
                default = f.default
            elif f.default_factory is not MISSING:
                default = f.default_factory()
            else:
                default = MISSING
            meta = f.metadata
            yield Row(
                names(f.name), default, meta.get("help", ""), meta.get("free_on_resume", False)
            )


def values(cfg: Any, names: Names | None = None) -> dict[str, Any]:
    """Every leaf key of the config instance `cfg`, as written -> its value (inline keys in
    place, nested tables as dotted keys)."""
    names = names or Names()
    out: dict[str, Any] = {}
    for f in _fields(cfg):
        v = getattr(cfg, f.name)
        if f.metadata.get("inline"):
            out.update(values(v, names))
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            out.update(values(v, names.child(f.name)))
        elif isinstance(v, list) and v and all(dataclasses.is_dataclass(x) for x in v):
            out[names(f.name)] = [values(x) for x in v]
        else:
            out[names(f.name)] = v
    return out
