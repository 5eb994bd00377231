"""A Llama-style decoder over packed micro-batches: RMSNorm, RoPE from position_ids (with the
shape's scaling rule, trainer.model.rope), SwiGLU, grouped-query attention, optional Q/K/V
biases, tied or untied embeddings. Parameter names are mixlen's own; trainer/model/families/ maps
them to each Hugging Face architecture's tensor names.

Shapes (`ModelConfig`, `MODEL_CONFIGS`) are defined once in datapipe.shapes, where the planner's
cost presets read them too. The forward takes one packed micro-batch: ``input_ids`` [T] (any integer dtype: the fetch keeps the
dataset's uint16/uint32, widened on the device), ``position_ids`` [T] (position within
its sample) and either ``cu_seqlens`` [n+1] (local document-masked attention) or an attention context
(`trainer.attention.local.AttentionContext`, e.g. `trainer.attention.ring.RingAttention`) that decides how the
layers attend (with dynamic NTK RoPE it also gives each position's document length). Given
``labels`` [T] (-100 = unlabelled) it returns the SUM of token losses (each times its
``label_weights`` entry, if given) and the number of labelled tokens; the caller divides by the
step's denominator. The loss runs in chunks of tokens (trainer.model.loss): the whole batch's
logits are never held; only a forward without labels returns them.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from datapipe.plan.loss import IGNORE_INDEX
from datapipe.shapes import DTYPES, MODEL_CONFIGS, ModelConfig, get_config
from trainer.attention.dispatch import FLASH_ATTN
from trainer.attention.local import AttentionContext, LocalAttention, accum_dtype
from trainer.attention.op import varlen_attention
from trainer.model.loss import linear_cross_entropy, token_losses
from trainer.model.rope import Rope, apply_rope

__all__ = [
    "MODEL_CONFIGS",
    "ModelConfig",
    "Transformer",
    "build",
    "build_model",
    "parameter_shapes",
    "get_config",
    "torch_dtype",
]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name (trainer.config.job.DTYPES)."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (known: {', '.join(DTYPES)})")
    return getattr(torch, name)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.q_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.q_dim, cfg.dim, bias=False)

    def project(
        self, x_TC: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K (rotated) and V [T, heads, head_dim] of the normalised input."""
        # -1 heads: under tensor parallelism (trainer.parallel.tensor) a process holds a share;
        # unflatten rather than view(T, -1, ...): a ring member may hold no token (T = 0)
        q = self.wq(x_TC).unflatten(-1, (-1, self.head_dim))
        k = self.wk(x_TC).unflatten(-1, (-1, self.head_dim))
        v = self.wv(x_TC).unflatten(-1, (-1, self.head_dim))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()

    def forward(
        self, x_TC: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        q, k, v = self.project(x_TC, cos, sin)
        return self.wo(attn.attend(q, k, v).flatten(1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        self._compiled: _Compiled | None = None  # set by compile_block

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        c = self._compiled
        if c is None:
            return self.residual_ffn(x, self.attention(self.attention_norm(x), cos, sin, attn))
        if type(attn) is LocalAttention and attn.backend != FLASH_ATTN:  # one graph, op inside
            cu_dev, _ = attn.docs.cu(x.device)
            return c.local(x, cos, sin, attn.docs.host_cu(), cu_dev, attn.backend or "")
        # a ring: compiled segments around its attention, which talks to other ranks
        q, k, v = c.project(c.norm(x), cos, sin)
        out = attn.attend(q, k, v).flatten(1)
        return c.residual_ffn(x, self.attention.wo(out))

    def residual_ffn(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The block from the attention's output on: residuals and SwiGLU."""
        x = x + attn_out
        return x + self.feed_forward(self.ffn_norm(x))

    def local_forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_host: torch.Tensor,
        cu_dev: torch.Tensor,
        backend: str,
    ) -> torch.Tensor:
        """The block over local attention through its registered operator
        (trainer.attention.op): what `compile_block` captures as one graph."""
        q, k, v = self.attention.project(self.attention_norm(x), cos, sin)
        scale = self.attention.head_dim**-0.5
        out, _ = varlen_attention(q, k, v, cu_host, cu_dev, scale, backend)
        return self.residual_ffn(x, self.attention.wo(out.flatten(1)))

    def compile_block(self, backend: str | Callable = "inductor") -> None:
        """torch.compile the block with dynamic shapes, each a whole graph (a graph break is an
        error): over local attention the whole block, the attention kernel one registered
        operator in it; over a ring the segments around its attention (the norm, the projections
        and RoPE, the residuals and SwiGLU), the ring itself eager. Both call the attention's
        projections as modules but not `self.attention` itself: hooks on it would not run, so
        they are refused."""
        if self.attention._forward_hooks or self.attention._forward_pre_hooks:
            raise ValueError(
                "train.compile: a compiled block does not call its attention module's forward, "
                "so the hooks registered on it would not run"
            )
        opts: dict[str, Any] = {"dynamic": True, "fullgraph": True, "backend": backend}
        self._compiled = _Compiled(
            local=torch.compile(self.local_forward, **opts),
            norm=torch.compile(self.attention_norm, **opts),
            project=torch.compile(self.attention.project, **opts),
            residual_ffn=torch.compile(self.residual_ffn, **opts),
        )


@dataclass(frozen=True)
class _Compiled:
    """A block's compiled callables (kept outside the module tree: no parameters twice)."""

    local: Callable
    norm: Callable
    project: Callable
    residual_ffn: Callable


class Transformer(nn.Module):
    """The decoder. `forward` returns logits [T, V], or (loss_sum, n_labelled) given labels."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rope = Rope(cfg)  # tables only, no parameters or buffers
        self.tp_mesh: Any = None  # the TP group's DeviceMesh once parallelized
        self.tp_comm: Any = None  # and its communicator (the vocabulary-parallel loss)
        self.loss_chunk_tokens: int | None = None  # None: trainer.model.loss.chunk_tokens
        self.loss_compile: str | None = None  # the loss chunks' torch.compile backend, or eager
        if self.tok_embeddings.weight.device.type != "meta":
            self.init_weights()

    def compile_layers(self, backend: str = "inductor") -> None:
        """torch.compile every block (`Block.compile_block`) and the loss's arithmetic on each
        chunk of logits (trainer.model.loss) with `backend`: what `[train] compile` does."""
        for layer in self.layers:
            layer.compile_block(backend)
        self.loss_compile = backend

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, std) weights, residual output projections scaled by 1/sqrt(2 * n_layers),
        norms at 1, biases at 0. Also used after materialising a meta-device model (`to_empty`)."""
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.tok_embeddings.weight.device).manual_seed(seed)
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith(("wo.weight", "w2.weight")):
                p.normal_(0.0, out_std, generator=gen)
            else:
                p.normal_(0.0, std, generator=gen)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | Sequence[int] | None = None,
        labels: torch.Tensor | None = None,
        attn: AttentionContext | None = None,
        label_weights: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if attn is None:
            if cu_seqlens is None:
                cu_seqlens = [0, input_ids.shape[0]]
            attn = LocalAttention(cu_seqlens)
        h = self.hidden(input_ids, position_ids, attn)
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} != input_ids {tuple(input_ids.shape)}")
        if labels is None:
            return self._logits(h)
        w, vocab_start, comm = self._output_rows()
        loss_sum = linear_cross_entropy(
            h, w, labels, label_weights, self.loss_chunk_tokens, vocab_start, comm,
            self.loss_compile,
        )  # fmt: skip
        return loss_sum, (labels != IGNORE_INDEX).sum()

    def hidden(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        """The final norm's output [T, dim]: embeddings, every block, the norm."""
        if input_ids.dim() != 1 or position_ids.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and position_ids must be 1-D of equal length, got "
                f"{tuple(input_ids.shape)} and {tuple(position_ids.shape)}"
            )
        if input_ids.dtype not in (torch.int32, torch.int64):  # narrow token dtypes (uint16)
            input_ids = input_ids.to(torch.int32)  # widened here, on the model's device
        h = self.tok_embeddings(input_ids)
        # dynamic NTK only: each position's document length, from the attention context
        lengths = attn.doc_lengths(position_ids) if self.rope.needs_lengths else None
        cos, sin = self.rope.cos_sin(position_ids, h.dtype, lengths)
        for layer in self.layers:
            h = layer(h, cos, sin, attn)
        return self.norm(h)

    @torch.no_grad()
    def token_losses(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor,
        attn: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per position: (cross-entropy, 0 without a label; greedy prediction == label), the
        logits computed chunk by chunk (trainer.model.loss.token_losses)."""
        h = self.hidden(input_ids, position_ids, attn)
        w, vocab_start, comm = self._output_rows()
        return token_losses(h, w, labels, self.loss_chunk_tokens, vocab_start, comm)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Whole logits [T, V] (evaluation and tests; training never holds them)."""
        if self.tp_mesh is not None:  # sharded over the vocabulary, gathered
            from trainer.parallel.tensor import sharded_logits

            return sharded_logits(self, h).full_tensor()
        w_out = self.tok_embeddings.weight if self.output is None else self.output.weight
        return F.linear(h, w_out)

    def _output_rows(self) -> tuple[torch.Tensor, int, Any]:
        """(the output weight rows this process holds, the first one's token id, the TP
        communicator or None): the whole weight without tensor parallelism."""
        w = self.tok_embeddings.weight if self.output is None else self.output.weight
        if self.tp_mesh is None:
            return w, 0, None
        local = w.to_local()  # differentiable: its gradient arrives as the DTensor's shard
        comm = self.tp_comm
        assert local.shape[0] * comm.size == self.cfg.vocab_size, "tp divides the vocabulary"
        return local, comm.rank * local.shape[0], comm


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of `Transformer(cfg)`, in its order, without building it
    (tests/test_hf_errors.py checks this against a built model)."""
    d, kv = cfg.dim, cfg.n_kv_heads * cfg.head_dim
    layer: dict[str, tuple[int, ...]] = {
        "attention_norm.weight": (d,),
        "attention.wq.weight": (cfg.q_dim, d),
        **({"attention.wq.bias": (cfg.q_dim,)} if cfg.qkv_bias else {}),
        "attention.wk.weight": (kv, d),
        **({"attention.wk.bias": (kv,)} if cfg.qkv_bias else {}),
        "attention.wv.weight": (kv, d),
        **({"attention.wv.bias": (kv,)} if cfg.qkv_bias else {}),
        "attention.wo.weight": (d, cfg.q_dim),
        "ffn_norm.weight": (d,),
        "feed_forward.w1.weight": (cfg.ffn_dim, d),
        "feed_forward.w3.weight": (cfg.ffn_dim, d),
        "feed_forward.w2.weight": (d, cfg.ffn_dim),
    }
    shapes = {"tok_embeddings.weight": (cfg.vocab_size, d)}
    for i in range(cfg.n_layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    shapes["norm.weight"] = (d,)
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (cfg.vocab_size, d)
    return shapes


def build(
    cfg: ModelConfig, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> Transformer:
    """The decoder of `cfg` (initialised, unless on the meta device)."""
    with torch.device(device if device is not None else "cpu"):
        model = Transformer(cfg)
    if dtype is not None:
        model = model.to(dtype)
    return model


def build_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    load: Callable[[nn.Module], Any] | None = None,
    shard: Callable[[nn.Module], nn.Module] | None = None,
) -> tuple[nn.Module, nn.Module]:
    """(compute model, master weights) of `cfg`, initialised from `seed`, or with the weights
    `load(module)` writes into it (e.g. a Hugging Face folder's, trainer.model.pretrained): one
    module for float32/float64; for bfloat16 a float32 master and a bfloat16 copy. `shard`
    (tensor parallelism) splits both: a loaded model is split on the meta device, so `load`
    writes each process's shards only; a seeded one is initialised whole, then split (the
    same weights as without `shard`)."""
    master_dtype = accum_dtype(dtype)
    if shard is not None and load is not None:
        master = shard(build(cfg, "meta", master_dtype)).to_empty(device=device)
        load(master)
        if dtype == master_dtype:
            return master, master
        from trainer.parallel.tensor import local_tensor

        model = shard(build(cfg, "meta", dtype)).to_empty(device=device)
        with torch.no_grad():
            for p, q in zip(model.parameters(), master.parameters()):
                local_tensor(p).copy_(local_tensor(q))
        return model, master
    if shard is not None:
        model, master = build_model(cfg, dtype, device, seed)
        return shard(model), (master if master is model else shard(master))
    # built on the meta device and materialised once: the weights are written exactly once
    master = build(cfg, "meta", master_dtype).to_empty(device=device)
    if load is None:
        master.init_weights(seed)
    else:
        load(master)
    if dtype == master_dtype:
        return master, master
    return copy.deepcopy(master).to(dtype), master
