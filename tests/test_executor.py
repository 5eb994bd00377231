"""The HDP step executor: tiny samples and idle ranks, refusals, plan agreement, ring bytes (the
exactness tests against the reference trainer are in tests/test_reference_trainer.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from _train_worker import (
    LENGTHS,
    WORLD,
    compare,
    make_plan,
    model_config,
    run_policy,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from datapipe.errors import MixlenError
from datapipe.fetch import MemoryFetcher
from datapipe.plan.loss import labelled_positions
from datapipe.plan.zigzag import member_ranges
from trainer.model.transformer import build_model
from trainer.parallel.comm import SoloComm
from trainer.parallel.executor import HDPExecutor
from trainer.parallel.zero import ZeroOptimizer
from trainer.testing.threads import run_threads

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def test_labelled_positions():
    lengths = np.array([5, 0, 300, 17, 64, 1], dtype=np.int64)
    assert labelled_positions(lengths) == 4 + 299 + 16 + 63 + 0


def test_idle_ranks_and_tiny_samples():
    """Ranks without micro-batches still join the reduction; samples of 1 token have no label."""
    tokens = [np.arange(n) % 258 for n in (10, 7, 1)]
    fetcher = MemoryFetcher(tokens)

    def run(comm):
        ids = np.arange(3)
        policy = "single" if comm.size == 1 else "hdp"
        plan = make_plan(policy, fetcher.lengths, ids, comm.size)
        model, _ = build_model(model_config(), F64, seed=3)
        ex = HDPExecutor(model, ZeroOptimizer.for_model(model, comm, level=1), comm)
        mine = plan.microbatches(comm.rank)
        res = ex.accumulate(plan, fetcher.fetch_step([np.array(m.pieces) for m in mine]), 0)
        return res, ex.zero.gather_grad()

    ((ref, g_ref),) = run_threads(1, run)
    out = run_threads(4, run)
    assert out[0][0].microbatches.count(0) >= 1  # three samples on 4 ranks: one runs none
    assert out[0][0].n_labels == 9 + 6 + 0 == ref.n_labels
    # float64 sums in another order: an element near 0 may differ by 1e-12 of itself (seen on an
    # AMD EPYC host), never by more than 1e-14 of the largest
    scale = float(g_ref.abs().max())
    torch.testing.assert_close(out[0][1], g_ref, rtol=1e-12, atol=1e-14 * scale)
    assert abs(out[0][0].loss - ref.loss) <= 1e-12 * ref.loss


def test_offload_plan_refused_without_offload_enabled():
    plan = make_plan("hdp", np.array([150, 20]), np.arange(2), 4)
    plan = dataclasses.replace(plan, mb_offload=np.where(plan.group_sizes > 1, 0.5, 0.0))
    model, _ = build_model(model_config(), F64)
    ex = HDPExecutor(model, ZeroOptimizer.for_model(model, SoloComm()), SoloComm())
    ex.comm.size = 4  # the refusal comes before any communication
    with pytest.raises(MixlenError, match="step 7: .*offload.enabled = false"):
        ex.check_plan(plan, 7)


def test_plan_disagreement_stops_every_rank():
    def run(comm):
        lengths = np.array([150, 100, 20] if comm.rank != 2 else [150, 100, 21])
        plan = make_plan("hdp", lengths, np.arange(3), comm.size)
        model, _ = build_model(model_config(), F64)
        ex = HDPExecutor(model, ZeroOptimizer.for_model(model, comm), comm)
        try:
            ex.check_plan(plan, 5)
        except MixlenError as exc:
            return str(exc)
        return None

    msgs = run_threads(4, run, timeout=30)
    assert all(m is not None and "step 5" in m and "disagrees" in m for m in msgs)
    assert "[2]" in msgs[0] and "[0, 1, 3]" in msgs[2]


def test_ring_bytes_counted():
    """CountingComm's P2P bytes equal an independent count of the plan's ring hops."""
    fetcher = MemoryFetcher([np.arange(n) % 258 for n in (150, 100, 20)])
    cfg = model_config()

    def run(comm):
        plan = make_plan("hdp", fetcher.lengths, np.arange(3), comm.size)
        model, _ = build_model(cfg, F64)
        ex = HDPExecutor(model, ZeroOptimizer.for_model(model, comm), comm)
        mine = plan.microbatches(comm.rank)
        res = ex.accumulate(plan, fetcher.fetch_step([np.array(m.pieces) for m in mine]), 0)
        return res.rank_p2p_bytes, [(m.group, m.group_index, m.group_pieces) for m in mine]

    kv = 2 * cfg.n_kv_heads * cfg.head_dim * 8  # float64 K+V bytes of one position, one layer
    for sent, mbs in run_threads(4, run):
        want = 0
        for group, p, pieces in mbs:
            k = len(group)
            if k == 1:
                continue
            count = [
                sum(b - a for sid, s, e in pieces for a, b in member_ranges(e - s, k, j))
                for j in range(k)
            ]
            total = sum(count)
            # forward and backward each pass on the K/V of every member but the next one
            # (k-1 hops); backward also passes the dK/dV accumulators of all k members
            want += cfg.n_layers * kv * (2 * (total - count[(p + 1) % k]) + total)
        assert sent == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exactness_threads_cuda(dtype, monkeypatch):
    """On a GPU (benchmarks/gpu_smoke.sh): 4 fake ranks sharing the device vs `single`, local
    micro-batches through flash-attn varlen when installed, bf16 within BF16_GRAD_RTOL."""
    import _train_worker as w

    real = w.build_model
    monkeypatch.setattr(
        w, "build_model", lambda cfg, dt, dev="cpu", seed=0: real(cfg, dt, "cuda", seed)
    )
    orig_init = HDPExecutor.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **{**k, "device": "cuda"})

    monkeypatch.setattr(HDPExecutor, "__init__", init)
    ref = run_policy(SoloComm(), "single", dtype)
    res = run_threads(WORLD, lambda comm: run_policy(comm, "hdp", dtype), timeout=90)
    compare(ref, res[0], dtype)


# operators that make the host wait on a CUDA device: a scalar read (.item(), bool(), int()),
# data-dependent shapes (nonzero, boolean-mask indexing, masked_select, unique, repeat_interleave
# without a size), whole-tensor comparisons read on the host
HOST_WAITS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "equal",
              "is_nonzero", "repeat_interleave"}  # fmt: skip


class _HostWaits(TorchDispatchMode):
    """Counts the operators of HOST_WAITS this thread dispatches (a dispatch mode is per thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func._schema.name.split("::")[-1]
        bool_index = name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None
        )
        self.count += name in HOST_WAITS or bool_index
        return func(*args, **(kwargs or {}))


# a tensor's value read into Python: on a CUDA tensor each is a device-to-host copy the host waits
# for. At dispatch level a CPU shows only .item()'s; .tolist(), .cpu() and .numpy() are no-ops there
HOST_READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}


class _HostReads(TorchFunctionMode):
    """Counts this thread's calls of HOST_READS' tensor methods (a function mode is per thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += getattr(func, "__name__", "") in HOST_READS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("policy", ["single", "hdp"])
def test_no_host_wait_per_micro_batch_or_layer(policy) -> None:
    """A step's operators that would make the host wait on a GPU (counted on the CPU by a
    dispatch mode: what torch.cuda.set_sync_debug_mode reports there) and its reads of tensor
    values into Python (.tolist(), .cpu(), .numpy(), .item(), bool/int/float: a function mode,
    as a CPU hides those copies from dispatch) are as many with 2 layers and few micro-batches as
    with 4 layers and several times the micro-batches, rings included: none per micro-batch,
    none per layer."""
    counts = []
    for layers, lengths in ((2, [30, 20, 9, 40, 3]), (4, [*LENGTHS, 60, 50, 7, 70, 33, 21])):
        cfg = dataclasses.replace(model_config(), n_layers=layers)
        fetcher = MemoryFetcher([np.arange(n) % 200 for n in lengths])

        def run(comm, cfg=cfg, fetcher=fetcher):
            plan = make_plan(policy, fetcher.lengths, np.arange(fetcher.lengths.size), comm.size)
            model, _ = build_model(cfg, torch.float32, seed=3)
            ex = HDPExecutor(model, ZeroOptimizer.for_model(model, comm, level=1), comm)
            mine = plan.microbatches(comm.rank)
            fetched = fetcher.fetch_step([np.array(m.pieces) for m in mine])
            with _HostWaits() as waits, _HostReads() as reads:
                ex.step(plan, fetched, 1)
            return len(mine), (waits.count, reads.count)

        counts.append(run_threads(1 if policy == "single" else WORLD, run, timeout=60))
    few, many = counts
    assert sum(n for n, _ in many) >= 3 * sum(n for n, _ in few)  # micro-batches
    assert {w for _, w in few} == {w for _, w in many}, (few, many)
