"""Model shapes: the one definition of each named network, used by the planner's cost presets
(FLOPs and bytes per position) and by the trainer, which builds the network from the same object.

Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP of width `ffn_dim`;
optionally biases on the Q, K and V projections (Qwen2), a head dimension other than
dim / n_heads, and a RoPE scaling rule (`RopeScaling`: linear, llama3, yarn, dynamic NTK, with
transformers' formulas in trainer.model.rope).
Imports nothing heavier than the standard library (the planner must start fast).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COST_FREE_FIELDS",
    "DTYPES",
    "FLOAT_RANGES",
    "INT_BOUNDS",
    "MODEL_CONFIGS",
    "ROPE_SETTINGS",
    "TP_DEGREES",
    "ModelConfig",
    "Range",
    "RopeScaling",
    "get_config",
]

DTYPES = ("float32", "float64", "bfloat16")  # compute dtypes by config name (trainer.model maps)
TP_DEGREES = (1, 2, 4, 8)  # tensor-parallel processes per HDP rank (trainer.parallel.tensor)
# ModelConfig fields that leave a step's work as it is: a cost file timed on a shape that differs
# from a run's in these only still times the run's model (any other field moves its cost)
COST_FREE_FIELDS = ("norm_eps", "rope_theta", "init_std", "rope_scaling", "max_position_embeddings")

# the settings of each RoPE scaling type besides `type` and `factor`: (required, optional)
ROPE_SETTINGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": ((), ()),
    "llama3": (("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"), ()),
    "yarn": (
        ("original_max_position_embeddings",),
        ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"),
    ),
    "dynamic": (("original_max_position_embeddings",), ()),
}
_FLOAT_SETTINGS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class Range:
    """The values a float setting may take: finite, above `lo` (or at it, unless `lo_open`), at
    most `hi` (None: no upper bound)."""

    lo: float
    lo_open: bool = True
    hi: float | None = None

    def problem(self, value: float) -> str | None:
        """Why `value` is not in the range ("must be ..., got ..."); None if it is."""
        if not math.isfinite(value):
            return f"must be finite, got {value!r}"
        if value < self.lo or (self.lo_open and value == self.lo):
            return f"must be {'>' if self.lo_open else '>='} {self.lo:g}, got {value!r}"
        if self.hi is not None and value > self.hi:
            return f"must be <= {self.hi:g}, got {value!r}"
        return None


# The range of every float of a shape and of a RoPE scaling rule, refused outside it with the key
# named (a non-finite value trains NaN or a dead model; a huge yarn beta is a math domain error):
# the shape's by field name, the scaling rule's as `rope_scaling.<setting>`.
FLOAT_RANGES: dict[str, Range] = {
    "norm_eps": Range(0.0, True, 1.0),
    "rope_theta": Range(1.0, True),  # a base of 1 or less has no wavelengths to stretch
    "init_std": Range(0.0, False, 1.0),
    "rope_scaling.factor": Range(1.0, False, float(1 << 20)),
    "rope_scaling.low_freq_factor": Range(0.0),
    "rope_scaling.high_freq_factor": Range(0.0),
    "rope_scaling.beta_fast": Range(0.0, True, 1e6),
    "rope_scaling.beta_slow": Range(0.0, True, 1e6),
    "rope_scaling.attention_factor": Range(0.0, True, 100.0),
    "rope_scaling.mscale": Range(0.0, False, 100.0),
    "rope_scaling.mscale_all_dim": Range(0.0, False, 100.0),
}
# The bounds [lo, hi] of every integer of a shape (`[model]`'s keys and config.json's share them):
# a config.json of 10^9 layers is refused by name instead of listing their weights until memory
# runs out.
INT_BOUNDS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 32),
    "dim": (1, 1 << 20),
    "n_layers": (1, 1 << 12),
    "n_heads": (1, 1 << 12),
    "n_kv_heads": (1, 1 << 12),
    "ffn_dim": (1, 1 << 22),
    "explicit_head_dim": (1, 1 << 16),
    "max_position_embeddings": (1, 1 << 36),
}


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling rule (the settings of transformers' `rope_scaling`, same names).

    `original_max_position_embeddings` is the context the base frequencies were trained for:
    llama3 and yarn scale relative to it, and dynamic NTK starts stretching the base for documents
    longer than it. yarn's `beta_fast` / `beta_slow` default to 32 / 1, its `attention_factor`
    (which multiplies cos and sin) to one derived from `factor` (and `mscale`, `mscale_all_dim`),
    `truncate` (round the correction range to whole dimensions) to true.
    Settings are refused with the key named: `rope_scaling.<key>`."""

    type: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None

    def __post_init__(self) -> None:
        if self.type not in ROPE_SETTINGS:
            raise ValueError(
                f"rope_scaling.type: unknown {self.type!r} (known: {', '.join(ROPE_SETTINGS)})"
            )
        required, optional = ROPE_SETTINGS[self.type]
        for f in dataclasses.fields(self)[2:]:
            value = getattr(self, f.name)
            if value is None:
                if f.name in required:
                    raise ValueError(f"rope_scaling.{f.name}: required for type {self.type!r}")
            elif f.name not in required + optional:
                raise ValueError(
                    f"rope_scaling.{f.name}: not a setting of type {self.type!r} (its settings: "
                    f"{', '.join(('factor', *required, *optional))})"
                )
        if self.factor is None:
            raise ValueError("rope_scaling.factor: required")
        for name in _FLOAT_SETTINGS:
            value = getattr(self, name)
            if value is not None:
                if not _is_number(value):
                    raise ValueError(f"rope_scaling.{name}: must be a number, got {value!r}")
                object.__setattr__(self, name, float(value))
                problem = FLOAT_RANGES[f"rope_scaling.{name}"].problem(float(value))
                if problem:
                    raise ValueError(f"rope_scaling.{name}: {problem}")
        omp = self.original_max_position_embeddings
        if omp is not None and not (
            isinstance(omp, int) and not isinstance(omp, bool) and omp >= 1
        ):
            raise ValueError(
                f"rope_scaling.original_max_position_embeddings: must be an int >= 1, got {omp!r}"
            )
        if self.truncate is not None and not isinstance(self.truncate, bool):
            raise ValueError(f"rope_scaling.truncate: must be true or false, got {self.truncate!r}")
        self._check_ranges()

    def _check_ranges(self) -> None:
        lo, hi = self.low_freq_factor, self.high_freq_factor
        if lo is not None and hi is not None and not hi > lo:
            raise ValueError(
                f"rope_scaling.high_freq_factor: must be > low_freq_factor ({lo}), got {hi}"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RopeScaling:
        """From a mapping of setting names (a TOML table); unknown keys are refused."""
        known = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in known:
                raise ValueError(f"rope_scaling.{key}: unknown setting (known: {', '.join(known)})")
        for key in ("type", "factor"):
            if key not in d:
                raise ValueError(f"rope_scaling.{key}: required")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """The settings that are set (the form `from_dict` reads)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder. `ffn_dim` is the SwiGLU hidden width; `qkv_bias`: the Q, K and V
    projections have biases (Qwen2); `explicit_head_dim`: the attention head width when it is not
    dim / n_heads (config.json's `head_dim`); `rope_scaling`: a `RopeScaling` (a mapping of its
    settings is converted); `max_position_embeddings`: the context the model is declared for
    (written to an exported config.json; None: not declared)."""

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
    qkv_bias: bool = False
    explicit_head_dim: int | None = None
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, Mapping):  # a TOML table, or asdict() of a config
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        for name, (lo, hi) in INT_BOUNDS.items():
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and lo <= v <= hi):
                raise ValueError(f"{name} must be an integer in [{lo:,}, {hi:,}], got {v!r}")
        for name in ("norm_eps", "rope_theta", "init_std"):
            v = getattr(self, name)
            problem = FLOAT_RANGES[name].problem(v) if _is_number(v) else "must be a number"
            if problem:
                raise ValueError(f"{name} {problem}")
        if self.explicit_head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} not a multiple of n_kv_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head dim {self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling must be a RopeScaling, got {self.rope_scaling!r}")
        if self.rope_scaling is not None and self.rope_scaling.type == "dynamic":
            if self.head_dim < 4:  # its base is stretched to the power d / (d - 2)
                raise ValueError(
                    f"rope_scaling type 'dynamic' needs head dim >= 4, got {self.head_dim}"
                )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        if self.explicit_head_dim is not None:
            return self.explicit_head_dim
        return self.dim // self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of the query projection's output (n_heads x head_dim; dim unless head_dim is
        explicit)."""
        return self.n_heads * self.head_dim

    def num_params(self) -> int:
        """Number of parameters of the built model."""
        hd = self.head_dim
        attn = self.dim * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.qkv_bias:
            attn += hd * (self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.ffn_dim
        layer = attn + mlp + 2 * self.dim
        emb = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * layer + emb + self.dim

    def tp_problem(self, tp: int) -> str | None:
        """Why this shape cannot be split over `tp` tensor-parallel processes (None: it can):
        tp must divide the heads, the SwiGLU width and the vocabulary, and either divide the K/V
        heads or be a multiple of them (K/V replicated)."""
        if tp not in TP_DEGREES:
            return f"must be one of {', '.join(map(str, TP_DEGREES))}, got {tp!r}"
        for name in ("n_heads", "ffn_dim", "vocab_size"):
            v = getattr(self, name)
            if v % tp:
                return f"{tp} does not divide the model's {name} ({v})"
        if self.n_kv_heads % tp and tp % self.n_kv_heads:
            return (
                f"{tp} and the model's n_kv_heads ({self.n_kv_heads}): one must divide the other "
                "(K/V heads are split over tp, or replicated when tp is the larger)"
            )
        return None

    def tp_params(self, tp: int = 1) -> int:
        """Parameters one process of a tensor-parallel group of `tp` holds (trainer.parallel.tensor:
        vocabulary, heads and SwiGLU units split; norms, and K/V when tp > n_kv_heads,
        replicated); `num_params()` at tp 1."""
        problem = self.tp_problem(tp)
        if problem:
            raise ValueError(f"parallel.tp {problem}")
        kv = self.n_kv_heads * self.head_dim
        kv_share = kv // tp if self.n_kv_heads % tp == 0 else kv
        attn = self.dim * (2 * self.q_dim // tp + 2 * kv_share)
        if self.qkv_bias:
            attn += self.q_dim // tp + 2 * kv_share
        layer = attn + 3 * self.dim * self.ffn_dim // tp + 2 * self.dim
        emb = self.vocab_size // tp * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * layer + emb + self.dim

    # --- what the cost model needs ----------------------------------------------------------------
    def attn_proj_flops_per_token(self) -> float:
        """Forward FLOPs per position of one layer's Q, K, V and O projections."""
        kv = self.n_kv_heads * self.head_dim
        return 2.0 * (2 * self.dim * self.q_dim + 2 * self.dim * kv)

    def mlp_flops_per_token(self) -> float:
        """Forward FLOPs per position of one layer's SwiGLU MLP (three matmuls)."""
        return 2.0 * 3 * self.dim * self.ffn_dim

    def attn_core_flops_per_s2(self) -> float:
        """Forward FLOPs of one layer's causal attention core per S^2 (QK^T and PV over S^2/2
        pairs)."""
        return 2.0 * self.q_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> float:
        """K and V bytes of one position over all layers (KV heads, un-expanded)."""
        return 2.0 * self.n_kv_heads * self.head_dim * dtype_bytes * self.n_layers

    def act_bytes_per_token_layer(self, dtype_bytes: int) -> float:
        """Saved activation bytes per position per layer of trainer.model.transformer's block (flash-style
        attention keeping only its output and log-sum-exp, no recompute), with compute dtype of
        `dtype_bytes` bytes; the norms and the log-sum-exp keep at least float32 (4 bytes).

        In the compute dtype: per RMSNorm its normalised input and its output (2 x 2 dim), the
        rotated Q, K and V and the attention output (2 q_dim + 2 KV dim), and the SwiGLU's w1 and w3
        outputs, the SiLU and the product (4 ffn_dim). At >= float32: per RMSNorm its float input
        and reciprocal RMS (2 x (dim + 1)), the log-sum-exp per query head. The rope tables are
        shared by all layers and not counted. `tests/test_offload.py` checks this against a count
        of the saved tensors."""
        kv = self.n_kv_heads * self.head_dim
        acc = max(int(dtype_bytes), 4)
        low = 4 * self.dim + 2 * self.q_dim + 2 * kv + 4 * self.ffn_dim
        return float(dtype_bytes * low + acc * (2 * self.dim + self.n_heads + 2))

    def saved_bytes_per_token_layer(self, dtype_bytes: int, checkpoint: str = "none") -> float:
        """Bytes one block keeps per position from its forward to its backward under
        `train.activation_checkpoint` = `checkpoint` ("none", "full" or "selective"; "every:K"
        mixes the first two).

        "none": `act_bytes_per_token_layer`. "full": the block's input (dim), its forward run
        again in backward (one block's "none" bytes while it runs). "selective": the input, the
        outputs of the seven matmuls (Q, K, V, output projection: q_dim + 2 KV dim + dim; SwiGLU:
        2 ffn_dim + dim) and the attention output (q_dim) in the compute dtype, and the
        attention's log-sum-exp per query head in >= float32; the norms, RoPE, SiLU, product and
        residual sums are recomputed. `tests/test_selective.py` checks it against what a block
        keeps."""
        if checkpoint == "none":
            return self.act_bytes_per_token_layer(dtype_bytes)
        if checkpoint == "full":
            return float(dtype_bytes * self.dim)
        if checkpoint != "selective":
            raise ValueError(
                f'checkpoint: expected "none", "full" or "selective", got {checkpoint!r}'
            )
        kv = self.n_kv_heads * self.head_dim
        acc = max(int(dtype_bytes), 4)
        low = 3 * self.dim + 2 * self.q_dim + 2 * kv + 2 * self.ffn_dim
        return float(dtype_bytes * low + acc * self.n_heads)

    def backward_bytes_per_token(self, dtype_bytes: int) -> float:
        """Bytes per position one block's backward allocates beyond what its forward saved, at
        its peak: the gradients of the SwiGLU's two input projections (2 ffn_dim in the compute
        dtype), alive together. Under every `train.activation_checkpoint` mode it comes on top of
        what the blocks keep; `tests/test_memory_meta.py` checks the sum against torch's memory
        tracker."""
        return float(dtype_bytes * 2 * self.ffn_dim)

    def loss_bytes(self, positions: int, dtype_bytes: int, tp: int = 1) -> float:
        """Device bytes the chunked loss (trainer.model.loss) holds for a micro-batch of
        `positions`, beyond the blocks' activations: dL/dh [positions, dim] in the compute dtype
        and dL/dW of this process's vocabulary rows in float32, kept from the forward to the
        backward (in a lower compute dtype also one dL/dW in it: a chunk's share, then the
        gradient handed back), plus one chunk of float32 logits while it runs (their
        exponentials and then their gradient in their place), and in a lower compute dtype that
        chunk in it too (the matmul's output, then the gradient the matmuls read). Whole float32
        logits and their log-softmax, which it replaces, would be 8 x vocab_size bytes a
        position."""
        rows = self.vocab_size // tp
        acc = max(int(dtype_bytes), 4)
        # a chunk holds LOSS_CHUNK_BYTES of float32 logits: as many logits in float64 are twice that
        chunk = min(LOSS_CHUNK_BYTES, positions * rows * 4) * acc / 4
        # in a lower compute dtype, one more dL/dW and one more chunk in it
        low = (rows * self.dim + chunk / 4) * dtype_bytes if dtype_bytes < acc else 0
        return float(positions * self.dim * dtype_bytes + rows * self.dim * acc + low + chunk)


# one chunk of the loss's float32 logits: at most this many bytes. Each chunk adds its share of
# dL/dW into a float32 [vocabulary, dim] buffer, so fewer chunks move fewer bytes: on an H200 the
# 1B's 32K-token step took 0.953 s with 256 MiB chunks (523 tokens at 128K), 0.896 s with chunks of
# 2,048 tokens (about this budget) for 1.1 GiB more (benchmarks/RESULTS.md, "One GPU")
LOSS_CHUNK_BYTES = 1 << 30


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
    # Llama 3.2 1B's shape (its RoPE scaling left out: the GPU benchmarks train it from random
    # weights at the lengths they measure)
    "llama3.2-1b": ModelConfig(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    "llama3-70b": ModelConfig(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=_llama_ffn(8192, 4096, 1.3),
        rope_theta=500000.0,
        tie_embeddings=False,
        max_position_embeddings=8192,
    ),
}


def get_config(name: str, **overrides: object) -> ModelConfig:
    """A named config, optionally with fields replaced."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model config {name!r}; known: {sorted(MODEL_CONFIGS)}")
    return dataclasses.replace(MODEL_CONFIGS[name], **overrides)
