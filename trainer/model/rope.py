"""Rotary position embedding: inverse frequencies and the cos/sin tables of a model shape.

The frequency rules are those of transformers' RoPE types (its `modeling_rope_utils`), evaluated
in float64 here: "default" (``theta ** (-2i / d)``), "linear" (divided by `factor`), "llama3"
(long wavelengths divided by `factor`, short ones kept, a smooth blend between), "yarn" (a ramp
between interpolated and original frequencies over the dimensions, and an attention factor that
multiplies cos and sin) and "dynamic" (NTK: a base stretched by each document's length once it
exceeds `original_max_position_embeddings`).

Angles are position x frequency in float64 (positions reach millions), cast to the compute dtype
after cos/sin. Dynamic NTK depends on the length of each token's document: the model asks its
attention context (`AttentionContext.doc_lengths`), which knows the documents of a packed
micro-batch (cu_seqlens) or the whole samples of a ring (the layout's lengths).
"""

from __future__ import annotations

import math

import torch

from datapipe.shapes import ModelConfig, RopeScaling

__all__ = ["Rope", "apply_rope", "attention_factor", "dynamic_inv_freq", "inv_freq"]

F64 = torch.float64


def _exponents(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """2i / d for the head_dim / 2 rotated pairs (on the CPU unless told: a model built under a
    meta device context still gets real tables)."""
    return torch.arange(0, head_dim, 2, dtype=F64, device=device) / head_dim


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: wavelengths above omp / low_freq_factor divided by `factor`, below
    omp / high_freq_factor kept, a linear blend in 1 / wavelength between."""
    assert s.low_freq_factor is not None and s.high_freq_factor is not None
    assert s.original_max_position_embeddings is not None
    omp, lo, hi = s.original_max_position_embeddings, s.low_freq_factor, s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (omp / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * inv / s.factor + smooth * inv
    out = torch.where(wavelen > omp / lo, inv / s.factor, inv)
    medium = (wavelen >= omp / hi) & (wavelen <= omp / lo)
    return torch.where(medium, blended, out)


def _yarn_dims(s: RopeScaling, head_dim: int, theta: float) -> tuple[float, float]:
    """YaRN's correction range: the dimensions that turn beta_fast and beta_slow times over the
    original context, floored / ceiled unless truncate is false, clamped to [0, d - 1]."""
    assert s.original_max_position_embeddings is not None
    omp = s.original_max_position_embeddings

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(omp / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = dim_of(s.beta_fast if s.beta_fast is not None else 32.0)
    high = dim_of(s.beta_slow if s.beta_slow is not None else 1.0)
    if s.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def _yarn(head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: original frequencies below the correction range, interpolated (/ factor) above it,
    a linear ramp across it."""
    powers = theta ** _exponents(head_dim)
    extrapolated, interpolated = 1.0 / powers, 1.0 / (s.factor * powers)
    low, high = _yarn_dims(s, head_dim, theta)
    if low == high:
        high += 0.001  # a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=F64, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float64, CPU) of a length-independent rule
    (default, linear, llama3, yarn; dynamic NTK's at or below its original context)."""
    inv = theta ** -_exponents(head_dim)
    if scaling is None or scaling.type == "dynamic":
        return inv
    if scaling.type == "linear":
        return inv / scaling.factor
    if scaling.type == "llama3":
        return _llama3(inv, scaling)
    assert scaling.type == "yarn", scaling.type  # RopeScaling validates the type
    return _yarn(head_dim, theta, scaling)


def dynamic_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling, lengths: torch.Tensor
) -> torch.Tensor:
    """Dynamic NTK: inverse frequencies [U, head_dim / 2] for documents of `lengths` [U], with the
    base theta * (factor * L / omp - (factor - 1)) ** (d / (d - 2)), L = max(length, omp)."""
    assert scaling.original_max_position_embeddings is not None
    omp = scaling.original_max_position_embeddings
    seq = lengths.to(F64).clamp(min=omp)
    base = theta * (scaling.factor * seq / omp - (scaling.factor - 1)) ** (
        head_dim / (head_dim - 2)
    )
    return base[:, None] ** -_exponents(head_dim, lengths.device)[None, :]


def attention_factor(scaling: RopeScaling | None) -> float:
    """The factor multiplying cos and sin: YaRN's attention temperature, else 1."""
    if scaling is None or scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return mscale(scaling.factor)


class Rope:
    """The cos/sin tables of one model shape. `needs_lengths`: the tables depend on each token's
    document length (dynamic NTK), which `cos_sin` then takes."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.head_dim, self.theta, self.scaling = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
        self.needs_lengths = self.scaling is not None and self.scaling.type == "dynamic"
        self.scale = attention_factor(self.scaling)
        self._inv_cpu = inv_freq(self.head_dim, self.theta, self.scaling)
        self._inv: dict[torch.device, torch.Tensor] = {}

    def _inv_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv:
            self._inv[device] = self._inv_cpu.to(device)
        return self._inv[device]

    def cos_sin(
        self,
        position_ids: torch.Tensor,
        dtype: torch.dtype,
        doc_lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim / 2] in `dtype` for positions [T]; with dynamic NTK,
        `doc_lengths` [T] is the length of each token's document."""
        pos = position_ids.to(F64)[:, None]
        if self.needs_lengths:
            if doc_lengths is None or doc_lengths.shape != position_ids.shape:
                raise ValueError("dynamic RoPE needs the document length of every position")
            assert self.scaling is not None
            uniq, which = torch.unique(doc_lengths, return_inverse=True)
            ang = pos * dynamic_inv_freq(self.head_dim, self.theta, self.scaling, uniq)[which]
        else:
            ang = pos * self._inv_on(position_ids.device)[None, :]
        cos, sin = ang.cos(), ang.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x_THD: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[i], x[i + D/2]) of every head by the token's angles."""
    x1, x2 = x_THD.chunk(2, dim=-1)
    c, s = cos_TF[:, None, :], sin_TF[:, None, :]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
