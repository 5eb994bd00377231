"""A plain-torch training loop for benchmarks/bench_gpu.py to stand beside mixlen: a Llama-style
decoder written here from the shape's numbers alone (nothing of mixlen's model, attention, loss
or optimizer), torch's varlen flash kernel over packed documents, each block compiled as
TorchTitan compiles its blocks, bfloat16 weights with a float32 master copy and fused AdamW,
the loss as TorchTitan takes it (whole logits in float32, F.cross_entropy).

On the CPU (the benchmark's dry run) attention falls back to SDPA per document and blocks
compile with the `eager` backend (tracing only), so the loop's logic runs in the test suite.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _varlen_kernel() -> tuple[Any, set[str]] | None:
    """torch's varlen_attn and the keyword arguments this torch's version takes, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: dict) -> torch.Tensor:
    """Causal attention per document of q [T, H, D], k/v [T, Hkv, D]."""
    g = q.shape[1] // k.shape[1]
    found = _varlen_kernel() if q.is_cuda else None
    if found is not None:
        fn, kw = found
        extra: dict[str, Any] = {}
        if "window_size" in kw:  # torch 2.11 on: causal is the window (-1, 0)
            extra["window_size"] = (-1, 0)
        else:
            extra["is_causal"] = True
        if g > 1 and "enable_gqa" in kw:
            extra["enable_gqa"] = True
        # K/V as they are otherwise too: the flash kernel underneath takes fewer KV heads (as
        # TorchTitan passes them), and repeating them would cost the reference 4x their traffic
        return fn(q, k, v, docs["cu"], docs["cu"], docs["max"], docs["max"], **extra)
    out = []
    for a, b in zip(docs["bounds"], docs["bounds"][1:]):
        qd = q[a:b].transpose(0, 1)[None]
        kd = k[a:b].repeat_interleave(g, 1).transpose(0, 1)[None]
        vd = v[a:b].repeat_interleave(g, 1).transpose(0, 1)[None]
        out.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)[0].transpose(0, 1))
    return torch.cat(out)


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv: int, ffn: int, eps: float) -> None:
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, dim // heads
        self.n1, self.n2 = nn.RMSNorm(dim, eps=eps), nn.RMSNorm(dim, eps=eps)
        self.qkv = nn.Linear(dim, (heads + 2 * kv) * self.hd, bias=False)
        self.o = nn.Linear(heads * self.hd, dim, bias=False)
        self.gate_up = nn.Linear(dim, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: dict
    ) -> torch.Tensor:  # noqa: E501
        t = x.shape[0]
        q, k, v = self.qkv(self.n1(x)).view(t, -1, self.hd).split([self.heads, self.kv, self.kv], 1)

        def rot(z: torch.Tensor) -> torch.Tensor:
            a, b = z.chunk(2, -1)
            return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)

        att = _varlen(rot(q), rot(k), v.contiguous(), docs)
        x = x + self.o(att.reshape(t, -1))
        gate, up = self.gate_up(self.n2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class ReferenceModel(nn.Module):
    """The decoder: tied embeddings, RMSNorm, RoPE, GQA, SwiGLU."""

    def __init__(self, shape: Any) -> None:
        super().__init__()
        s = shape
        self.theta, self.hd = s.rope_theta, s.dim // s.n_heads
        self.emb = nn.Embedding(s.vocab_size, s.dim)
        self.blocks = nn.ModuleList(
            _Block(s.dim, s.n_heads, s.n_kv_heads, s.ffn_dim, s.norm_eps) for _ in range(s.n_layers)
        )
        self.norm = nn.RMSNorm(s.dim, eps=s.norm_eps)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.02)

    def forward(
        self, ids: torch.Tensor, pos: torch.Tensor, docs: dict, labels: torch.Tensor
    ) -> torch.Tensor:  # noqa: E501
        inv = self.theta ** (-torch.arange(0, self.hd, 2, device=ids.device) / self.hd)
        ang = pos.double()[:, None] * inv.double()[None, :]
        h = self.emb(ids)
        cos, sin = ang.cos().to(h.dtype)[:, None], ang.sin().to(h.dtype)[:, None]
        for blk in self.blocks:
            h = blk(h, cos, sin, docs)
        logits = F.linear(self.norm(h), self.emb.weight)
        return F.cross_entropy(logits.float(), labels, ignore_index=-100)


class ReferenceLoop:
    """One rank's training loop: bfloat16 (or the given dtype) compute, float32 master, fused
    AdamW on CUDA, blocks compiled (`compile_backend`: None for eager)."""

    def __init__(
        self, shape: Any, dtype: torch.dtype, device: torch.device, compile_backend: str | None
    ) -> None:  # noqa: E501
        torch.manual_seed(0)
        self.master = ReferenceModel(shape).to(device)
        self.model = ReferenceModel(shape).to(device).to(dtype)
        self.model.load_state_dict(self.master.state_dict())
        self.params = list(self.model.parameters())
        self.master_params = list(self.master.parameters())
        fused = device.type == "cuda"
        self.opt = torch.optim.AdamW(self.master_params, lr=1e-4, fused=fused)
        if compile_backend is not None:
            for blk in self.model.blocks:
                blk.compile(backend=compile_backend, dynamic=False)

    def step(
        self, ids: torch.Tensor, pos: torch.Tensor, lengths: list[int], labels: torch.Tensor
    ) -> float:  # noqa: E501
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        cu = torch.tensor(bounds, dtype=torch.int32).to(ids.device, non_blocking=True)
        docs = {"cu": cu, "max": max(lengths), "bounds": bounds}
        loss = self.model(ids, pos, docs, labels)
        loss.backward()
        for p, m in zip(self.params, self.master_params):
            m.grad = p.grad.float()
            p.grad = None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.master_params)
        return loss.detach()


def flops_per_token(shape: Any, seq_len: int) -> float:
    """TorchTitan's count: 6 x (parameters less the input embedding) + 12 x layers x heads x
    head_dim x sequence length. The output layer's matrix is counted also when it is the tied
    embedding (Llama 3.2 1B): its product is computed all the same, and TorchTitan's own model of
    the shape (untied) counts it."""
    params = shape.num_params() - (0 if shape.tie_embeddings else shape.vocab_size * shape.dim)
    return 6.0 * params + 12.0 * shape.n_layers * shape.n_heads * shape.head_dim * seq_len


def causal_attention_flops(lengths: list[int], heads: int, head_dim: int) -> float:
    """Forward + backward FLOPs of causal attention over documents (QK^T and PV over the L(L+1)/2
    visible pairs: 4 x heads x head_dim a pair forward, 2.5x that backward)."""
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    return 3.5 * 4.0 * heads * head_dim * pairs


def isclose_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(math.ulp(1.0)))
