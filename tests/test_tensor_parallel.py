"""Tensor parallelism of the decoder (trainer.parallel.tensor) against the plain decoder, and
the per-process parameter count against hand arithmetic (Llama-3-70B's at tp 8, and its
model-state table: tests/test_simulate.py)."""

from __future__ import annotations

import json
from pathlib import Path

import _tp_worker
import pytest
from _hf_reference import hf_model, save

from tools.cli import main as cli_main
from trainer.parallel.comm import free_port, spawn

WORLD = 4


# a test's limit covers the one spawn of every 4-process check (the first test to use it)
TIMEOUT = 480


@pytest.fixture(scope="module")
def tp_all(tmp_path_factory) -> dict:
    """The one spawn of tests/_tp_worker.py main: its three parts' folders, and the training
    part's dataset, the reference trainer's run of its config and the Hugging Face Llama folder
    it started from."""
    import torch
    from _train_worker import make_dataset, train_config
    from test_reference_trainer import reference_run

    out = tmp_path_factory.mktemp("tp_all")
    tmp = out / "train"
    for name in ("tp", "exact", "train"):
        (out / name).mkdir()
    torch.set_num_threads(1)
    data = make_dataset(str(tmp / "ds"))
    ref = reference_run(train_config(data, str(tmp / "ref")))
    hf = hf_model("llama-llama3", vocab_size=300, bos_token_id=256, eos_token_id=257,
                  max_position_embeddings=1024)  # fmt: skip
    folder = save(hf, str(tmp / "llama"))
    spawn(
        _tp_worker.main, WORLD, (WORLD, free_port(), str(out), data, folder), timeout=TIMEOUT - 40
    )
    return {"out": out, "tmp": tmp, "data": data, "ref": ref, "hf": hf, "folder": folder}


@pytest.fixture(scope="module")
def tp_reports(tp_all) -> list[dict]:
    return [json.loads((tp_all["out"] / "tp" / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("case", [c[0] for c in _tp_worker.CASES])
def test_tp_decoder_equals_plain_decoder_float64(tp_reports, case) -> None:
    """Loss, labelled count, every parameter's gradient and the logits of each TP group equal
    the plain decoder's on that group's micro-batch (1e-10)."""
    for rank, rep in enumerate(tp_reports):
        r = rep[case]
        assert r["is_dtensor"]
        assert r["group"] == rank // r["tp"]
        assert r["n"] == r["n_ref"] > 0
        assert abs(r["loss"] - r["loss_ref"]) <= 1e-10 * abs(r["loss_ref"])
        assert r["weight_err"] == 0.0  # the shards put back together are the weights
        assert r["grad_err"] < 1e-10, (rank, r)
        assert r["logit_err"] < 1e-10, (rank, r)
    if tp_reports[0][case]["tp"] == 2:  # two groups, two micro-batches
        assert tp_reports[0][case]["loss"] != tp_reports[2][case]["loss"]


# bfloat16 keeps 8 significant bits (a relative rounding of 2^-9 per operation). Splitting the
# model over TP processes changes only where sums are cut and in which order the pieces add (each
# process's partial products, the all-reduces, the partial log-sum-exps combined), so the TP
# decoder's error against float64 is the same kind of rounding as the plain decoder's in bfloat16:
# it differs by the luck of the order, not in size. Measured on these 5 shapes x 2 micro-batches:
# TP / plain in [0.82, 1.37] for the logits and the gradients (largest error relative to the
# reference's largest magnitude), and for the loss (a sum of 29 float32 terms, whose errors mostly
# cancel) at most 1.75 x the plain decoder's largest over the micro-batches. Planting the partial
# log-sum-exps all-gathered in bfloat16 (a bug only bfloat16 shows) made the TP loss 3.6-29 x the
# plain one (8 x and more of the largest), its logits and gradients unchanged.
BF16_RATIO = 2.0  # logits and gradients, each micro-batch
BF16_LOSS_RATIO = 3.0  # the loss, against the plain decoder's largest over the micro-batches


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("case", [c[0] for c in _tp_worker.CASES])
def test_tp_decoder_bfloat16_is_as_close_as_the_plain_decoder(tp_reports, case) -> None:
    """In bfloat16 the TP decoder is as close to the float64 reference as the plain decoder in
    bfloat16 (from the same weights, on each TP group's micro-batch): its logits and gradients
    within BF16_RATIO of the plain decoder's error, its loss within BF16_LOSS_RATIO of the plain
    decoder's largest; the plain error is not 0 (bfloat16 ran) and small."""
    errs = [rep[case]["bf16"] for rep in tp_reports]
    for rank, err in enumerate(errs):
        for what in ("loss", "logits", "grads"):
            assert 0 < err["plain"][what] < 0.1, (rank, what, err)
        for what in ("logits", "grads"):
            assert err["tp"][what] <= BF16_RATIO * err["plain"][what], (rank, what, err)
    plain_loss = max(e["plain"]["loss"] for e in errs)
    assert max(e["tp"]["loss"] for e in errs) <= BF16_LOSS_RATIO * plain_loss, errs


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("case", [c[0] for c in _tp_worker.CASES])
def test_tp_params_is_what_a_process_holds(tp_reports, case) -> None:
    tp, kw = next((tp, kw) for name, tp, kw in _tp_worker.CASES if name == case)
    cfg = _tp_worker.shape(**kw)
    assert all(rep[case]["held"] == cfg.tp_params(tp) for rep in tp_reports)
    assert cfg.tp_params(1) == cfg.num_params() > cfg.tp_params(tp)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("tp", [4, 2])
def test_tp_offload_moves_the_local_activations(tp_reports, tp) -> None:
    """Activation offload at tp > 1: the manager sees every storage each block saves (the local
    tensors inside DTensor activations too: plain saved-tensor hooks count the same bytes), moves
    the first two of four blocks', each process saving less than the plain decoder; gradients
    equal the plain decoder's (float64)."""
    for rank, rep in enumerate(tp_reports):
        r = rep["offload"][f"tp{tp}"]
        assert r["blocks"] == r["want"], (rank, r)
        assert r["offloaded"] == 2 and r["moved"] >= 0.9 * sum(r["blocks"][:2]), (rank, r)
        assert sum(r["blocks"]) < sum(r["plain"]), (rank, r)
        assert r["grad_err"] < 1e-10, (rank, r)


@pytest.mark.timeout(TIMEOUT)
def test_selective_checkpointing_at_tp2_runs_no_matmul_or_all_reduce_again(tp_reports) -> None:
    """Selective checkpointing of DTensor blocks (tp 2): gradients equal the plain decoder's, and
    the backward runs the matmuls and all-reduces of no checkpointing (full runs more)."""
    for rank, rep in enumerate(tp_reports):
        r = rep["selective"]
        assert all(r[m]["grad_err"] < 1e-10 for m in r), (rank, r)
        assert (r["selective"]["mm"], r["selective"]["all_reduce"]) == (
            r["none"]["mm"],
            r["none"]["all_reduce"],
        ), (rank, r)
        assert (
            r["full"]["mm"] > r["none"]["mm"] and r["full"]["all_reduce"] > r["none"]["all_reduce"]
        )


@pytest.mark.parametrize(
    ("model", "tp", "message"),
    [
        ("debug", 4, "--tp: 4 does not divide the model's vocab_size (258)"),
        ("llama-7b", 3, "--tp: must be one of 1, 2, 4, 8, got 3"),
    ],
)
def test_tp_flag_refusals(model, tp, message, capsys) -> None:
    argv = ["simulate", "--model", model, "--ranks", "8", "--tp", str(tp), "--steps", "1"]
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err


def test_tp_problem_kv_heads() -> None:
    cfg = _tp_worker.shape(n_heads=8, n_kv_heads=4)
    assert cfg.tp_problem(8) is None and cfg.tp_problem(2) is None
    bad = _tp_worker.shape(n_heads=24, n_kv_heads=3, dim=48, ffn_dim=48)
    assert "n_kv_heads (3)" in bad.tp_problem(2)
    with pytest.raises(ValueError, match="parallel.tp 2 and the model's n_kv_heads"):
        bad.tp_params(2)


@pytest.mark.timeout(TIMEOUT)
def test_executor_tp2_hdp2_equals_reference_trainer_float64(tp_exactness) -> None:
    """4 gloo processes as 2 HDP ranks x tp 2: hdp (a ring of 2 beside local work) and static (a
    CP-2 mesh) at ZeRO 0, and ZeRO 1 and 2 with offload forced (hdp ZeRO 1 ratio 1, static
    ZeRO 2 ratio 0.5), each against the plain reference trainer:
    the whole first-step gradient within 1e-10 (exact zeros zero), the loss curve within 1e-9,
    the gradient norms (TP shards summed, replicated norms counted once) and the final weights."""
    import numpy as np
    import torch
    from _train_worker import (
        MODEL_SEED,
        TRAIN,
        compare,
        model_config,
        offload_model_config,
        scenario_data,
    )
    from test_reference_trainer import reference_train

    results = tp_exactness
    tokens, batches = scenario_data(lengths=_tp_worker.EXEC_LENGTHS)
    refs = {
        m: reference_train(tokens, batches, TRAIN, m(), torch.float64, MODEL_SEED)
        for m in (model_config, offload_model_config)
    }
    for case in _tp_worker.EXEC_CASES:
        got = results[case]
        ref = refs[model_config if case[2] is None else offload_model_config]
        assert got["group_sizes"][0] == ([2] if case[0] == "static" else [1, 2]), case
        compare(ref, got, torch.float64)
        np.testing.assert_allclose(got["grad_norms"], ref["grad_norms"], rtol=1e-9)
        if case[2] is not None:  # offload forced: every step moved saved activations to host
            assert min(got["moved"]) > 0, (case, got["moved"])
        err = (got["weights"] - ref["weights"]).abs().max().item()
        assert err < 1e-10 * ref["weights"].abs().max().item(), (case, err)


@pytest.fixture(scope="module")
def tp_exactness(tp_all) -> dict:
    import torch

    return torch.load(tp_all["out"] / "exact" / "tp_exactness.pt", weights_only=False)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("name", _tp_worker.ISLAND_CASES)
def test_islands_at_tp2_equal_plain_references_float64(tp_exactness, name) -> None:
    """2 islands x 1 HDP rank x tp 2 (4 processes): co2 (overlap, adaptive penalty, value
    clipping, Nesterov), global-norm clipping of the outer momentum, and sync equal the plain
    references of tests/_co2_worker.py (whole samples, torch AdamW per island, the contract's
    outer rule): every island's loss curve and the final weights within 1e-9."""
    import _co2_worker as cw
    from test_islands import check

    got = tp_exactness["islands"][name]
    want = cw.reference(got["mode"], got["co2"])
    w = want["weights"]
    err = float((got["weights"] - w).abs().max() / w.abs().max())
    check(name, got["losses"], err, want)
    if name == "co2-clipnorm":  # the momentum's global norm (TP shards summed) was clipped
        recs = [r for r in got["records"] if r.get("co2_applied")]
        assert recs and all(r["co2_clipped_fraction"] == 1.0 for r in recs), recs
    if name == "co2":
        recs = [r for r in got["records"] if r.get("co2_applied")]
        assert all(0 < r["co2_clipped_fraction"] < 1 for r in recs), recs
        assert recs[-1]["co2_penalty"] > 1.01


@pytest.fixture(scope="module")
def tp_train(tp_all) -> dict:
    """The tp 2 training part's runs (tests/_tp_worker.py train_runs) beside the reference
    trainer's run of the same config and the Hugging Face Llama folder it started from."""
    runs = [json.loads((tp_all["tmp"] / f"losses{r}.json").read_text()) for r in range(WORLD)]
    return {**tp_all, "runs": runs}


@pytest.mark.timeout(TIMEOUT)
def test_train_tp2_four_processes_equals_reference(tp_train) -> None:
    """`parallel.tp = 2` on 4 gloo processes (2 HDP ranks): the hdp loss curve and validation
    losses equal the reference trainer's (float32), comparing with static on the way changes
    nothing, a resume continues the curve exactly, at tp 1 on 4 ranks (and tp 1 -> 2) within
    float32 rounding, static with activation checkpointing equals it; every process reports the
    same losses; the checkpoint holds the reference's final weights."""
    import numpy as np
    import torch
    from _train_worker import train_config

    from trainer.checkpoint.weights import read_model_weights
    from trainer.model.transformer import build

    tmp, runs, ref, data = tp_train["tmp"], tp_train["runs"], tp_train["ref"], tp_train["data"]
    assert [r["world"] for r in runs] == [[2, 2, p % 2, p, 4] for p in range(WORLD)]
    got = runs[0]
    assert all(r["straight"] == got["straight"] for r in runs)
    assert got["second_start"] == 3
    assert got["first"] + got["second"] == got["straight"]
    # resumed at another tp and HDP size (tp 2 x 2 ranks <-> tp 1 x 4 ranks), the curve goes on
    assert got["at_tp1"][0] == got["at_tp2"][0] == 3
    np.testing.assert_allclose(got["at_tp1"][1], got["straight"][3:], rtol=1e-5)
    np.testing.assert_allclose(got["first_tp1"], got["straight"][:3], rtol=1e-5)
    np.testing.assert_allclose(got["at_tp2"][1], got["straight"][3:], rtol=1e-5)
    np.testing.assert_allclose(got["straight"], ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["static"], ref["losses"][:3], rtol=1e-5)
    np.testing.assert_allclose(
        [v for _, v in got["val"]], [v for _, v in ref["val_losses"]], rtol=1e-5
    )
    recs = [json.loads(x) for x in open(tmp / "straight" / "metrics.jsonl")]
    assert [r["step"] for r in recs] == list(range(1, 7))  # one writer: process 0
    assert [r["step"] for r in recs if "compare" in r] == [3, 6]
    # the DCP checkpoint holds whole tensors: the reference's final weights, under plain names
    weights = read_model_weights(str(tmp / "straight" / "ckpt"))
    plain = build(train_config(data, "unused").model.shape(), device="meta")
    flat = torch.cat([weights[n].reshape(-1).double() for n, _ in plain.named_parameters()])
    assert flat.shape == ref["weights"].shape
    err = float((flat - ref["weights"]).norm() / ref["weights"].norm())
    assert err < 1e-5, err


@pytest.mark.timeout(TIMEOUT)
def test_tp2_eval_and_export_equal_one_process(tp_train, capsys) -> None:
    """`mixlen eval --nproc 4 --tp 2` of the tp 2 checkpoint and of the Hugging Face folder
    equal the one-process evaluations, each process reading only its shards; the checkpoint
    exported gives transformers the plain decoder's logits (1e-5)."""
    import torch
    from _train_worker import train_config
    from test_hf_export import hf_load

    from trainer.checkpoint.weights import read_model_weights
    from trainer.model.transformer import build

    tmp, got, data = tp_train["tmp"], tp_train["runs"][0], tp_train["data"]
    ckpt = str(tmp / "straight" / "ckpt")
    ev = ["eval", ckpt, data, "--split", "all", "--no-passkey", "--capacity", "1024"]
    assert cli_main([*ev, "--json"]) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["eval"]["tokens"] == one["tokens"] > 0
    assert got["eval"]["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert [b["tokens"] for b in got["eval"]["by_position"]] == [
        b["tokens"] for b in one["by_position"]
    ]
    # each process read its shards' chunks of the checkpoint: half of each split weight (the
    # debug shape's 2 K/V heads split too), each norm whole
    whole = read_model_weights(ckpt)
    for r in tp_train["runs"]:
        want = {n: t.numel() // (1 if "norm" in n else 2) for n, t in whole.items()}
        assert r["ckpt_read"] == want
    # the Hugging Face folder evaluated at tp 2 (its tensors read slice by slice) too
    assert cli_main(["eval", tp_train["folder"], *ev[2:], "--json"]) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    loss, tokens, _ = got["hf_eval"]
    assert tokens == one["tokens"] > 0 and loss == pytest.approx(one["loss"], rel=1e-6)
    # exported from the tp 2 checkpoint, transformers gives the plain decoder's logits
    assert cli_main(["export", ckpt, "--hf", str(tmp / "hf")]) == 0
    mine = build(train_config(data, "unused").model.shape())
    mine.load_state_dict(read_model_weights(ckpt))
    ids = torch.randint(0, 258, (200,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got_hf = mine(ids, torch.arange(200)), hf_load(str(tmp / "hf"))(ids[None])
    assert (got_hf.logits[0] - want).norm() <= 1e-5 * want.norm()


@pytest.mark.timeout(TIMEOUT)
def test_tp2_pretrained_reads_only_its_slices(tp_train) -> None:
    """A Hugging Face Llama (tied embeddings, GQA) at tp 2 gives transformers' loss of the first
    batch; each process read only its shards' slices of the safetensors tensors (training and
    `mixlen eval --tp 2` of the folder): half of each split tensor, each norm whole."""
    hf, runs = tp_train["hf"], tp_train["runs"]
    assert runs[0]["pretrained"][0] == pytest.approx(hf_first_loss(hf, tp_train["data"]), rel=1e-5)
    total = {n: t.numel() for n, t in hf.state_dict().items() if n != "lm_head.weight"}
    for reads in ([r["pretrained_read"] for r in runs], [r["hf_eval"][2] for r in runs]):
        assert all(set(r) == set(total) for r in reads)
        for name, n in total.items():
            each = [r[name] for r in reads]
            want = [n] * 4 if "norm" in name else [n // 2] * 4
            assert each == want, (name, each)


def hf_first_loss(hf, data: str) -> float:
    """transformers' loss of the first global batch of `train_config(data)`: token losses summed
    over the batch's samples, divided by its labelled positions (the same stream and split as
    test_reference_trainer.reference_run)."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from _train_worker import train_config
    from readback import read_rows, samples_from_rows

    from datapipe.stream import held_out_mask

    cfg = train_config(data, "unused")
    manifest = json.loads((Path(data) / "manifest.json").read_text())
    by_id = samples_from_rows(read_rows(data, manifest))
    lengths = np.array([len(by_id[i]) for i in range(len(by_id))], dtype=np.int64)
    ids = np.arange(len(lengths), dtype=np.int64)
    train_ids = ids[~held_out_mask(ids, cfg.data.stream.seed, cfg.data.val_fraction)]
    stream = cfg.data.stream.build(lengths[train_ids], cfg.train.global_batch_tokens)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in train_ids[next(stream).sample_ids]:
            x = torch.as_tensor(np.asarray(by_id[i], dtype=np.int64))
            logits = hf(x[None]).logits[0]
            total += float(F.cross_entropy(logits[:-1].double(), x[1:], reduction="sum"))
            count += len(x) - 1
    return total / count


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"parallel": {"tp": 4}}, "parallel.tp: 4 does not divide the model's vocab_size (258)"),
        ({"parallel": {"tp": 3}}, "parallel.tp"),
    ],
)
def test_tp_config_refusals(sections, message) -> None:
    from _train_worker import train_config

    from datapipe.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        train_config("unused", "unused", **sections).validate()


def test_tp_must_divide_the_processes() -> None:
    from _train_worker import train_config

    from datapipe.errors import ConfigError

    cfg = train_config("unused", "unused", parallel={"tp": 2})
    assert cfg.parallel.ranks_per_island(4) == 2
    with pytest.raises(ConfigError, match="parallel.tp: 2 tensor-parallel processes per rank"):
        cfg.parallel.ranks_per_island(3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("clip", ["value", "norm"])
def test_tp_members_outer_sums_equal_the_whole_models(clip):
    """Two TP members, each holding half the rows of a matrix and the whole (replicated) norm,
    compute the penalty, the update norm and the clipped fraction of the whole model: norms and
    clipped counts summed over the TP group with the replicated parameter counted once, the
    fraction over the whole model's elements (reference: one OuterSync over the whole model)."""
    import torch
    from test_co2 import F64, _Rank, oc

    from trainer.islands.co2 import OuterSync
    from trainer.parallel.slices import FlatLayout as Layout
    from trainer.testing.threads import run_threads

    g = torch.Generator().manual_seed(7)
    d, d_prev, m = (torch.randn(17, generator=g, dtype=F64) for _ in range(3))
    cfg = oc(
        staleness_lambda=0.5, nesterov=True, clip=clip, clip_value=0.8 if clip == "value" else 2.0
    )

    def stats(sync, pick) -> tuple:
        for buf, v in ((sync.inflight, d), (sync.d_prev, d_prev), (sync.momentum, m)):
            buf.copy_(pick(v))
        sync.has_prev = True
        return sync._prepare(True, 0.7)

    plain = OuterSync(cfg, Layout([(4, 3), (5,)], 1, 1), _Rank(0, 1), _Rank(0, 1), dtype=F64)
    want = stats(plain, lambda v: v)

    def member(comm):
        t = comm.rank
        lay = Layout([(2, 3), (5,)], 1, 1)
        sync = OuterSync(
            cfg, lay, _Rank(0, 1), _Rank(0, 1), dtype=F64, tp=comm, replicated=[False, True]
        )
        return stats(
            sync, lambda v: torch.cat([v[:12].view(4, 3)[2 * t : 2 * t + 2].reshape(-1), v[12:]])
        )

    got = run_threads(2, member, timeout=30)
    assert 0 < want[2] < 1 if clip == "value" else want[2] == 1.0  # clipping acted
    assert want[0] > 1.01  # the penalty acted
    for g2 in got:
        assert g2 == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("kv", [2, 1])
def test_four_tp_all_reduces_a_layer(kv: int) -> None:
    """What the cost model counts (datapipe.plan.costfit.TP_PASSES): per layer, the attention and
    SwiGLU outputs forward and their inputs' gradients backward, once each (the projections
    that read one norm's output add their gradients before the all-reduce). Counted in one
    process on torch's fake process group of 2, which runs no collective."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from datapipe.plan.costfit import TP_PASSES
    from datapipe.shapes import get_config
    from trainer.attention.local import LocalAttention
    from trainer.model.transformer import build
    from trainer.parallel.tensor import parallelize, tp_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        cfg = get_config("debug", n_layers=2, n_kv_heads=kv, tie_embeddings=False)
        model = parallelize(build(cfg, "cpu", torch.float32), tp_mesh(2))
        x = torch.randn(16, cfg.dim, requires_grad=True)
        cos, sin = model.rope.cos_sin(torch.arange(16), x.dtype, None)
        fwd, bwd = CommDebugMode(), CommDebugMode()
        with fwd:
            h = x
            for block in model.layers:
                h = block(h, cos, sin, LocalAttention([0, 16]))
        with bwd:
            h.sum().backward()
        counts = [
            {str(k).rsplit(".", 1)[-1]: v for k, v in m.get_comm_counts().items()}
            for m in (fwd, bwd)
        ]
    finally:
        dist.destroy_process_group()
    assert counts[0]["all_reduce"] + counts[1]["all_reduce"] == TP_PASSES * cfg.n_layers
    assert counts[0]["all_reduce"] == counts[1]["all_reduce"]
    # K/V replicated (tp > n_kv_heads): each process's K/V head gradients are gathered
    assert counts[1].get("all_gather_into_tensor", 0) == (0 if kv == 2 else 2 * cfg.n_layers)
