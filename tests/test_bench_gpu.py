"""benchmarks/bench_gpu.py's dry run on the CPU: every part's logic runs at tiny sizes, so the
script a GPU session runs in one call cannot rot between sessions; and the MFU arithmetic."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys

import pytest
from conftest import ROOT

from datapipe.shapes import MODEL_CONFIGS

sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gpu  # noqa: E402
from gpu_reference import causal_attention_flops, flops_per_token  # noqa: E402


def test_llama_3_2_1b_shape_and_torchtitan_flops() -> None:
    cfg = MODEL_CONFIGS["llama3.2-1b"]
    assert cfg.num_params() == 1_235_814_400  # Meta's published count
    assert cfg.head_dim == 64
    # by hand: 6 x 1,235,814,400 (the tied embedding counted once, as the output layer: what
    # TorchTitan counts for its untied model of the shape, 1,498,482,688 less 128,256 x 2,048)
    # + 12 x 16 x 32 x 64 x 8,192
    assert flops_per_token(cfg, 8192) == 6 * 1_235_814_400 + 12 * 16 * 32 * 64 * 8192
    untied = dataclasses.replace(cfg, tie_embeddings=False)
    assert flops_per_token(untied, 8192) == flops_per_token(cfg, 8192)
    # causal pairs: one document of 4 tokens has 10, two of 2 have 6
    assert causal_attention_flops([4], 2, 8) == 3.5 * 4 * 2 * 8 * 10
    assert causal_attention_flops([2, 2], 2, 8) == 3.5 * 4 * 2 * 8 * 6


def test_a_failing_case_keeps_the_others_and_the_budget_skips(tmp_path) -> None:
    """One case's error is its row's (the part goes on); a part or case that no longer fits the
    budget is skipped, and the tables are written after every part."""
    b = bench_gpu.Bench(bench_gpu.DRY, tmp_path, 100)
    rows: list[dict] = []
    assert not b.case(rows, {"tokens": 1}, lambda: {"x": 1 / 0})
    assert b.case(rows, {"tokens": 2}, lambda: {"x": 1})
    assert rows == [{"tokens": 1, "error": "ZeroDivisionError: division by zero"},
                    {"tokens": 2, "x": 1}]  # fmt: skip
    b.part = "train"  # inside run(): each case's row is on disk before the next case starts
    b.case(rows, {"tokens": 3}, lambda: {"x": 3})
    saved = json.loads((tmp_path / "bench_gpu.json").read_text())["parts"]["train"]
    assert saved["running"] and saved["rows"][-1] == {"tokens": 3, "x": 3}
    assert "## train (running)" in (tmp_path / "bench_gpu.md").read_text()
    tight = dataclasses.replace(bench_gpu.DRY, budget_scale=1.0)
    parts = bench_gpu.run(tight, tmp_path, ["check", "train"], budget_s=12)["parts"]
    assert [r["result"] for r in parts["check"]["rows"]] == ["skipped: budget"] * 4
    assert parts["train"]["rows"][0]["result"].startswith("skipped: ")
    assert "## train" in (tmp_path / "bench_gpu.md").read_text()


# kernel names as an H100/H200's profiler reports them (torch 2.11, cuBLAS 13), with their kinds
KERNELS = {
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, "
    "128, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t>, false, true>": "attention",
    "nvjet_tst_192x192_64x4_1x2_h_bz_coopB_NNT": "matmul",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_"
    "segment_k_off_kernel__5x_cublas": "matmul",
    "cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "matmul",
    "triton_tem_fused_mm_0": "matmul",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1": "inductor fused",
    "triton_poi_fused_cat_mul_sub_2": "inductor fused",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
    "namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>>": "optimizer",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "std::array<char*, 3ul> >": "elementwise",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::"
    "TensorIteratorBase&)::{lambda()#3}::operator()() const>": "copy, fill",
    "Memcpy HtoD (Pinned -> Device)": "copy, fill",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MaxOps<float>, "
    "unsigned int, float, 4> >": "reduction",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForwardSmem<4, float, float, float, "
    "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>": "softmax",
    "void at::native::_scatter_gather_elementwise_kernel<128, 4, ...>": "gather, scatter, index",
    "void at::native::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>": (
        "gather, scatter, index"
    ),
    "void at::native::multi_tensor_apply_kernel<at::native::TensorListMetadata<2>, at::native::"
    "(anonymous namespace)::CopyFunctor<...>>": "copy, fill",
    "aten::mm": "matmul",
    "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64_4x1x1_kernel0_0": "attention",
    "mixlen::varlen_attention": "attention",
    "aten::add_": "elementwise",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "communication",
    "some_custom_kernel_42": "other",
}


def test_kernel_kinds_of_real_names() -> None:
    """The `gap` part's kinds: each name as the first matching kind takes it (flash kernels hold
    "cutlass", cuBLAS's split-K "reduce", inductor's kernels "copy")."""
    assert {name: bench_gpu.kernel_kind(name) for name in KERNELS} == KERNELS


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dry_run_of_every_part(tmp_path) -> None:
    results = bench_gpu.run(bench_gpu.DRY, tmp_path, list(bench_gpu.PARTS), budget_s=200)
    parts = results["parts"]
    assert list(parts) == list(bench_gpu.PARTS)
    errors = {k: v["error"] for k, v in parts.items() if "error" in v}
    assert not errors, errors
    for row in parts["check"]["rows"]:  # the tolerances: fp32 1e-5, bf16 2e-2
        tol = 1e-5 if row["dtype"] == "float32" else 2e-2
        assert max(row[k] for k in ("out", "dq", "dk", "dv")) < tol, row
    attn = parts["attention"]["rows"]
    assert [(r["tokens"], r["layout"]) for r in attn] == [
        (t, lay) for t in bench_gpu.DRY.attn_tokens for lay in ("packed", "one document")
    ]
    assert all(r["tflops"] > 0 for r in attn)
    assert all((r["sdpa_ms"] is None) == (r["layout"] == "packed") for r in attn)
    assert (tmp_path / "cost-gpu.json").is_file()
    train = parts["train"]["rows"] + parts["compiled"]["rows"]
    assert len(train) == 8 and all(r["cost"] == "calibrated" and r["planned_s"] > 0 for r in train)
    assert [r.get("compiled", False) for r in train] == [False] * 4 + [True] * 3 + ["blocks only"]
    assert all(0 < r["mfu_titan"] < 1 and r["tokens_per_s"] > 0 for r in train)
    assert len(parts["reference"]["rows"]) == 4
    titan = parts["torchtitan"]["rows"]  # its dry run where TorchTitan is installed
    if importlib.util.find_spec("torchtitan") is None:
        assert [r["result"] for r in titan] == [
            "skipped: torchtitan is not installed (benchmarks/torchtitan_wheels.sh; gpu_run.sh "
            "installs)"
        ]
    else:
        untied = MODEL_CONFIGS["debug"].num_params() + 258 * 128  # its own output layer
        assert [(r["tokens"], r["result"], r["params"]) for r in titan] == [
            (t, "dry run", untied) for t in sorted(bench_gpu.DRY.step_tokens, reverse=True)
        ]
    ring = parts["ring"]["rows"]
    assert max(ring[0][k] for k in ("out", "dq", "dk", "dv")) < 1e-5 and ring[1]["ratio"] > 0
    ckpt = parts["checkpoint"]["rows"]
    assert [(r["checkpoint"], r["tokens"]) for r in ckpt] == [
        (m, bench_gpu.DRY.step_tokens[-1]) for m in ("none", "selective", "full")
    ]
    assert all(r["tokens_per_s"] > 0 for r in ckpt)
    # the planner's bytes: full least (2 layers: a recomputed block makes selective hold more)
    planned = [r["planned_gib"] for r in ckpt]
    assert 0 < planned[2] < min(planned[:2])
    longest = parts["longest"]["rows"]
    for mode in ("none", "full"):  # doubling stops past the dry run's emulated memory cap
        rows = [r for r in longest if r["checkpoint"] == mode]
        trained = [r["tokens"] for r in rows if r["result"] == "trained"]
        assert max(trained) == bench_gpu.DRY.memory_cap and rows[-1]["result"] == "out of memory"
    syncs = parts["syncs"]["rows"]  # counted on CUDA only
    assert [(r["microbatches"], r["syncs"]) for r in syncs] == [(1, None), (4, None)]
    prof = parts["profile"]["rows"]
    for step in ("256 packed", "512 one document", "512 packed, compiled"):
        rows = [r for r in prof if r["step"] == step]
        assert rows[0]["op"] == "(the step)" and 0 < rows[0]["share"] <= 1.0 and len(rows) > 5
        assert any(r["op"] == "aten::mm" for r in rows) and sum(r["share"] for r in rows[1:]) <= 1
    gap = {r["kind"]: r for r in parts["gap"]["rows"]}
    assert list(gap)[:2] == ["(the step)", "(device busy)"] and gap["matmul"]["mixlen_ms"] > 0
    kernels = [k for k in gap if k.startswith("kernel ")]
    assert 8 <= len(kernels) <= 16 and gap["kernel 1: aten::mm"]["mixlen_ms"] > 0
    for side in ("mixlen_ms", "reference_ms"):
        kinds = sum(r[side] for k, r in gap.items() if not k.startswith(("(", "kernel ")))
        assert kinds == pytest.approx(gap["(device busy)"][side]) and 0 < kinds
        assert sum(gap[k][side] for k in kernels) <= kinds
    assert all(r["difference_ms"] == r["mixlen_ms"] - r["reference_ms"] for r in gap.values())
    chunks = parts["losschunk"]["rows"]
    tokens = bench_gpu.DRY.step_tokens[-1]
    assert [(r["chunk"], r["default"]) for r in chunks][1:] == [(tokens // 16, False),
                                                                (tokens // 4, False)]  # fmt: skip
    assert chunks[0]["default"] and all(r["tokens_per_s"] > 0 for r in chunks)
    page = (tmp_path / "bench_gpu.md").read_text()
    assert all(f"## {name}" in page for name in bench_gpu.PARTS)
    # what comes back from a device run: at most 8 files (TorchTitan's work goes elsewhere)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bench_gpu.json", "bench_gpu.md", "cost-gpu.json"
    ]  # fmt: skip
    with pytest.raises(SystemExit):
        bench_gpu.main(["--dry-run", "--out", str(tmp_path), "--parts", "nope"])
