"""The documents of one varlen attention call: host boundaries, and the device tensors a fused
kernel takes, built once per micro-batch and reused by every layer.

A call attends the queries q[q[d]:q[d+1]] of document d to its keys k[k[d]:k[d+1]], for every d
at once. Kernels take the boundaries as int32 tensors on their device plus the longest document
on each side as host integers (no device-to-host read); `VarlenDocs` keeps both, so the layers of
a micro-batch share one host-to-device copy (pinned, non-blocking on CUDA) instead of one per
call. The per-token document index and offset some kernels' log-sum-exp layouts need are kept the
same way (`token_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["Kernels", "VarlenDocs", "as_docs", "check_inputs", "to_device"]


def to_device(x: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`: through pinned memory without waiting on CUDA, as is on the CPU."""
    t = torch.from_numpy(np.ascontiguousarray(x))
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _check(bounds: tuple[int, ...], side: str) -> None:
    if len(bounds) < 1 or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        head = list(bounds[:8])
        raise ValueError(
            f"cu_seqlens ({side} side) must rise from 0, got {head}{'...' if len(bounds) > 8 else ''}"
        )


@dataclass(eq=False)
class VarlenDocs:
    """Boundaries of n documents on the query side (`q`, n+1 entries) and the key side (`k`)."""

    q: tuple[int, ...]
    k: tuple[int, ...]
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if len(self.q) != len(self.k):
            raise ValueError(f"cu_q has {len(self.q)} entries but cu_k has {len(self.k)}")
        _check(self.q, "q")
        _check(self.k, "k")

    @property
    def n(self) -> int:
        return len(self.q) - 1

    @property
    def total_q(self) -> int:
        return self.q[-1]

    @property
    def total_k(self) -> int:
        return self.k[-1]

    @property
    def max_q(self) -> int:
        """The longest document's query count (0 with no document)."""
        return int(np.diff(self.q).max()) if self.n else 0

    @property
    def max_k(self) -> int:
        return int(np.diff(self.k).max()) if self.n else 0

    def same_sides(self) -> bool:
        return self.q == self.k

    def cu(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cu_q, cu_k) as int32 tensors on `device`, copied there once."""
        key = ("cu", device)
        if key not in self._cache:
            both = np.array([self.q, self.k], dtype=np.int32)
            dev = to_device(both, device)
            self._cache[key] = (dev[0], dev[0] if self.same_sides() else dev[1])
        return self._cache[key]

    def adopt_cu(self, cu: torch.Tensor) -> None:
        """Take `cu` (int32, both sides' boundaries, on its device) as this documents' device
        copy instead of copying them there again."""
        assert self.same_sides() and cu.shape == (self.n + 1,) and cu.dtype == torch.int32
        self._cache[("cu", cu.device)] = (cu, cu)

    def host_cu(self) -> torch.Tensor:
        """The query-side boundaries as an int64 CPU tensor, built once (what
        trainer.attention.op's operator takes beside the device copy)."""
        key = ("host", None)
        if key not in self._cache:
            self._cache[key] = torch.tensor(self.q, dtype=torch.int64)
        return self._cache[key]

    def token_rows(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(document, offset in it) of every query token, int64 on `device`, copied once."""
        key = ("rows", device)
        if key not in self._cache:
            sizes = np.diff(np.asarray(self.q, dtype=np.int64))
            doc = np.repeat(np.arange(self.n, dtype=np.int64), sizes)
            off = np.arange(self.total_q, dtype=np.int64) - np.repeat(
                np.asarray(self.q[:-1], dtype=np.int64), sizes
            )
            dev = to_device(np.stack([doc, off]), device)
            self._cache[key] = (dev[0], dev[1])
        return self._cache[key]

    def no_key_rows(self, device: torch.device) -> torch.Tensor | None:
        """A bool [T] mask of the query rows whose document has no key (on `device`, built
        once), or None if every document with queries has keys."""
        return self._lonely("no_key", device, self.q, self.k)

    def no_query_rows(self, device: torch.device) -> torch.Tensor | None:
        """A bool [S] mask of the key rows whose document has no query, or None."""
        return self._lonely("no_query", device, self.k, self.q)

    def _lonely(
        self, name: str, device: torch.device, mine: tuple[int, ...], other: tuple[int, ...]
    ) -> torch.Tensor | None:
        """Rows of `mine`'s side whose document is empty on the `other` side (a kernel may leave
        their outputs and gradients unwritten), built once per device."""
        key = (name, device)
        if key not in self._cache:
            n_mine, n_other = np.diff(np.asarray(mine)), np.diff(np.asarray(other))
            bad = (n_other == 0) & (n_mine > 0)
            self._cache[key] = to_device(np.repeat(bad, n_mine), device) if bad.any() else None
        return self._cache[key]

    def check_tokens(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """The boundaries cover exactly the tokens given (a kernel would read out of bounds)."""
        if (self.total_q, self.total_k) != (q.shape[0], k.shape[0]):
            raise ValueError(
                f"the documents cover {self.total_q} queries and {self.total_k} keys, the "
                f"tensors hold {q.shape[0]} and {k.shape[0]}"
            )

    def zero_lonely(
        self, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients with the rows of documents empty on the other side set to 0 (what the
        kernels may leave unwritten)."""
        rows_q, rows_k = self.no_key_rows(dq.device), self.no_query_rows(dk.device)
        if rows_q is not None:
            dq = dq.masked_fill(rows_q[:, None, None], 0.0)
        if rows_k is not None:
            dk = dk.masked_fill(rows_k[:, None, None], 0.0)
            dv = dv.masked_fill(rows_k[:, None, None], 0.0)
        return dq, dk, dv


def as_docs(
    cu_q: VarlenDocs | torch.Tensor | Sequence[int],
    cu_k: torch.Tensor | Sequence[int] | None = None,
) -> VarlenDocs:
    """`cu_q` if it already is a VarlenDocs, else the documents of boundaries cu_q / cu_k (the
    same boundaries on both sides when cu_k is None)."""
    if isinstance(cu_q, VarlenDocs):
        return cu_q

    def bounds(cu: torch.Tensor | Sequence[int]) -> tuple[int, ...]:
        if isinstance(cu, torch.Tensor):
            return tuple(int(x) for x in cu.tolist())
        return tuple(int(x) for x in cu)

    q = bounds(cu_q)
    return VarlenDocs(q, q if cu_k is None else bounds(cu_k))


@dataclass(frozen=True)
class Kernels:
    """The forward and backward ops a CUDA backend calls: torch's own, or the CPU fakes tests put
    in a backend's `kernels` (trainer.testing.fake_kernels)."""

    forward: Callable
    backward: Callable


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    kernel: str,
    dtypes: tuple[torch.dtype, ...],
    align: int,
    max_head_dim: int = 1 << 16,
) -> None:
    """Refuse what `kernel` cannot compute, naming the setting: a dtype outside `dtypes`
    (train.dtype), a head dimension not a multiple of `align` or above `max_head_dim`
    (model.dim / model.n_heads), query heads not a multiple of the KV heads."""
    if q.dtype not in dtypes:
        names = ", ".join(str(d)[6:] for d in dtypes)
        raise ValueError(
            f"the {kernel} kernel computes in {names}, not {str(q.dtype)[6:]} (train.dtype)"
        )
    d = q.shape[-1]
    if d % align or d > max_head_dim:
        sizes = f"multiples of {align} up to" if align > 1 else "head dimensions up to"
        raise ValueError(
            f"head dimension {d} (model.dim / model.n_heads, or a pretrained config.json's head_dim): the {kernel} "
            f"kernel takes {sizes} {max_head_dim} in {str(q.dtype)[6:]}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"{q.shape[1]} query heads not a multiple of {k.shape[1]} KV heads "
            "(model.n_heads, model.n_kv_heads)"
        )
