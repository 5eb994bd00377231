"""Small units of `mixlen eval`, `mixlen calibrate` and `mixlen export` against hand
computations: pooled length buckets, samples beyond the context, the held-out seed, the default
passkey lengths, maximal passkey cases, a case's correctness, the calibrated links, offload rate
and K/V bytes, the mean over ranks, the --nproc limit and the exported context."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from datapipe.errors import ConfigError
from datapipe.fetch import MemoryFetcher
from datapipe.ingest.tokenizer import TokenizerSpec
from datapipe.plan.cost import preset
from datapipe.plan.costfit import Timing
from datapipe.plan.planner import PlannerConfig
from datapipe.shapes import get_config
from trainer.eval import cli as eval_cli
from trainer.eval.buckets import BucketLosses
from trainer.eval.passkey import FILLER, make_cases
from trainer.eval.run import evaluate_passkey
from trainer.parallel.executor import TokenLosses

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

M64 = (1 << 64) - 1


def test_merged_buckets_add_each_parts_samples() -> None:
    """A mixture's pooled buckets: samples per length row are the sum of its sources' (hand
    counted: 0-1K 2 + 1, 1K-2K 1 + 0, 2K-4K 0 + 2)."""
    a, b = BucketLosses(), BucketLosses()
    a.count_samples(np.array([5, 900, 1500]))
    b.count_samples(np.array([2, 3000, 2048]))
    rows = a.merged(b).by_length()
    assert [(r["start"], r["samples"]) for r in rows] == [(0, 3), (1024, 1), (2048, 2)]


def test_beyond_context_counts_only_samples_longer_than_the_context(monkeypatch) -> None:
    """run_eval (model and evaluation stubbed) on samples of ctx - 1, ctx and ctx + 1 tokens of a
    model declaring ctx: exactly one lies beyond the context, and three were evaluated."""
    ctx = 1024
    buckets = BucketLosses()
    buckets.pos_sum[0], buckets.pos_n[0] = 6.0, 3
    lengths = np.array([ctx - 1, ctx, ctx + 1], dtype=np.int64)
    loaded = eval_cli.LoadedModel(torch.nn.Linear(1, 1), get_config("debug"), ctx, None, {})
    monkeypatch.setattr(eval_cli, "load_model", lambda *a, **k: loaded)
    monkeypatch.setattr(eval_cli, "HDPExecutor", lambda *a, **k: None)
    monkeypatch.setattr(eval_cli, "_evaluate", lambda *a: eval_cli.Evaluated(buckets, lengths, {}))
    rt = SimpleNamespace(tp=1, world=1, rank=0, device=torch.device("cpu"), comm=None)
    opts = eval_cli.EvalOptions(model="m", data="d", passkey=False, capacity=4096)
    out = eval_cli.run_eval(opts, rt)
    assert (out["context"], out["samples"], out["beyond_context"]) == (ctx, 3, 1)


def _splitmix_held_out(n: int, seed: int, fraction: float) -> list[int]:
    """Held-out ids by plain Python integers: splitmix64(id ^ seed), top 53 bits / 2^53."""
    out = []
    for i in range(n):
        z = ((i ^ seed) + 0x9E3779B97F4A7C15) & M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        z ^= z >> 31
        if (z >> 11) / (1 << 53) < fraction:
            out.append(i)
    return out


def test_eval_seed_zero_overrides_the_runs_seed() -> None:
    """--seed 0 on a run of seed 7 holds out seed 0's samples (a hand splitmix64), not seed 7's;
    without --seed the run's seed 7 is used."""
    run = {"data": {"seed": 7, "val_fraction": 0.3}}
    zero = eval_cli._eval_ids(eval_cli.EvalOptions(model="m", data="d", seed=0), run, 200)
    own = eval_cli._eval_ids(eval_cli.EvalOptions(model="m", data="d"), run, 200)
    assert zero.tolist() == _splitmix_held_out(200, 0, 0.3)
    assert own.tolist() == _splitmix_held_out(200, 7, 0.3) != zero.tolist()


def test_default_passkey_lengths_reach_the_context_or_the_limit() -> None:
    """Powers of two from 1,024 up to and including min(context, limit); the limit alone without
    a context; the top itself when it is under 1,024."""
    opts = eval_cli.EvalOptions(model="m", data="d")
    assert eval_cli._passkey_lengths(opts, 4096, 1 << 20)[0] == [1024, 2048, 4096]
    assert eval_cli._passkey_lengths(opts, 4096, 3000)[0] == [1024, 2048]
    assert eval_cli._passkey_lengths(opts, 4096, 2048)[0] == [1024, 2048]
    assert eval_cli._passkey_lengths(opts, None, 8192)[0] == [1024, 2048, 4096, 8192]
    assert eval_cli._passkey_lengths(opts, 600, 8192)[0] == [600]


def test_passkey_cases_fill_their_length_with_whole_filler_lines() -> None:
    """Byte tokens (one per character): every case is within its length and one more filler line
    would not fit (length - len(FILLER) < tokens <= length), a length that fits exactly included."""
    tok = TokenizerSpec("bytes").build()
    exact = make_cases(tok, [400], [0.0])[0].tokens.size + 3 * len(FILLER)
    lengths = [400, 1000, 1024, 2048, 4097, exact]
    for c in make_cases(tok, lengths, [0.0, 0.5, 1.0], seed=3):
        assert c.length - len(FILLER) < c.tokens.size <= c.length, (c.length, c.tokens.size)
    assert {c.tokens.size for c in make_cases(tok, [exact], [0.0, 1.0])} == {exact}


class _StubExecutor:
    """token_losses: every labelled position of the plan's samples, loss 1.0, the greedy
    prediction right except where `wrong` (sample id -> positions) says."""

    def __init__(self, fetcher: MemoryFetcher, wrong: dict[int, set[int]]) -> None:
        self.fetcher, self.wrong = fetcher, wrong
        self.comm = SimpleNamespace(all_reduce=lambda t: None)

    def token_losses(self, plan, fetched) -> list[TokenLosses]:
        out = []
        for s in plan.sample_ids.tolist():
            pos = np.arange(int(self.fetcher.lengths[s]) - 1, dtype=np.int64)
            right = np.array([p not in self.wrong.get(s, set()) for p in pos])
            out.append(TokenLosses(np.ones(pos.size), right, pos, np.full(pos.size, s)))
        return out


def test_a_passkey_case_is_correct_only_when_every_answer_token_is() -> None:
    """Three cases scored from crafted predictions: all answer tokens right -> correct; one
    wrong -> not; all wrong -> not; a wrong token outside the answer changes nothing."""
    cases = make_cases(TokenizerSpec("bytes").build(), [400], [0.0, 0.5, 1.0], seed=2)
    first = [c.answer_start - 1 for c in cases]  # position p predicts token p + 1
    wrong = {
        0: {first[0] - 1},
        1: {first[1] + 2},
        2: set(range(first[2], first[2] + cases[2].answer_len)),
    }
    ex = _StubExecutor(MemoryFetcher([c.tokens for c in cases]), wrong)
    planner = PlannerConfig(capacity=2048).build(preset("debug"), 1)
    got = evaluate_passkey(ex, planner, cases, 2048, 0)
    assert [r["correct"] for r in got] == [True, False, False]
    assert all(
        c.answer_len == 6 and r["answer_loss"] == 1.0 for c, r in zip(cases, got)
    )  # " NNNNN"


def _timings() -> list[Timing]:
    """Local timings of a smooth model of the micro-batch (as test_calibrate builds them)."""

    def t(lengths: tuple[int, ...]) -> float:
        s = np.array(lengths, dtype=float)
        return 2e-3 + 3e-8 * (s * s).sum() + 1e-4 * s.sum() + 2e-9 * s.sum() ** 2

    cases = [(128,), (512,), (2048,), (8192,), (16,) * 128, (256,) * 8, (512,) * 8, (256,) * 32]
    return [Timing("local", 1, c, 0.0, t(c)) for c in cases]


def test_calibrated_links_offload_rate_and_tp_kv_bytes() -> None:
    """--ranks-per-node: the (here given) measured link becomes the node link, the inter-node
    rate the link; --offload-bytes-per-s is kept; at tp 2 a ring passes half the K/V bytes (debug:
    2 KV heads of 32 wide, 2 layers, K and V, 4 bytes: 1,024 B/token whole)."""
    from trainer.calibrate import calibrate

    cal = calibrate("debug", 1, timings=_timings(), link_bytes_per_s=2e10, ranks_per_node=8,
                    inter_node_bytes_per_s=1e9, offload_bytes_per_s=7e9)  # fmt: skip
    c = cal.cost
    assert (c.link_bytes_per_s, c.node_link_bytes_per_s, c.ranks_per_node) == (1e9, 2e10, 8)
    assert (
        c.offload_bytes_per_s
        == 7e9
        != calibrate("debug", 1, timings=_timings()).cost.offload_bytes_per_s
    )
    shape = get_config("debug")
    whole = 2 * shape.n_kv_heads * (shape.dim // shape.n_heads) * 4 * shape.n_layers
    assert whole == 1024 and c.kv_bytes_per_token == whole
    assert calibrate("debug", 2, timings=_timings(), tp=2).cost.kv_bytes_per_token == whole / 2


def test_rank_mean_divides_by_the_world(monkeypatch) -> None:
    """_reduce over 2 ranks holding 1.0 and 3.0 (a fake all-reduce adds the other rank's value,
    or keeps the larger): mean 2.0, max 3.0, on either rank."""
    import torch.distributed as dist

    from trainer.calibrate_ranks import _reduce

    other = {}

    def all_reduce(t, op=None):
        v = torch.tensor([other["v"]], dtype=t.dtype)
        t.copy_(torch.maximum(t, v) if op == dist.ReduceOp.MAX else t + v)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    for mine, theirs in ((1.0, 3.0), (3.0, 1.0)):
        other["v"] = theirs
        assert _reduce(mine, "mean", "cpu") == 2.0 and _reduce(mine, "max", "cpu") == 3.0


def test_calibrate_nproc_limit_is_the_cores(monkeypatch) -> None:
    """4 cores: --nproc 4 is accepted with the wall clock and 5 refused; --threads 2 halves it;
    --clock cpu allows 4 ranks a core (16, not 17); --nproc names the limit."""
    from tools import cmd_calibrate

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})

    def check(nproc: int, threads: int = 1, clock: str = "wall") -> None:
        ns = SimpleNamespace(device="cpu", nproc=nproc, threads=threads, clock=clock)
        cmd_calibrate._check_nproc(ns)

    assert cmd_calibrate.CPU_CLOCK_RANKS_PER_CORE == 4
    for ok in ((4,), (2, 2), (16, 1, "cpu")):
        check(*ok)
    for bad in ((5,), (3, 2), (17, 1, "cpu")):
        with pytest.raises(ConfigError, match=f"--nproc {bad[0]}: more processes"):
            check(*bad)


def test_export_context_flag_wins_over_the_declared_context() -> None:
    """--max-position-embeddings 4096 on a model declaring 1,024 exports 4,096; without the flag
    the declared 1,024; declaring none, a single-dataset run's longest sample (a mixture run's,
    or a dataset not here: the flag is asked for)."""
    from tools.cmd_export import _context

    shape = get_config("debug", max_position_embeddings=1024)
    assert _context(SimpleNamespace(max_position_embeddings=4096), shape, {}) == 4096
    assert _context(SimpleNamespace(max_position_embeddings=None), shape, {}) == 1024
    # no declared context: a single-dataset run's longest sample, else the flag is asked for
    import datapipe.index

    bare, flag = get_config("debug"), SimpleNamespace(max_position_embeddings=None)
    assert bare.max_position_embeddings is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datapipe.index, "read_lengths", lambda p: np.array([3, 9, 4]) if p else 1 / 0)
        assert _context(flag, bare, {"data": {"path": "ds"}}) == 9
        with pytest.raises(ConfigError, match=r"a mixture run's \(data.sources\) is not measured"):
            _context(flag, bare, {"data": {"path": "", "sources": [{"path": "a"}]}})
    for data in ({"path": "/no/such/dataset"}, {"path": ""}, {}):
        with pytest.raises(ConfigError, match="the run's dataset is not here to measure"):
            _context(flag, bare, {"data": data})
