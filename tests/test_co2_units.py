"""Small checks of CO2's pieces (trainer.islands.co2) against hand counts and the plain reference of
tests/test_co2.py: the link emulator's ring traffic per collective, and the end of training
applying every pending average exactly once."""

from __future__ import annotations

import pytest
import torch
from test_co2 import F64, X0, FakeClock, layout, local_step, oc, reference

from trainer.islands.co2 import LinkEmulator, OuterSync
from trainer.testing.threads import run_islands, run_threads


def test_link_emulator_counts_the_ring_bytes_of_every_collective():
    """3 ranks on a link of 1000 B/s: each collective sends its ring traffic per rank, by hand:
    all-reduce 2(k-1)/k of its payload, all-gather (k-1)/k of the gathered whole (k pieces),
    reduce-scatter and all-gather-into (k-1)/k of the flat buffer, send-recv the tensor sent;
    each takes those bytes / bandwidth on an idle link, and the collectives still compute."""

    def run(comm):
        clock = FakeClock()
        link = LinkEmulator(comm, 8000 / 1e9, clock=clock, sleep=clock.sleep)  # 1000 B/s
        seen = []

        def note():
            seen.append((link.bytes_sent, clock.now))

        link.all_reduce(torch.ones(300, dtype=torch.float32))  # 1200 B payload
        note()
        parts = link.all_gather(torch.full((30,), float(comm.rank), dtype=F64))  # 3 x 240 B
        note()
        out = torch.zeros(30, dtype=torch.float32)
        link.reduce_scatter(torch.ones(90, dtype=torch.float32), out)  # 360 B
        note()
        flat = torch.zeros(90, dtype=torch.float32)
        flat[30 * comm.rank : 30 * (comm.rank + 1)] = 1.0 + comm.rank
        link.all_gather_into(flat)  # 360 B
        note()
        recv = torch.zeros(10, dtype=F64)
        link.send_recv(
            torch.ones(10, dtype=F64), (comm.rank + 1) % 3, recv, (comm.rank - 1) % 3
        ).wait()
        note()
        return seen, [p.tolist() for p in parts], out.tolist(), flat.tolist(), recv.tolist()

    sent = [1600.0, 480.0, 240.0, 240.0, 80.0]  # 2*2/3*1200, 2/3*720, 2/3*360, 2/3*360, 80
    want, total = [], 0.0
    for b in sent:
        total += b
        want.append((pytest.approx(total), pytest.approx(total / 1000)))
    for seen, parts, out, flat, recv in run_threads(3, run, timeout=30):
        assert seen == want
        assert parts == [[float(r)] * 30 for r in range(3)]
        assert out == [3.0] * 30
        assert flat == [1.0] * 30 + [2.0] * 30 + [3.0] * 30
        assert recv == [1.0] * 10


def test_finish_applies_the_pending_average_once():
    """Overlapped rounds (2 islands x 2 ranks, 3 rounds of tau 2): `finish` after the last
    boundary applies the average still in flight, giving the reference's final anchor; a second
    `finish` finds nothing pending, returns (None, None) and leaves the weights, and the saved
    counters say nothing is pending (round 3, no local steps), so no resume applies it again."""
    cfg = oc(tau=2, outer_lr=0.7, momentum=0.9)
    islands, rounds = 2, 3
    final = reference(cfg, islands, rounds)[-1]["anchor"]

    def body(island, cross):
        lay = layout(2)
        lo, hi = lay.slice(island.rank)
        sync = OuterSync(cfg, lay, island, cross, dtype=F64)
        x = X0[lo:hi].clone()
        sync.start(x)
        for t in range(rounds):
            for s in range(cfg.tau):
                x.copy_(local_step(x, cross.rank, t, s, lo))
                sync.after_step(x)
        ended, flushed = sync.finish(x)
        first = x.clone()
        again = sync.finish(x)
        counters = sync.state_dict()["counters"].tolist()
        return (lo, hi), ended, flushed, first, again, x.clone(), counters

    for (lo, hi), ended, flushed, first, again, x, counters in run_islands(islands, 2, body, 30):
        assert ended is None and flushed is not None and flushed.applied
        torch.testing.assert_close(first, final[lo:hi], rtol=1e-12, atol=1e-13)
        assert again == (None, None)
        assert torch.equal(x, first)
        assert counters == [rounds, 0, 1, 0]
