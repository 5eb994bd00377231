"""Long-context evaluation (trainer/eval/): position and length buckets against a plain-Python
reference, the island's bucketed losses on 1, 2 and 3 fake ranks (long samples on rings) against
each sample run alone through the model, and passkey cases (the answer where the generator says,
scored against each case alone)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _train_worker import model_config
from hypothesis import example, given, settings
from hypothesis import strategies as st

from datapipe.errors import ConfigError
from datapipe.fetch import MemoryFetcher
from datapipe.ingest.tokenizer import TokenizerSpec
from datapipe.plan.cost import preset
from datapipe.plan.planner import PlannerConfig
from trainer.eval.buckets import bucket_bounds, bucket_of
from trainer.eval.passkey import FILLER, INTRO, NEEDLE, QUESTION, check_lengths, make_cases
from trainer.eval.run import evaluate_passkey, evaluate_samples, fetched, planned_batches
from trainer.model.transformer import build_model
from trainer.parallel.executor import HDPExecutor
from trainer.testing.threads import run_threads

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def bucket_reference(v: int) -> int:
    """0 for [0, 1024), k for [1024 * 2^(k-1), 1024 * 2^k), by repeated doubling."""
    k, end = 0, 1024
    while v >= end:
        k, end = k + 1, end * 2
    return k


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 1 << 45), max_size=20))
def test_buckets_match_the_reference(values) -> None:
    values += [0, 1023, 1024, 2047, 2048, (1 << 40) - 1, 1 << 40]
    assert bucket_of(np.array(values)).tolist() == [bucket_reference(v) for v in values]
    for v in values:
        lo, hi = bucket_bounds(bucket_reference(v))
        assert lo <= v < hi


def _model():
    model, _ = build_model(model_config(), F64, seed=3)
    return model


def reference(tokens: list[np.ndarray]) -> dict[str, dict[int, tuple[float, int]]]:
    """Each sample alone through the model, plain per-token cross-entropy, bucketed by hand."""
    model = _model()
    pos: dict[int, list] = {}
    length: dict[int, list] = {}
    with torch.no_grad():
        for t in tokens:
            if len(t) < 2:
                continue
            ids = torch.from_numpy(t.astype(np.int64))
            logits = model(ids, torch.arange(len(t)))
            loss = F.cross_entropy(logits[:-1], ids[1:], reduction="none").tolist()
            for p, x in enumerate(loss):
                pos.setdefault(bucket_reference(p), []).append(x)
                length.setdefault(bucket_reference(len(t)), []).append(x)
    return {
        "pos": {k: (sum(v) / len(v), len(v)) for k, v in pos.items()},
        "len": {k: (sum(v) / len(v), len(v)) for k, v in length.items()},
    }


def test_island_buckets_equal_each_sample_alone() -> None:
    """Samples up to 3,000 tokens on 1, 2 and 3 fake ranks of capacity 3,072 / 1,536 / 1,024 (the
    longest on a ring of every rank): the position- and length-bucket losses equal each sample's plain cross-entropy
    (float64, 1e-9), and the overall loss is summed losses / labelled positions."""
    rng = np.random.default_rng(0)
    lengths = [3000, 1500, 1100, 700, 64, 1, 5, 2048, 900]
    tokens = [rng.integers(0, 258, n) for n in lengths]
    want = reference(tokens)
    fetcher = MemoryFetcher(tokens)

    def run(comm):
        cap = {1: 3072, 2: 1536, 3: 1024}[comm.size]
        planner = PlannerConfig(capacity=cap).build(preset("debug"), comm.size)
        plans = planned_batches(planner, np.arange(len(tokens)), fetcher.lengths, 4096)
        ex = HDPExecutor(_model(), None, comm)
        b = evaluate_samples(ex, fetched(plans, fetcher.fetch_step, comm.rank), comm.rank)
        return b, max(int(k) for p in plans for k in p.group_sizes)

    for n in (1, 2, 3):
        b, widest = run_threads(n, run)[0]
        assert widest == (1 if n == 1 else n)  # 3,000 tokens need every rank of 2 or 3
        got_pos = {(r["start"], r["end"]): (r["loss"], r["tokens"]) for r in b.by_position()}
        assert got_pos.keys() == {bucket_bounds(k) for k in want["pos"]}
        for k, (loss, count) in want["pos"].items():
            g = got_pos[bucket_bounds(k)]
            assert g[1] == count and g[0] == pytest.approx(loss, rel=1e-9)
        for r in b.by_length():
            loss, count = want["len"][bucket_of(np.array([r["start"]]))[0]]
            assert r["tokens"] == count and r["loss"] == pytest.approx(loss, rel=1e-9)
        assert sum(r["samples"] for r in b.by_length()) == sum(1 for x in lengths if x > 0)
        n_pos = sum(c for _, c in want["pos"].values())
        total = sum(loss * c for loss, c in want["pos"].values()) / n_pos
        assert b.loss == pytest.approx(total, rel=1e-9) and b.tokens == sum(x - 1 for x in lengths)


def test_a_length_bucket_of_one_token_samples_keeps_its_samples() -> None:
    """Samples of 1 token predict nothing: their bucket is still a row (loss NaN, shown as - and
    null in JSON), so the rows' samples add up to the evaluated samples."""
    from tools.cmd_eval import finite_json
    from trainer.eval.report import render

    tokens = [np.array([5]), np.array([7]), np.arange(1500) % 250]
    fetcher = MemoryFetcher(tokens)
    planner = PlannerConfig(capacity=2048).build(preset("debug"), 1)
    plans = planned_batches(planner, np.arange(3), fetcher.lengths, 4096)
    b = run_threads(1, lambda comm: evaluate_samples(
        HDPExecutor(_model(), None, comm), fetched(plans, fetcher.fetch_step, 0), 0))[0]  # fmt: skip
    rows = b.by_length()
    assert [(r["start"], r["tokens"], r["samples"]) for r in rows] == [(0, 0, 2), (1024, 1499, 1)]
    assert np.isnan(rows[0]["loss"]) and finite_json(rows)[0]["loss"] is None
    result = {"model": "m", "data": "d", "split": "all", "samples": 3, "tokens": b.tokens,
              "loss": b.loss, "by_position": b.by_position(), "by_length": rows}  # fmt: skip
    assert "| 0-1K | - | 0 | 2 |" in render(result)


def test_a_passkey_length_shorter_than_the_question_is_refused() -> None:
    """The case without filler (BOS, the introduction, the needle, the question and the key:
    counted here in bytes) is the shortest; a shorter length is refused naming it, never built
    longer than asked."""
    tok = TokenizerSpec("bytes").build()
    shortest = 1 + len((INTRO + NEEDLE.format(key="12345") + QUESTION + " 12345").encode())
    check_lengths(tok, [shortest, 4096], [0.0, 1.0])
    assert make_cases(tok, [shortest], [0.0, 1.0])[0].tokens.size == shortest
    for refuse in (lambda: check_lengths(tok, [4096, shortest - 1], [0.5]),
                   lambda: make_cases(tok, [shortest - 1], [0.5])):  # fmt: skip
        with pytest.raises(ConfigError, match=f"--passkey-lengths: {shortest - 1:,} tokens is "
                           f"shorter than a passkey case without filler, {shortest:,}"):  # fmt: skip
            refuse()


def test_the_launchers_passkey_check_agrees_with_the_cases() -> None:
    """With a BPE a key's digits take 1 to 4 more tokens than another key's: the check before
    launch refuses exactly the lengths the cases cannot fit (it measured key 12345 only)."""
    from datapipe.errors import ConfigError as Refused

    tok = TokenizerSpec("hf", "tests/assets/bpe-stdlib.json").build()
    depths = [0.0, 0.25, 0.5, 0.75, 1.0]
    verdicts = []
    for n in range(70, 100):
        refused = []
        for build in (check_lengths, make_cases):
            try:
                build(tok, [n], depths)
                refused.append(False)
            except Refused:
                refused.append(True)
        assert refused[0] == refused[1], (n, refused)
        verdicts.append(refused[0])
    assert verdicts[0] and not verdicts[-1]  # the boundary lies in the range


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_passkey_cases_hold_their_answer(kind) -> None:
    """The generator's answer tokens decode to " KEY", the needle sits after round(depth x filler
    lines) of them (byte tokens), and the case fits its length; with a BPE the answer is the tail
    the key's text adds."""
    spec = (
        TokenizerSpec("bytes")
        if kind == "bytes"
        else TokenizerSpec("hf", "tests/assets/bpe-stdlib.json")
    )
    tok = spec.build()
    cases = make_cases(tok, [500, 1200], [0.0, 0.3, 0.5, 0.7, 1.0], seed=4)
    assert len(cases) == 10 and len({c.key for c in cases}) == 10
    for c in cases:
        assert c.tokens.size <= c.length
        answer = c.tokens[c.answer_start : c.answer_start + c.answer_len]
        if kind == "bytes":
            assert bytes(answer.tolist()).decode() == " " + c.key
            text = bytes(t for t in c.tokens.tolist() if t < 256).decode()
            units = text.count(FILLER)
            before = text.index(NEEDLE.format(key=c.key))
            assert before == len(INTRO) + round(c.depth * units) * len(FILLER)
        assert c.tokens[: c.answer_start].size + answer.size == c.tokens.size


def test_passkey_scoring_equals_each_case_alone() -> None:
    """evaluate_passkey on 2 fake ranks (cases up to 2,048 tokens, capacity 1,024: on rings) gives
    every case's answer loss and greedy correctness as each case run alone does."""
    tok = TokenizerSpec("bytes").build()
    cases = make_cases(tok, [400, 2048], [0.0, 1.0], seed=1)
    model = _model()
    want = []
    with torch.no_grad():
        for c in cases:
            ids = torch.from_numpy(c.tokens.astype(np.int64))
            logits = model(ids, torch.arange(len(ids)))
            a, n = c.answer_start, c.answer_len
            tgt = ids[a : a + n]
            pred = logits[a - 1 : a - 1 + n]
            want.append((F.cross_entropy(pred, tgt).item(), bool((pred.argmax(-1) == tgt).all())))

    def run(comm):
        planner = PlannerConfig(capacity=1024).build(preset("debug"), comm.size)
        return evaluate_passkey(HDPExecutor(_model(), None, comm), planner, cases, 1024, comm.rank)

    got = run_threads(2, run)[0]
    assert [r["key"] for r in got] == [c.key for c in cases]
    for r, (loss, correct) in zip(got, want):
        assert r["answer_loss"] == pytest.approx(loss, rel=1e-9) and r["correct"] == correct


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[str, str, dict]:
    """(dataset, checkpoint.dir, the run's summary) of 2 steps on 40 documents."""
    from _train_worker import make_dataset, train_config

    from trainer.train import run_training

    tmp = tmp_path_factory.mktemp("trained")
    data = make_dataset(str(tmp / "ds"), n_docs=40)
    c = train_config(data, str(tmp / "run"), train={"steps": 2, "eval_interval": 2},
                     parallel={"policy": "single", "capacity": 4096})  # fmt: skip
    c.data.val_tokens = 1 << 20  # the whole held-out split, as mixlen eval takes it
    return data, str(tmp / "run" / "ckpt"), run_training(c)


def test_mixlen_eval_on_a_checkpoint(trained, tmp_path, capsys, monkeypatch) -> None:
    """`mixlen eval CKPT DATA`: a mixlen checkpoint's held-out samples (its val_fraction and
    seed), the table, --json's fields (no `passkey` with --no-passkey), eval.json and the passkey
    heatmap written with --out; the overall loss is the training run's own held-out loss at that
    step."""
    from tools.cli import main as cli_main

    data, ckpt, summary = trained
    out = tmp_path / "eval"
    args = ["eval", ckpt, data, "--out", str(out), "--passkey-lengths",
            "600,1200", "--passkey-depths", "0,1"]  # fmt: skip
    assert cli_main([*args, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert set(got) >= {"loss", "tokens", "by_position", "by_length", "passkey", "perplexity"}
    assert got["loss"] == pytest.approx(summary["val_losses"][-1][1], rel=1e-6)
    assert all(set(r) == {"start", "end", "loss", "tokens"} for r in got["by_position"])
    assert len(got["passkey"]) == 4 and {p["depth"] for p in got["passkey"]} == {0.0, 1.0}
    assert json.loads((out / "eval.json").read_text())["loss"] == got["loss"]
    assert (out / "passkey.png").stat().st_size > 1000
    assert cli_main([*args[:5], "--no-passkey"]) == 0  # the same --out: no stale heatmap left
    text = capsys.readouterr().out
    assert "| positions | loss | perplexity | tokens |" in text and "passkey" not in text
    assert "passkey" not in json.loads((out / "eval.json").read_text())
    assert not (out / "passkey.png").exists()
    assert cli_main([*args[:3], "--no-passkey", "--json"]) == 0
    bare = json.loads(capsys.readouterr().out)
    assert "passkey" not in bare and bare["by_position"] == got["by_position"]
    # a passkey length shorter than the question: refused before any sample is evaluated
    monkeypatch.setattr("trainer.eval.cli.evaluate_samples", lambda *a: pytest.fail("evaluated"))
    for extra in ([], ["--nproc", "2"]):  # --nproc: by the launcher, before any rank starts
        assert cli_main([*args[:3], "--passkey-lengths", "100", *extra]) == 2
        err = capsys.readouterr().err
        assert "--passkey-lengths: 100 tokens is shorter than a passkey case" in err


def test_eval_of_an_exported_folder_scores_the_runs_held_out_samples(
    trained, tmp_path, capsys
) -> None:
    """`mixlen export` writes the run's held-out split (data.val_fraction 0.1, seed 0) into the
    folder's mixlen.json, so `mixlen eval FOLDER` scores the samples the run held out: the same
    loss as the checkpoint's (before: a folder fell back to a 0.01 fraction, a set that includes
    samples a run with a smaller fraction trained on). A bad mixlen.json is refused by name."""
    from tools.cli import main as cli_main

    data, ckpt, summary = trained
    hf = tmp_path / "hf"
    assert cli_main(["export", ckpt, "--hf", str(hf)]) == 0
    capsys.readouterr()
    assert json.loads((hf / "mixlen.json").read_text()) == {
        "data": {"val_fraction": 0.1, "seed": 0}}  # fmt: skip
    assert cli_main(["eval", str(hf), data, "--no-passkey", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["loss"] == pytest.approx(summary["val_losses"][-1][1], rel=1e-6)
    assert cli_main(["eval", str(hf), data, "--no-passkey", "--json", "--val-fraction", "0.5"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] > got["tokens"], "the flag wins"
    for bad, said in (  # checked as [data]'s own settings: their bounds, their messages
        ('{"val_fraction": 2, "seed": 0}', "data.val_fraction: must be in [0, 1), got 2.0"),
        ('{"val_fraction": 0.1, "seed": 18446744073709551616}', "data.seed: must be <="),
        ('{"val_fraction": 0.1, "sed": 0}', "data.sed: unknown key"),
    ):
        (hf / "mixlen.json").write_text(f'{{"data": {bad}}}')
        assert cli_main(["eval", str(hf), data, "--no-passkey"]) == 2
        assert f"mixlen.json: {said}" in capsys.readouterr().err


def max_tokens_reference(lengths: list[int], n: int) -> list[int]:
    """The lengths `--max-tokens n` evaluates, by walking the samples: a sample of L tokens
    predicts L - 1; take whole samples while their predictions fit, then the first k tokens of
    the next (k predictions, its k-th the sample's next token) to make n."""
    out, left = [], n
    for length in lengths:
        if left <= 0:
            break
        if length - 1 <= left:
            out.append(length)
            left -= max(length - 1, 0)
        else:
            out.append(left)
            left = 0
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=12), st.integers(1, 300))
@example([23, 40, 0], 61)  # N reached exactly: the empty sample after it is not evaluated
def test_max_tokens_cut_equals_the_reference(lengths, n) -> None:
    """`_evaluated` under --max-tokens n (split all) against the walk above: the same ids in
    order and the same lengths, the last one cut; never more than n predictions."""
    from trainer.eval.cli import EvalOptions, _evaluated

    stored = np.array(lengths, dtype=np.int64)
    opts = EvalOptions(model="m", data="d", split="all", max_tokens=n)
    ids, got = _evaluated(opts, {}, stored, "d")
    want = max_tokens_reference(lengths, n)
    assert got.tolist() == want and ids.tolist() == list(range(len(want)))
    whole = got == stored[ids]  # a cut sample predicts all its k tokens
    assert int(np.maximum(got - 1, 0)[whole].sum() + got[~whole].sum()) <= n
    assert (~whole).sum() <= 1 and (whole.all() or not whole[-1])


def test_eval_max_tokens_at_the_boundaries(trained, capsys) -> None:
    """`mixlen eval --max-tokens N` evaluates exactly N predictions (the report's tokens): N = 1
    (the first token of the first held-out sample), N = that sample's whole count (it alone,
    uncut), one more (the second sample's first token too); a sample cut to k tokens has the
    loss of the whole sample's first k positions, run alone through the checkpoint's model."""
    from datapipe.fetch import FetchConfig
    from tools.cli import main as cli_main
    from trainer.data import held_out_mask
    from trainer.eval.cli import load_model

    data, ckpt, _ = trained
    fetcher = FetchConfig().build(data)
    lengths = np.asarray(fetcher.lengths, dtype=np.int64)
    ids = np.arange(lengths.size)
    held = ids[held_out_mask(ids, 0, 0.1)]  # the run's split (train_config: seed 0)
    sid, first = int(held[0]), int(lengths[held[0]]) - 1
    assert first > 4 and held.size > 1
    mb = fetcher.fetch(np.array([[sid, 0, first + 1]], dtype=np.int64))
    fetcher.close()
    model = load_model(ckpt, torch.float32, torch.device("cpu")).model
    with torch.no_grad():
        tok = torch.from_numpy(mb.input_ids.astype(np.int64))
        logits = model(tok, torch.arange(tok.numel()))
    ce = F.cross_entropy(logits[:-1].double(), tok[1:], reduction="none").numpy()

    def evaluate(n: int) -> dict:
        assert cli_main(["eval", ckpt, data, "--no-passkey", "--json", "--max-tokens", str(n)]) == 0
        return json.loads(capsys.readouterr().out)

    for n, samples in ((1, 1), (2, 1), (first // 2, 1), (first, 1), (first + 1, 2)):
        got = evaluate(n)
        assert (got["tokens"], got["samples"]) == (n, samples), (n, got)
        if samples == 1:
            assert got["loss"] == pytest.approx(ce[:n].mean(), rel=1e-5), n
