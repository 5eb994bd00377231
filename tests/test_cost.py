"""Cost model: presets against the paper's per-layer table, shares, cost files, ByteScale Eq. 3."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.errors import ConfigError, InputError
from datapipe.plan import cost as C
from datapipe.shapes import MODEL_CONFIGS

# ByteScale's per-layer forward times (docs/ARCHITECTURE.md, "Cost model"): length -> (attention ms, MLP ms).
PAPER = {
    4096: (0.8, 0.9),
    8192: (1.8, 1.8),
    16384: (4.8, 3.6),
    32768: (14.1, 7.5),
    65536: (48.2, 15.1),
    131072: (175.5, 28.2),
}


def test_7b_layer_forward_matches_paper_shape() -> None:
    shape, dev = MODEL_CONFIGS["llama-7b"], C.DEVICES["h100"]
    ratios = {}
    for s, (pa, pm) in PAPER.items():
        attn, mlp = C.layer_forward_ms(shape, dev, s)
        ours, theirs = attn / mlp, pa / pm
        assert 0.5 <= ours / theirs <= 2.0, (s, ours, theirs)
        ratios[s] = ours
    # Attention overtakes the MLP near 8K: below at 4K, above at 16K, within 10% of equal at 8K.
    assert ratios[4096] < 1.0 < ratios[16384]
    assert abs(ratios[8192] - 1.0) < 0.1
    # Quadratic regime: attention grows ~3.6x per doubling by 128K (paper: 175.5 / 48.2).
    a64, _ = C.layer_forward_ms(shape, dev, 65536)
    a128, _ = C.layer_forward_ms(shape, dev, 131072)
    assert 3.0 < a128 / a64 < 4.0


def test_presets_shapes() -> None:
    d = MODEL_CONFIGS["debug"]
    assert (d.n_layers, d.dim, d.n_heads, d.n_kv_heads, d.vocab_size) == (2, 128, 4, 2, 258)
    assert C.preset("debug").name == "debug@cpu"
    for name in ("llama-7b", "llama-13b", "llama-70b"):
        m = C.preset(name)
        assert m.name == f"{name}@h100" and m.a > 0 and m.b > 0 and m.c > 0
    assert C.preset("llama-7b@cpu").b > C.preset("llama-7b").b  # slower device
    # K/V bytes come from KV heads: 70B has 8 KV heads of 128 dims, 80 layers, 2 bytes, K and V.
    assert C.preset("llama-70b").kv_bytes_per_token == 2 * 8 * 128 * 2 * 80
    with pytest.raises(ConfigError, match="unknown model preset 'gpt'"):
        C.preset("gpt")
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        C.preset("llama-7b@tpu")


def test_flops_coefficients_independent() -> None:
    # Reference arithmetic for llama-7b: per layer QKVO 4*h^2 MACs (MHA), MLP 3*h*ffn MACs.
    h, ffn, layers, vocab = 4096, 11008, 32, 32000
    dev = C.DEVICES["h100"]
    m = C.preset("llama-7b")
    lin_flops = 2 * (layers * (4 * h * h + 3 * h * ffn) + h * vocab)
    assert m.b == pytest.approx(3 * lin_flops / dev.matmul_flops, rel=1e-12)
    # Causal core: S^2/2 query-key pairs, QK^T and PV each 2*h FLOPs per pair, per layer.
    assert m.a == pytest.approx(3 * layers * 2 * h / dev.attn_flops, rel=1e-12)
    # The optimizer's step: LLaMA-7B's published 6,738,415,616 parameters at the device's rate;
    # none on the CPU preset, whose cost files keep their bytes and hashes
    assert dev.step_s_per_param > 0
    assert m.step == pytest.approx(6_738_415_616 * dev.step_s_per_param, rel=1e-12)
    assert C.preset("debug").step == 0.0 and "step" not in C.preset("debug").to_dict()


@given(
    s=st.integers(1, 4_000_000),
    k=st.integers(1, 4096),
)
@settings(deadline=None, max_examples=200)
def test_split_share_is_whole_cost_over_k(s: int, k: int) -> None:
    m = C.preset("llama-7b")
    h = Fraction(m.attn_n_half)
    assert h > 0  # the GPU preset charges short chunks their lower efficiency
    share = int(m.work_ns(np.array([s]), k)[0])
    # a member's attention is a*S^2/k at efficiency eff(S/k) = (S/k) / (S/k + h)
    chunk = Fraction(s, k)
    attn = Fraction(m.a) * s * s / k / (chunk / (chunk + h))
    ref = (attn + Fraction(m.b) * s / k) * 10**9
    assert abs(share - ref) <= Fraction(1, 2) + Fraction(1, 10**6) * ref
    if k > 1 and s >= 2 * k:
        # Costing a piece as a*(S/k)^2 would under-cost the member's attention k-fold.
        piece = m.a * (s / k) ** 2 * 1e9
        assert int(m.attn_ns(np.array([s]), k)[0]) >= k * piece * (1 - 1e-9)


def test_exposed_comm_and_offload() -> None:
    m = dataclasses.replace(C.preset("llama-7b"), overlap=1.0)
    z = np.zeros(1, dtype=np.int64)
    # Ring traffic hides under attention; only the excess shows.
    assert m.exposed_ns(np.array([100]), z, np.array([60]), z)[0] == 0
    assert m.exposed_ns(np.array([100]), z, np.array([160]), z)[0] == 60
    # Offload: one copy per direction, under forward (1/3) and backward (2/3) compute.
    assert m.exposed_ns(np.array([90]), np.array([210]), z, np.array([100]))[0] == 0
    assert m.exposed_ns(np.array([90]), np.array([210]), z, np.array([150]))[0] == 50
    # past the backward's 200 ns too: each direction shows its own excess, 150 + 50
    assert m.exposed_ns(np.array([90]), np.array([210]), z, np.array([250]))[0] == 200
    # Ring bytes: k-1 hops of the member's K/V, 3 passes, KV heads.
    assert m.ring_bytes(np.array([1000.0]), 4)[0] == 3 * 3 * 1000 * m.kv_bytes_per_token
    assert m.ring_bytes(np.array([1000.0]), 1)[0] == 0
    # Only `overlap` of the ring time can hide: with 0.75, a 400 ns ring under 1000 ns of
    # attention still shows 100 ns; under 200 ns of attention, 100 + (300 - 200).
    q = dataclasses.replace(m, overlap=0.75)
    assert q.exposed_ns(np.array([1000]), z, np.array([400]), z)[0] == 100
    assert q.exposed_ns(np.array([200]), z, np.array([400]), z)[0] == 200


def test_ring_time_latency_and_links() -> None:
    m = C.preset("llama-7b")  # 8 ranks per node, NVLink inside, InfiniBand between nodes
    n = 10_000.0
    for k in (2, 8, 9, 64):
        hops = m.num_layers * (3 * (k - 1) + 1)  # fwd k-1, bwd k-1 K/V + k dK/dV, per layer
        nbytes = 3 * (k - 1) * n * m.kv_bytes_per_token
        link = m.node_link_bytes_per_s if k <= 8 else m.link_bytes_per_s
        want = (hops * m.hop_latency_s + nbytes / link) * 1e9
        assert int(m.ring_ns(np.array([n]), k)[0]) == pytest.approx(want, abs=1)
        # a group placed across nodes pays the slower link whatever its size
        across = (hops * m.hop_latency_s + nbytes / m.link_bytes_per_s) * 1e9
        got = int(m.ring_ns(np.array([n]), k, np.array([True]))[0])
        assert got == pytest.approx(across, abs=1)
    assert int(m.ring_ns(np.array([n]), 1)[0]) == 0
    assert list(m.spans_nodes(np.array([1, 8, 9]))) == [False, False, True]
    # an island of exactly one node's ranks fits in it: no group of it is timed between nodes
    assert not m.for_island(8).spans_nodes(np.array([2, 4, 8])).any()
    assert m.for_island(9).spans_nodes(np.array([2, 4, 8])).all()
    one = dataclasses.replace(m, ranks_per_node=0)
    assert one.spans_nodes(np.array([2])).all()  # one link class: every ring uses link_bytes_per_s


def test_cost_file_roundtrip_and_hash(tmp_path) -> None:
    m = C.preset("llama-13b")
    p = tmp_path / "cost.json"
    p.write_text(m.to_json())
    back = C.load(p)
    assert back == m
    assert back.hash == hashlib.sha256(p.read_bytes()).hexdigest()
    # A different file (same numbers, other bytes) has another hash; decisions stay identical.
    q = tmp_path / "cost2.json"
    q.write_text(json.dumps(m.to_dict()))
    assert C.load(q).hash != back.hash and C.load(q) == m
    assert C.resolve("debug", str(p)) == m and C.resolve("debug", None) == C.preset("debug")


def test_cost_file_errors(tmp_path) -> None:
    p = tmp_path / "bad.json"
    d = C.preset("debug").to_dict()
    del d["b"]
    p.write_text(json.dumps(d))
    with pytest.raises(InputError, match=r"bad\.json: missing key\(s\) b"):
        C.load(p)
    d = C.preset("debug").to_dict()
    d["a"] = -1.0
    p.write_text(json.dumps(d))
    with pytest.raises(InputError, match="'a' must be a finite number >= 0"):
        C.load(p)
    p.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        C.load(p)
    with pytest.raises(InputError, match="cannot read cost file"):
        C.load(tmp_path / "missing.json")


@given(
    layers=st.integers(3, 96),
    cap=st.integers(1, 65536),
    j=st.integers(0, 96),
    s=st.integers(1, 10**8),
)
@settings(deadline=None, max_examples=200)
def test_eq3_capacity(layers: int, cap: int, j: int, s: int) -> None:
    j = min(j, layers)
    m = C.CostModel(1e-9, 1e-5, 1e-3, 1.0, 1e9, layers, 100.0, 1e9)
    c_eff = int(m.offload_capacity(cap, j))
    r = Fraction(j, layers)
    # Memory bound from Eq. 3 with Act linear: a rank holding n positions needs
    # (2 + (1-r)(l-2)) * n <= l * C.
    bound = lambda n: (2 + (1 - r) * (layers - 2)) * n <= layers * cap  # noqa: E731
    assert bound(c_eff) and not bound(c_eff + 1)
    if j == 0:
        assert c_eff == cap
    d = -(-s // c_eff)
    eq3 = math.ceil((2 + (1 - r) * (layers - 2)) * s / (layers * cap))
    # Our D is Eq. 3's rank count made integral: the fewest ranks whose largest share fits.
    assert bound(-(-s // d)) and (d == 1 or not bound(-(-s // (d - 1))))
    assert eq3 <= d


@given(s=st.integers(1, 10**7), k=st.integers(1, 512))
@settings(deadline=None, max_examples=200)
def test_max_offload_layers_hides_under_forward(s: int, k: int) -> None:
    m = C.preset("llama-7b")
    j = int(m.max_offload_layers(np.array([s]))[0])
    n = s / k
    fwd = (m.a * s * s + m.b * s) / k / 3

    def copy_time(jj: int) -> float:  # r = jj/l of the l - 2 layers Eq. 3 can move
        l_ = m.num_layers
        return jj / l_ * (l_ - 2) * m.act_bytes_per_token_layer * n / m.offload_bytes_per_s

    assert copy_time(j) <= fwd * (1 + 1e-9)
    if j < m.num_layers:
        assert copy_time(j + 1) > fwd * (1 - 1e-9)


def test_offload_bytes_are_a_share_of_the_l_minus_2_movable_layers() -> None:
    """Eq. 3 keeps two layers on the device whatever r is: r*(l-2)*Act per position moves, and
    nothing for l <= 2 (plain arithmetic, not the model's code)."""
    n = np.array([1000.0, 37.0, 0.0])
    r = np.array([1.0, 0.25, 0.5])
    for layers in (1, 2, 3, 8, 32):
        m = C.CostModel(1e-9, 1e-5, 1e-3, 1.0, 1e9, layers, 100.0, 2e9)
        want = [ri * max(layers - 2, 0) * 100.0 * ni for ri, ni in zip(r, n)]
        assert m.offload_bytes(n, r).tolist() == want
        assert m.offload_ns(n, r).tolist() == [round(w / 2e9 * 1e9) for w in want]


def test_max_offload_layers_counts_a_tie_as_hidden() -> None:
    """s = 65: 7 of 8 layers' copies, 7/8*6*2000*65/5e8 s, take exactly the forward's
    (2e-7*65^2 + 5e-5*65)/3 s (0.001365 s both); rounding must not drop j to 6."""
    m = C.CostModel(2e-7, 5e-5, 1e-4, 64.0, 1e9, 8, 2000.0, 5e8)
    copy = Fraction(7, 8) * 6 * Fraction(2000.0) * 65 / Fraction(5e8)
    fwd = (Fraction(2e-7) * 65 * 65 + Fraction(5e-5) * 65) / 3
    assert abs(copy - fwd) <= Fraction(1, 10**15) * fwd  # a tie, up to the inputs' float values
    assert int(m.max_offload_layers(np.array([65]))[0]) == 7
