"""Cost model of one rank's work in a step: what the HDP planner balances.

A sample of length S computed whole on one rank costs ``a*S^2/eff(S) + b*S`` seconds (forward +
backward, all layers: causal attention is quadratic, the linear layers are linear). Split zigzag over
a group of k ranks, each member computes ``a*S^2/k / eff(S/k) + b*S/k``: its queries still see up to
all S keys, in chunks of about S/k positions. ``eff(n) = n / (n + attn_n_half)`` is the attention
kernel's efficiency on a chunk of n positions (short chunks run below the long-sequence rate), so a
member's attention is ``a*S^2/k + a*attn_n_half*S``: splitting a sample over k ranks adds
``(k-1)*a*attn_n_half*S`` of attention work in total. Every micro-batch adds a fixed ``c``, and
``T*r(T)`` for the T positions one rank computes in it: a per-position rate that grows with the
micro-batch's size (on CPUs a larger micro-batch's activations outgrow the caches). r is the size
table: linear from 0 at T = 0 through calibrated points (``size_knots``, ``size_rates``), the last
rate beyond them; older files' ``d`` adds ``d*T^2`` (r(T) = d*T); both empty or 0 in the presets.
A step adds ``step`` around its micro-batches on every rank (the optimizer's apply, the gradient
reduction that did not hide, the fetch hand-off: 0 in the presets): the planner's decisions do not
depend on it (every rank pays it), a step's predicted time is the plan's makespan plus it.

A ring of k >= 2 members: per layer, each member makes ``comm_passes*(k-1) + 1`` hops (k-1 K/V hops
forward, k-1 backward, and k for the dK/dV accumulators, which travel home), and sends
``comm_passes*(k-1)`` times its K/V bytes (KV heads, not query heads). Its ring time is
``hops * hop_latency_s + bytes / link``, where the link is ``node_link_bytes_per_s`` for a group
inside one node (``ranks_per_node`` > 0 and the group's ranks in one node) and
``link_bytes_per_s`` otherwise. A fraction ``overlap`` of the ring time can hide under the member's
attention compute (each hop is posted before the previous block is computed); the rest is always
exposed, and so is whatever of the hidden part the attention does not cover:
``exposed = (1 - overlap)*ring + max(overlap*ring - attention, 0)``. Offloading a fraction r of a
micro-batch's layers moves their saved activations to host during the forward and back during the
backward; each direction hides under the compute of its own pass and only the excess is exposed.

Decisions use integer nanoseconds (int64). Float arithmetic is plain IEEE float64 on numpy arrays
(no fast-math, no fused multiply-add), rounded once per term, so every rank computes the same integers.

A file timed at tensor-parallel degree ``tp`` > 1 (``mixlen calibrate --tp``) holds a TP group's
times, one HDP rank: ``b`` and ``c`` include its all-reduces (4 per layer of ``dim`` values per
position, ``tp_latency_s`` each plus bytes / ``tp_bytes_per_s``), recorded beside them.

The cost file schema (``--cost cost.json``, ``"schema": "mixlen-cost/2"``) is in docs/PLAN.md.
``mixlen calibrate`` writes /2 files; presets (:func:`preset`) build the same object from a model
shape and a device's rates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

from datapipe.errors import ConfigError, InputError, MixlenError
from datapipe.files import CONFIG_FILE_LIMIT, read_bounded_bytes
from datapipe.plan.costcheck import check_terms
from datapipe.shapes import MODEL_CONFIGS, ModelConfig

SCHEMA = "mixlen-cost/2"
SCHEMA_V1 = "mixlen-cost/1"  # still read (defaults reproduce its costs)
NS = 1e9  # integer cost unit: nanoseconds


@dataclass(frozen=True)
class DeviceRates:
    """Achieved rates of one rank: matmul and attention-kernel FLOP/s, links, per-micro-batch
    overhead, and the ring terms (see the module docstring)."""

    name: str
    matmul_flops: float
    attn_flops: float
    link_bytes_per_s: float
    offload_bytes_per_s: float
    microbatch_overhead_s: float
    dtype_bytes: int = 2  # compute dtype of a rank (bf16 on GPUs, float32 on CPUs)
    bwd_factor: float = 2.0  # backward = 2x forward
    hop_latency_s: float = 0.0
    attn_n_half: float = 0.0
    overlap: float = 1.0
    ranks_per_node: int = 0
    node_link_bytes_per_s: float = 0.0
    step_s_per_param: float = 0.0  # the optimizer's step (the cost model's `step`) a parameter


DEVICES: dict[str, DeviceRates] = {
    # Measured on one H200 (the H100's SMs and clocks; `benchmarks/fit_device_rates.py` on the cost
    # file of `mixlen calibrate --model llama3.2-1b --device cuda`, torch 2.11, eager bf16 blocks,
    # benchmarks/RESULTS.md "One GPU"): GEMMs at 4.6e14 FLOP/s (46% of 989 TFLOP/s dense bf16)
    # and torch's varlen flash kernel at 2.4e14 (its rate assumed to halve on chunks of 512
    # positions, as flash kernels' published throughput does at a few hundred: one rank's
    # timings cannot tell that term from the GEMMs'); 35 ms a micro-batch (the 1B's eager kernel
    # launches: a 1,024-token micro-batch takes 59 ms for 17 ms of GEMMs); the optimizer's step
    # at 1.5e-11 s a parameter (fused AdamW, float32 master beside bf16 weights: 18 ms for
    # 1.24e9 parameters). Assumed, not measured (one GPU): 8 GPUs
    # per node on NVLink 4 (450 GB/s per direction, ~2/3 achieved by point-to-point copies:
    # 3e11), 400 Gbit/s InfiniBand per GPU between nodes (5e10); 20 us per ring hop (NCCL
    # send/recv latency plus launch); 90% of a hop hides under the attention (NCCL on its own
    # stream, sharing the SMs); PCIe Gen5 ~32 GB/s effective per direction.
    "h100": DeviceRates(
        "h100",
        4.6e14,
        2.4e14,
        5.0e10,
        3.2e10,
        3.5e-2,
        hop_latency_s=2e-5,
        attn_n_half=512.0,
        overlap=0.9,
        ranks_per_node=8,
        node_link_bytes_per_s=3.0e11,
        step_s_per_param=1.5e-11,
    ),
    # The development box's cores (2 cores, torch 2.x CPU kernels, float32), one rank per core,
    # gloo over loopback: round figures of the rates `mixlen calibrate --model debug` measured
    # there (FLOP rates derived from the fitted a and b); the ring terms stay neutral (no hop
    # latency, full chunk efficiency, full overlap): calibrate a file with --nproc K for them
    # (benchmarks/RESULTS.md, "Calibration residuals").
    "cpu": DeviceRates("cpu", 5.0e10, 2.5e10, 1.25e9, 5.0e9, 1e-3, dtype_bytes=4),
}

DEFAULT_DEVICE = {"debug": "cpu"}


MAX_NS = float(1 << 62)  # an estimate beyond this (146 years) would overflow the int64 sums


def _ns(seconds_ns: np.ndarray) -> np.ndarray:
    """Float nanoseconds as int64, refusing what int64 sums of them could not hold."""
    x = np.asarray(seconds_ns, dtype=np.float64)
    if x.size and not float(np.max(x)) < MAX_NS:
        raise MixlenError(
            f"the cost model estimates {float(np.max(x)) / 1e9:.3g} s for one piece of work, "
            "beyond what the planner's int64 nanoseconds hold: the samples or micro-batches are "
            "too long for this cost model (lower the capacity or max_context, or cap sample "
            "length at preprocess time with --max-len)"
        )
    return np.rint(x).astype(np.int64)


def size_rate(knots: tuple[float, ...], rates: tuple[float, ...], t: np.ndarray) -> np.ndarray:
    """Seconds per position of a micro-batch of t positions: linear from 0 at t = 0 through
    (knots, rates), the last rate beyond the last knot; 0 without knots."""
    t = np.asarray(t, dtype=np.float64)
    if not knots:
        return np.zeros_like(t)
    return np.interp(t, (0.0, *knots), (0.0, *rates))


@dataclass(frozen=True)
class CostModel:
    """Coefficients of the per-rank time model (see module docstring); build with preset/load."""

    a: float
    b: float
    c: float
    kv_bytes_per_token: float
    link_bytes_per_s: float
    num_layers: int
    act_bytes_per_token_layer: float
    offload_bytes_per_s: float
    comm_passes: float = 3.0
    hop_latency_s: float = 0.0
    attn_n_half: float = 0.0
    overlap: float = 1.0
    ranks_per_node: int = 0
    node_link_bytes_per_s: float = 0.0
    d: float = 0.0
    size_knots: tuple[float, ...] = ()
    size_rates: tuple[float, ...] = ()
    step: float = 0.0
    tp: int = 1  # timed at this TP degree: b and c include the TP all-reduces (docstring)
    tp_latency_s: float = 0.0
    tp_bytes_per_s: float = 0.0
    name: str = "custom"
    file_hash: str = dataclasses.field(default="", compare=False, repr=False)
    # ranks of the island being planned (for_island; 0: not known), not part of the file
    island_ranks: int = dataclasses.field(default=0, compare=False, repr=False)

    def __post_init__(self) -> None:
        for key, value in check_terms(self).items():  # the size table as tuples of floats
            object.__setattr__(self, key, value)

    # --- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        del d["file_hash"], d["island_ranks"]
        d["tp"] = d["tp"] if d["tp"] > 1 else 0  # dropped below, with its terms
        for key in (
            "d",
            "size_knots",
            "size_rates",
            "step",
            "tp",
            "tp_latency_s",
            "tp_bytes_per_s",
        ):
            if not d[key]:
                del d[key]  # files without the term keep their bytes and hashes
            elif isinstance(d[key], tuple):
                d[key] = list(d[key])
        d["schema"] = SCHEMA
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2) + "\n"

    @property
    def hash(self) -> str:
        """sha256 (hex) of the canonical JSON; load() records the file's own bytes' hash instead."""
        return self.file_hash or hashlib.sha256(self.to_json().encode()).hexdigest()

    def with_offload_bandwidth(self, bytes_per_s: float) -> CostModel:
        return dataclasses.replace(self, offload_bytes_per_s=float(bytes_per_s))

    # --- integer costs -------------------------------------------------------------------------
    @property
    def c_ns(self) -> int:
        return int(round(self.c * NS))

    @property
    def step_ns(self) -> int:
        """The work around a step's micro-batches on every rank, int ns."""
        return int(round(self.step * NS))

    def _attn_s(self, s: np.ndarray, k: np.ndarray) -> np.ndarray:
        """a*S^2/k / eff(S/k) = a*S*(S + n_half*k)/k, float seconds (a*S*S/k when n_half = 0)."""
        return self.a * s * (s + self.attn_n_half * k) / k

    def work_ns(self, lengths: np.ndarray, k: np.ndarray | int = 1) -> np.ndarray:
        """Compute share of one member: attention (with its chunk efficiency) + b*S/k, int64 ns
        (no c, no exposed comm)."""
        s = np.asarray(lengths, dtype=np.float64)
        k = np.asarray(k, dtype=np.float64)
        return _ns((self.a * s * (s + self.attn_n_half * k) + self.b * s) / k * NS)

    def attn_ns(self, lengths: np.ndarray, k: np.ndarray | int = 1) -> np.ndarray:
        s = np.asarray(lengths, dtype=np.float64)
        return _ns(self._attn_s(s, np.asarray(k, dtype=np.float64)) * NS)

    def linear_ns(self, lengths: np.ndarray, k: np.ndarray | int = 1) -> np.ndarray:
        s = np.asarray(lengths, dtype=np.float64)
        return _ns(self.b * s / np.asarray(k, dtype=np.float64) * NS)

    def size_ns(self, member_tokens: np.ndarray) -> np.ndarray:
        """d*T^2 + T*r(T) (r: size_rate) of micro-batches whose one member computes T positions,
        int64 ns."""
        t = np.asarray(member_tokens, dtype=np.float64)
        if not self.size_knots:
            return _ns(self.d * t * t * NS)
        return _ns((self.d * t * t + t * size_rate(self.size_knots, self.size_rates, t)) * NS)

    def size_table_ns(self) -> tuple[np.ndarray, np.ndarray]:
        """(knots with 0 first, rates in ns per position with 0 first): the size table for the
        numba kernels (two zeros without a table)."""
        x = np.array((0.0, *self.size_knots), dtype=np.float64)
        return x, np.array((0.0, *self.size_rates), dtype=np.float64) * NS

    def ring_bytes(self, member_tokens: np.ndarray, k: np.ndarray | int) -> np.ndarray:
        """Bytes one member sends around a ring of k in one step (0 for k = 1)."""
        n = np.asarray(member_tokens, dtype=np.float64)
        hops = np.maximum(np.asarray(k, dtype=np.float64) - 1.0, 0.0)
        return self.comm_passes * hops * n * self.kv_bytes_per_token

    def ring_hops(self, k: np.ndarray | int) -> np.ndarray:
        """Hops one member makes in a ring of k over all layers: num_layers*(comm_passes*(k-1)+1)
        (0 for k = 1)."""
        k = np.asarray(k, dtype=np.float64)
        return np.where(k > 1, self.num_layers * (self.comm_passes * (k - 1.0) + 1.0), 0.0)

    def for_island(self, num_ranks: int) -> CostModel:
        """This model as the planners of an island of `num_ranks` use it (same hash)."""
        return dataclasses.replace(self, island_ranks=int(num_ranks), file_hash=self.hash)

    def spans_nodes(self, k: np.ndarray | int) -> np.ndarray:
        """Whether a group of k ranks is timed on the link between nodes before it is placed:
        always with one link class (ranks_per_node = 0); never in an island that fits in one node;
        always in a larger island (the schedulers do not keep small groups inside a node, so a
        group is re-timed on the node link once placed inside one: datapipe.plan.common); and,
        with the island unknown, when the group cannot fit in one node."""
        k = np.asarray(k, dtype=np.int64)
        rpn, n = self.ranks_per_node, self.island_ranks
        if not rpn:
            return np.ones(k.shape, dtype=bool)
        if n:
            return np.full(k.shape, n > rpn, dtype=bool)
        return k > rpn

    def ring_ns(
        self, member_tokens: np.ndarray, k: np.ndarray | int, spans: np.ndarray | None = None
    ) -> np.ndarray:
        """Ring time of one member (int64 ns): hops * hop_latency_s + bytes / link, the link
        between nodes where `spans` (default: spans_nodes(k)), else the node link."""
        if spans is None:
            spans = self.spans_nodes(k)
        bw = np.where(spans, self.link_bytes_per_s, self.node_link_bytes_per_s or 1.0)
        t = self.ring_bytes(member_tokens, k) / bw + self.ring_hops(k) * self.hop_latency_s
        return _ns(t * NS)

    def offload_bytes(self, member_tokens: np.ndarray, ratio: np.ndarray | float) -> np.ndarray:
        """Bytes moved to host (and the same back) at offload ratio r: r*(l-2)*Act per position.

        Eq. 3 keeps two layers' activations on the device whatever r is (the block computing and
        the one whose copy is in transit), so r is a fraction of the other l-2; nothing moves for
        l <= 2."""
        n = np.asarray(member_tokens, dtype=np.float64)
        r = np.asarray(ratio, dtype=np.float64)
        return r * max(self.num_layers - 2, 0) * self.act_bytes_per_token_layer * n

    def offload_ns(self, member_tokens: np.ndarray, ratio: np.ndarray | float) -> np.ndarray:
        b = self.offload_bytes(member_tokens, ratio)
        return _ns(b / self.offload_bytes_per_s * NS)

    def ring_hideable_ns(self, ring_ns: np.ndarray) -> np.ndarray:
        """The part of ring time that may overlap compute, overlap * ring (int64 ns)."""
        return np.rint(np.asarray(ring_ns, dtype=np.float64) * self.overlap).astype(np.int64)

    def ring_exposed_ns(self, attn_ns: np.ndarray, ring_ns: np.ndarray) -> np.ndarray:
        """Ring time not hidden under attention (int64 ns): the part that cannot overlap,
        (1 - overlap) * ring, plus what of the rest exceeds the attention compute."""
        ring = np.asarray(ring_ns, dtype=np.int64)
        hideable = self.ring_hideable_ns(ring)
        return ring - hideable + np.maximum(hideable - np.asarray(attn_ns, dtype=np.int64), 0)

    def exposed_ns(
        self,
        attn_ns: np.ndarray,
        linear_ns: np.ndarray,
        ring_ns: np.ndarray,
        offload_ns: np.ndarray,
    ) -> np.ndarray:
        """Communication and offload time not hidden under compute (int64 ns).

        Ring traffic hides (up to `overlap` of it) under attention compute; offload's host copies
        (one per direction) hide under the forward (1/3 of compute) and the backward (2/3).
        """
        attn = np.asarray(attn_ns, dtype=np.int64)
        comp = attn + np.asarray(linear_ns, dtype=np.int64)
        off = np.asarray(offload_ns, dtype=np.int64)
        fwd = comp // 3
        return (
            self.ring_exposed_ns(attn, ring_ns)
            + np.maximum(off - fwd, 0)
            + np.maximum(off - (comp - fwd), 0)
        )

    # --- ByteScale Eq. 3 ------------------------------------------------------------------------
    def offload_capacity(self, capacity: int, offload_layers: np.ndarray | int) -> np.ndarray:
        """C_eff(r), r = j/l: positions a rank holds when j of its l layers offload their activations.

        From D(s) = ceil((2*Act(s) + (1-r)(l-2)*Act(s)) / (l*Act(C))) with Act linear in s:
        a rank holds l*C / (2 + (1-r)(l-2)) positions (C at r = 0, l*C/2 at r = 1).
        """
        l_ = self.num_layers
        j = np.asarray(offload_layers, dtype=np.int64)
        if l_ <= 2:
            return np.full(j.shape, capacity, dtype=np.int64)
        return (l_ * l_ * int(capacity)) // (2 * l_ + (l_ - j) * (l_ - 2))

    def max_offload_layers(self, lengths: np.ndarray) -> np.ndarray:
        """Largest j (of l layers, r = j/l) whose offload hides under the forward compute.

        For a member of any group size k holding S/k positions, the D2H bytes
        (j/l)*(l-2)*act*S/k (`offload_bytes`) and the forward time (a*S^2 + b*S)/(3k) scale alike
        in k, so the bound depends on S only. With l <= 2 nothing moves and every j hides. A copy
        exactly as long as the forward hides; so that float rounding of the ratio cannot decide a
        tie, the ratio is taken 1e-9 larger (same arithmetic on every rank).
        """
        s = np.asarray(lengths, dtype=np.float64)
        l_ = self.num_layers
        # seconds per position per unit of j
        per_layer_s = (
            max(l_ - 2, 0) / l_ * self.act_bytes_per_token_layer / self.offload_bytes_per_s
        )
        fwd_per_pos = (self.a * s + self.b) / 3.0
        with np.errstate(divide="ignore", invalid="ignore"):
            j = np.floor(fwd_per_pos / per_layer_s * (1.0 + 1e-9))
        j = np.where(np.isfinite(j), j, l_)
        return np.clip(j, 0, l_).astype(np.int64)


def build_cost_model(
    name: str, shape: ModelConfig, device: DeviceRates, dtype_bytes: int | None = None
) -> CostModel:
    """Cost model of the network `shape` (named `name`) on a device's achieved rates (FLOPs over
    rate); byte sizes use `dtype_bytes` (default: the device's compute dtype)."""
    nbytes = device.dtype_bytes if dtype_bytes is None else int(dtype_bytes)
    passes = 1.0 + device.bwd_factor
    lin_per_tok = (
        shape.n_layers * (shape.attn_proj_flops_per_token() + shape.mlp_flops_per_token())
        + 2.0 * shape.dim * shape.vocab_size
    )
    return CostModel(
        a=passes * shape.n_layers * shape.attn_core_flops_per_s2() / device.attn_flops,
        b=passes * lin_per_tok / device.matmul_flops,
        c=device.microbatch_overhead_s,
        kv_bytes_per_token=shape.kv_bytes_per_token(nbytes),
        link_bytes_per_s=device.link_bytes_per_s,
        num_layers=shape.n_layers,
        act_bytes_per_token_layer=shape.act_bytes_per_token_layer(nbytes),
        offload_bytes_per_s=device.offload_bytes_per_s,
        comm_passes=3.0,
        hop_latency_s=device.hop_latency_s,
        attn_n_half=device.attn_n_half,
        overlap=device.overlap,
        ranks_per_node=device.ranks_per_node,
        node_link_bytes_per_s=device.node_link_bytes_per_s,
        step=shape.num_params() * device.step_s_per_param,
        name=f"{name}@{device.name}",
    )


def layer_forward_ms(shape: ModelConfig, device: DeviceRates, length: int) -> tuple[float, float]:
    """One layer's forward time (ms) at one length, a whole sample: (attention incl. projections,
    MLP); the attention core runs at the kernel's efficiency on that length."""
    s = float(length)
    attn = shape.attn_proj_flops_per_token() * s / device.matmul_flops
    attn += shape.attn_core_flops_per_s2() * s * (s + device.attn_n_half) / device.attn_flops
    mlp = shape.mlp_flops_per_token() * s / device.matmul_flops
    return attn * 1e3, mlp * 1e3


def preset(name: str) -> CostModel:
    """Preset by name: a model of datapipe.shapes (debug, small, llama-7b, ...), optionally
    '@device'."""
    model, _, dev = name.partition("@")
    if model not in MODEL_CONFIGS:
        raise ConfigError(
            f"unknown model preset '{model}' (known: {', '.join(MODEL_CONFIGS)}; or --cost FILE)"
        )
    dev = dev or DEFAULT_DEVICE.get(model, "h100")
    if dev not in DEVICES:
        raise ConfigError(f"unknown device '{dev}' in '{name}' (known: {', '.join(DEVICES)})")
    return build_cost_model(model, MODEL_CONFIGS[model], DEVICES[dev])


_REQUIRED_V1 = ("a", "b", "c", "kv_bytes_per_token", "link_bytes_per_s", "num_layers")
_REQUIRED_V1 += ("act_bytes_per_token_layer", "offload_bytes_per_s")
_REQUIRED_V2 = ("attn_n_half", "hop_latency_s", "overlap")
_OPTIONAL = ("comm_passes", "ranks_per_node", "node_link_bytes_per_s", "d", "size_knots")
_OPTIONAL += ("size_rates", "step", "tp", "tp_latency_s", "tp_bytes_per_s")  # default if absent


def from_dict(d: dict, source: str = "cost model") -> CostModel:
    """Validate a cost dict (schema above) into a CostModel; errors name the key and source.
    A /1 dict (or one without 'schema' and without any /2 key) gets the /2 terms' neutral values,
    which reproduce its costs exactly."""
    if not isinstance(d, dict):
        raise InputError(f"{source}: expected a JSON object")
    schema = d.get("schema")
    if schema is None:
        schema = SCHEMA if any(k in d for k in _REQUIRED_V2) else SCHEMA_V1
    if schema not in (SCHEMA, SCHEMA_V1):
        raise InputError(
            f"{source}: 'schema' is {schema!r}, expected {SCHEMA!r} (or the older {SCHEMA_V1!r})"
        )
    if schema == SCHEMA_V1:
        newer = [k for k in _REQUIRED_V2 if k in d]
        if newer:
            raise InputError(
                f"{source}: key(s) {', '.join(newer)} need 'schema' {SCHEMA!r}, not {SCHEMA_V1!r}"
            )
        required = _REQUIRED_V1
    else:
        required = _REQUIRED_V1 + _REQUIRED_V2
    missing = [k for k in required if k not in d]
    if missing:
        raise InputError(f"{source}: missing key(s) {', '.join(missing)}")
    kwargs = {k: d[k] for k in required}
    kwargs.update({k: d[k] for k in _OPTIONAL if k in d})
    kwargs["name"] = str(d.get("name", os.path.basename(source)))
    for key in ("num_layers", "ranks_per_node", "tp"):
        v = kwargs.get(key)
        if isinstance(v, float) and v.is_integer():
            kwargs[key] = int(v)
    try:
        model = CostModel(**kwargs)
    except ConfigError as exc:
        raise InputError(f"{source}: {exc}") from None
    return model  # extra keys (e.g. calibration metadata) are allowed and ignored


def load(path: str | os.PathLike) -> CostModel:
    """Read a cost file; the model's hash is the sha256 of the file's bytes."""
    try:
        raw = read_bounded_bytes(path, CONFIG_FILE_LIMIT, "a cost file")
    except FileNotFoundError:
        raise InputError(f"cannot read cost file {path}: No such file or directory") from None
    try:
        d = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None
    model = from_dict(d, str(path))
    return dataclasses.replace(model, file_hash=hashlib.sha256(raw).hexdigest())


def resolve(model: str | None, cost_file: str | None) -> CostModel:
    """The CLI's choice: --cost FILE wins over --model NAME (default llama-7b)."""
    if cost_file:
        return load(cost_file)
    return preset(model or "llama-7b")
