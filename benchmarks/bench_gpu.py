"""One GPU: mixlen's long-context path measured beside torch's own ceilings and a plain-torch
reference loop.

    python benchmarks/bench_gpu.py --out DIR             # a CUDA machine (benchmarks/gpu_run.sh)
    python benchmarks/bench_gpu.py --dry-run --out DIR   # the CPU, tiny sizes (tests/test_bench_gpu.py)

Parts (`--parts`, in this order, most wanted first; each case of a part records its figures or
its error and the next case runs; a part that no longer fits the budget is skipped):

- `check`: attention forward and backward on the device's kernels against the `math` reference
  in float64 (packed documents, GQA; float32 and bfloat16), and ring blocks through 4 threaded
  ranks: ||out - ref|| / ||ref|| per tensor.
- `attention`: forward + backward of packed documents of the demo corpus's lengths
  (benchmarks/stdlib_lengths.npy) and of one whole document, at 8K, 32K and 128K tokens: time,
  achieved TFLOP/s (causal pairs only), peak memory, beside torch SDPA's flash kernel on one
  document of the same length (the ceiling).
- `calibrate`: `mixlen calibrate --device cuda` of the model's shape (the cost file the `train`
  part plans with; without it, the h100 preset).
- `train`: the real executor (one rank, bf16 weights, fp32 master, fused AdamW) on the
  Llama-3.2-1B shape at 8K and 32K tokens a step, packed documents and one document:
  tokens/s, MFU by TorchTitan's formula (989 TFLOP/s), peak memory, planned vs measured step
  time, host synchronisations per step (torch.cuda.set_sync_debug_mode).
- `torchtitan`: TorchTitan 0.2.2's own trainer on the same shape and document lengths
  (benchmarks/torchtitan_bench.py, a process per step size, 32K first; skipped when it is not
  installed).
- `longest`: the longest single document one GPU trains (no checkpointing, then full activation
  checkpointing), doubling until out of memory or out of budget.
- `compiled`: `[train] compile = true` (each block and the loss's chunks compiled) at the largest
  and the smallest step size, packed, and the largest as one document, then the largest packed
  with the loss eager.
- `ring`: 4 threaded ranks on one GPU: a document split over the ring against whole-document
  attention, and the ring's time beside the same document on one rank.
- `checkpoint`: one document of the largest step size (32K) with no, selective and full
  activation checkpointing: step time, tokens/s, MFU and peak memory side by side.
- `reference`: the plain-torch loop of benchmarks/gpu_reference.py (compiled blocks, torch's
  varlen kernel, whole float32 logits) on the same batches (the stand-in where TorchTitan is
  not installed).
- `syncs`: the host synchronisations of one step of the largest size, packed, as one micro-batch
  and as four: how many, and the source lines that make them (torch.cuda.set_sync_debug_mode).
- `profile`: one step of the smallest size packed, of the largest as one document, and of the
  largest packed with compiled blocks, under torch.profiler: the operators with the most device
  time, and the step's wall time beside the device's busy time.
- `losschunk`: the largest step size, packed, with the loss's default chunk of tokens (its
  float32 logits in 1 GiB) beside chunks of 1/16 and 1/4 of the step: each chunk adds its
  share of dL/dW into a float32 [vocabulary, dim] buffer, so fewer chunks move fewer bytes.
- `gap`: where a compiled mixlen step's device time goes beside the reference loop's, kernel by
  kind (matmuls, attention, inductor's fused kernels, aten's elementwise and reductions, the
  optimizer, copies, ...), one step of the largest size packed each under torch.profiler: the
  rows that differ are what is left between them.

Writes DIR/bench_gpu.json and DIR/bench_gpu.md after every part (the tables, also printed last)
and DIR/cost-gpu.json (calibrate); TorchTitan's work folders and logs go to the temp directory.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PEAK_TFLOPS = 989.0  # H100/H200 dense bfloat16, TorchTitan's MFU denominator
PARTS = (
    "check", "attention", "calibrate", "train", "torchtitan", "longest", "compiled", "ring",
    "checkpoint", "reference", "syncs", "profile", "losschunk", "gap",
)  # fmt: skip
# seconds a part needs left in the budget to start on the GPU (a case inside checks again)
PART_MIN_S = {
    "check": 10, "attention": 20, "calibrate": 30, "train": 40, "torchtitan": 100, "longest": 30,
    "compiled": 90, "ring": 20, "checkpoint": 45, "reference": 90, "syncs": 20, "profile": 45,
    "losschunk": 30, "gap": 90,
}  # fmt: skip
# seconds a case needs left to start (compiling ones more: inductor's first compile of a shape)
CASE_MIN_S = {"compiled": 60.0, "reference": 60.0, "gap": 45.0}
CASE_MIN_DEFAULT_S = 15.0


@dataclass(frozen=True)
class Sizes:
    """What a run measures: the GPU's sizes, or the dry run's tiny ones on the CPU."""

    device: str = "cuda"
    dtype: str = "bfloat16"
    heads: tuple[int, int, int] = (32, 8, 64)  # query heads, KV heads, head dim (Llama 3.2 1B)
    attn_tokens: tuple[int, ...] = (8192, 32768, 131072)
    check_tokens: int = 4096
    check_max_doc: int = 2048
    model: str = "llama3.2-1b"
    model_overrides: dict = field(default_factory=dict)
    step_tokens: tuple[int, ...] = (8192, 32768)
    ring_tokens: int = 32768
    longest_start: int = 16384
    longest_cap: int = 1 << 20  # never probe past this
    memory_cap: int | None = None  # dry run: a probe "runs out of memory" past this many tokens
    compile_backend: str | None = "inductor"
    calibrate_args: tuple[str, ...] = (
        "--lengths", "1024,4096,8192,16384,32768", "--packs", "8x1024,4x4096,16x2048",
        "--repeats", "2", "--min-seconds", "0",
    )  # fmt: skip
    warmup: int = 2
    iters: int = 5
    step_iters: int = 3  # timed training steps a case (after its first and one warm-up)
    budget_scale: float = 1.0  # x PART_MIN_S and CASE_MIN_S (the dry run: 0, everything runs)
    length_divisor: int = 1  # the dry run's documents: the corpus's lengths / this


DRY = Sizes(
    device="cpu",
    dtype="float32",
    heads=(4, 2, 16),
    attn_tokens=(256, 512, 1024),
    check_tokens=192,
    check_max_doc=96,
    model="debug",
    step_tokens=(256, 512),
    ring_tokens=256,
    longest_start=256,
    longest_cap=4096,
    memory_cap=1024,
    compile_backend="eager",
    calibrate_args=(
        "--lengths",
        "64,128,256",
        "--packs",
        "4x64,2x128",
        "--repeats",
        "1",
        "--min-seconds",
        "0",
    ),  # fmt: skip
    warmup=1,
    iters=1,
    step_iters=1,
    budget_scale=0.0,
    length_divisor=64,
)


class Bench:
    """Shared state of one run: sizes, device, budget, results."""

    def __init__(self, sizes: Sizes, out: Path, budget_s: float) -> None:
        import torch

        self.sizes = sizes
        self.out = out
        self.dev = torch.device(sizes.device)
        self.dtype = getattr(torch, sizes.dtype)
        self.deadline = time.perf_counter() + budget_s
        self.results: dict[str, Any] = {"sizes": asdict(sizes), "parts": {}}
        self.part = ""  # the part running (run() sets it): its rows are saved after each case
        self.cost_path: Path | None = None
        self.batches: dict[tuple[int, str], list[int]] = {}

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def free(self) -> None:
        """What a finished case left behind: collected, and the allocator's cache emptied."""
        import torch

        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    def case(self, rows: list[dict], head: dict, fn: Callable[[], dict]) -> bool:
        """Append head with fn()'s figures, or with the error fn raised (the part goes on), or
        "skipped: budget" when too little of the budget is left; True if measured."""
        need = CASE_MIN_S.get(self.part, CASE_MIN_DEFAULT_S) * self.sizes.budget_scale
        if self.left() < need:
            rows.append({**head, "result": "skipped: budget"})
            return False
        try:
            rows.append({**head, **fn()})
            return True
        except Exception as exc:  # out of memory, a kernel's refusal: this case's row says so
            rows.append({**head, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print(f"bench_gpu: {head}: {traceback.format_exc()}", flush=True)
            return False
        finally:
            self.free()
            if self.part:  # a run killed in its next case keeps this one
                self.results["parts"][self.part] = {"rows": rows, "running": True}
                self.save()

    def save(self) -> None:
        """bench_gpu.json and bench_gpu.md as they stand."""
        (self.out / "bench_gpu.json").write_text(json.dumps(self.results, indent=1, default=str))
        (self.out / "bench_gpu.md").write_text(render(self.results))

    def sync(self) -> None:
        import torch

        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def timed(
        self, fn: Callable[[], Any], warmup: int | None = None, iters: int | None = None
    ) -> float:  # noqa: E501
        """Median seconds of fn() after warm-up (device-synchronised)."""
        for _ in range(self.sizes.warmup if warmup is None else warmup):
            fn()
        self.sync()
        times = []
        for _ in range(self.sizes.iters if iters is None else iters):
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    def peak(self, fn: Callable[[], Any]) -> int | None:
        """Peak device bytes allocated while fn() runs, above what was allocated before."""
        import torch

        if self.dev.type != "cuda":
            fn()
            return None
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.dev)
        base = torch.cuda.memory_allocated(self.dev)
        fn()
        self.sync()
        return int(torch.cuda.max_memory_allocated(self.dev) - base)

    def shape(self) -> Any:
        from datapipe.shapes import get_config

        return get_config(self.sizes.model, **self.sizes.model_overrides)

    def packed(self, tokens: int, seed: int = 0) -> list[int]:
        """Document lengths of the demo corpus (benchmarks/stdlib_lengths.npy) drawn until they
        fill `tokens`, the last cut to fit."""
        pool = np.load(ROOT / "benchmarks" / "stdlib_lengths.npy") // self.sizes.length_divisor
        pool = np.maximum(pool, 1)
        rng = np.random.default_rng(seed)
        out: list[int] = []
        while sum(out) < tokens:
            out.append(int(min(rng.choice(pool), tokens - sum(out))))
        return out


# --- parts ----------------------------------------------------------------------------------------


def part_check(b: Bench) -> list[dict]:
    """Device kernels against math in float64: packed documents with GQA, then a ring of 4."""
    import torch

    lens = [min(n, b.sizes.check_max_doc) for n in b.packed(b.sizes.check_tokens, seed=1)]
    rows: list[dict] = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype)[6:]
        head = {"case": "packed, GQA", "dtype": name, "docs": len(lens)}
        b.case(rows, head, lambda dtype=dtype: _packed_errors(b, dtype, lens))
        head = {"case": "ring of 4 (threads)", "dtype": name}
        b.case(rows, head, lambda dtype=dtype: _ring_errors(b, dtype))
    return rows


def _packed_errors(b: Bench, dtype: Any, lens: list[int]) -> dict:
    """Packed documents with GQA on the device's kernel against math in float64."""
    import torch
    from gpu_reference import isclose_rel

    from trainer.attention.local import attend

    hq, hkv, d = b.sizes.heads
    cu = [0, *np.cumsum(lens).tolist()]
    g = torch.Generator(device=b.dev).manual_seed(0)
    x = [torch.randn(cu[-1], h, d, device=b.dev, generator=g) for h in (hq, hkv, hkv, hq)]
    q, k, v, dout = (t.to(dtype) for t in x)
    got = _attend_grads(attend, q, k, v, dout, cu, None)
    ref = _attend_grads(attend, *(t.double() for t in (q, k, v, dout)), cu, "math")
    return {n: isclose_rel(a, r) for n, a, r in zip(("out", "dq", "dk", "dv"), got, ref)}


def _attend_grads(
    attend: Any, q: Any, k: Any, v: Any, dout: Any, cu: list[int], backend: str | None
) -> list:  # noqa: E501
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, _ = attend(*leaves, cu, backend=backend)
    out.backward(dout)
    return [out.detach(), *(t.grad for t in leaves)]


def _ring_errors(b: Bench, dtype: Any, lengths: tuple[int, ...] | None = None) -> dict:
    """4 threaded ranks, documents zigzag over the ring, against whole-document math (float64)."""
    import torch
    from gpu_reference import isclose_rel

    from trainer.attention.local import attend
    from trainer.attention.ring import RingAttention, ZigzagLayout, ring_attend
    from trainer.testing.threads import run_threads

    hq, hkv, d = b.sizes.heads
    lengths = lengths or (b.sizes.check_max_doc, b.sizes.check_max_doc // 3 + 5, 7)
    total = sum(lengths)
    g = torch.Generator(device=b.dev).manual_seed(3)
    x = [torch.randn(total, h, d, device=b.dev, generator=g).to(dtype) for h in (hq, hkv, hkv, hq)]
    ref = _attend_grads(attend, *(t.double() for t in x), [0, *np.cumsum(lengths).tolist()], "math")

    def member(comm: Any) -> tuple:
        idx = torch.as_tensor(ZigzagLayout(lengths, 4).global_index(comm.rank), device=b.dev)
        ring = RingAttention(comm, [0, 1, 2, 3], comm.rank, lengths, device=b.dev)
        leaves = [t[idx].clone().requires_grad_() for t in x[:3]]
        out, _ = ring_attend(*leaves, ring)
        out.backward(x[3][idx])
        return idx, [out.detach(), *(t.grad for t in leaves)]

    got = [torch.zeros_like(r) for r in ref]
    for idx, parts in run_threads(4, member, timeout=120):
        for whole, part in zip(got, parts):
            whole[idx] = part.double()
    return {n: isclose_rel(a, r) for n, a, r in zip(("out", "dq", "dk", "dv"), got, ref)}


def part_attention(b: Bench) -> list[dict]:
    """mixlen's attention fwd+bwd (packed and one document) beside SDPA's flash kernel."""
    from trainer.attention.local import attend

    rows: list[dict] = []
    for t in b.sizes.attn_tokens:
        for layout, lens in (("packed", b.packed(t)), ("one document", [t])):
            head = {"tokens": t, "layout": layout, "docs": len(lens)}
            b.case(rows, head, lambda t=t, lens=lens: _attention_case(b, attend, t, lens))
    return rows


def _attention_case(b: Bench, attend: Any, t: int, lens: list[int]) -> dict:
    """One forward + backward of `lens` packed into t tokens; SDPA's ceiling for one document."""
    import torch
    from gpu_reference import causal_attention_flops

    hq, hkv, d = b.sizes.heads
    g = torch.Generator(device=b.dev).manual_seed(t)
    q, k, v, dout = (
        torch.randn(t, h, d, device=b.dev, generator=g).to(b.dtype).requires_grad_(i < 3)
        for i, h in enumerate((hq, hkv, hkv, hq))
    )
    cu = [0, *np.cumsum(lens).tolist()]

    def run() -> None:
        out, _ = attend(q, k, v, cu)
        out.backward(dout)

    secs = b.timed(run)
    mem = b.peak(run)
    flops = causal_attention_flops(lens, hq, d)
    ceil_s = _sdpa_seconds(b, t) if len(lens) == 1 else None
    return {
        "ms": secs * 1e3, "tflops": flops / secs / 1e12,
        "sdpa_ms": None if ceil_s is None else ceil_s * 1e3,
        "sdpa_tflops": None if ceil_s is None else flops / ceil_s / 1e12,
        "peak_mib": None if mem is None else mem / 2**20,
        "bytes_per_token": None if mem is None else mem / t,
    }  # fmt: skip


def _sdpa_seconds(b: Bench, t: int) -> float:
    """torch SDPA (the flash kernel on CUDA) on one causal document of t tokens, fwd+bwd."""
    import torch
    import torch.nn.functional as F

    hq, hkv, d = b.sizes.heads
    g = torch.Generator(device=b.dev).manual_seed(1)
    q = torch.randn(1, hq, t, d, device=b.dev, generator=g).to(b.dtype).requires_grad_()
    k = torch.randn(1, hkv, t, d, device=b.dev, generator=g).to(b.dtype).requires_grad_()
    v = torch.randn(1, hkv, t, d, device=b.dev, generator=g).to(b.dtype).requires_grad_()
    dout = torch.randn(1, hq, t, d, device=b.dev, generator=g).to(b.dtype)

    def run() -> None:
        with _sdpa_backend(b):  # a new one each call: sdpa_kernel's can be entered once
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(dout)

    return b.timed(run)


def _sdpa_backend(b: Bench) -> Any:
    """SDPA's flash kernel alone on CUDA (math on the CPU's dry run, through the same API)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION if b.dev.type == "cuda" else SDPBackend.MATH])


def part_calibrate(b: Bench) -> list[dict]:
    """`mixlen calibrate` of the model's shape on this device (one rank)."""
    from datapipe.plan.cost import load
    from tools.cli import main

    path = b.out / "cost-gpu.json"
    args = ["calibrate", "--model", b.sizes.model, "--device", b.sizes.device, "--out", str(path)]
    args += ["--dtype", b.sizes.dtype, *b.sizes.calibrate_args]
    t0 = time.perf_counter()
    if main(args) != 0:
        raise RuntimeError(f"mixlen {' '.join(args)} failed")
    b.cost_path = path
    cost = load(path)
    return [{"a": cost.a, "b": cost.b, "c": cost.c, "step": cost.step,
             "seconds": time.perf_counter() - t0, "file": path.name}]  # fmt: skip


def _cost(b: Bench) -> Any:
    from datapipe.plan.cost import load, preset

    if b.cost_path is not None:
        return load(b.cost_path)
    return preset(f"{b.sizes.model}@{'h100' if b.dev.type == 'cuda' else 'cpu'}")


def _batch(b: Bench, tokens: int, layout: str) -> list[int]:
    key = (tokens, layout)
    if key not in b.batches:
        b.batches[key] = b.packed(tokens, seed=7) if layout == "packed" else [tokens]
    return b.batches[key]


def _executor(b: Bench, checkpoint: str = "none") -> tuple[Any, Any]:
    """The trainer's executor and its model for one rank of the benchmark's shape."""
    from trainer.model.transformer import build_model
    from trainer.offload.config import OffloadConfig
    from trainer.offload.manager import activation_manager
    from trainer.parallel.comm import SoloComm
    from trainer.parallel.executor import HDPExecutor
    from trainer.parallel.zero import ZeroOptimizer

    shape = b.shape()
    model, master = build_model(shape, b.dtype, b.dev, seed=0)
    comm = SoloComm()
    zero = ZeroOptimizer.for_model(model, comm, master=master, level=0, lr=1e-4, grad_clip=1.0)
    acts = activation_manager(OffloadConfig(), checkpoint, shape, b.dev, b.dtype)
    return HDPExecutor(model, zero, comm, device=b.dev, activations=acts), model


def _plan_and_fetch(b: Bench, lens: list[int], capacity: int) -> tuple[Any, Any]:
    from datapipe.fetch import MemoryFetcher
    from datapipe.plan.planner import PlannerConfig

    shape = b.shape()
    rng = np.random.default_rng(sum(lens))
    tokens = [rng.integers(0, shape.vocab_size, n) for n in lens]
    plan = PlannerConfig(policy="single", capacity=capacity).build(_cost(b), 1).plan(np.array(lens))
    fetched = MemoryFetcher(tokens).fetch_step([m.pieces for m in plan.microbatches(0)])
    return plan, fetched


def _mfu(b: Bench, tokens_per_s: float, lens: list[int], tokens: int) -> tuple[float, float]:
    """(MFU by TorchTitan's formula with the step's tokens as its sequence, MFU counting only the
    documents' causal attention), against PEAK_TFLOPS."""
    from gpu_reference import causal_attention_flops, flops_per_token

    shape = b.shape()
    titan = tokens_per_s * flops_per_token(shape, tokens) / (PEAK_TFLOPS * 1e12)
    linear = flops_per_token(shape, 0)
    attn = causal_attention_flops(lens, shape.n_heads, shape.head_dim) * shape.n_layers / tokens
    actual = tokens_per_s * (linear + attn * 3.0 / 3.5) / (PEAK_TFLOPS * 1e12)  # fwd x 3
    return titan, actual


def _release(ex: Any) -> None:
    """An executor's optimizer unhooked from its model, so both go with their last reference."""
    ex.zero.remove_hooks()


def _step_case(b: Bench, ex: Any, tokens: int, layout: str, capacity: int | None = None) -> dict:  # noqa: E501
    """One step size and layout through the executor (micro-batches of `capacity` positions,
    default the step's): its first step, then timed steps."""
    from datapipe.plan.metrics import predicted_step_ns

    lens = _batch(b, tokens, layout)
    plan, fetched = _plan_and_fetch(b, lens, capacity or tokens)
    step = [0]

    def run() -> None:
        step[0] += 1
        ex.step(plan, fetched, step[0])

    t0 = time.perf_counter()
    run()  # allocations, cuBLAS plans; with compiled blocks, the compilation
    b.sync()
    first = time.perf_counter() - t0
    secs = b.timed(run, warmup=1, iters=b.sizes.step_iters)
    mem = b.peak(run)
    syncs = _count_syncs(b, run)
    tps = tokens / secs
    titan, actual = _mfu(b, tps, lens, tokens)
    return {
        "docs": len(lens), "step_s": secs, "tokens_per_s": tps, "mfu_titan": titan,
        "mfu_doc_attention": actual, "peak_gib": None if mem is None else mem / 2**30,
        "planned_s": predicted_step_ns(plan, _cost(b)) / 1e9,
        "cost": "calibrated" if b.cost_path else "preset", "syncs_per_step": syncs,
        "microbatches": len(fetched), "first_step_s": first,
    }  # fmt: skip


def part_train(b: Bench) -> list[dict]:
    """The executor at each step size, packed and one document."""
    rows: list[dict] = []
    ex, model = _executor(b)
    try:
        for tokens in b.sizes.step_tokens:
            for layout in ("packed", "one document"):
                head = {"tokens": tokens, "layout": layout}
                b.case(rows, head, lambda t=tokens, lay=layout: _step_case(b, ex, t, lay))
    finally:
        _release(ex)  # the model and optimizer go when this returns (run() frees them)
    return rows


def part_compiled(b: Bench) -> list[dict]:
    """`[train] compile = true`: every block and the loss's chunks compiled, the largest step size
    packed, the smallest packed, the largest as one document (a first step includes its
    compilation), then the largest packed with the blocks compiled and the loss eager; `train`'s
    eager rows of the same batches beside them."""
    rows: list[dict] = []
    ex, model = _executor(b)
    try:
        model.compile_layers(b.sizes.compile_backend or "inductor")
        cases = [(b.sizes.step_tokens[-1], "packed"), (b.sizes.step_tokens[0], "packed")]
        cases.append((b.sizes.step_tokens[-1], "one document"))
        for tokens, layout in cases:
            head = {"tokens": tokens, "layout": layout, "compiled": True}
            b.case(rows, head, lambda t=tokens, lay=layout: _step_case(b, ex, t, lay))
        # the blocks compiled, the loss eager: what compiling the loss's chunks gives
        model.loss_compile = None
        tokens = b.sizes.step_tokens[-1]
        head = {"tokens": tokens, "layout": "packed", "compiled": "blocks only"}
        b.case(rows, head, lambda: _step_case(b, ex, tokens, "packed"))
    finally:
        _release(ex)  # the model and optimizer go when this returns (run() frees them)
    return rows


def _count_syncs(b: Bench, run: Callable[[], None]) -> int | None:
    """Host synchronisations torch reports during one call (CUDA only)."""
    sites = _sync_sites(b, run)
    return None if sites is None else sum(sites.values())


def _sync_sites(b: Bench, run: Callable[[], None]) -> dict[str, int] | None:
    """The source lines (file:line, under the repository or torch) that made the host
    synchronisations torch reports during one call, with their counts (CUDA only)."""
    import torch

    if b.dev.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{_short_path(w.filename)}:{w.lineno}"
            sites[key] = sites.get(key, 0) + 1
    return sites


def _short_path(path: str) -> str:
    """`path` from the repository's root, or from torch's folder's parent."""
    import torch

    p = Path(path)
    for base in (ROOT, Path(torch.__file__).parent.parent):
        if p.is_relative_to(base):
            return str(p.relative_to(base))
    return p.name


def part_syncs(b: Bench) -> list[dict]:
    """Host synchronisations of one step, one micro-batch against four (per-micro-batch ones
    would grow with them), and where they come from."""
    rows: list[dict] = []
    tokens = b.sizes.step_tokens[-1]
    ex, model = _executor(b)
    try:
        for capacity in (tokens, tokens // 4):

            def one(capacity: int = capacity) -> dict:
                lens = _batch(b, tokens, "packed")
                plan, fetched = _plan_and_fetch(b, lens, capacity)
                ex.step(plan, fetched, 1)  # warm: allocations, the optimizer's state
                sites = _sync_sites(b, lambda: ex.step(plan, fetched, 2))
                top = sorted((sites or {}).items(), key=lambda kv: -kv[1])
                return {
                    "microbatches": len(fetched),
                    "syncs": None if sites is None else sum(sites.values()),
                    "sites": "; ".join(f"{k} x{n}" for k, n in top) or "-",
                }

            b.case(rows, {"tokens": tokens, "capacity": capacity}, one)
    finally:
        _release(ex)
    return rows


def part_profile(b: Bench) -> list[dict]:
    """One step of the smallest size packed, of the largest as one document, then of the
    largest packed with every block compiled (what is left beside TorchTitan's compiled blocks),
    under torch.profiler: the step's wall time and the share of it the device was busy (its
    kernels and copies), then the operators whose own kernels took the most device time (on the
    CPU's dry run, the most CPU time)."""
    rows: list[dict] = []
    small, large = b.sizes.step_tokens[0], b.sizes.step_tokens[-1]
    ex, model = _executor(b)
    try:
        for tokens, layout, compiled in ((small, "packed", False),
                                         (large, "one document", False),
                                         (large, "packed", True)):  # fmt: skip
            step = f"{tokens} {layout}" + (", compiled" if compiled else "")
            try:
                if compiled:
                    model.compile_layers(b.sizes.compile_backend or "inductor")
                rows += [{"step": step, **r} for r in _profile_step(b, ex, tokens, layout)]
            except Exception as exc:
                rows.append({"step": step, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                print(f"bench_gpu: profile: {traceback.format_exc()}", flush=True)
            b.free()
    finally:
        _release(ex)
    return rows


def _profiled(b: Bench, step: Callable[[], Any]) -> tuple[Any, float, str, Any]:
    """One call of `step` (warmed by the caller) under torch.profiler: (its key_averages, its
    wall seconds, the event attribute of own time, the device type whose events are the device's
    busy time: CUDA's kernels and copies on a GPU; on the CPU's dry run, the operators' CPU time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = b.dev.type == "cuda"
    b.sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        b.sync()
        wall = time.perf_counter() - t0
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages(), wall, attr, DeviceType.CUDA if cuda else DeviceType.CPU


def _profile_step(b: Bench, ex: Any, tokens: int, layout: str) -> list[dict]:
    from torch.autograd import DeviceType

    lens = _batch(b, tokens, layout)
    plan, fetched = _plan_and_fetch(b, lens, tokens)
    for i in range(2):  # warm
        ex.step(plan, fetched, i + 1)
    events, wall, attr, busy_type = _profiled(b, lambda: ex.step(plan, fetched, 3))
    busy = sum(getattr(e, attr) for e in events if e.device_type == busy_type) / 1e3  # us -> ms
    out = [{"op": "(the step)", "calls": 1, "ms": wall * 1e3, "share": busy / wall / 1e3}]
    ops = [e for e in events if e.device_type == DeviceType.CPU]  # the operators: launchers'
    for e in sorted(ops, key=lambda e: -getattr(e, attr))[:15]:
        ms = getattr(e, attr) / 1e3
        out.append({"op": e.key[:60], "calls": e.count, "ms": ms, "share": ms / busy})
    # the kernels themselves: compiled blocks launch inductor's fused kernels from no operator
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]  # none on the CPU
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:10]:
        ms = e.self_device_time_total / 1e3
        out.append({"op": f"kernel {e.key[:53]}", "calls": e.count, "ms": ms, "share": ms / busy})
    return out


def part_reference(b: Bench) -> list[dict]:
    """The plain-torch loop on the same batches as `train`."""
    from gpu_reference import ReferenceLoop

    loop = ReferenceLoop(b.shape(), b.dtype, b.dev, b.sizes.compile_backend)
    rows: list[dict] = []

    def one(tokens: int, layout: str) -> dict:
        lens = _batch(b, tokens, layout)
        ids, pos, labels = _reference_inputs(b, lens)
        t0 = time.perf_counter()
        loop.step(ids, pos, lens, labels)  # compiles
        b.sync()
        first = time.perf_counter() - t0
        secs = b.timed(lambda: loop.step(ids, pos, lens, labels), 1, b.sizes.step_iters)
        mem = b.peak(lambda: loop.step(ids, pos, lens, labels))
        titan, actual = _mfu(b, tokens / secs, lens, tokens)
        return {
            "docs": len(lens), "step_s": secs, "tokens_per_s": tokens / secs,
            "mfu_titan": titan, "mfu_doc_attention": actual,
            "peak_gib": None if mem is None else mem / 2**30, "first_step_s": first,
        }  # fmt: skip

    try:
        for tokens in sorted(b.sizes.step_tokens, reverse=True):  # the goal's 32K first
            for layout in ("packed", "one document"):
                head = {"tokens": tokens, "layout": layout}
                b.case(rows, head, lambda t=tokens, lay=layout: one(t, lay))
    finally:
        b.free()
    return rows


def _reference_inputs(b: Bench, lens: list[int]) -> tuple[Any, Any, Any]:
    """(token ids, positions, labels) of documents `lens` on the device, for the reference loop:
    random tokens, each document's next token as its labels, none at a document's end."""
    import torch

    rng = np.random.default_rng(sum(lens))
    ids = torch.as_tensor(
        np.concatenate([rng.integers(0, b.shape().vocab_size, n) for n in lens]), device=b.dev
    )
    pos = torch.as_tensor(np.concatenate([np.arange(n) for n in lens]), device=b.dev)
    labels = torch.roll(ids, -1)
    labels[torch.as_tensor(np.cumsum(lens) - 1, device=b.dev)] = -100
    return ids, pos, labels


def part_torchtitan(b: Bench) -> list[dict]:
    """TorchTitan 0.2.2's own trainer on the same shape and document lengths, a process per step
    size (benchmarks/torchtitan_bench.py); on the CPU its dry run (everything but training)."""
    import importlib.util

    from gpu_reference import flops_per_token

    if importlib.util.find_spec("torchtitan") is None:
        why = "torchtitan is not installed (benchmarks/torchtitan_wheels.sh; gpu_run.sh installs)"
        return [{"result": f"skipped: {why}"}]
    dry = b.dev.type != "cuda"
    rows: list[dict] = []
    work = Path(tempfile.mkdtemp(prefix="mixlen-torchtitan-"))  # not under --out: its 8 files
    for tokens in sorted(b.sizes.step_tokens, reverse=True):  # the goal's 32K first
        if not dry and b.left() < 100:  # a process's start, compilation and 8 steps
            rows.append({"tokens": tokens, "result": "skipped: budget"})
            continue
        cmd = [sys.executable, str(ROOT / "benchmarks" / "torchtitan_bench.py"),
               "--out", str(work), "--model", b.sizes.model,
               "--seq-len", str(tokens), "--length-divisor", str(b.sizes.length_divisor)]  # fmt: skip
        try:
            proc = subprocess.run(
                cmd + (["--dry-run"] if dry else []), capture_output=True, text=True,
                timeout=max(60.0, min(b.left() - 10, 240.0)),
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            tail = "\n".join(
                _text(exc.stdout).splitlines()[-15:] + _text(exc.stderr).splitlines()[-30:]
            )
            print(f"bench_gpu: torchtitan {tokens} timed out; its last lines:\n{tail}", flush=True)
            rows.append({"tokens": tokens, "result": f"timed out after {exc.timeout:.0f} s"})
            continue
        (work / f"torchtitan-{tokens}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode:
            tail = (proc.stdout + proc.stderr).strip().splitlines()
            print(f"bench_gpu: torchtitan {tokens} failed:", *tail[-30:], sep="\n", flush=True)
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            rows.append({"tokens": tokens, "result": f"failed ({proc.returncode}): {last[:200]}"})
            continue
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        row = {"tokens": tokens, "result": "dry run" if dry else "trained",
               "torchtitan": got["torchtitan"], "params": got.get("params")}  # fmt: skip
        if not dry:
            tps = got["tokens_per_s"]
            row.update(step_s=got["step_s"], tokens_per_s=tps, peak_gib=got["peak_gib"],
                       mfu_titan=tps * flops_per_token(b.shape(), tokens) / (PEAK_TFLOPS * 1e12),
                       first_step_s=got["first_step_s"])  # fmt: skip
        rows.append(row)
    shutil.rmtree(work, ignore_errors=True)  # the failures' last lines went to the log
    return rows


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def part_ring(b: Bench) -> list[dict]:
    """One document over a ring of 4 threaded ranks: equal to whole attention; its time beside
    the same document's attention on one rank."""
    import torch

    from trainer.attention.local import attend
    from trainer.attention.ring import RingAttention, ZigzagLayout, ring_attend
    from trainer.testing.threads import run_threads

    rows: list[dict] = []
    n = b.sizes.ring_tokens
    hq, hkv, d = b.sizes.heads
    head = {"case": "equality", "dtype": b.sizes.dtype}
    b.case(rows, head, lambda: _ring_errors(b, b.dtype, (n // 8, n // 16 + 3)))
    g = torch.Generator(device=b.dev).manual_seed(5)
    x = [torch.randn(n, h, d, device=b.dev, generator=g).to(b.dtype) for h in (hq, hkv, hkv, hq)]
    idx = [torch.as_tensor(ZigzagLayout((n,), 4).global_index(r), device=b.dev) for r in range(4)]

    def ring_once() -> None:
        def member(comm: Any) -> None:
            i = idx[comm.rank]
            ring = RingAttention(comm, [0, 1, 2, 3], comm.rank, (n,), device=b.dev)
            leaves = [t[i].clone().requires_grad_() for t in x[:3]]
            ring_attend(*leaves, ring)[0].backward(x[3][i])

        run_threads(4, member, timeout=300)

    def one_rank() -> None:
        leaves = [t.clone().requires_grad_() for t in x[:3]]
        attend(*leaves, [0, n])[0].backward(x[3])

    def timing() -> dict:
        ring_s, one_s = b.timed(ring_once), b.timed(one_rank)
        return {"ring_of_4_ms": ring_s * 1e3, "one_rank_ms": one_s * 1e3, "ratio": ring_s / one_s}

    b.case(rows, {"case": f"{n} tokens", "dtype": b.sizes.dtype}, timing)
    return rows


def _planned_bytes(b: Bench, tokens: int, checkpoint: str) -> int:
    """What the planner's memory model says a micro-batch of `tokens` positions holds above the
    model state (datapipe.plan.memory.micro_batch_bytes): `peak_gib`'s counterpart."""
    from datapipe.plan.memory import micro_batch_bytes

    return micro_batch_bytes(b.shape(), tokens, checkpoint, b.sizes.dtype)


def part_checkpoint(b: Bench) -> list[dict]:
    """One document of the largest step size with no, selective and full activation
    checkpointing: step time and peak memory side by side (selective is kept where it beats
    full), the peak beside the planner's figure."""
    rows: list[dict] = []
    tokens = b.sizes.step_tokens[-1]

    def one(checkpoint: str) -> dict:
        ex, model = _executor(b, checkpoint)
        try:
            got = _step_case(b, ex, tokens, "one document")
        finally:
            _release(ex)
        keep = ("step_s", "tokens_per_s", "mfu_titan", "peak_gib", "first_step_s")
        return {
            **{k: got[k] for k in keep},
            "planned_gib": _planned_bytes(b, tokens, checkpoint) / 2**30,
        }

    for checkpoint in ("none", "selective", "full"):
        b.case(rows, {"checkpoint": checkpoint, "tokens": tokens}, lambda c=checkpoint: one(c))
    return rows


def part_longest(b: Bench) -> list[dict]:
    """Double a single document's length until a step runs out of memory or of budget."""
    rows: list[dict] = []
    start = b.sizes.longest_start
    for checkpoint in ("none", "full"):
        try:
            ex, model = _executor(b, checkpoint)
        except Exception as exc:  # out of memory for the model itself: the next mode may fit
            rows.append({"checkpoint": checkpoint, "result": f"{type(exc).__name__}: {exc}"[:300]})
            b.free()
            continue
        try:
            start = _double(b, ex, checkpoint, start, rows)
        finally:
            _release(ex)
            del ex, model
            b.free()
    return rows


def _double(b: Bench, ex: Any, checkpoint: str, n: int, rows: list[dict]) -> int:
    """Probe one document of n, 2n, ... tokens until one does not fit (memory, budget, or an
    error); the longest trained."""
    import torch

    last_s, best = 0.0, n
    while n <= b.sizes.longest_cap:
        if last_s * 4.5 > b.left() - 30:  # the next probe (quadratic) would not fit
            rows.append({"checkpoint": checkpoint, "tokens": n, "result": "skipped: budget"})
            break
        t0 = time.perf_counter()
        try:
            if b.sizes.memory_cap is not None and n > b.sizes.memory_cap:
                raise torch.cuda.OutOfMemoryError("dry run: past the emulated memory cap")
            plan, fetched = _plan_and_fetch(b, [n], n)
            mem = _probe(b, ex, plan, fetched)
            del plan, fetched
        except torch.cuda.OutOfMemoryError:
            rows.append({"checkpoint": checkpoint, "tokens": n, "result": "out of memory"})
            break
        except Exception as exc:  # anything else ends this mode's search, named
            rows.append({"checkpoint": checkpoint, "tokens": n,
                         "result": f"{type(exc).__name__}: {exc}"[:300]})  # fmt: skip
            break
        finally:
            b.free()
        last_s = time.perf_counter() - t0
        rows.append({"checkpoint": checkpoint, "tokens": n, "result": "trained",
                     "step_s": last_s, "peak_gib": None if mem is None else mem / 2**30,
                     "planned_gib": _planned_bytes(b, n, checkpoint) / 2**30})  # fmt: skip
        best, n = n, 2 * n
    return best


def _probe(b: Bench, ex: Any, plan: Any, fetched: Any) -> int | None:
    return b.peak(lambda: ex.step(plan, fetched, 1))


def part_losschunk(b: Bench) -> list[dict]:
    """The largest step size packed, at the loss's default chunk and at 1/16 and 1/4 of the
    step's tokens a chunk."""
    from trainer.model.loss import chunk_tokens

    rows: list[dict] = []
    tokens = b.sizes.step_tokens[-1]
    keep = ("step_s", "tokens_per_s", "mfu_titan", "peak_gib")
    ex, model = _executor(b)
    try:
        for chunk in (None, tokens // 16, tokens // 4):
            model.loss_chunk_tokens = chunk
            size = chunk or chunk_tokens(b.shape().vocab_size)

            def one() -> dict:
                got = _step_case(b, ex, tokens, "packed")
                return {k: got[k] for k in keep}

            b.case(rows, {"tokens": tokens, "chunk": size, "default": chunk is None}, one)
    finally:
        model.loss_chunk_tokens = None
        _release(ex)
    return rows


# kinds of device kernels (on the CPU's dry run, of operators), by what their names contain, first
# match wins: attention before matmuls (flash kernels' names hold "gemm"-like words), inductor's
# matmul templates before its other kernels, collectives ("AllReduce") before reductions
KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "gloo", "c10d::")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("triton_tem", "gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "aten::mm",
                "aten::addmm", "aten::bmm", "aten::matmul")),
    ("optimizer", ("adam",)),
    ("inductor fused", ("triton_",)),
    ("softmax", ("softmax",)),
    ("gather, scatter, index", ("embedding", "index", "scatter", "gather")),
    ("reduction", ("reduce", "aten::sum", "aten::amax", "aten::max", "aten::norm", "aten::dot")),
    ("copy, fill", ("copy", "memcpy", "memset", "fill")),
    ("foreach", ("multi_tensor", "foreach")),
    ("elementwise", ("elementwise", "aten::")),
)  # fmt: skip


def kernel_kind(name: str) -> str:
    """The kind (KERNEL_KINDS) of a kernel's or operator's name, else "other"."""
    low = name.lower()
    for kind, words in KERNEL_KINDS:
        if any(w in low for w in words):
            return kind
    return "other"


def _kinds_ms(b: Bench, step: Callable[[], Any]) -> tuple[dict[str, float], dict[str, float]]:
    """Device milliseconds of one call of `step` (warmed by the caller) by kernel kind, with
    "(the step)": its wall milliseconds, and "(device busy)": all kinds; and by kernel name. On
    the CPU, the operators' own CPU time."""
    events, wall, attr, busy_type = _profiled(b, step)
    kinds = {"(the step)": wall * 1e3}
    names: dict[str, float] = {}
    for e in events:
        if e.device_type == busy_type and not e.key.startswith("ProfilerStep"):
            ms = getattr(e, attr) / 1e3
            kinds[kernel_kind(e.key)] = kinds.get(kernel_kind(e.key), 0.0) + ms
            names[e.key] = names.get(e.key, 0.0) + ms
    kinds["(device busy)"] = sum(v for k, v in kinds.items() if k != "(the step)")
    return kinds, names


def part_gap(b: Bench) -> list[dict]:
    """One step of the largest size, packed, with compiled blocks, and the reference loop's step
    on the same documents: device milliseconds by kernel kind side by side, and the difference;
    then the kernels among either side's 8 longest, by name (inductor's differ between the two
    programs; cuBLAS's, flash's and aten's are the same names on both sides)."""
    tokens = b.sizes.step_tokens[-1]
    lens = _batch(b, tokens, "packed")
    backend = b.sizes.compile_backend or "inductor"
    got: dict[str, tuple[dict[str, float], dict[str, float]]] = {}

    def mixlen_step() -> dict:
        ex, model = _executor(b)
        try:
            model.compile_layers(backend)
            plan, fetched = _plan_and_fetch(b, lens, tokens)
            for i in range(3):  # compiles, then warm
                ex.step(plan, fetched, i + 1)
            got["mixlen"] = _kinds_ms(b, lambda: ex.step(plan, fetched, 4))
        finally:
            _release(ex)
        return {"step_ms": got["mixlen"][0]["(the step)"]}

    def reference_step() -> dict:
        from gpu_reference import ReferenceLoop

        loop = ReferenceLoop(b.shape(), b.dtype, b.dev, b.sizes.compile_backend)
        ids, pos, labels = _reference_inputs(b, lens)
        for _ in range(3):
            loop.step(ids, pos, lens, labels)
        got["reference"] = _kinds_ms(b, lambda: loop.step(ids, pos, lens, labels))
        return {"step_ms": got["reference"][0]["(the step)"]}

    runs: list[dict] = []
    b.case(runs, {"tokens": tokens, "loop": "mixlen, compiled"}, mixlen_step)
    b.case(runs, {"tokens": tokens, "loop": "reference"}, reference_step)
    if len(got) < 2:
        return runs  # a side failed or did not fit: its row says why
    (mine, mine_k), (ref, ref_k) = got["mixlen"], got["reference"]
    first = ("(the step)", "(device busy)")
    kinds = sorted(
        set(mine) | set(ref), key=lambda k: (k not in first, k != first[0], -mine.get(k, 0.0))
    )
    top = {k for side in (mine_k, ref_k) for k in sorted(side, key=lambda k: -side[k])[:8]}
    rows = [(k, mine.get(k, 0.0), ref.get(k, 0.0)) for k in kinds]
    for n, k in enumerate(sorted(top, key=lambda k: -max(mine_k.get(k, 0.0), ref_k.get(k, 0.0)))):
        # templated names share long prefixes: the row's number keeps two cut names apart
        rows.append((f"kernel {n + 1}: {k[:90]}", mine_k.get(k, 0.0), ref_k.get(k, 0.0)))
    return [
        {"tokens": tokens, "kind": k, "mixlen_ms": m, "reference_ms": r, "difference_ms": m - r}
        for k, m, r in rows
    ]


RUNNERS: dict[str, Callable[[Bench], list[dict]]] = {
    "check": part_check,
    "attention": part_attention,
    "calibrate": part_calibrate,
    "train": part_train,
    "torchtitan": part_torchtitan,
    "longest": part_longest,
    "compiled": part_compiled,
    "ring": part_ring,
    "checkpoint": part_checkpoint,
    "reference": part_reference,
    "syncs": part_syncs,
    "profile": part_profile,
    "losschunk": part_losschunk,
    "gap": part_gap,
}


# --- report ---------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v == 0 or math.isnan(v):
            return f"{v}"
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def render(results: dict) -> str:
    """Markdown: one table per part (or its error)."""
    lines = [f"# bench_gpu ({results.get('device_name', '?')}, torch {results.get('torch', '?')})"]
    for name, part in results["parts"].items():
        took = "running" if part.get("running") else f"{part.get('seconds', 0):.1f} s"
        lines += ["", f"## {name} ({took})"]
        if "error" in part:
            lines.append(f"error: {part['error']}")
            continue
        rows = part["rows"]
        if not rows:
            continue
        keys = list(dict.fromkeys(k for r in rows for k in r))
        lines.append("| " + " | ".join(keys) + " |")
        lines.append("|" + " --- |" * len(keys))
        lines += ["| " + " | ".join(_fmt(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def run(sizes: Sizes, out: Path, parts: list[str], budget_s: float) -> dict:
    """Every part in order; the results (also written under `out`)."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    b = Bench(sizes, out, budget_s)
    b.results["torch"] = torch.__version__
    b.results["device_name"] = torch.cuda.get_device_name() if b.dev.type == "cuda" else "cpu"
    # what exists now (imported modules, the caller's objects) is not a case's garbage: frozen, a
    # case's collection (`free`) scans only what came after (0.2 s a collection, 47 of them, else)
    gc.freeze()
    try:
        _run_parts(b, parts)
    finally:
        gc.unfreeze()
    return b.results


def _run_parts(b: Bench, parts: list[str]) -> None:
    """Each part of `parts` in order, its rows saved after it."""
    sizes = b.sizes
    for name in parts:
        t0 = time.perf_counter()
        b.part = name
        if b.left() < PART_MIN_S[name] * sizes.budget_scale:
            part: dict[str, Any] = {"rows": [{"result": f"skipped: {b.left():.0f} s left"}]}
        else:
            try:
                part = {"rows": RUNNERS[name](b)}
            except Exception as exc:  # one part's failure is reported; the others still run
                part = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
                print(f"bench_gpu: {name}: {part['trace']}", flush=True)
        part["seconds"] = time.perf_counter() - t0
        b.results["parts"][name] = part
        b.free()  # the part's model and optimizer go before the next part allocates
        b.save()  # a run cut short keeps its tables
        print(f"bench_gpu: {name} done in {part['seconds']:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for bench_gpu.json and bench_gpu.md")
    p.add_argument("--dry-run", action="store_true", help="the CPU, tiny sizes")
    p.add_argument("--parts", default=",".join(PARTS), help=f"subset of {','.join(PARTS)}")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop probing past this")
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    bad = [x for x in parts if x not in RUNNERS]
    if bad:
        p.error(f"--parts: unknown {bad} (known: {', '.join(PARTS)})")
    sizes = DRY if args.dry_run else Sizes()
    results = run(sizes, Path(args.out), parts, args.budget_s)
    print(render(results))
    return 1 if any("error" in part for part in results["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
