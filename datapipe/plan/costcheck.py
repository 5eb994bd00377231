"""Validation of a cost model's terms (datapipe.plan.cost.CostModel): every error names the key
and the range it must be in; and what a cost file records of the model it was timed on."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from datapipe.errors import ConfigError
from datapipe.files import CONFIG_FILE_LIMIT, read_bounded_bytes
from datapipe.shapes import TP_DEGREES

_NON_NEGATIVE = (
    "a",
    "b",
    "c",
    "kv_bytes_per_token",
    "act_bytes_per_token_layer",
    "hop_latency_s",
    "attn_n_half",
    "node_link_bytes_per_s",
    "d",
    "step",
    "tp_latency_s",
    "tp_bytes_per_s",
)
_POSITIVE = ("link_bytes_per_s", "offload_bytes_per_s", "comm_passes")


def finite(key: str, v: object, lo: float, lo_open: bool, hi: float | None = None) -> None:
    """Refuse `v` unless it is a finite number above `lo` (or at it, unless `lo_open`), at most
    `hi`."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
    if not ok:
        rng = f"> {lo:g}" if lo_open else f">= {lo:g}"
        if hi is not None:
            rng = f"in [{lo:g}, {hi:g}]"
        raise ConfigError(f"cost model: '{key}' must be a finite number {rng}, got {v!r}")


def check_terms(model: Any) -> dict[str, tuple[float, ...]]:
    """Check every term of `model`; return its size table as tuples of floats (to store)."""
    for key in _NON_NEGATIVE:
        finite(key, getattr(model, key), 0.0, False)
    for key in _POSITIVE:
        finite(key, getattr(model, key), 0.0, True)
    finite("overlap", model.overlap, 0.0, False, 1.0)
    if not (isinstance(model.num_layers, int) and model.num_layers >= 1):
        raise ConfigError(f"cost model: 'num_layers' must be an int >= 1, got {model.num_layers!r}")
    if not (isinstance(model.ranks_per_node, int) and model.ranks_per_node >= 0):
        raise ConfigError(
            f"cost model: 'ranks_per_node' must be an int >= 0, got {model.ranks_per_node!r}"
        )
    if model.tp not in TP_DEGREES or isinstance(model.tp, bool):
        raise ConfigError(f"cost model: 'tp' must be one of {TP_DEGREES}, got {model.tp!r}")
    if model.ranks_per_node and not model.node_link_bytes_per_s > 0:
        raise ConfigError(
            "cost model: 'node_link_bytes_per_s' must be > 0 when 'ranks_per_node' is set"
        )
    return size_table(model.size_knots, model.size_rates)


def size_table(knots: object, rates: object) -> dict[str, tuple[float, ...]]:
    """size_knots strictly increasing positions > 0, size_rates as many non-decreasing seconds
    per position >= 0 (so a micro-batch's size term never falls as it grows)."""
    out = {}
    for key, v in (("size_knots", knots), ("size_rates", rates)):
        if not isinstance(v, (list, tuple)):
            raise ConfigError(f"cost model: '{key}' must be a list of numbers, got {v!r}")
        for i, x in enumerate(v):
            finite(f"{key}[{i}]", x, 0.0, key == "size_knots")
        out[key] = tuple(float(x) for x in v)
    kn, rt = out["size_knots"], out["size_rates"]
    if len(kn) != len(rt):
        raise ConfigError(
            f"cost model: 'size_knots' has {len(kn)} entries and 'size_rates' {len(rt)}: "
            "one rate per knot expected"
        )
    if any(y <= x for x, y in zip(kn, kn[1:])):
        raise ConfigError(f"cost model: 'size_knots' must increase strictly, got {list(kn)}")
    if any(y < x for x, y in zip(rt, rt[1:])):
        raise ConfigError(f"cost model: 'size_rates' must not decrease, got {list(rt)}")
    return out


def timed_model(path: str | os.PathLike) -> dict:
    """What `mixlen calibrate` recorded of the model it timed for the cost file `path`: `shape`
    (datapipe.shapes.ModelConfig's fields, those the file has), `dtype` and `tp` (1 in files
    from before tensor parallelism); {} for a file without a record or one load() cannot read
    (load() names its errors)."""
    try:
        rec = json.loads(read_bounded_bytes(path, CONFIG_FILE_LIMIT, "a cost file"))["calibration"]
        shape, dtype, tp = rec.get("shape"), rec.get("dtype"), rec.get("tp", 1)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # MixlenError: a ValueError
        return {}
    out = {"shape": shape} if isinstance(shape, dict) else {}
    out = {**out, "tp": tp} if type(tp) is int else out
    return {**out, "dtype": dtype} if isinstance(dtype, str) else out
