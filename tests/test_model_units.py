"""Model-area rules the logits tests do not reach, each against an independent reference
(transformers' own RoPE functions and models, or a hand computation): config.json rope_scaling
forms transformers accepts (yarn without an original context, linear with one), YaRN's attention
factor when only `mscale` is set, Q/K/V biases initialised at zero, an export's pad token id,
the calibrated TP all-reduce bytes of a bfloat16 model, and YaRN's tables rounded once to the
compute dtype."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _hf_reference import assert_close_per_doc, hf_model, packed, reference_logits, save
from test_hf_errors import _transformers_rope
from test_hf_model import mixlen_model

from datapipe.shapes import RopeScaling, get_config
from trainer.model.rope import attention_factor, inv_freq
from trainer.model.transformer import build

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

F64 = torch.float64


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "yarn", "factor": 4.0},
        {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 32},
    ],
    ids=["yarn-no-original", "linear-with-original"],
)
def test_rope_scaling_forms_transformers_accepts_load_and_match_it(rope_scaling, tmp_path):
    """config.json's yarn without original_max_position_embeddings (transformers takes
    max_position_embeddings, 128) and linear with one (transformers ignores it) load, and give
    transformers' float64 logits per document, past 128 positions too."""
    hf = hf_model("llama-yarn", rope_scaling=rope_scaling)
    path = save(hf, str(tmp_path / "m"))
    model = mixlen_model(path, F64)
    lengths = [150, 20]
    ids, pos, cu = packed(lengths, model.cfg.vocab_size, seed=11)
    with torch.no_grad():
        got = model(ids, pos, cu)
    assert_close_per_doc(got, reference_logits(hf, ids, lengths, F64), lengths, 1e-10)


def test_yarn_attention_factor_with_mscale_alone_is_transformers():
    """YaRN with `mscale` but no `mscale_all_dim`: transformers' attention factor is the plain
    0.1 * ln(factor) + 1 (mscale unused); the frequencies are transformers' too."""
    settings = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    settings["mscale"] = 0.8
    want_inv, want_af = _transformers_rope(settings)
    scaling = RopeScaling("yarn", 4.0, 32, mscale=0.8)
    assert want_af == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-15)
    assert attention_factor(scaling) == pytest.approx(want_af, rel=1e-15)
    torch.testing.assert_close(inv_freq(16, 500.0, scaling), want_inv, rtol=1e-14, atol=0)


@pytest.mark.parametrize("meta", [False, True], ids=["built", "materialised"])
def test_qkv_biases_start_at_zero(meta):
    """A model with Q/K/V biases (Qwen2's layout) trained from scratch starts with every bias at
    exactly zero (as transformers' Qwen2 initialises them), built directly or materialised from
    the meta device and initialised from a seed; the weights beside them are drawn."""
    cfg = get_config("debug", qkv_bias=True)
    if meta:
        model = build(cfg, device="meta").to_empty(device="cpu")
        model.init_weights(seed=3)
    else:
        model = build(cfg)
    biases = {n: p for n, p in model.named_parameters() if n.endswith(".bias")}
    assert len(biases) == 3 * cfg.n_layers
    for name, b in biases.items():
        assert torch.equal(b, torch.zeros_like(b)), name
    assert float(model.layers[0].attention.wq.weight.detach().std()) > 0


def test_an_export_carries_the_source_models_token_ids(tmp_path):
    """export_hf with the source config.json as base_config writes its bos, eos and pad token
    ids: transformers reads the export's ids as the source's (pad 5, bos 1, eos 2)."""
    from transformers import AutoConfig

    from trainer.model.export import export_hf
    from trainer.model.pretrained import inspect_pretrained

    src = save(hf_model("llama-tied", pad_token_id=5), str(tmp_path / "src"))
    pre = inspect_pretrained(src)
    model = mixlen_model(src, torch.float32)
    out = str(tmp_path / "out")
    export_hf(dict(model.named_parameters()), pre.shape, pre.family, out, base_config=pre.config)
    want, got = AutoConfig.from_pretrained(src), AutoConfig.from_pretrained(out)
    assert (want.pad_token_id, want.bos_token_id, want.eos_token_id) == (5, 1, 2)
    assert (got.pad_token_id, got.bos_token_id, got.eos_token_id) == (5, 1, 2)


def test_calibrated_tp_all_reduce_bytes_follow_the_dtype():
    """`calibrate --tp 2 --dtype bfloat16` fits the TP all-reduces with [T, dim] activations of
    2 bytes an element: on noisy micro-batch timings the cost's b and c are fit_terms' with
    128 * 2 bytes per position (by hand), which differ from float32's 128 * 4."""
    from datapipe.plan.costfit import Timing, fit_terms
    from trainer.calibrate import calibrate

    def t(lengths: tuple[int, ...]) -> float:
        s = np.array(lengths, dtype=float)
        return 2e-3 + 3e-8 * (s * s).sum() + 1e-4 * s.sum() + 2e-9 * s.sum() ** 2

    cases = [(128,), (512,), (2048,), (8192,), (16,) * 128, (256,) * 8, (512,) * 8, (256,) * 32]
    noise = [1.1, 0.9, 1.05, 0.95, 1.0, 1.1, 0.9, 1.0]  # measured times never fit exactly
    timings = [Timing("local", 1, c, 0.0, t(c) * e) for c, e in zip(cases, noise)]
    timings += [Timing("tp", 2, (), n, 1e-4 + n / 1e8) for n in (4096, 65536, 1 << 20)]
    cal = calibrate("debug", 2, timings=timings, tp=2, dtype="bfloat16", link_bytes_per_s=1e9)
    cost = cal.cost
    want = fit_terms(timings, cost.kv_bytes_per_token, 2, cost.comm_passes, 1e9,
                     tp_bytes_per_token=128 * 2)  # fmt: skip
    float32 = fit_terms(timings, cost.kv_bytes_per_token, 2, cost.comm_passes, 1e9,
                        tp_bytes_per_token=128 * 4)  # fmt: skip
    assert cost.tp_bytes_per_s == pytest.approx(1e8, rel=1e-6)
    assert (cost.b, cost.c) == (want.terms.b, want.terms.c)
    # the bytes matter: timings less 4-byte all-reduces are fitted (and weighted) otherwise
    assert abs(float32.terms.b / want.terms.b - 1) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_yarn_tables_are_rounded_once_to_the_compute_dtype(dtype):
    """YaRN's cos and sin tables in float32 or bfloat16 are transformers' float64 angles, cos
    and sin times its attention factor, rounded once to the compute dtype (scaling after the
    cast would round twice, a last bit off)."""
    from datapipe.shapes import ModelConfig
    from trainer.model.rope import Rope

    settings = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    want_inv, want_af = _transformers_rope(settings)
    cfg = ModelConfig(vocab_size=64, dim=64, n_heads=4, rope_theta=500.0,
                      rope_scaling=RopeScaling("yarn", 4.0, 32))  # fmt: skip
    pos = torch.arange(300)
    ang = pos.to(F64)[:, None] * want_inv[None, :]
    cos, sin = Rope(cfg).cos_sin(pos, dtype)
    assert torch.equal(cos, (ang.cos() * want_af).to(dtype))
    assert torch.equal(sin, (ang.sin() * want_af).to(dtype))
