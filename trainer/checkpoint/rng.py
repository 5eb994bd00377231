"""Every random number generator a training process draws from, as plain JSON values: torch's
CPU generator (and the current CUDA device's), numpy's global generator and Python's `random`.
A checkpoint stores one such state per rank, so a resumed run draws exactly what the
uninterrupted one would have.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

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


def restore_rng(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Put every generator back to `state` (from capture_rng)."""
    torch.set_rng_state(_tensor(state["torch"]))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], np.asarray(n["keys"], np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["words"]), p["gauss_next"]))
    if device is not None and device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(_tensor(state["cuda"]), device)
