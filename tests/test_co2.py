"""CO2's outer update (trainer.islands.co2) against plain references written from the contract's
formulas, DiLoCo (torch's SGD on the pseudo-gradient) and parameter averaging; resume and
resharding of its state; the link emulator on an injected clock."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dcp_join import detached, save_as_ranks

from datapipe.plan.memory import outer_state_bytes
from trainer.islands.co2 import LinkEmulator, OuterConfig, OuterSync
from trainer.parallel.slices import FlatLayout
from trainer.parallel.zero import ZeroOptimizer
from trainer.testing.threads import run_islands, run_threads

F64 = torch.float64
SHAPES = [(5, 3), (22,)]  # 37 elements; align 4: slices of 16, 16, 5 on 3 ranks
N = 37
EPS = 1e-8


def layout(ranks: int, align: int = 4) -> FlatLayout:
    return FlatLayout(SHAPES, ranks, align)


def _vec(seed: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed), dtype=F64)


X0 = _vec(0) * 0.5


def oc(**kw) -> OuterConfig:
    """An OuterConfig with these settings over overlapped heavy-ball rounds without penalty,
    clipping or warm-up (OuterConfig has no defaults of its own)."""
    base = {
        "tau": 3, "outer_lr": 0.7, "momentum": 0.9, "nesterov": False, "staleness_lambda": 0.0,
        "staleness_rule": "adaptive", "clip": "none", "clip_value": 1.0, "overlap": True,
        "warmup_rounds": 0, "warmup_outer_lr": 1.0,
    }  # fmt: skip
    return OuterConfig(**{**base, **kw})


def local_step(x: torch.Tensor, island: int, t: int, s: int, lo: int = 0) -> torch.Tensor:
    """One element-wise inner step of island `island` in round t (x holds elements lo..): a pull
    toward the island's own target plus noise, so islands drift apart within a round."""
    n = x.numel()
    target = _vec(100 + island)[lo : lo + n]
    noise = _vec(1000 * t + 10 * s + island)[lo : lo + n]
    return x - 0.3 * (x - target) + 0.05 * noise


# --- the plain reference, from DESIGN "CO2 across islands" ----------------------------------------


def reference(cfg: OuterConfig, islands: int, rounds: int) -> list[dict]:
    """Anchor after every boundary (and after the final flush), with penalty, ||alpha*step||
    and the clipped fraction of the update applied there."""
    a, m = X0.clone(), torch.zeros(N, dtype=F64)
    st = {"d_prev": None}

    def apply(a, d, stale, alpha):
        nonlocal m
        prev = d if st["d_prev"] is None else st["d_prev"]
        penalty = torch.tensor(1.0, dtype=F64)
        if stale and cfg.staleness_rule == "constant":
            penalty = torch.tensor(1.0 + cfg.staleness_lambda, dtype=F64)
        elif stale:  # adaptive
            penalty = 1 + cfg.staleness_lambda * torch.linalg.norm(d - prev) / (
                torch.linalg.norm(d) + cfg.eps
            )
        m = cfg.momentum * m + d / penalty
        frac = 0.0
        if cfg.clip == "value":
            frac = float((m.abs() > cfg.clip_value).double().mean())
            m = m.clamp(-cfg.clip_value, cfg.clip_value)
        elif cfg.clip == "norm" and torch.linalg.norm(m) > cfg.clip_value:
            m = m * (cfg.clip_value / torch.linalg.norm(m))
            frac = 1.0
        step = d / penalty + cfg.momentum * m if cfg.nesterov else m
        st["d_prev"] = d
        return a - alpha * step, float(penalty), float(alpha * step.norm()), frac

    out, pending = [], None
    for t in range(rounds):
        deltas = []
        for j in range(islands):
            x = a.clone()
            for s in range(cfg.tau):
                x = local_step(x, j, t, s)
            deltas.append(a - x)
        avg = sum(deltas) / islands
        info = {"applied": False, "penalty": 1.0, "update_norm": 0.0, "clipped": 0.0}
        if cfg.overlap and t >= cfg.warmup_rounds:  # one round stale
            if pending is not None:
                a, p, u, f = apply(a, pending, True, cfg.outer_lr)
                info = {"applied": True, "penalty": p, "update_norm": u, "clipped": f}
            pending = avg
        else:  # a round's own average: a warm-up round's, or every round's without overlap
            alpha = cfg.warmup_outer_lr if cfg.overlap else cfg.outer_lr
            a, p, u, f = apply(a, avg, False, alpha)
            info = {"applied": True, "penalty": p, "update_norm": u, "clipped": f}
        out.append({"anchor": a.clone(), **info})
    if pending is not None:
        a, p, u, f = apply(a, pending, True, cfg.outer_lr)
        out.append({"anchor": a.clone(), "applied": True, "penalty": p, "update_norm": u})
    return out


# --- the sharded run -------------------------------------------------------------------------------


def run_co2(cfg, islands, ranks, rounds, flush=True, align=4):
    """Every fake rank of every island runs its slice: local steps, after_step, flush."""

    def body(island, cross):
        lay = layout(ranks, align)
        lo, hi = lay.slice(island.rank)
        sync = OuterSync(cfg, lay, island, cross, dtype=F64)
        x = X0[lo:hi].clone()
        sync.start(x)
        trace = []
        for t in range(rounds):
            for s in range(cfg.tau):
                x.copy_(local_step(x, cross.rank, t, s, lo))
                stats = sync.after_step(x)
                assert (stats is None) == (s < cfg.tau - 1)
            trace.append((x.clone(), stats))
        if flush:
            stats = sync.flush(x)
            trace.append((x.clone(), stats))
        return (lo, hi), trace, sync

    return run_islands(islands, ranks, body, timeout=30)


CONFIGS = [
    oc(tau=3, outer_lr=0.7, momentum=0.9),
    oc(tau=3, outer_lr=0.8, momentum=0.6, nesterov=True, staleness_lambda=0.5,
       clip="value", clip_value=0.15),
    oc(tau=2, outer_lr=0.7, momentum=0.8, staleness_lambda=0.5, clip="norm", clip_value=0.6),
    oc(tau=2, outer_lr=0.9, momentum=0.5, nesterov=True, staleness_lambda=0.3,
       clip="norm", clip_value=0.6, overlap=False),
    oc(tau=3, outer_lr=0.5, momentum=0.7, staleness_lambda=1.0, clip="value",
       clip_value=0.15, overlap=False),
    oc(tau=2, outer_lr=0.6, momentum=0.5, staleness_lambda=0.5, clip="value",
       clip_value=0.15, warmup_rounds=2, warmup_outer_lr=0.9),
    oc(tau=2, outer_lr=0.6, momentum=0.3, nesterov=True, staleness_lambda=0.4,
       staleness_rule="constant", warmup_rounds=1),
    # a norm threshold the momentum crosses both ways: rounds 3 and 4 of 5 clipped
    oc(tau=2, outer_lr=0.7, momentum=0.8, staleness_lambda=0.5, clip="norm", clip_value=3.0),
]  # fmt: skip


def _close(a, b, tol=1e-12):
    assert abs(a - b) <= tol * max(1.0, abs(b)), (a, b)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("ci", range(len(CONFIGS)))
def test_outer_update_matches_the_contract(ranks, ci):
    cfg, rounds, islands = CONFIGS[ci], 5, 2 if ci != 1 else 3
    want = reference(cfg, islands, rounds)
    if cfg.clip == "value":  # clipping really acts, but not on everything
        assert any(0 < w["clipped"] < 1 for w in want[:rounds])
    if cfg.clip == "norm":
        assert any(w["clipped"] == 1.0 for w in want[:rounds])
        if cfg.clip_value > 1:  # and some rounds not
            assert [w["clipped"] for w in want[:rounds]] == [0.0, 0.0, 1.0, 1.0, 0.0]
    if cfg.staleness_lambda and cfg.overlap:
        assert any(w["penalty"] > 1.01 for w in want)
    if not cfg.overlap:  # nothing is stale, so nothing is penalised whatever lambda
        assert all(w["penalty"] == 1.0 for w in want)
    got = run_co2(cfg, islands, ranks, rounds)
    assert len(got) == islands * ranks
    for (lo, hi), trace, _ in got:
        assert len(trace) == len(want) if cfg.overlap else len(trace) == rounds + 1
        for k, (x, stats) in enumerate(trace):
            if k == rounds and not cfg.overlap:
                assert stats is None  # nothing in flight without overlap
                continue
            w = want[k]
            torch.testing.assert_close(x, w["anchor"][lo:hi], rtol=1e-12, atol=1e-13)
            assert stats.applied == w["applied"]
            _close(stats.penalty, w["penalty"])
            _close(stats.update_norm, w["update_norm"])
            if k < rounds:
                _close(stats.clipped_fraction, w["clipped"])
    if cfg.overlap and not cfg.warmup_rounds:  # the first boundary applies nothing: a_2 = a_1
        (lo, hi), trace, _ = got[0]
        assert torch.equal(trace[0][0], X0[lo:hi])


@pytest.mark.timeout(60)
def test_warmup_rounds_wait_then_overlap():
    """warmup_rounds = 2: the first two boundaries are DiLoCo's at warmup_outer_lr (the same
    anchors as overlap = False at that outer lr, bit for bit: no penalty, although lambda is set
    and the second average differs from the first), the third applies nothing, then
    one-round-stale averages again, penalised."""
    cfg, rounds = CONFIGS[5], 5
    assert cfg.warmup_rounds == 2 and cfg.staleness_lambda > 0
    awaited = dataclasses.replace(cfg, overlap=False, warmup_rounds=0, outer_lr=cfg.warmup_outer_lr)
    plain = run_co2(awaited, 2, 2, rounds)
    got = run_co2(cfg, 2, 2, rounds)
    for (_, trace), (_, want) in zip(
        [(g[0], g[1]) for g in got], [(p[0], p[1]) for p in plain], strict=True
    ):
        assert [s.applied for _, s in trace] == [True, True, False, True, True, True]
        for k in range(cfg.warmup_rounds):
            assert torch.equal(trace[k][0], want[k][0])
            assert trace[k][1].penalty == 1.0
        assert trace[4][1].penalty > 1.01  # the stale ones are penalised
        assert torch.equal(trace[2][0], trace[1][0])  # nothing applied at the third boundary
        assert not torch.equal(trace[3][0], want[3][0])  # the overlapped rounds differ


@pytest.mark.parametrize("nesterov", [False, True])
def test_no_overlap_equals_diloco_with_torch_sgd(nesterov):
    """overlap off, lambda 0, no clipping: DiLoCo, i.e. torch.optim.SGD with momentum on the
    anchor with the averaged pseudo-gradient as its gradient."""
    cfg = oc(tau=3, outer_lr=0.7, momentum=0.9, nesterov=nesterov, overlap=False)
    rounds, islands = 4, 2
    anchor = X0.clone().requires_grad_(False)
    opt = torch.optim.SGD([anchor], lr=cfg.outer_lr, momentum=cfg.momentum, nesterov=nesterov)
    want = []
    for t in range(rounds):
        xs = []
        for j in range(islands):
            x = anchor.clone()
            for s in range(cfg.tau):
                x = local_step(x, j, t, s)
            xs.append(x)
        anchor.grad = sum(anchor - x for x in xs) / islands
        opt.step()
        want.append(anchor.clone())
    for (lo, hi), trace, _ in run_co2(cfg, islands, 2, rounds, flush=False):
        for (x, _), w in zip(trace, want):
            torch.testing.assert_close(x, w[lo:hi], rtol=1e-12, atol=1e-13)


def test_tau1_momentum0_lr1_no_overlap_is_parameter_averaging():
    cfg = oc(tau=1, outer_lr=1.0, momentum=0.0, overlap=False)
    rounds, islands = 4, 3
    x = X0.clone()
    want = []
    for t in range(rounds):
        x = sum(local_step(x, j, t, 0) for j in range(islands)) / islands
        want.append(x)
    for (lo, hi), trace, _ in run_co2(cfg, islands, 2, rounds, flush=False):
        for (got, _), w in zip(trace, want):
            torch.testing.assert_close(got, w[lo:hi], rtol=1e-12, atol=1e-14)


# --- resume ----------------------------------------------------------------------------------------


def _resumable(cfg, islands, ranks, total_steps, stop_at, load=None, align=4):
    """Run global local steps [start, total_steps); at `stop_at` return the state (outer state
    and this rank's x) instead of continuing. `load` maps a rank to the state to start from."""

    def body(island, cross):
        lay = layout(ranks, align)
        lo, hi = lay.slice(island.rank)
        sync = OuterSync(cfg, lay, island, cross, dtype=F64)
        if load is None:
            x, start = X0[lo:hi].clone(), 0
            sync.start(x)
        else:
            st = load(cross.rank, island.rank, lo, hi)
            x, start = st["x"].clone(), st["step"]
            sync.load_state_dict(st["outer"])
        xs = []
        for g in range(start, total_steps):
            if g == stop_at:
                return {"outer": detached(sync.state_dict()), "x": x.clone(), "step": g}
            t, s = divmod(g, cfg.tau)
            x.copy_(local_step(x, cross.rank, t, s, lo))
            sync.after_step(x)
            xs.append(x.clone())
        return {"xs": xs, "lo": lo}

    return run_islands(islands, ranks, body, timeout=30)


@pytest.mark.parametrize("stop_at", [7, 9])  # mid-round; at a boundary with a round in flight
def test_resume_neither_loses_nor_repeats_a_round(stop_at):
    cfg = CONFIGS[1]  # tau 3, overlap, Nesterov, penalty, value clipping
    total, islands, ranks = 15, 2, 2
    straight = _resumable(cfg, islands, ranks, total, stop_at=None)
    saved = _resumable(cfg, islands, ranks, total, stop_at=stop_at)
    assert saved[0]["outer"]["counters"].tolist()[3] == 1  # a round was in flight
    resumed = _resumable(
        cfg, islands, ranks, total, None, load=lambda j, r, lo, hi: saved[j * ranks + r]
    )
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a["xs"][stop_at:], b["xs"]))


def _load_rank(path, cfg, rank, ranks, align):
    sync = OuterSync(cfg, layout(ranks, align), _Rank(rank, ranks), _Rank(0, 2), dtype=F64)
    sd = sync.state_dict()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(sd, checkpoint_id=path)
    return detached(sd)


class _Rank:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def test_outer_state_reshards_4_to_2_to_1(tmp_path):
    """Outer state saved by 4 ranks (one DCP chunk each, shared by both islands) resumes on 2,
    then on 1 rank per island, equal to the uninterrupted run on 4."""
    cfg, total, islands = CONFIGS[2], 12, 2  # tau 2, norm clipping, penalty, overlap
    straight = _resumable(cfg, islands, 4, total, stop_at=None, align=1)
    x_full = {}

    def save(ranks, stop_at, load, path):
        got = _resumable(cfg, islands, ranks, total, stop_at, load, align=1)
        save_as_ranks(path, [g["outer"] for g in got[:ranks]])  # island 0's ranks
        for j in range(islands):
            x_full[j] = torch.cat([g["x"] for g in got[j * ranks : (j + 1) * ranks]])
        return got[0]["step"]

    step = save(4, 5, None, str(tmp_path / "c4"))  # mid-round 3, a round in flight

    def loader(path, ranks, step):
        outer = [_load_rank(path, cfg, r, ranks, 1) for r in range(ranks)]
        return lambda j, r, lo, hi: {"outer": outer[r], "x": x_full[j][lo:hi], "step": step}

    step2 = save(2, 9, loader(str(tmp_path / "c4"), 2, step), str(tmp_path / "c2"))
    final = _resumable(cfg, islands, 1, total, None, loader(str(tmp_path / "c2"), 1, step2), 1)
    for j in range(islands):
        want = [torch.cat(v) for v in zip(*(g["xs"] for g in straight[j * 4 : (j + 1) * 4]))]
        for got, w in zip(final[j]["xs"], want[step2:]):
            torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-13)


# --- link emulator, memory, and the ZeRO hand-off ------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_link_emulator_delays_by_bytes_over_bandwidth():
    def run(comm):
        clock = FakeClock()
        gbps = 4000 * 8 / 1e9  # 4000 bytes per second
        link = LinkEmulator(comm, gbps, clock=clock, sleep=clock.sleep)
        t = torch.ones(1000, dtype=torch.float32)  # 4000 B, ring all-reduce of 2: 4000 B sent
        h = link.all_reduce(t, async_op=True)
        clock.now += 0.3  # compute overlapping the transfer
        h.wait()
        first = (clock.now, link.delayed_s)
        h1 = link.all_reduce(torch.ones(500), async_op=True)  # 0.5 s
        h2 = link.all_reduce(torch.ones(500), async_op=True)  # queued behind it: done at +1 s
        h2.wait()
        h1.wait()
        second = clock.now
        clock.now += 5.0  # an idle link: the next transfer starts when launched
        link.all_reduce(torch.ones(250))
        return first, second, clock.now, t.tolist() == [2.0] * 1000

    for first, second, third, summed in run_threads(2, run, timeout=30):
        assert first == (pytest.approx(1.0), pytest.approx(0.7))
        assert second == pytest.approx(2.0)
        assert third == pytest.approx(7.25)
        assert summed


def test_overlap_hides_the_link_behind_local_steps():
    """Wait per boundary with an emulated link of 1 s per round: overlap waits 1 s minus the
    round's compute (0.6 s), DiLoCo waits the full second."""

    def run(island, cross, overlap):
        clock = FakeClock()
        link = LinkEmulator(cross, 37 * 8 * 8 / 1e9, clock=clock, sleep=clock.sleep)  # 37 B/s
        cfg = oc(tau=3, outer_lr=0.7, momentum=0.9, overlap=overlap)
        sync = OuterSync(cfg, layout(1), island, link, dtype=F64, clock=clock)
        x = X0.clone()
        sync.start(x)
        waits = []
        for t in range(4):
            for s in range(3):
                clock.now += 0.2  # one local step of compute
                x.copy_(local_step(x, cross.rank, t, s))
                stats = sync.after_step(x)
            waits.append(stats.wait_s)
        return waits

    co2 = run_islands(2, 1, lambda i, c: run(i, c, True), timeout=30)[0]
    diloco = run_islands(2, 1, lambda i, c: run(i, c, False), timeout=30)[0]
    assert co2 == [0.0] + [pytest.approx(0.4)] * 3
    assert diloco == [pytest.approx(1.0)] * 4


@pytest.mark.parametrize("compute", ["float32", "bfloat16", "float64"])
def test_outer_state_bytes_equal_the_formula(compute):
    from trainer.attention.local import accum_dtype

    lay = FlatLayout(SHAPES, 3, 4)
    dtype = accum_dtype(getattr(torch, compute))
    sync = OuterSync(CONFIGS[0], lay, _Rank(0, 3), _Rank(0, 2), dtype=dtype)
    assert sync.memory_bytes() == outer_state_bytes(N, 3, compute, align=4)


@pytest.mark.parametrize("level", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_outer_slice_publishes_the_new_anchor(level, dtype):
    """Each rank changes its slice of the weights (as the outer update does); after
    publish_outer_slice every rank's parameters hold every slice's new values."""
    base = [torch.randn(s, generator=torch.Generator().manual_seed(3)) for s in SHAPES]

    def run(comm):
        params = [torch.nn.Parameter(b.clone().to(dtype)) for b in base]
        zero = ZeroOptimizer(params, comm, level=level, layout=layout(comm.size))
        x = zero.outer_slice()
        lo, hi = zero.layout.slice(comm.rank)
        assert x.numel() == hi - lo and x.dtype == torch.float32
        x.add_(1.0 + comm.rank)
        zero.publish_outer_slice()
        return torch.cat([p.detach().float().reshape(-1) for p in params])

    lay = layout(3)
    want = torch.cat([b.reshape(-1) for b in base]).to(dtype).float()
    for r in range(3):
        lo, hi = lay.slice(r)
        want[lo:hi] = (want[lo:hi] + (1.0 + r)).to(dtype).float()
    for got in run_threads(3, run, timeout=30):
        assert torch.equal(got, want)


def test_penalty_is_one_at_the_first_application():
    """D_prev = D the first time: penalty 1 whatever lambda (round 1 applies nothing, round 2
    the first stale average), more than 1 after; by the reference too."""
    cfg = oc(tau=1, outer_lr=1.0, momentum=0.0, staleness_lambda=5.0)
    got = run_co2(cfg, 2, 1, 3, flush=False)
    assert got[0][1][1][1].penalty == 1.0
    assert got[0][1][2][1].penalty > 1.0
    assert math.isclose(reference(cfg, 2, 3)[2]["penalty"], got[0][1][2][1].penalty, rel_tol=1e-12)


@pytest.mark.parametrize("rule", ["adaptive", "constant"])
def test_penalty_rules_by_hand(rule):
    """Three stale applications worked out by hand: tau 1, one island-independent step so the
    averages are known exactly. constant divides every stale average by 1 + lambda; adaptive by
    1 + lambda ||D - D_prev|| / ||D||, with D_prev the average applied before (D at the first)."""
    lam = 0.5
    cfg = oc(tau=1, outer_lr=1.0, momentum=0.0, staleness_lambda=lam, staleness_rule=rule)
    got = [s.penalty for _, s in run_co2(cfg, 2, 1, 4, flush=False)[0][1]]
    want = reference(cfg, 2, 4)
    if rule == "constant":
        assert got == [1.0, 1.5, 1.5, 1.5]
    else:
        assert got[:2] == [1.0, 1.0] and all(p > 1.0 for p in got[2:])
    assert got[1:] == pytest.approx([w["penalty"] for w in want[1:4]], rel=1e-12)
