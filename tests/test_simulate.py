"""Synthetic length distributions against the paper's statistics; `mixlen plan` and `mixlen
simulate` end to end (JSON shape, dump format checked against the planner and the checker)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from datapipe.index import write_index
from datapipe.plan import cost as C
from datapipe.plan import simulate as S
from datapipe.plan.check import check_plan
from datapipe.plan.memory import format_preset_memory, model_state_bytes, preset_memory
from datapipe.plan.planner import PlannerConfig
from datapipe.shapes import MODEL_CONFIGS
from datapipe.stream import StreamConfig
from tools.cli import main

K, M = 1024, 1024 * 1024


def test_byted_statistics() -> None:
    """Tolerances: sample fractions +-0.5 points (exact-count strata), token shares +-1.5 points."""
    s = S.length_stats(S.sample_lengths("byted", 400_000, seed=1))
    assert abs(s["frac_samples_le_4k"] - 0.80) <= 0.005
    assert abs(s["frac_samples_ge_128k"] - 0.01) <= 0.0005
    assert abs(s["frac_tokens_ge_128k"] - 0.443) <= 0.015
    assert abs(s["frac_samples_ge_2m"] - 0.0005) <= 0.0001
    assert abs(s["frac_tokens_ge_2m"] - 0.121) <= 0.015


def test_github_statistics() -> None:
    s = S.length_stats(S.sample_lengths("github", 400_000, seed=2))
    assert abs(s["frac_tokens_gt_128k"] - 0.162) <= 0.015
    assert abs(s["frac_tokens_gt_256k"] - 0.098) <= 0.015


def test_segment_means_match_sampling() -> None:
    """The closed-form segment means the mixture is solved with agree with draws."""
    rng = np.random.Generator(np.random.PCG64(0))
    for seg in S.byted() + S.github():
        x = seg.sample(rng, 200_000)
        assert x.min() >= max(1, seg.lo) and x.max() <= seg.hi
        assert x.mean() == pytest.approx(seg.mean(), rel=0.03)


def test_draw_batches_fill_rule() -> None:
    pool = S.sample_lengths("byted", 50_000, seed=3)
    for b in S.draw_batches(np.minimum(pool, 2 * M), 4 * M, 5, seed=3):
        assert b.sum() <= 4 * M or b.size == 1


def write_dataset(root: Path, lengths: np.ndarray) -> None:
    """manifest.json + index.parquet for `lengths` (FORMAT.md), one fake shard."""
    root.mkdir(parents=True, exist_ok=True)
    rows = -(-lengths // 1024)
    write_index(
        str(root / "index.parquet"),
        lengths,
        np.zeros(len(lengths), np.int32),
        np.concatenate([[0], np.cumsum(rows)[:-1]]),
        rows,
        [f"fake:{i}" for i in range(len(lengths))],
    )
    manifest = {
        "mixlen_version": "0.1.0",
        "format": "mds",
        "dtype": "uint16",
        "chunk_tokens": 1024,
        "num_samples": len(lengths),
        "num_tokens": int(lengths.sum()),
        "num_rows": int(rows.sum()),
        "shards": [{"name": "shard.00000.mds", "rows": int(rows.sum()), "samples": len(lengths)}],
    }
    (root / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, np.ndarray]:
    rng = np.random.default_rng(7)
    lengths = np.minimum(rng.lognormal(np.log(300), 1.5, 3000).astype(np.int64) + 1, 20_000)
    root = tmp_path_factory.mktemp("ds")
    write_dataset(root, lengths)
    return root, lengths


def test_plan_cli_json_and_dump(dataset, tmp_path, capsys) -> None:
    root, lengths = dataset
    dump = tmp_path / "plan.json"
    args = "--ranks 16 --capacity 2048 --global-batch-tokens 200000 --steps 2 --model llama-7b"
    rc = main(["plan", str(root), *args.split(), "--no-widen", "--json", "--dump", str(dump)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    names = [p["policy"] for p in out["policies"]]
    assert names == ["static", "naive-hdp", "hdp"]  # --no-widen: no hdp+widen row
    for p in out["policies"]:
        for key in (
            "est_step_time_s",
            "imbalance",
            "max_over_lower_bound",
            "token_fill",
            "comm_bytes",
            "plan_ms",
        ):
            assert isinstance(p[key], float) and p[key] >= 0
    assert out["speedup_hdp_over_static"] > 1.0
    assert out["model_state_bytes_per_rank"] == _state_bytes_by_hand("llama-7b", 16)
    # activations at C = 2048, by hand for llama-7b (dim 4096, 32 heads and KV heads, ffn 11008,
    # 32 layers, vocabulary 32,000) in bfloat16: a position and layer keeps, without
    # checkpointing, 2 x (4 dim + 2 q + 2 kv + 4 ffn) + 4 x (2 dim + heads + 2) = 186,504 bytes;
    # selective 2 x (3 dim + 2 q + 2 kv + 2 ffn) + 4 x heads = 101,504; full 2 x dim = 8,192.
    # The loss: dL/dh 2048 x 4096 x 2, dL/dW 32000 x 4096 x (4 + 2), one chunk of 2048 x 32000
    # float32 logits and its bfloat16 copy.
    per = 32 * 2048
    assert out["activation_bytes_per_rank"] == {
        "kept_none": 186504 * per,
        "kept_selective": 101504 * per,
        "kept_full": 8192 * per,
        "recompute": 186504 * 2048,
        "backward": 2 * 2 * 11008 * 2048,  # a block's backward: 2 ffn in bfloat16
        "loss": 2048 * 4096 * 2 + 32000 * 4096 * 6 + 2048 * 32000 * (4 + 2),
    }
    # The dump replays: rebuild each step's batch from the stream, re-plan, compare per rank.
    d = json.loads(dump.read_text())
    assert len(d["steps"]) == 6
    stream = StreamConfig().open(str(root), 200000)
    batches = [next(stream) for _ in range(2)]
    cost = C.preset("llama-7b")
    for step in d["steps"]:
        b = batches[step["step"]]
        assert step["samples"] == [[int(s), int(n)] for s, n in zip(b.sample_ids, b.lengths)]
        plan = (
            PlannerConfig(
                policy=step["policy"],
                capacity=2048,
                max_context=int(lengths.max()),
                widen=bool(step["widen"]),
            )
            .build(cost, num_ranks=16)
            .plan(b.lengths, b.sample_ids)
        )
        check_plan(plan)
        assert step["digest"] == plan.digest().hex()
        for r in (0, 7, 15):
            got = step["ranks"][r]["microbatches"]
            want = plan.microbatches(r)
            assert [m["slot"] for m in got] == [m.slot for m in want]
            assert [m["pieces"] for m in got] == [[list(p) for p in m.pieces] for m in want]
            assert [m["group"] for m in got] == [list(m.group) for m in want]


def test_plan_cli_widen(dataset, tmp_path, capsys) -> None:
    """hdp widens by default, as `mixlen train` does: --policy all adds an hdp+widen row beside
    the smallest-group rule's hdp, and its dumped steps are the plans of `[parallel]`'s defaults
    (the trainer's planner) bit for bit; --policy hdp is hdp+widen alone, --no-widen plain hdp;
    an explicit --widen with another policy is refused."""
    root, lengths = dataset
    dump = tmp_path / "plan.json"
    args = ["plan", str(root), "--ranks", "4", "--capacity", "8192", "--model", "debug"]
    args += ["--global-batch-tokens", "40000", "--steps", "2", "--json"]
    assert main(args + ["--dump", str(dump)]) == 0
    out = json.loads(capsys.readouterr().out)
    by = {p["policy"]: p for p in out["policies"]}
    assert list(by) == ["static", "naive-hdp", "hdp", "hdp+widen"]
    assert by["hdp+widen"]["est_step_time_s"] <= by["hdp"]["est_step_time_s"]
    stream = StreamConfig().open(str(root), 40000)
    batches = [next(stream) for _ in range(2)]
    steps = [s for s in json.loads(dump.read_text())["steps"] if s["widen"]]
    assert len(steps) == 2 and all(s["policy"] == "hdp" for s in steps)
    max_ctx = int(lengths.max())  # plan's default --max-context: static's mesh, widen's candidate
    for step in steps:
        b = batches[step["step"]]
        cfg = PlannerConfig(capacity=8192, max_context=max_ctx)  # the trainer's defaults
        plan = cfg.build(C.preset("debug"), num_ranks=4).plan(b.lengths, b.sample_ids)
        assert plan.meta["widen"] and step["digest"] == plan.digest().hex()
    for flags, want in (([], ["hdp+widen"]), (["--no-widen"], ["hdp"])):
        assert main(args + ["--policy", "hdp", *flags]) == 0
        assert [p["policy"] for p in json.loads(capsys.readouterr().out)["policies"]] == want
    assert main(args + ["--policy", "static"]) == 0  # the default widen says nothing of static
    assert [p["policy"] for p in json.loads(capsys.readouterr().out)["policies"]] == ["static"]
    assert main(args[:-1] + ["--policy", "static", "--widen"]) == 2
    assert "--widen applies to the hdp policy only" in capsys.readouterr().err
    assert main(args[:-1] + ["--policy", "hdp"]) == 0  # the table says which row train runs
    header = [line for line in capsys.readouterr().out.splitlines() if "hdp" in line]
    assert header[0].split() == ["hdp+widen"]  # the table's one column
    assert header[-1].startswith("rows: ") and header[-1].endswith("runs hdp+widen")
    assert main(args[:-1] + ["--policy", "hdp", "--offload"]) == 0  # the row it shows
    header = [line for line in capsys.readouterr().out.splitlines() if "hdp" in line]
    assert header[0].split() == ["hdp+offload+widen"]
    assert header[-1].endswith("runs hdp+offload+widen")


def test_plan_cli_table_plot_html(dataset, tmp_path, capsys) -> None:
    root, _ = dataset
    png, page = tmp_path / "r.png", tmp_path / "r.html"
    rc = main(
        [
            "plan",
            str(root),
            "--ranks",
            "8",
            "--capacity",
            "4096",
            "--global-batch-tokens",
            "100000",
            "--policy",
            "hdp",
            "--offload",
            "--offload-gbps",
            "256",
            "--plot",
            str(png),
            "--html",
            str(page),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "hdp+offload" in text and "est. step time" in text
    # the default --model llama-7b: 121.3 GB of model state per rank at zero 0 on 8 ranks
    assert "model state per rank (llama-7b, bfloat16 compute, 8 ranks per island, GB;" in text
    assert "zero 0: weights 13.5  master 27.0  moments 53.9  grads 27.0" in text
    assert (
        "activations per rank at C=4096 positions (llama-7b, bfloat16, GB): kept by the blocks "
        "24.4 with activation_checkpoint none, 13.3 selective, 1.1 full" in text
    )
    fit = "largest --capacity in 85.5 GB (usable 80.2) beside zero 1's model state (tp 1, no "
    assert fit in text  # the trainer's ZeRO on 8 ranks
    from datapipe.plan.memory import format_activation_memory

    assert format_activation_memory("llama-7b", 4096, tp=2).endswith("not modelled (tp 1 only)")
    assert format_activation_memory("no-such-shape", 4096) == ""
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = page.read_text().split('id="plan-data">', 1)[1].split("</script>", 1)[0]
    # the page's embedded data: hdp widens by default, as `mixlen train` plans it
    assert json.loads(data)["policies"] == ["hdp+offload+widen"]


def test_plan_cli_errors(dataset, tmp_path, capsys) -> None:
    root, lengths = dataset
    args = [
        "plan",
        str(root),
        "--ranks",
        "2",
        "--capacity",
        "1024",
        "--global-batch-tokens",
        "50000",
    ]
    assert main(args + ["--policy", "hdp"]) == 2  # longest sample 20,000 > N*C
    assert "more than N * C" in capsys.readouterr().err
    assert main(args + ["--cost", str(tmp_path / "nope.json")]) == 2
    assert "cannot read cost file" in capsys.readouterr().err
    assert main(args + ["--max-context", "0"]) == 2  # refused, not taken as the default
    assert "--max-context: must be >= 1, got 0" in capsys.readouterr().err
    # the static mesh's context too short: only that setting makes room
    assert main(args + ["--policy", "static", "--ranks", "64", "--max-context", "100"]) == 2
    err = capsys.readouterr().err
    assert "more than --max-context = 100: no group can hold it (raise --max-context, or" in err


def test_plan_steps_bounds_and_offload_bits(dataset, capsys, monkeypatch) -> None:
    """--steps in [1, MAX_STEPS], both ends included (MAX_STEPS lowered to 2 to run its edge);
    --offload-gbps is gigabits per second: 8 of them are 10^9 bytes per second."""
    import argparse

    from tools import cmd_plan

    root, _ = dataset
    args = ["plan", str(root), "--ranks", "4", "--capacity", "32768",
            "--global-batch-tokens", "50000", "--policy", "hdp", "--json"]  # fmt: skip
    monkeypatch.setattr(cmd_plan, "MAX_STEPS", 2)
    for steps, rc in ((0, 2), (2, 0), (3, 2)):
        assert main([*args, "--steps", str(steps)]) == rc, steps
        out = capsys.readouterr()
        assert ("--steps: must be in [1, 2], got" in out.err) == (rc == 2), out.err
    ns = argparse.Namespace(model="llama-7b", cost=None, offload_gbps=8.0)
    assert cmd_plan.resolve_cost(ns).offload_bytes_per_s == 1e9


def test_simulate_cli_errors(tmp_path, capsys) -> None:
    """Refused before anything is drawn, naming the flag: a negative --seed, an output file in
    a folder that does not exist, a --lengths that is no distribution or folder; --offload is no
    flag of simulate (it shows every policy with and without)."""
    base = ["simulate", "--ranks", "8", "--capacity", "4096", "--context", "32768",
            "--global-batch-tokens", "100000", "--steps", "1"]  # fmt: skip
    missing = str(tmp_path / "nope" / "s.html")
    for extra, want in ((["--seed", "-3"], "--seed: must be >= 0, got -3"),
                        (["--html", missing], f"--html {missing}: its folder"),
                        (["--steps", "2", "--global-batch-tokens", str(1 << 40)],
                         "--steps x --global-batch-tokens: at most 2^40 tokens in all"),
                        (["--lengths", "bytedx"],
                         "--lengths: 'bytedx' is neither byted, github nor a dataset folder")):  # fmt: skip
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert want in err and "Traceback" not in err and ".tmp-" not in err, err
    with pytest.raises(SystemExit):
        main(base + ["--offload"])
    assert "unrecognized arguments: --offload" in capsys.readouterr().err


def test_simulate_cli_json(capsys) -> None:
    args = [
        "simulate",
        "--model",
        "llama-7b",
        "--ranks",
        "64",
        "--capacity",
        "8192",
        "--context",
        str(256 * K),
        "--lengths",
        "byted",
        "--global-batch-tokens",
        str(2 * M),
        "--steps",
        "1",
        "--json",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    by = {p["policy"]: p for p in out["policies"]}
    paper = {"static", "naive-hdp", "naive-hdp+offload", "hdp", "hdp+offload"}
    assert set(by) == paper | {"hdp+widen", "hdp+offload+widen"}  # widen: train's default
    assert by["static"]["speedup_over_static"] == 1.0
    assert by["hdp+widen"]["est_step_time_s"] <= by["hdp"]["est_step_time_s"]
    assert by["hdp"]["est_step_time_s"] <= by["naive-hdp"]["est_step_time_s"]
    assert out["paper"]["ablation_speedup"]["hdp+offload"] == 3.69
    assert out["model_state_bytes_per_rank"] == _state_bytes_by_hand("llama-7b", 64)
    # the table shows the same: each hdp variant's speedup, the largest CP groups first
    assert main(args[:-1]) == 0
    text = capsys.readouterr().out
    for name, p in by.items():
        if name.startswith("hdp"):
            assert f"speedup of {name} over static: {p['speedup_over_static']:.2f}x" in text
    row = next(line for line in text.splitlines() if line.startswith("CP groups (size x n)"))
    for name, p in by.items():  # each column: its 3 largest group sizes x their counts
        groups = sorted(((int(k), v) for k, v in p["groups_by_size"].items()), reverse=True)
        cell = " ".join(f"{k}x{v}" for k, v in groups[:3]) + (" ..." if len(groups) > 3 else "")
        assert cell in row, (name, cell, row)
    assert any(len(p["groups_by_size"]) > 3 for p in by.values())  # an order to get wrong


def _state_bytes_by_hand(model: str, n: int) -> dict:
    """Model-state bytes of rank 0 with bfloat16 compute: 2-byte weights in a flat buffer of n
    slices of S elements (P/n rounded up to 64), 4-byte master weights, moments and gradients;
    zero 1 keeps the slice of master and moments, zero 2 also of the gradient between steps."""
    from datapipe.shapes import get_config

    p = get_config(model).num_params()
    per = (p + n - 1) // n  # ceil(P / n)
    s = (per + 63) // 64 * 64
    full = {"weights": 2 * n * s, "grads": 4 * n * s, "grads_peak": 4 * n * s}
    rows = {
        "zero0": {**full, "master": 4 * n * s, "moments": 8 * p},
        "zero1": {**full, "master": 4 * s, "moments": 8 * s},
        "zero2": {**full, "master": 4 * s, "moments": 8 * s, "grads": 4 * s, "grads_peak": 4 * p},
    }
    for r in rows.values():
        r["optimizer"] = r["master"] + r["moments"]
        r["total"] = r["weights"] + r["optimizer"] + r["grads_peak"]
    return rows


def test_simulate_cli_dataset(dataset, capsys) -> None:
    root, _ = dataset
    rc = main(
        [
            "simulate",
            "--ranks",
            "8",
            "--capacity",
            "4096",
            "--context",
            "32768",
            "--lengths",
            str(root),
            "--global-batch-tokens",
            "100000",
            "--steps",
            "1",
            "--no-widen",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "assumptions:" in text and "hdp+offload" in text and "hdp+widen" not in text
    # --no-widen: train with widen = false runs plain hdp; with offload, the row with it
    assert "runs hdp (hdp+offload with [offload] enabled = true)\n" in text
    # its page written into the dataset it reads: refused before drawing anything
    inside = str(root / "sim.html")
    assert main(["simulate", "--lengths", str(root), "--html", inside]) == 2
    assert f"--html {inside}: inside the dataset folder " in capsys.readouterr().err
    assert not os.path.exists(inside)


def test_llama3_70b_published_size_and_tp8_share() -> None:
    cfg = MODEL_CONFIGS["llama3-70b"]
    assert cfg.num_params() == 70_553_706_496  # Meta's published count
    # by hand, one process of 8: vocabulary rows of embedding and output, 1/8 of every layer's
    # matrices (8 K/V heads: one per process), norms whole
    d, v, ffn, layers = 8192, 128256, 28672, 80
    per_layer = d * d // 8 * 2 + d * 1024 // 8 * 2 + 3 * d * ffn // 8 + 2 * d
    assert cfg.tp_params(8) == layers * per_layer + 2 * v * d // 8 + d == 8_820_367_360


def test_tp_model_state_table_llama3_70b_tp8_zero1_16_ranks() -> None:
    n = 8_820_367_360
    got = preset_memory("llama3-70b@h100", 16, "bfloat16", tp=8)["zero1"]
    want = model_state_bytes(n, 16, 1, "bfloat16").as_dict()
    assert got == want
    own = -(-n // 16 // 64) * 64  # rank 0's slice (aligned to 64 elements)
    assert got["weights"] >= 2 * n and got["moments"] == 2 * own * 4
    assert got["total"] < 80e9 < preset_memory("llama3-70b", 16, "bfloat16", tp=1)["zero1"]["total"]
    table = format_preset_memory("llama3-70b", 16, tp=8)
    assert "tp 8" in table and "zero 1:" in table and "(fits an 80 GB H100)" in table
