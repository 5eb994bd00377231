"""`[offload]`: selective activation offload (ByteScale Eq. 3, trainer.offload.manager), and the
parsing of `train.activation_checkpoint`."""

from __future__ import annotations

import typing
from dataclasses import dataclass

from datapipe.errors import ConfigError, MixlenError
from datapipe.settings import Names, setting

__all__ = ["SELECTIVE", "SELECTIVE_OFFLOAD", "OffloadConfig", "checkpoint_every"]

SELECTIVE = "selective"  # every block: matmul and attention outputs kept, pointwise ops recomputed
SELECTIVE_OFFLOAD = (
    'train.activation_checkpoint = "selective" does not run with offload.enabled = true (what '
    'it keeps is held outside the offload\'s hooks): use "full" or "every:K" with offload, '
    "or set offload.enabled = false"
)


@dataclass
class OffloadConfig:
    """`[offload]`: with `enabled`, hdp and naive-hdp plan with offload and every micro-batch keeps
    the first blocks' saved activations in host memory as its plan's `offload_ratio` says."""

    enabled: bool = setting(False, help="plan with offload (hdp, naive-hdp) and offload as planned")
    force_ratio: float | None = setting(
        None,
        help="run every micro-batch at this ratio instead, on plans made without offload "
        "(tests, experiments)",
        lo=0.0,
        hi=1.0,
    )
    host_bytes_per_s: float | None = setting(
        None, help="the host link the planner assumes, bytes/s (default: the cost model's)"
    )
    host_budget_bytes: int = setting(
        0,
        help="a rank refuses a plan whose host store would exceed this, before the step (0: no "
        "limit)",
        lo=0,
        free_on_resume=True,
    )
    min_bytes: int = setting(
        4096,
        help="saved storages under this many bytes stay on the device",
        lo=0,
        free_on_resume=True,
    )
    pool_bytes: int | None = setting(
        None,
        help="bound of the (pinned, on CUDA) host buffer pool (default: twice the budget, or 4 "
        "GiB without one)",
        lo=0,
        free_on_resume=True,
    )

    DEFAULT_POOL_BYTES: typing.ClassVar[int] = 4 << 30

    def validate(self, names: Names) -> None:
        if self.force_ratio is not None and not self.enabled:
            raise ConfigError(f"{names('force_ratio')}: needs {names('enabled')} = true")
        if self.host_bytes_per_s is not None and not self.host_bytes_per_s > 0:
            raise ConfigError(
                f"{names('host_bytes_per_s')}: must be > 0, got {self.host_bytes_per_s}"
            )

    @property
    def planned(self) -> bool:
        """Does the planner plan with offload (enabled, no force_ratio)?"""
        return self.enabled and self.force_ratio is None

    @property
    def pool_bound(self) -> int:
        """Bytes the host buffer pool may own."""
        if self.pool_bytes is not None:
            return self.pool_bytes
        return 2 * self.host_budget_bytes if self.host_budget_bytes else self.DEFAULT_POOL_BYTES

    def ratio(self, planned: float) -> float:
        """The ratio a micro-batch runs with: `force_ratio`, else its plan's."""
        if self.force_ratio is not None:
            return float(self.force_ratio)
        if planned > 0 and not self.enabled:
            raise MixlenError(
                f"the plan offloads activations (offload_ratio {planned:g}) but "
                "offload.enabled = false"
            )
        return float(planned)


def checkpoint_every(spec: str, key: str = "train.activation_checkpoint") -> int:
    """An activation checkpointing spec as a stride: 0 for "none", 1 for "full" and "selective"
    (every block, whole or selectively), K for "every:K"."""
    if spec == "none":
        return 0
    if spec in ("full", SELECTIVE):
        return 1
    head, _, k = spec.partition(":")
    if head == "every" and k.isdigit() and 1 <= int(k) <= 1 << 20:
        return int(k)
    raise ConfigError(
        f'{key}: expected "none", "full", "selective" or "every:K" (K >= 1), got {spec!r}'
    )
