"""Small in-process checks of the communicators (trainer.parallel.comm, the test fake
trainer.testing.threads) and of the tensor-parallel split (trainer.parallel.tensor) against hand
counts and the plain decoder: no process launch."""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from trainer.parallel import comm as comm_mod
from trainer.parallel.comm import CountingComm, TorchComm, chunk_offsets
from trainer.testing.threads import ThreadWorld


def test_chunk_offsets_refuses_a_wrong_number_of_sizes() -> None:
    """`sizes` must name exactly one chunk per rank: too many or too few are refused (even when
    they fit the buffer); the right number gives the running sums."""
    assert chunk_offsets(10, 3, [3, 0, 5]) == [0, 3, 3, 8]
    with pytest.raises(ValueError, match="need 2 chunk sizes"):
        chunk_offsets(6, 2, [2, 2, 2])
    with pytest.raises(ValueError, match="need 3 chunk sizes"):
        chunk_offsets(6, 3, [3, 3])


def test_thread_comm_keeps_tags_apart() -> None:
    """Two messages from one peer with different tags each reach the receive of their own tag,
    whatever order the receives are posted and waited in."""
    world = ThreadWorld(2, timeout=5)
    a, b = world.comm(0), world.comm(1)
    sink = torch.zeros(1)
    a.send_recv(torch.tensor([1.0]), 1, sink, 1, tag=1)
    a.send_recv(torch.tensor([2.0]), 1, sink, 1, tag=2)
    got2, got1 = torch.zeros(1), torch.zeros(1)
    h2 = b.send_recv(torch.zeros(1), 0, got2, 0, tag=2)
    h1 = b.send_recv(torch.zeros(1), 0, got1, 0, tag=1)
    h2.wait()
    h1.wait()
    assert (got1.item(), got2.item()) == (1.0, 2.0)


def test_counting_comm_counts_bytes_and_wait_and_reset_clears_both(monkeypatch) -> None:
    """CountingComm adds each send's bytes (elements x element size) and the time blocked in
    its wait (a fake clock: 2 s a wait); reset() sets both back to 0; collectives pass through."""
    ticks = iter([10.0, 12.0, 20.0, 22.0])
    monkeypatch.setattr(comm_mod, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    done = SimpleNamespace(wait=lambda: None)
    inner = SimpleNamespace(rank=0, size=2, send_recv=lambda *a: done, all_reduce=lambda t: "ok")
    c = CountingComm(inner)
    c.send_recv(torch.zeros(3, dtype=torch.float64), 1, torch.zeros(3), 1).wait()
    assert (c.p2p_bytes, c.wait_s) == (24, 2.0)
    c.reset()
    assert (c.p2p_bytes, c.wait_s) == (0, 0.0)
    c.send_recv(torch.zeros(5, dtype=torch.bfloat16), 1, torch.zeros(5), 1).wait()
    assert (c.p2p_bytes, c.wait_s) == (10, 2.0)
    assert c.all_reduce(torch.zeros(1)) == "ok"


class _Work:
    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


@pytest.fixture
def subgroup_comm(monkeypatch):
    """A TorchComm over a gloo subgroup of 3 whose ranks are global 2, 5 and 7, this process its
    rank 1; the point-to-point ops and per-chunk collectives issued are recorded, not run."""
    calls: list[tuple] = []
    glob = [2, 5, 7]
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, r: glob[r])
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist.distributed_c10d, "get_group_rank", lambda group, g: glob.index(g))

    def reduce(t, dst, group, async_op):
        calls.append(("reduce", dst, t.numel()))
        return _Work()

    def broadcast(t, src, group, async_op):
        calls.append(("broadcast", src, t.numel()))
        return _Work()

    def batch(ops):
        calls.extend((op.op.__name__, op.peer, op.tag, op.tensor.numel()) for op in ops)
        return [_Work() for _ in ops]

    monkeypatch.setattr(dist, "reduce", reduce)
    monkeypatch.setattr(dist, "broadcast", broadcast)
    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    return TorchComm(object()), calls


def test_torch_comm_addresses_subgroup_peers_by_global_rank(subgroup_comm) -> None:
    """On a subgroup whose ranks are not the global ones, uneven chunks reduce to and broadcast
    from each chunk's owner by its global rank (empty chunks skipped), and a ring hop sends to
    dst and receives from src by global rank, both with the caller's tag."""
    comm, calls = subgroup_comm
    comm.reduce_scatter(torch.zeros(10), torch.zeros(4), [3, 4, 3])
    assert calls == [("reduce", 2, 3), ("reduce", 5, 4), ("reduce", 7, 3)]
    calls.clear()
    comm.all_gather_into(torch.zeros(10), [0, 4, 6])
    assert calls == [("broadcast", 5, 4), ("broadcast", 7, 6)]
    calls.clear()
    comm.send_recv(torch.zeros(2), 2, torch.zeros(3), 0, tag=9).wait()
    assert calls == [("isend", 7, 9, 2), ("irecv", 2, 9, 3)]


def _threaded_ranks(world: int, fn):
    """fn(rank) in `world` threads, each the rank of torch's in-process threaded process group
    (torch's own test utility; real collectives between the threads)."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    store = dist.HashStore()
    results: list = [None] * world
    errors: list = [None] * world

    def body(r: int) -> None:
        dist.init_process_group("threaded", rank=r, world_size=world, store=store)
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[r] = e
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    assert not any(t.is_alive() for t in threads), "threaded ranks still running"
    for e in errors:
        if e is not None:
            raise e
    return results


@pytest.mark.timeout(60)
def test_tp4_with_two_kv_heads_equals_the_plain_decoder_in_threads() -> None:
    """tp 4 over 2 K/V heads (K/V replicated, each process keeps its query group's head), in
    one process on torch's threaded process group: logits, loss and every parameter's gradient
    equal the plain decoder's (float64, 1e-10), and each local shard is the block of the whole
    parameter that place_of names."""
    from _tp_worker import reference, shape
    from torch.distributed.tensor import DTensor

    from trainer.parallel.tensor import parallelize, place_of, tp_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    cfg = shape(n_kv_heads=2, tie_embeddings=False, qkv_bias=True)
    ids = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    pos, labels = torch.arange(20), ids.roll(-1)
    plain = reference(cfg, seed=7)
    base = copy.deepcopy(plain)  # the threads copy it: seeding inside them would race
    with torch.no_grad():
        want_logits = plain(ids, pos)
    want_loss, _ = plain(ids, pos, labels=labels)
    want_loss.backward()
    whole = {n: p.detach() for n, p in plain.named_parameters()}

    def member(rank: int):
        model = parallelize(copy.deepcopy(base), tp_mesh(4))
        with torch.no_grad():
            logits = model(ids, pos)
        loss, _ = model(ids, pos, labels=labels)
        loss.backward()
        grads, misplaced = {}, []
        for name, p in model.named_parameters():
            g = p.grad
            grads[name] = g.full_tensor() if isinstance(g, DTensor) else g
            local = p.to_local() if isinstance(p, DTensor) else p
            box = tuple(slice(o, o + n) for o, n in zip(place_of(name, p).offset, local.shape))
            if not torch.equal(whole[name][box], local.detach()):
                misplaced.append(name)
        return logits, loss.detach(), grads, misplaced

    for logits, loss, grads, misplaced in _threaded_ranks(4, member):
        assert misplaced == []
        torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-10)
        torch.testing.assert_close(loss, want_loss.detach(), rtol=0, atol=1e-10)
        for name, p in plain.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-10, msg=name)
