"""Selective activation offload and activation checkpointing (trainer.offload.manager) against references
that share nothing with it: the plain model's gradients, a plain saved-tensor counter, shape
arithmetic, and ByteScale's Eq. 3 written out here."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from datapipe.plan.cost import DEVICES, build_cost_model
from trainer.attention.ring import RingAttention, ZigzagLayout
from trainer.model.transformer import build as build_model
from trainer.model.transformer import get_config
from trainer.offload.config import OffloadConfig
from trainer.offload.host_store import HostPool, size_class
from trainer.offload.manager import ActivationPolicy
from trainer.testing.threads import run_threads

F64 = torch.float64
T = 512  # positions of the one-process micro-batch


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def build(n_layers: int = 4, seed: int = 1):
    cfg = get_config(
        "debug",
        dim=32,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        n_layers=n_layers,
        tie_embeddings=False,
    )
    return build_shape(cfg, seed)


def build_shape(cfg, seed: int = 1):
    model = build_model(cfg, "meta", F64).to_empty(device="cpu")
    model.init_weights(seed)
    return model


def batch(n: int = T, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 200, (n,), generator=gen)
    pos = torch.cat([torch.arange(n // 3), torch.arange(n - n // 3)])  # two samples
    labels = ids.roll(-1)
    labels[n // 3 - 1] = -100
    return ids, pos, [0, n // 3, n], labels


def grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def plain_step(n_layers: int = 4):
    """The reference: the model's own forward and backward, no manager."""
    model = build(n_layers)
    ids, pos, cu, labels = batch()
    loss, _ = model(ids, pos, cu, labels)
    loss.backward()
    return loss.detach(), grads(model)


def managed_step(policy: ActivationPolicy, ratio: float, n_layers: int = 4, model=None):
    model = model if model is not None else build(n_layers)
    mgr = policy.build("cpu")
    ids, pos, cu, labels = batch()
    with mgr.microbatch(model, ratio) as stats:
        loss, _ = model(ids, pos, cu, labels)
        loss.backward()
        assert mgr.store_bytes == 0 and mgr.pool.live_bytes == 0  # emptied by the backward
    return loss.detach(), grads(model), stats, mgr


def offload(**kw) -> ActivationPolicy:
    return ActivationPolicy(kw.pop("checkpoint", "none"), OffloadConfig(enabled=True, **kw))


# --- exactness -----------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_offload_gradients_bitwise_equal(ratio):
    loss_ref, g_ref = plain_step()
    loss, g, stats, _ = managed_step(offload(), ratio)
    assert torch.equal(loss, loss_ref)
    assert all(torch.equal(a, b) for a, b in zip(g, g_ref))
    assert stats.offloaded_blocks == {0.0: 0, 0.5: 1, 1.0: 2}[ratio]
    assert (stats.moved_bytes > 0) == (ratio > 0)  # bytes really went through the host store
    assert stats.late_fetches == 0  # every copy-in was issued a block ahead


@pytest.mark.parametrize("spec", ["full", "every:2"])
@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_checkpointing_matches_no_checkpointing(spec, ratio):
    loss_ref, g_ref = plain_step()
    model = build()
    calls = [0] * 4
    for i, blk in enumerate(model.layers):
        blk.attention.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    loss, g, stats, _ = managed_step(offload(checkpoint=spec), ratio, model=model)
    # the checkpointed blocks really ran their forward twice (once more in backward)
    assert calls == ([2, 2, 2, 2] if spec == "full" else [2, 1, 2, 1])
    assert abs(float(loss - loss_ref)) <= 1e-12 * abs(float(loss_ref))
    for a, b in zip(g, g_ref):
        assert float((a - b).abs().max()) <= 1e-12 * max(float(b.abs().max()), 1e-300)
    # a checkpointed block saves only its inputs: the hidden state (T x dim) plus, in block 0,
    # the rope tables it shares with every block (2 x T x head_dim/2)
    hidden, rope = T * 32 * 8, 2 * T * 4 * 8
    want = [hidden + rope, hidden, hidden, hidden]
    got = stats.block_bytes
    assert [got[i] for i in (0, 2)] == [want[0], want[2]]
    if spec == "full":
        assert got == want
        assert stats.moved_bytes == (2 * hidden if ratio == 1.0 else 0)  # blocks 0, 1 inputs


# --- accounting against a plain counter and Eq. 3 --------------------------------------------------


def count_saved_per_block(model) -> list[int]:
    """Independent reference: bytes of distinct storages (not parameters) each block saves first,
    counted by a plain saved_tensors_hooks counter around the model's own forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, torch.Tensor] = {}  # keeps the tensors alive: no address is reused
    per_block = [0] * len(model.layers)
    current = [-1]
    for i, blk in enumerate(model.layers):
        blk.register_forward_pre_hook(lambda *_, i=i: current.__setitem__(0, i))
        blk.register_forward_hook(lambda *_: current.__setitem__(0, -1))

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if current[0] >= 0 and key not in params and key not in seen:
            seen[key] = t
            per_block[current[0]] += t.untyped_storage().nbytes()
        return t

    ids, pos, cu, labels = batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = model(ids, pos, cu, labels)
    loss.backward()
    return per_block


@pytest.mark.parametrize("n_layers", [4, 6])
def test_peak_matches_the_planners_eq3(n_layers):
    """The accounted peak of saved bytes on the device against ByteScale's Eq. 3 with the planner's
    Act(s): the cost model's act_bytes_per_token_layer of the `debug` shape (float64) times the
    positions. On the ratios k/(l-2) within 10%; on the planner's ratios j/l at most Eq. 3 and
    above Eq. 3 minus one block (whole blocks move, rounded up)."""
    shape = get_config("debug", n_layers=n_layers, tie_embeddings=False)
    cost = build_cost_model("debug", shape, DEVICES["cpu"], dtype_bytes=8)
    act = cost.act_bytes_per_token_layer * T  # Act(s) of the micro-batch's T positions
    per_block = count_saved_per_block(build_shape(shape))
    # what each block saves is the cost model's Act (block 0 also holds the shared rope tables)
    assert all(abs(b - act) <= 0.02 * act for b in per_block), (per_block, act)
    grid = [k / (n_layers - 2) for k in range(n_layers - 1)]  # 0 .. 1
    planned = [j / n_layers for j in range(n_layers + 1)]
    peaks = {}
    for r in sorted(set(grid + planned)):
        _, _, stats, _ = managed_step(offload(), r, model=build_shape(shape))
        assert stats.block_bytes == per_block
        assert stats.kept_bytes + stats.moved_bytes == sum(per_block)
        eq3 = (2 + (1 - r) * (n_layers - 2)) * act
        if r in grid:
            assert abs(stats.peak_bytes - eq3) <= 0.10 * eq3, (r, stats.peak_bytes, eq3)
        assert eq3 - act < stats.peak_bytes <= 1.01 * eq3, (r, stats.peak_bytes, eq3)
        peaks[r] = stats.peak_bytes
    assert peaks[0.0] == sum(per_block)  # nothing moved: every block's bytes at once
    assert all(peaks[a] > peaks[b] for a, b in zip(grid, grid[1:]))  # falls as r rises


def _watch_store(ratio: float):
    """One step; returns (stats, block 0's MLP input freed after the forward, per block 1 then 0:
    the store's bytes and the bytes copied in so far when the gradient of the block's output is
    ready, i.e. when the backward of the block after it is over)."""
    model = build()
    mgr = offload().build("cpu")
    refs, seen = [], []
    copied_in = [0]
    copy_in = mgr.copies.copy_in

    def counting_copy_in(buf, nbytes):
        copied_in[0] += nbytes
        return copy_in(buf, nbytes)

    mgr.copies.copy_in = counting_copy_in
    model.layers[0].feed_forward.w1.register_forward_hook(
        lambda m, i, out: refs.append(StorageWeakRef(out.untyped_storage()))
    )

    def watch(module, inputs, out):
        out.register_hook(lambda g: seen.append((mgr.store_bytes, copied_in[0])))

    for i in (0, 1):
        model.layers[i].register_forward_hook(watch)
    ids, pos, cu, labels = batch()
    with mgr.microbatch(model, ratio) as stats:
        loss, _ = model(ids, pos, cu, labels)
        freed = refs[0].expired()
        assert mgr.store_bytes == stats.moved_bytes
        loss.backward()
        assert mgr.store_bytes == 0
    return stats, freed, seen


def test_moved_bytes_leave_the_device_and_come_back_one_block_ahead():
    """Block 0's MLP input (saved by silu) is freed after the forward when block 0 offloads; a
    block's bytes are copied in while the block after it runs backward, and its host copies are
    let go as soon as its own backward is over."""
    stats, freed, seen = _watch_store(0.0)
    assert not freed and stats.moved_bytes == 0 and seen == [(0, 0), (0, 0)]
    stats, freed, seen = _watch_store(1.0)
    assert freed
    # blocks 0 and 1 moved everything but the rope tables block 0 shares with every block
    moved0 = stats.block_bytes[0] - 2 * T * 4 * 8
    assert stats.moved_bytes == moved0 + stats.block_bytes[1]
    assert seen == [(stats.moved_bytes, stats.block_bytes[1]), (moved0, stats.moved_bytes)]


# --- the host store ------------------------------------------------------------------------------


def test_store_empty_and_no_growth_over_20_steps():
    model = build()
    mgr = offload(checkpoint="every:2").build("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids, pos, cu, labels = batch()
    after_first = None
    for step in range(20):
        with mgr.microbatch(model, (0.5, 1.0)[step % 2]):
            loss, _ = model(ids, pos, cu, labels)
            loss.backward()
            assert mgr.store_bytes == 0
        opt.step()
        opt.zero_grad()
        assert mgr.store_bytes == 0 and mgr.pool.live_bytes == 0 and mgr.pool.outside == 0
        assert mgr.last.moved_bytes > 0
        if step == 1:
            after_first = (mgr.pool.allocations, mgr.pool.pooled_bytes)
        elif step > 1:
            assert (mgr.pool.allocations, mgr.pool.pooled_bytes) == after_first
    assert all("forward" not in blk.__dict__ for blk in model.layers)


class _Boom(RuntimeError):
    pass


class _FailingAttention:
    """A local attention context that fails in the third block."""

    def __init__(self, inner, fail_at: int) -> None:
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    def attend(self, q, k, v):
        self.calls += 1
        if self.calls == self.fail_at:
            raise _Boom("attention failed")
        return self.inner.attend(q, k, v)


def test_exception_in_forward_leaves_nothing_behind():
    from trainer.attention.local import LocalAttention

    model = build()
    mgr = offload(checkpoint="every:2").build("cpu")
    ids, pos, cu, labels = batch()
    with pytest.raises(_Boom):
        with mgr.microbatch(model, 1.0):
            model(ids, pos, labels=labels, attn=_FailingAttention(LocalAttention(cu), 3))
    assert mgr.store_bytes == 0 and mgr.pool.live_bytes == 0 and mgr._active is None
    assert mgr.last.moved_bytes > 0  # blocks 0 and 1 had moved bytes before the failure
    assert all("forward" not in blk.__dict__ for blk in model.layers)
    # the next micro-batch runs normally and exactly
    model.zero_grad(set_to_none=True)
    _, g, _, _ = managed_step(offload(), 1.0, model=model)
    assert all(torch.equal(a, b) for a, b in zip(g, plain_step()[1]))


def test_backward_after_the_context_is_refused():
    model = build()
    mgr = offload().build("cpu")
    ids, pos, cu, labels = batch()
    with mgr.microbatch(model, 1.0):
        loss, _ = model(ids, pos, cu, labels)
    with pytest.raises(RuntimeError, match="after its micro-batch ended"):
        loss.backward()


class _ViewBlock(nn.Module):
    """Saves two views of one base (u, v of a chunk), a small tensor, its input and a weight."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, 2 * d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, v = self.lin(x).chunk(2, dim=-1)  # mm saves x and the weight; mul saves u and v
        small = (x[:4] * 2.0).sin()  # sin saves a 4 x d tensor: under the threshold
        return u * v + small.sum()


def test_views_move_once_small_tensors_and_parameters_stay():
    d, n = 16, 256
    torch.manual_seed(0)
    blocks = nn.ModuleList(_ViewBlock(d) for _ in range(4)).double()
    x0 = torch.randn(n, d, dtype=F64, requires_grad=True)

    def run(ratio):
        blocks.zero_grad(set_to_none=True)
        mgr = offload(min_bytes=1024).build("cpu")
        with mgr.microbatch(blocks, ratio, blocks=list(blocks)) as stats:
            h = x0 * 1.0  # requires grad: block 0 saves its small tensor too
            for blk in blocks:
                h = blk(h)
            h.square().sum().backward()
        return [p.grad.clone() for p in blocks.parameters()], stats, mgr

    g0, _, _ = run(0.0)
    g, stats, mgr = run(0.5)  # block 0 offloads
    assert all(torch.equal(a, b) for a, b in zip(g, g0))
    x_bytes, base_bytes, small_bytes = n * d * 8, n * 2 * d * 8, 4 * d * 8
    assert small_bytes < 1024 <= x_bytes
    assert stats.moved_bytes == x_bytes + base_bytes  # u and v: one storage, moved once
    assert mgr.pool.allocations == 2
    assert stats.block_bytes[0] == x_bytes + base_bytes + small_bytes  # the weight not counted
    assert stats.kept_bytes == small_bytes + 3 * (x_bytes + base_bytes + small_bytes)


def test_host_pool_is_bounded_and_reused():
    pool = HostPool(max_bytes=3 * 4096)
    bufs = [pool.take(4000) for _ in range(3)]
    assert pool.pooled_bytes == 3 * 4096 and pool.allocations == 3
    extra = pool.take(100)  # over the bound: served from outside the pool
    assert pool.overflow_bytes == 100 and pool.pooled_bytes == 3 * 4096
    for b in [*bufs, extra]:
        pool.give(b)
    assert pool.live_bytes == 0 and pool.outside == 0
    again = [pool.take(3000) for _ in range(3)]  # reused, no new allocation
    assert pool.allocations == 3 and all(b.data.numel() == 4096 for b in again)
    for b in again:
        pool.give(b)
    pool.trim()
    assert pool.pooled_bytes == 0


def test_host_pool_size_classes_and_reuse_of_larger_idle_buffers():
    """A request gets the smallest power of two that holds it (at least 4,096 bytes: an exact
    power of two is its own class), and an idle buffer up to 4 times larger serves it."""
    for nbytes, want in [(1, 4096), (4096, 4096), (4097, 8192), (8192, 8192), (3 << 13, 32768)]:
        assert size_class(nbytes) == want, nbytes
        pool = HostPool(max_bytes=1 << 20)
        assert pool.take(nbytes).data.numel() == want and pool.pooled_bytes == want
    pool = HostPool(max_bytes=1 << 20)
    for big, reused in [(4 * 4096, True), (8 * 4096, False)]:
        pool.give(pool.take(big))
        before = pool.allocations
        buf = pool.take(4096)
        assert (pool.allocations == before) is reused, big
        assert buf.data.numel() == (big if reused else 4096)
        pool.give(buf)
        pool.trim()


# --- a ring micro-batch over 4 fake ranks ---------------------------------------------------------


@pytest.mark.timeout(120)
def test_ring_microbatch_offload_equals_no_offload():
    """One sample split zigzag over 4 thread-ranks: offload 0.5 (with and without checkpointing
    every other block) gives every rank bitwise the gradients of offload 0 (checkpointing: 1e-12)."""
    length = 4 * 200
    ids_all = torch.randint(0, 200, (length,), generator=torch.Generator().manual_seed(3))

    def member(comm, policy, ratio):
        torch.set_num_threads(1)
        model = build()
        layout = ZigzagLayout((length,), 4)
        idx = torch.as_tensor(layout.global_index(comm.rank))
        pos = torch.as_tensor(layout.position_ids(comm.rank))
        labels = torch.where(idx + 1 < length, ids_all[(idx + 1).clamp(max=length - 1)], -100)
        ring = RingAttention(comm, [0, 1, 2, 3], comm.rank, [length])
        if policy is None:
            loss, _ = model(ids_all[idx], pos, labels=labels, attn=ring)
            loss.backward()
            return grads(model), None
        mgr = policy.build("cpu")
        with mgr.microbatch(model, ratio) as stats:
            loss, _ = model(ids_all[idx], pos, labels=labels, attn=ring)
            loss.backward()
        return grads(model), stats

    ref = run_threads(4, lambda c: member(c, None, 0.0), timeout=100)
    off = run_threads(4, lambda c: member(c, offload(min_bytes=1024), 0.5), timeout=100)
    ckpt = run_threads(4, lambda c: member(c, offload(min_bytes=1024, checkpoint="every:2"), 0.5),
                       timeout=100)  # fmt: skip
    for (g_ref, _), (g, stats), (g_ck, stats_ck) in zip(ref, off, ckpt):
        assert stats.moved_bytes > 0 and stats_ck.moved_bytes > 0
        assert all(torch.equal(a, b) for a, b in zip(g, g_ref))
        for a, b in zip(g_ck, g_ref):
            assert float((a - b).abs().max()) <= 1e-12 * max(float(b.abs().max()), 1e-300)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_bitwise_and_pinned_pool_bounded():  # pragma: no cover - GPU smoke
    """On a GPU (benchmarks/gpu_smoke.sh): side-stream copies give bitwise the gradients of r = 0
    over several steps; the pinned pool stops growing after the first steps."""
    out = {}
    for ratio in (0.0, 0.5):
        torch.manual_seed(0)
        model = build().to("cuda", torch.float32)
        mgr = offload().build("cuda")
        ids, pos, cu, labels = (x.cuda() if isinstance(x, torch.Tensor) else x for x in batch())
        sizes = []
        for _ in range(5):
            model.zero_grad(set_to_none=True)
            with mgr.microbatch(model, ratio):
                loss, _ = model(ids, pos, cu, labels)
                loss.backward()
            sizes.append(mgr.pool.pooled_bytes)
        torch.cuda.synchronize()
        assert sizes[1:] == [sizes[1]] * 4 and mgr.pool.overflow_bytes == 0
        print(f"r = {ratio}: pinned pool {sizes[-1]} bytes, peak live {mgr.pool.peak_live_bytes}")
        out[ratio] = [p.grad.cpu() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(out[0.5], out[0.0]))
