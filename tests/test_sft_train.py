"""Training on instruction data: the loss mask travels as the labels through packing and zigzag
ring splits, and both loss rules (`[train] loss_normalization`, datapipe.plan.loss) equal a
reference that trains whole samples one at a time (float64): "token" (the step's trained-token
losses over its trained positions) and "sequence" (each sample's mean over its own trained
positions, averaged over the step's samples that have one). The reference shares nothing with the
executor but the model's forward: it masks the per-position cross-entropy itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _train_worker import TRAIN, make_plan, model_config, optimizer
from test_reference_trainer import reference_lr

from datapipe.fetch import MemoryFetcher
from datapipe.plan.loss import IGNORE_INDEX
from trainer.model.transformer import build_model
from trainer.parallel.executor import HDPExecutor
from trainer.testing.threads import run_threads

F64 = torch.float64
SEED = 1
# 155 needs 3 ranks at capacity 64 and 103 two: rings split samples (and their masks) unevenly
LENGTHS = [155, 103, 20, 17, 30, 9, 25, 12, 5, 40, 3]
STEPS = 3

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def masked_scenario(seed: int = 0):
    """STEPS batches of LENGTHS with random trained spans: prompt-like runs untrained, answer-like
    runs trained; one sample per batch trains nothing (a unit with no trained token)."""
    rng = np.random.default_rng(seed)
    tokens, masks, batches = [], [], []
    for _ in range(STEPS):
        ids = np.arange(len(tokens), len(tokens) + len(LENGTHS), dtype=np.int64)
        batches.append(ids[rng.permutation(len(LENGTHS))])
        for k, n in enumerate(LENGTHS):
            tokens.append(rng.integers(0, 200, size=n))
            m = np.zeros(n, bool)
            if k != 5:  # sample 5 (9 tokens) of every batch: nothing trained
                for _ in range(rng.integers(1, 4)):
                    a = int(rng.integers(1, n))
                    m[a : a + int(rng.integers(1, max(2, n // 3)))] = True
            masks.append(m)
    return tokens, masks, batches


def reference_loss(model, tokens, masks, ids, rule: str) -> torch.Tensor:
    """Whole samples one at a time: cross-entropy of each position whose next token is trained;
    "token": their sum over their count; "sequence": each sample's mean, averaged over the
    samples with a trained position."""
    num = torch.zeros((), dtype=F64)
    counts = []
    for i in ids:
        t = torch.as_tensor(tokens[i], dtype=torch.int64)
        keep = torch.as_tensor(masks[i][1:])
        counts.append(int(keep.sum()))
        if not counts[-1]:
            continue
        ce = F.cross_entropy(model(t, torch.arange(len(t)))[:-1], t[1:], reduction="none")
        part = ce[keep].sum().double()
        num = num + (part if rule == "token" else part / counts[-1])
    den = sum(counts) if rule == "token" else sum(c > 0 for c in counts)
    return num / den


def reference_train(rule: str, steps: int = STEPS) -> dict:
    tokens, masks, batches = masked_scenario()
    model, _ = build_model(model_config(), F64, "cpu", seed=SEED)
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        params, lr=TRAIN["lr"], betas=(TRAIN["beta1"], TRAIN["beta2"]),
        weight_decay=TRAIN["weight_decay"],
    )  # fmt: skip
    out: dict = {"losses": []}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = reference_loss(model, tokens, masks, batches[step], rule)
        loss.backward()
        if step == 0:
            out["grad"] = torch.cat([p.grad.reshape(-1).double() for p in params])
        torch.nn.utils.clip_grad_norm_(params, TRAIN["grad_clip"])
        for g in opt.param_groups:
            g["lr"] = reference_lr(step, TRAIN)
        opt.step()
        out["losses"].append(float(loss.detach()))
    out["weights"] = torch.cat([p.detach().reshape(-1).double() for p in params])
    return out


def executor_train(comm, policy: str, rule: str, steps: int = STEPS) -> dict:
    tokens, masks, batches = masked_scenario()
    fetcher = MemoryFetcher(tokens, masks)
    model, master = build_model(model_config(), F64, "cpu", seed=SEED)
    opt, sched = optimizer(model, master, comm, level=1)
    ex = HDPExecutor(model, opt, comm, scheduler=sched, loss_normalization=rule)
    out: dict = {"losses": [], "groups": set(), "labels": 0}
    for step in range(steps):
        ids = batches[step]
        plan = make_plan(policy, fetcher.lengths[ids], ids, comm.size)
        out["groups"] |= {int(k) for k in plan.group_sizes}
        fetched = fetcher.fetch_step([np.array(m.pieces) for m in plan.microbatches(comm.rank)])
        out["labels"] += sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in fetched)
        # the index's count: trained tokens after each sample's first (here from the masks)
        loss_tokens = np.array([masks[i][1:].sum() for i in plan.sample_ids], np.int64)
        res = ex.accumulate(plan, fetched, step, loss_tokens)
        if step == 0:
            out["grad"] = opt.gather_grad().double()
            out["n_labels"], out["divisor"] = res.n_labels, res.loss_divisor
        ex.update(res)
        out["losses"].append(res.loss)
    out["weights"] = opt.gather_master().double()
    return out


@pytest.mark.parametrize("rule", ["token", "sequence"])
def test_masked_training_equals_reference(rule):
    """float64: every policy's first gradient within 1e-10 relative in norm, and hdp's loss
    curve and final weights after STEPS AdamW steps, against the whole-sample reference."""
    ref = reference_train(rule)
    tokens, masks, batches = masked_scenario()
    lt = [int(masks[i][1:].sum()) for i in batches[0]]
    runs = {"single": run_threads(1, lambda c: executor_train(c, "single", rule, 1))}
    for policy in ("hdp", "static"):
        runs[policy] = run_threads(4, lambda c, p=policy: executor_train(c, p, rule, 1))
    runs["hdp-3"] = run_threads(4, lambda c: executor_train(c, "hdp", rule))
    assert {3, 2} <= runs["hdp"][0]["groups"] and 4 in runs["static"][0]["groups"]
    for name, outs in runs.items():
        got = outs[0]
        assert got["n_labels"] == sum(lt)  # the step's trained positions
        assert got["divisor"] == (sum(lt) if rule == "token" else sum(n > 0 for n in lt))
        labels = sum(o["labels"] for o in outs)  # every rank's labels: each trained target once
        assert labels == sum(
            int(masks[i][1:].sum()) for b in batches[: len(got["losses"])] for i in b
        )
        err = (got["grad"] - ref["grad"]).norm() / ref["grad"].norm()
        assert err < 1e-10, (name, float(err))
        assert abs(got["losses"][0] - ref["losses"][0]) < 1e-12 * ref["losses"][0]
    got = runs["hdp-3"][0]
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-10)
    err = (got["weights"] - ref["weights"]).norm() / ref["weights"].norm()
    assert err < 1e-10


def test_sequence_rule_weighs_samples_not_tokens():
    """The two rules differ exactly where samples have different trained counts: with one
    trained position in a sample and many in another, "sequence" gives the short answer the
    same weight as the long one."""
    ref_t = reference_train("token", 1)["losses"][0]
    ref_s = reference_train("sequence", 1)["losses"][0]
    assert abs(ref_t - ref_s) > 1e-4


def test_eval_reports_trained_positions_only():
    """Evaluation on masked data (trainer.eval.run on 1 and 3 threaded ranks, the long samples on
    rings): the loss and its position buckets are over the trained targets only, each equal to
    the plain cross-entropy of those positions with each sample alone (float64)."""
    from datapipe.plan.cost import preset
    from datapipe.plan.planner import PlannerConfig
    from trainer.eval.buckets import bucket_of
    from trainer.eval.run import evaluate_samples, fetched, planned_batches

    tokens, masks, _ = masked_scenario()
    tokens, masks = tokens[: len(LENGTHS)], masks[: len(LENGTHS)]
    model, _ = build_model(model_config(), F64, "cpu", seed=SEED)
    pos: dict[int, list[float]] = {}
    with torch.no_grad():
        for t, m in zip(tokens, masks):
            ids = torch.as_tensor(t, dtype=torch.int64)
            ce = F.cross_entropy(model(ids, torch.arange(len(t)))[:-1], ids[1:], reduction="none")
            for p in np.flatnonzero(m[1:]):
                pos.setdefault(int(bucket_of(np.array([p]))[0]), []).append(float(ce[p]))
    fetcher = MemoryFetcher(tokens, masks)

    def run(comm):
        planner = PlannerConfig(capacity=256 if comm.size == 1 else 64).build(
            preset("debug"), comm.size
        )
        plans = planned_batches(planner, np.arange(len(tokens)), fetcher.lengths, 256)
        ex = HDPExecutor(model, None, comm)
        return evaluate_samples(ex, fetched(plans, fetcher.fetch_step, comm.rank), comm.rank)

    n = sum(len(v) for v in pos.values())
    for size in (1, 3):
        b = run_threads(size, run)[0]
        assert b.tokens == n == sum(int(m[1:].sum()) for m in masks)
        assert b.loss == pytest.approx(sum(sum(v) for v in pos.values()) / n, rel=1e-9)
        for r in b.by_position():
            v = pos[int(bucket_of(np.array([r["start"]]))[0])]
            assert r["tokens"] == len(v) and r["loss"] == pytest.approx(sum(v) / len(v), rel=1e-9)


def tp_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """4 gloo processes as 2 HDP ranks x tp 2: the masked scenario under hdp (samples on rings of
    the 2 HDP ranks, each TP group splitting the model and the vocabulary-parallel loss), both
    rules, float64; rank 0 saves each rule's first gradient (whole), loss curve and weights."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallel.comm import TorchComm, init_local_gloo
    from trainer.parallel.tensor import parallelize, whole_flat

    init_local_gloo(rank, world, port, timeout_s=60)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    hdp = TorchComm(mesh.get_group("dp"))
    tp_comm = TorchComm(mesh.get_group("tp"))
    for t in range(2):  # each TP index's gradient group, created by every rank
        group = dist.new_group(list(range(t, world, 2)))
        if t == rank % 2:
            grad_comm = TorchComm(group)
    out = {}
    for rule in ("token", "sequence"):
        tokens, masks, batches = masked_scenario()
        fetcher = MemoryFetcher(tokens, masks)
        model, master = build_model(model_config(), F64, "cpu", seed=SEED)
        for m in {id(model): model, id(master): master}.values():
            parallelize(m, mesh["tp"])
        opt, sched = optimizer(model, master, hdp, level=1, grad_comm=grad_comm, tp_comm=tp_comm)
        ex = HDPExecutor(model, opt, hdp, scheduler=sched, loss_normalization=rule)
        got: dict = {"losses": []}
        for step in range(STEPS):
            ids = batches[step]
            plan = make_plan("hdp", fetcher.lengths[ids], ids, hdp.size, capacity=96)
            mbs = fetcher.fetch_step([np.array(m.pieces) for m in plan.microbatches(hdp.rank)])
            lt = np.array([masks[i][1:].sum() for i in plan.sample_ids], np.int64)
            res = ex.accumulate(plan, mbs, step, lt)
            if step == 0:
                got["grad"] = whole_flat(model, opt.gather_grad()).double()
                got["groups"] = sorted({int(k) for k in plan.group_sizes})
            ex.update(res)
            got["losses"].append(res.loss)
        got["weights"] = whole_flat(model, opt.gather_master()).double()
        out[rule] = got
    if rank == 0:
        torch.save(out, os.path.join(out_dir, "sft_tp.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_masked_training_at_tp2_equals_reference(tmp_path):
    """Tensor parallelism (2 HDP ranks x tp 2, 4 processes): the masked labels and the
    "sequence" weights reach every TP member's share of the loss; both rules' first gradient,
    loss curve and final weights equal the whole-sample reference (float64)."""
    from trainer.parallel.comm import free_port, spawn

    spawn(tp_main, 4, (4, free_port(), str(tmp_path)), timeout=220)
    got = torch.load(tmp_path / "sft_tp.pt", weights_only=False)
    for rule in ("token", "sequence"):
        ref, g = reference_train(rule), got[rule]
        assert 2 in g["groups"]  # samples split over the 2 HDP ranks' ring
        assert (g["grad"] - ref["grad"]).norm() / ref["grad"].norm() < 1e-10
        np.testing.assert_allclose(g["losses"], ref["losses"], rtol=1e-10)
        assert (g["weights"] - ref["weights"]).norm() / ref["weights"].norm() < 1e-10


@pytest.mark.parametrize("rule", ["token", "sequence"])
def test_sync_islands_normalise_over_every_island(rule):
    """2 islands x 2 threaded ranks in sync mode: each island runs its own masked batch; the
    loss and gradient are those of one process on the union of both batches (the denominator,
    trained positions or samples with one, summed across the islands)."""
    from trainer.parallel.zero import ZeroOptimizer
    from trainer.testing.threads import run_islands

    tokens, masks, batches = masked_scenario()
    fetcher = MemoryFetcher(tokens, masks)

    def body(comm, cross):
        model, master = build_model(model_config(), F64, "cpu", seed=SEED)
        zero = ZeroOptimizer.for_model(model, comm, master=master, level=1, cross_comm=cross)
        ex = HDPExecutor(model, zero, comm, cross_comm=cross, loss_normalization=rule)
        ids = batches[cross.rank]
        plan = make_plan("hdp", fetcher.lengths[ids], ids, comm.size, capacity=96)
        mbs = fetcher.fetch_step([np.array(m.pieces) for m in plan.microbatches(comm.rank)])
        lt = np.array([masks[i][1:].sum() for i in plan.sample_ids], np.int64)
        res = ex.accumulate(plan, mbs, 0, lt)
        return res.loss, zero.gather_grad().double()

    out = run_islands(2, 2, body)
    model, _ = build_model(model_config(), F64, "cpu", seed=SEED)
    loss = reference_loss(model, tokens, masks, np.concatenate(batches[:2]), rule)
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1).double() for p in model.parameters()])
    want = float(loss.detach())
    for got_loss, got_grad in out:
        assert abs(got_loss - want) < 1e-12 * want
        assert (got_grad - grad).norm() / grad.norm() < 1e-10
