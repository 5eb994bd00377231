"""The Llama-style decoder: named shapes, a plain reference forward, packing, loss, and the ring
equivalence the HDP executor relies on."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainer.attention.ring import RingAttention, ZigzagLayout
from trainer.model.transformer import MODEL_CONFIGS, build, get_config
from trainer.testing.threads import run_threads

F64 = torch.float64


def build_debug(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return build(get_config("debug", **overrides), dtype=F64)


def packed_batch(lengths, vocab=258, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
    return ids, pos, cu


def reference_logits(model, ids, lengths):
    """Plain per-sample forward with the model's weights: complex-number RoPE on the pairs
    (i, i + D/2), expanded K/V and torch's causal SDPA."""
    cfg = model.cfg
    hd, g = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w

    def rope(x):  # x [L, H, D]
        pos = torch.arange(x.shape[0], dtype=F64)
        freqs = cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=F64) / hd)
        rot = torch.polar(torch.ones(x.shape[0], hd // 2, dtype=F64), pos[:, None] * freqs)
        z = torch.complex(x[..., : hd // 2], x[..., hd // 2 :]) * rot[:, None, :]
        return torch.cat([z.real, z.imag], dim=-1)

    outs, start = [], 0
    for n in lengths:
        x = model.tok_embeddings.weight[ids[start : start + n]]
        start += n
        for layer in model.layers:
            a = layer.attention
            h = rms(x, layer.attention_norm.weight)
            q = rope((h @ a.wq.weight.T).view(n, cfg.n_heads, hd))
            k = rope((h @ a.wk.weight.T).view(n, cfg.n_kv_heads, hd)).repeat_interleave(g, 1)
            v = (h @ a.wv.weight.T).view(n, cfg.n_kv_heads, hd).repeat_interleave(g, 1)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
            )
            x = x + o.transpose(0, 1).reshape(n, -1) @ a.wo.weight.T
            f = layer.feed_forward
            h = rms(x, layer.ffn_norm.weight)
            x = x + (F.silu(h @ f.w1.weight.T) * (h @ f.w3.weight.T)) @ f.w2.weight.T
        x = rms(x, model.norm.weight)
        w = model.tok_embeddings.weight if model.output is None else model.output.weight
        outs.append(x @ w.T)
    return torch.cat(outs)


def test_debug_config_shape():
    cfg = MODEL_CONFIGS["debug"]
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (
        2,
        128,
        4,
        2,
        258,
    )


@pytest.mark.parametrize(
    ("name", "published"),
    [("llama-7b", 6_738_415_616), ("llama-13b", 13_015_864_320), ("llama-70b", 68_976_648_192)],
)
def test_llama_shapes_on_meta_match_published_sizes(name, published):
    cfg = MODEL_CONFIGS[name]
    model = build(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == published == cfg.num_params()


@pytest.mark.parametrize("name", ["debug", "small"])
def test_num_params_counts_built_model(name):
    for tie in (True, False):
        model = build(get_config(name, tie_embeddings=tie), device="meta")
        assert (
            sum(p.numel() for p in model.parameters())
            == get_config(name, tie_embeddings=tie).num_params()
        )


@pytest.mark.parametrize("tie", [True, False])
def test_forward_matches_plain_reference(tie):
    model = build_debug(seed=1, tie_embeddings=tie)
    lengths = [7, 1, 20, 12]
    ids, pos, cu = packed_batch(lengths, seed=2)
    with torch.no_grad():
        logits = model(ids, pos, cu)
        ref = reference_logits(model, ids, lengths)
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-10)


def test_packed_equals_separate_and_rope_is_relative():
    model = build_debug(seed=3)
    lengths = [9, 15, 4]
    ids, pos, cu = packed_batch(lengths, seed=4)
    with torch.no_grad():
        packed = model(ids, pos, cu)
        parts = torch.split(ids, lengths)
        sep = torch.cat([model(p, torch.arange(len(p))) for p in parts])
        # positions enter only through RoPE, which sees relative offsets: a constant shift per
        # document leaves the logits unchanged ...
        shift = torch.repeat_interleave(torch.tensor([5, 1000, 77]), torch.tensor(lengths))
        shifted = model(ids, pos + shift, cu)
        # ... while breaking the order inside a document changes them
        mixed = model(ids, pos.flip(0), cu)
    torch.testing.assert_close(packed, sep, rtol=0, atol=1e-12)
    torch.testing.assert_close(packed, shifted, rtol=0, atol=1e-9)
    assert not torch.allclose(packed, mixed)


def test_loss_sum_and_count():
    model = build_debug(seed=5)
    lengths = [10, 6]
    ids, pos, cu = packed_batch(lengths, seed=6)
    labels = torch.randint(0, 258, ids.shape, generator=torch.Generator().manual_seed(7))
    labels[[0, 3, 9, 15]] = -100
    loss_sum, count = model(ids, pos, cu, labels=labels)
    logits = model(ids, pos, cu)
    keep = labels != -100
    ref = -torch.log_softmax(logits, -1)[keep].gather(1, labels[keep, None]).sum()
    assert int(count) == int(keep.sum()) == 12
    torch.testing.assert_close(loss_sum, ref, rtol=0, atol=1e-10)


def test_meta_build_then_materialise():
    model = build(get_config("debug"), device="meta")
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    ids, pos, cu = packed_batch([5, 3])
    assert torch.isfinite(model(ids, pos, cu)).all()
    assert torch.equal(model.layers[0].ffn_norm.weight, torch.ones(128))


def test_init_weights_scale_the_residual_projections():
    """GPT-2's init: every matrix Normal(0, init_std), the residual output projections (wo, w2)
    Normal(0, init_std / sqrt(2 * n_layers)), norms 1 (sample moments of each matrix, 6%)."""
    model = build(get_config("debug", n_layers=3, init_std=0.05), device="meta")
    model.to_empty(device="cpu")
    model.init_weights(seed=1)
    seen = set()
    for name, p in model.named_parameters():
        w = p.detach().double()
        if name.endswith("norm.weight"):
            assert torch.equal(w, torch.ones_like(w)), name
            continue
        want = 0.05 / (6**0.5 if name.endswith(("wo.weight", "w2.weight")) else 1.0)
        assert abs(float(w.mean())) < 0.06 * want, name
        assert abs(float(w.std()) / want - 1.0) < 0.06, (name, float(w.std()), want)
        seen.add(name.split(".")[-2])
    assert {"wo", "w2", "wq", "w1", "tok_embeddings"} <= seen


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="n_kv_heads"):
        get_config("debug", n_kv_heads=3)
    with pytest.raises(ValueError, match="unknown model config"):
        get_config("llama-8x")


def _labels_for(ids, lengths, gen):
    """Next-token labels inside each sample; the last token of a sample and a few others -100."""
    labels = torch.full_like(ids, -100)
    start = 0
    for n in lengths:
        labels[start : start + n - 1] = ids[start + 1 : start + n]
        start += n
    labels[torch.rand(ids.shape, generator=gen) < 0.1] = -100
    return labels


@pytest.mark.parametrize(
    ("lengths", "group"), [([23, 9, 40], [1, 0]), ([17, 30, 2], [2, 0, 1]), ([3], [3, 1, 0, 2])]
)
def test_ring_model_equals_single_rank(lengths, group):
    """Loss sum, count and parameter gradients of the whole samples on one rank equal the sums over
    zigzag members running the same model with ring attention (float64); also when a member holds
    no token (a 3-token sample over 4 ranks: it still passes K/V along the ring)."""
    model = build_debug(seed=8)
    ids, pos, cu = packed_batch(lengths, seed=9)
    labels = _labels_for(ids, lengths, torch.Generator().manual_seed(10))
    loss_ref, count_ref = model(ids, pos, cu, labels=labels)
    loss_ref.backward()
    grads_ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    layout = ZigzagLayout(tuple(lengths), len(group))

    def member(comm):
        p = group.index(comm.rank)
        m = copy.deepcopy(model)
        idx = torch.as_tensor(layout.global_index(p))
        ring = RingAttention(comm, group, p, lengths)
        pos_local = torch.as_tensor(layout.position_ids(p))
        loss, count = m(ids[idx], pos_local, labels=labels[idx], attn=ring)
        loss.backward()
        return loss.detach(), count, {n: q.grad for n, q in m.named_parameters()}

    res = run_threads(len(group), member, timeout=60)
    torch.testing.assert_close(sum(r[0] for r in res), loss_ref.detach(), rtol=0, atol=1e-10)
    assert sum(int(r[1]) for r in res) == int(count_ref)
    for name, g in grads_ref.items():
        torch.testing.assert_close(sum(r[2][name] for r in res), g, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loaded", [False, True])
def test_build_model_with_a_shard_step_gives_the_same_weights(dtype, loaded):
    """build_model(shard=...) (the tensor-parallel split; here one that marks the modules it
    saw) gives the weights build_model gives without it: loaded weights are written after the
    split, the bfloat16 compute copy from the float32 master; seeded ones before it."""
    from trainer.model.transformer import build_model

    cfg = get_config("debug")
    load = (lambda m: m.init_weights(seed=3)) if loaded else None
    seen = []

    def shard(m):
        seen.append(m)
        return m

    want, want_master = build_model(cfg, dtype, seed=5, load=load)
    got, got_master = build_model(cfg, dtype, seed=5, load=load, shard=shard)
    assert {id(m) for m in seen} == {id(got), id(got_master)}
    for a, b in ((want, got), (want_master, got_master)):
        for (n, p), q in zip(a.named_parameters(), b.parameters()):
            assert p.dtype == q.dtype and torch.equal(p, q), n


def test_rope_angles_are_exact_at_long_positions() -> None:
    """cos/sin at positions past a million against Python's math in double precision: the
    angles are formed in float64 before the cast (formed in float32, position x frequency
    loses ~1e-2 there)."""
    import math

    from trainer.model.rope import Rope

    cfg = get_config("debug", rope_theta=500000.0)
    pos = [0, 1000, 123457, 1_000_003, 4_194_301]
    cos, sin = Rope(cfg).cos_sin(torch.tensor(pos), torch.float32)
    d = cfg.head_dim
    inv = [cfg.rope_theta ** (-2 * i / d) for i in range(d // 2)]
    want_cos = torch.tensor([[math.cos(p * f) for f in inv] for p in pos], dtype=F64)
    want_sin = torch.tensor([[math.sin(p * f) for f in inv] for p in pos], dtype=F64)
    assert cos.dtype == sin.dtype == torch.float32
    torch.testing.assert_close(cos.double(), want_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin.double(), want_sin, rtol=0, atol=1e-6)
