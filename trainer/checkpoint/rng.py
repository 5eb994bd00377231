"""Every random number generator a training process draws from, as plain JSON values: torch's
CPU generator (and the current CUDA device's), numpy's global generator and Python's `random`.
A checkpoint stores one such state per rank, so a resumed run draws exactly what the
uninterrupted one would have.
"""

from __future__ import annotations

import base64
import binascii
import random
from typing import Any

import numpy as np
import torch

from datapipe.errors import MixlenError

__all__ = ["capture_rng", "restore_rng", "seed_all"]


def seed_all(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy's global generator and Python's `random`."""
    torch.manual_seed(seed)
    np.random.seed(seed % (1 << 32))
    random.seed(seed)


def _bytes(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _tensor(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng(device: torch.device | None = None) -> dict[str, Any]:
    """The state of every generator, JSON-serialisable."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, words, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": _bytes(torch.get_rng_state()),
        "numpy": {
            "kind": kind,
            "keys": np.asarray(keys).tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "python": {"version": version, "words": list(words), "gauss_next": gauss_next},
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = _bytes(torch.cuda.get_rng_state(device).cpu())
    return state


def _field(state: Any, path: str, source: str) -> Any:
    """`state[a][b]...` for path "a.b", or MixlenError naming the file and the field."""
    cur = state
    for key in path.split("."):
        if not isinstance(cur, dict) or key not in cur:
            raise MixlenError(f"{source}: field {path} is missing")
        cur = cur[key]
    return cur


def _words(v: Any, n: int, path: str, source: str) -> list[int]:
    """`n` integers in [0, 2^32) (the generators' state words)."""
    if not (isinstance(v, list) and len(v) == n):
        raise MixlenError(f"{source}: field {path}: expected a list of {n} integers")
    for i, x in enumerate(v):
        if not (type(x) is int and 0 <= x < 1 << 32):
            shown = f"a {len(str(x))}-digit integer" if type(x) is int else repr(x)[:40]
            raise MixlenError(
                f"{source}: field {path}[{i}]: expected an integer in [0, 2^32), got {shown}"
            )
    return v


def restore_rng(
    state: dict[str, Any], device: torch.device | None = None, source: str = "rng state"
) -> None:
    """Put every generator back to `state` (from capture_rng); MixlenError naming `source` (the
    file) and the field when a value is not what capture_rng writes."""
    torch_state = _tensor_field(state, "torch", source)
    keys = _words(_field(state, "numpy.keys", source), 624, "numpy.keys", source)
    pos = _field(state, "numpy.pos", source)
    words = _field(state, "python.words", source)
    if not (type(pos) is int and 0 <= pos <= 624):
        raise MixlenError(f"{source}: field numpy.pos: expected an integer in [0, 624]")
    _words(words[:-1] if isinstance(words, list) else words, 624, "python.words", source)
    if not (type(words[-1]) is int and 0 <= words[-1] <= 624):
        raise MixlenError(f"{source}: field python.words[624]: expected an integer in [0, 624]")
    n, p = state["numpy"], state["python"]
    try:
        torch.set_rng_state(torch_state)
        np.random.set_state(
            (n.get("kind"), np.asarray(keys, np.uint32), pos, n.get("has_gauss"), n.get("gauss"))
        )
        random.setstate((p.get("version"), tuple(words), p.get("gauss_next")))
        if device is not None and device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(_tensor_field(state, "cuda", source), device)
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise MixlenError(f"{source}: the generator states cannot be restored ({exc})") from None


def _tensor_field(state: dict[str, Any], key: str, source: str) -> torch.Tensor:
    value = _field(state, key, source)
    try:
        return _tensor(value)
    except (TypeError, ValueError, binascii.Error):
        raise MixlenError(f"{source}: field {key}: expected base64 bytes") from None
