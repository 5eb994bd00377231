"""Which attention kernel runs a block: one place that chooses by device and dtype.

Every backend module has the same two functions over a block's documents
(trainer.attention.varlen.VarlenDocs):

- ``forward(q_THD, k_SKD, v_SKD, docs, causal, scale) -> (out_THD, lse_TH)``: out in q's dtype,
  the log-sum-exp in float32 (float64 for float64), a query row with no key at out 0, lse -inf;
- ``backward(dout, q, k, v, out, lse_TH, docs, causal, scale) -> (dq, dk, dv)``: against the out
  and lse it is given (the merged ones in a ring).

| backend | where | what |
| --- | --- | --- |
| `cpu_flash` | CPU, every dtype | torch's fused CPU flash kernel, one call per document |
| `cuda_flash` | CUDA, float16/bfloat16 | torch's varlen flash kernel, one call per block, GQA native |
| `cuda_efficient` | CUDA, float32 (and half precision where flash cannot run: before Ampere, head_dim > 256) | torch's memory-efficient varlen kernel, one call per block |
| `math` | CUDA float64; tests | explicit scores per document: the reference |

The flash-attn package (optional, `flash_attn`) is never chosen by default: torch's own kernel is
the same algorithm; `attend(..., backend="flash_attn")` asks for it, float16/bfloat16 only.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from trainer.attention import cpu_flash, cuda_efficient, cuda_flash, math_ref

__all__ = ["BACKENDS", "FLASH_ATTN", "default_backend", "get"]

BACKENDS: dict[str, ModuleType] = {
    m.NAME: m for m in (cpu_flash, cuda_flash, cuda_efficient, math_ref)
}
FLASH_ATTN = "flash_attn"  # the optional package, local attention only


@functools.lru_cache(maxsize=16)
def _flash_runs_on(index: int | None) -> bool:
    """Does torch's flash kernel run on this CUDA device (built in, Ampere or newer)?"""
    if not torch.backends.cuda.is_flash_attention_available():
        return False
    return torch.cuda.get_device_capability(index) >= (8, 0)


def default_backend(
    device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> str:
    """The backend of tensors of `dtype` on `device` (the table above); half precision goes to
    the memory-efficient kernel where the flash kernel cannot run it (a GPU before Ampere, a
    head dimension above its limit)."""
    if device.type == "cpu":
        return cpu_flash.NAME
    if device.type == "cuda":
        big = head_dim is not None and head_dim > cuda_flash.MAX_HEAD_DIM
        if dtype in cuda_flash.DTYPES and not big and _flash_runs_on(device.index):
            return cuda_flash.NAME
        if dtype in cuda_efficient.DTYPES:
            return cuda_efficient.NAME
    return math_ref.NAME


def get(name: str) -> ModuleType:
    """The backend module called `name`."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (known: {', '.join(BACKENDS)})")
    return BACKENDS[name]
