"""Worker for tests/test_ring.py: one gloo process of a ring-attention launch.

Every rank builds the same whole-sample tensors from a seed, computes the single-process reference,
runs its share of each scenario's ring with `TorchComm` and checks it (float64, 1e-10).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from trainer.attention.local import attend
from trainer.attention.ring import RingAttention, ZigzagLayout, ring_attend
from trainer.parallel.comm import TorchComm, init_local_gloo

# (island ranks or None for the world, ring group in island-local ranks, sample lengths, hq, hkv)
SCENARIOS = [
    (None, [0, 1, 2, 3], [13, 30, 5], 4, 2),
    (None, [3, 0, 2], [21, 2, 9], 4, 1),
    (None, [2, 1], [16, 7], 6, 3),
    ([1, 2, 3], [2, 0], [11, 4], 4, 2),  # island-local [2, 0] = global ranks [3, 1]
]


def _check(comm: TorchComm, group: list[int], lengths: list[int], hq: int, hkv: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    total, d = sum(lengths), 8
    q = torch.randn(total, hq, d, dtype=torch.float64, generator=gen)
    k = torch.randn(total, hkv, d, dtype=torch.float64, generator=gen)
    v = torch.randn(total, hkv, d, dtype=torch.float64, generator=gen)
    dout = torch.randn(total, hq, d, dtype=torch.float64, generator=gen)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref, _ = attend(qr, kr, vr, [0, *np.cumsum(lengths).tolist()], backend="math")
    ref.backward(dout)

    p = group.index(comm.rank)
    idx = torch.as_tensor(ZigzagLayout(tuple(lengths), len(group)).global_index(p))
    ql, kl, vl = (x[idx].clone().requires_grad_() for x in (q, k, v))
    out, _ = ring_attend(ql, kl, vl, RingAttention(comm, group, p, lengths))
    out.backward(dout[idx])
    for got, want in ((out, ref), (ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad)):
        torch.testing.assert_close(got, want.detach()[idx], rtol=0, atol=1e-10)


def main(rank: int, world: int, port: int) -> None:
    init_local_gloo(rank, world, port, timeout_s=30)
    try:
        world_comm = TorchComm()
        islands = {}
        for island, *_ in SCENARIOS:  # every rank creates every subgroup, in the same order
            if island is not None and tuple(island) not in islands:
                islands[tuple(island)] = dist.new_group(island)
        for i, (island, group, lengths, hq, hkv) in enumerate(SCENARIOS):
            if island is None:
                comm = world_comm
            elif rank in island:
                comm = TorchComm(islands[tuple(island)])
            else:
                continue
            if comm.rank in group:
                _check(comm, group, lengths, hq, hkv, seed=100 + i)
        # collectives of the interface
        t = torch.tensor([float(rank + 1)])
        world_comm.all_reduce(t)
        assert t.item() == world * (world + 1) / 2
        got = world_comm.all_gather(torch.tensor([rank]))
        assert [int(x) for x in got] == list(range(world))
        dist.barrier()
    finally:
        dist.destroy_process_group()
