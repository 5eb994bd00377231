"""benchmarks/fit_device_rates.py: a device preset's rates recovered from calibration timings that
known rates made (the planner's own arithmetic written out here, not the script's)."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from conftest import ROOT

from datapipe.plan.cost import DEVICES, build_cost_model
from datapipe.shapes import get_config

sys.path.insert(0, str(ROOT / "benchmarks"))

import fit_device_rates  # noqa: E402


def _seconds(shape, rates, lengths: list[int]) -> float:
    """One micro-batch by hand: c + 3 x (linear FLOPs a position x T over the GEMM rate + the
    causal core's FLOPs, S x (S + n_half) pairs a sample, over the attention rate)."""
    lin = shape.n_layers * (shape.attn_proj_flops_per_token() + shape.mlp_flops_per_token())
    lin += 2.0 * shape.dim * shape.vocab_size
    core = shape.n_layers * shape.attn_core_flops_per_s2()
    pairs = sum(s * (s + rates.attn_n_half) for s in lengths)
    passes = 1.0 + rates.bwd_factor
    t = sum(lengths)
    return rates.microbatch_overhead_s + passes * (
        lin * t / rates.matmul_flops + core * pairs / rates.attn_flops
    )


def test_rates_come_back_from_the_timings_they_made() -> None:
    shape = get_config("llama3.2-1b")
    truth = dataclasses.replace(
        DEVICES["h100"], matmul_flops=3.1e14, attn_flops=1.7e14, microbatch_overhead_s=0.02,
        attn_n_half=512.0,
    )  # fmt: skip
    cases = [[1024], [4096], [8192], [16384], [32768], [1024] * 8, [4096] * 4, [2048] * 16]
    timings = [
        {"kind": "local", "k": 1, "lengths": c, "seconds": _seconds(shape, truth, c)} for c in cases
    ]
    timings += [{"kind": "step", "k": 1, "lengths": [1024], "seconds": s} for s in (0.02, 0.03)]
    base = dataclasses.replace(DEVICES["h100"], attn_n_half=512.0)  # kept: not identifiable
    got, rel = fit_device_rates.fit({"timings": timings}, shape, base)
    assert abs(rel).max() < 1e-9
    assert got.matmul_flops == pytest.approx(truth.matmul_flops, rel=1e-9)
    assert got.attn_flops == pytest.approx(truth.attn_flops, rel=1e-9)
    assert got.microbatch_overhead_s == pytest.approx(0.02, rel=1e-9)
    assert got.attn_n_half == 512.0
    assert got.step_s_per_param == pytest.approx(0.025 / 1_235_814_400, rel=1e-12)
    # what the planner makes of the fitted rates: the truth's own costs
    a, b = build_cost_model("x", shape, got), build_cost_model("x", shape, truth)
    assert (a.a, a.b, a.c) == pytest.approx((b.a, b.b, b.c), rel=1e-9)
