"""Model shapes: the one definition of each named network, used by the planner's cost presets
(FLOPs and bytes per position) and by the trainer, which builds the network from the same object.

Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP of width `ffn_dim`.
Imports nothing heavier than the standard library (the planner must start fast).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["MODEL_CONFIGS", "ModelConfig", "get_config"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder. `ffn_dim` is the SwiGLU hidden width."""

    vocab_size: int = 258
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 384
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} not a multiple of n_kv_heads {self.n_kv_heads}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dim {self.dim // self.n_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Number of parameters of the built model."""
        hd = self.head_dim
        attn = self.dim * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.ffn_dim
        layer = attn + mlp + 2 * self.dim
        emb = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * layer + emb + self.dim

    # --- what the cost model needs ----------------------------------------------------------------
    def attn_proj_flops_per_token(self) -> float:
        """Forward FLOPs per position of one layer's Q, K, V and O projections."""
        kv = self.n_kv_heads * self.head_dim
        return 2.0 * (2 * self.dim * self.dim + 2 * self.dim * kv)

    def mlp_flops_per_token(self) -> float:
        """Forward FLOPs per position of one layer's SwiGLU MLP (three matmuls)."""
        return 2.0 * 3 * self.dim * self.ffn_dim

    def attn_core_flops_per_s2(self) -> float:
        """Forward FLOPs of one layer's causal attention core per S^2 (QK^T and PV over S^2/2
        pairs)."""
        return 2.0 * self.dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> float:
        """K and V bytes of one position over all layers (KV heads, un-expanded)."""
        return 2.0 * self.n_kv_heads * self.head_dim * dtype_bytes * self.n_layers

    def act_bytes_per_token_layer(self, dtype_bytes: int) -> float:
        """Saved activation bytes per position per layer of trainer.model.transformer's block (flash-style
        attention keeping only its output and log-sum-exp, no recompute), with compute dtype of
        `dtype_bytes` bytes; the norms and the log-sum-exp keep at least float32 (4 bytes).

        In the compute dtype: per RMSNorm its normalised input and its output (2 x 2 dim), the
        rotated Q, K and V and the attention output (2 dim + 2 KV dim), and the SwiGLU's w1 and w3
        outputs, the SiLU and the product (4 ffn_dim). At >= float32: per RMSNorm its float input
        and reciprocal RMS (2 x (dim + 1)), the log-sum-exp per query head. The rope tables are
        shared by all layers and not counted. `tests/test_offload.py` checks this against a count
        of the saved tensors."""
        kv = self.n_kv_heads * self.head_dim
        acc = max(int(dtype_bytes), 4)
        low = 6 * self.dim + 2 * kv + 4 * self.ffn_dim
        return float(dtype_bytes * low + acc * (2 * self.dim + self.n_heads + 2))


def _llama_ffn(dim: int, multiple_of: int, multiplier: float = 1.0) -> int:
    hidden = int(multiplier * int(8 * dim / 3))
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


MODEL_CONFIGS: dict[str, ModelConfig] = {
    "debug": ModelConfig(),
    "small": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536),
    "llama-7b": ModelConfig(
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        ffn_dim=_llama_ffn(4096, 256),
        tie_embeddings=False,
    ),
    "llama-13b": ModelConfig(
        vocab_size=32000,
        dim=5120,
        n_layers=40,
        n_heads=40,
        n_kv_heads=40,
        ffn_dim=_llama_ffn(5120, 256),
        tie_embeddings=False,
    ),
    "llama-70b": ModelConfig(
        vocab_size=32000,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=_llama_ffn(8192, 4096, 1.3),
        tie_embeddings=False,
    ),
}


def get_config(name: str, **overrides: object) -> ModelConfig:
    """A named config, optionally with fields replaced."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model config {name!r}; known: {sorted(MODEL_CONFIGS)}")
    return dataclasses.replace(MODEL_CONFIGS[name], **overrides)
