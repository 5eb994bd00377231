"""Pins for the cases hand-planted bugs survived (issue 30, item 5): each test here fails on the
bug named in its docstring. `mixlen export --max-position-embeddings` against a model that
declares its own context; passkey scoring when some but not all answer tokens are right;
`--max-doc-bytes` on multi-byte values in parquet and Arrow inputs (a value under the bound in
characters, over it in bytes); `mixlen eval`'s explicit held-out split against the run's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _train_worker import make_dataset, train_config

from datapipe.index import read_index, read_lengths
from datapipe.ingest.preprocess import PreprocessConfig, preprocess
from datapipe.ingest.tokenizer import TokenizerSpec
from datapipe.plan.cost import preset
from datapipe.plan.planner import PlannerConfig
from tools.cli import main as cli_main
from trainer.data import held_out_mask
from trainer.eval.passkey import make_cases
from trainer.eval.run import evaluate_passkey
from trainer.parallel.executor import HDPExecutor
from trainer.testing.threads import run_threads

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(180)]


# --- export: the explicit context wins ------------------------------------------------------------


@pytest.fixture(scope="module")
def declared_context(tmp_path_factory) -> tuple[Path, Path]:
    """A 1-step run of the debug model whose [model] declares a context of 1,536 (checkpoint at
    the end), on a dataset whose longest sample is shorter than that."""
    from trainer.train import run_training

    root = tmp_path_factory.mktemp("ctx")
    data = make_dataset(str(root / "ds"), n_docs=20)
    cfg = train_config(data, str(root / "run"), model={"max_position_embeddings": 1536},
                       train={"steps": 1, "eval_interval": 0}, checkpoint={"interval": 1},
                       parallel={"policy": "single", "capacity": 4096})  # fmt: skip
    run_training(cfg)
    return root / "run" / "ckpt", Path(data)


def test_export_max_position_embeddings_wins_over_the_models_own(declared_context, tmp_path):
    """The model declares 1,536; `--max-position-embeddings 6000` must write 6000 (the bug:
    the model's own value taking precedence, in the command or in export_hf); without the flag
    the model's 1,536, not the dataset's longest sample."""
    ckpt, data = declared_context
    longest = int(read_lengths(str(data)).max())
    assert longest not in (1536, 6000)
    for flags, want in (([], 1536), (["--max-position-embeddings", "6000"], 6000)):
        out = tmp_path / f"hf{want}"
        assert cli_main(["export", str(ckpt), "--hf", str(out), *flags]) == 0
        config = json.loads((out / "config.json").read_text())
        assert config["max_position_embeddings"] == want


# --- passkey: answered only when every answer token is right --------------------------------------


class Oracle(torch.nn.Module):
    """Greedy predictions chosen per (position, input token): `table` maps them to the token to
    predict (one-hot logits); anything else predicts token + 1, never the next byte of a case."""

    def __init__(self, table: dict[tuple[int, int], int], vocab: int) -> None:
        super().__init__()
        self.table, self.vocab = table, vocab
        self.dummy = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))

    def forward(self, ids, pos, attn=None, labels=None):
        want = [self.table.get((int(p), int(t)), (int(t) + 1) % self.vocab)
                for p, t in zip(pos.tolist(), ids.tolist())]  # fmt: skip
        logits = torch.zeros(len(want), self.vocab, dtype=torch.float64)
        logits[torch.arange(len(want)), torch.tensor(want)] = 1.0
        return logits + 0.0 * self.dummy

    def token_losses(self, ids, pos, labels, attn=None):
        """The model's evaluation interface (trainer.model.transformer.Transformer): each
        position's cross-entropy and greedy hit, from the one-hot logits."""
        logits, lab = self(ids, pos), labels.long()
        loss = torch.nn.functional.cross_entropy(logits, lab, ignore_index=-100, reduction="none")
        return loss, (logits.argmax(-1) == lab) & (lab != -100)


@pytest.mark.parametrize("ranks", [1, 2])
def test_passkey_partly_right_answer_is_not_answered(ranks):
    """Four cases whose answer tokens are predicted right: all of them, all but the last, only
    the first, none. Only the first is answered (the bug: a case counted answered when any, or
    most, of its tokens are right); each answer loss is the mean over the answer tokens of
    log(e + V - 1) - [right], by hand."""
    tok = TokenizerSpec("bytes").build()
    cases = make_cases(tok, [300, 400, 500, 600], [0.5], seed=2)
    assert len(cases) == 4 and len({c.answer_start for c in cases}) == 4
    rules = ["all", "all but last", "first", "none"]
    table: dict[tuple[int, int], int] = {}
    want_loss = []
    for c, rule in zip(cases, rules):
        n, a, toks = c.answer_len, c.answer_start, c.tokens.tolist()
        right = {"all": [True] * n, "none": [False] * n, "first": [j == 0 for j in range(n)],
                 "all but last": [j < n - 1 for j in range(n)]}[rule]  # fmt: skip
        assert n >= 3
        for j in range(n):  # position a - 1 + j predicts answer token j
            key = (a - 1 + j, toks[a - 1 + j])
            nxt = toks[a + j] if right[j] else (toks[a + j] + 7) % tok.vocab_size
            assert table.setdefault(key, nxt) == nxt  # no two cases want different things
        z = math.log(math.e + tok.vocab_size - 1)
        want_loss.append(sum(z - r for r in right) / n)

    def run(comm):
        planner = PlannerConfig(capacity=1024).build(preset("debug"), comm.size)
        ex = HDPExecutor(Oracle(table, tok.vocab_size), None, comm)
        return evaluate_passkey(ex, planner, cases, 1024, comm.rank)

    got = run_threads(ranks, run)[0]
    assert [r["correct"] for r in got] == [True, False, False, False]
    assert [r["answer_loss"] for r in got] == pytest.approx(want_loss, rel=1e-12)


# --- --max-doc-bytes counts bytes --------------------------------------------------------------------


def _value(limit: int) -> str:
    """Lines of two-byte characters: fewer characters than `limit`, more bytes (1.9 x)."""
    text = "".join("é" * 30 + "\n" for _ in range(limit // 32))
    assert len(text) < limit < len(text.encode())
    return text


def _pieces(out: Path) -> dict[str, list[bytes]]:
    """Each stored document's source (without @piece / #row) -> its pieces' bytes, in order."""
    from readback import read_rows, samples_from_rows

    idx = read_index(str(out), with_source=True)
    rows = samples_from_rows(read_rows(str(out), idx.manifest))
    got: dict[str, list[bytes]] = {}
    for src, toks in zip(idx.source, (rows[i] for i in range(len(idx)))):
        assert toks[0] == 256 and toks[-1] == 257
        base = src.split("@")[0].split("#")[0]
        got.setdefault(base, []).append(bytes(np.asarray(toks[1:-1], dtype=np.uint8)))
    return got


@pytest.mark.parametrize("policy", ["split", "truncate"])
def test_max_doc_bytes_counts_bytes_in_parquet_and_arrow_values(tmp_path, policy):
    """A parquet value and an Arrow (datasets save_to_disk) value of 1,000 bytes' worth of
    limit in characters but 1.9x that in UTF-8 bytes: over --max-doc-bytes, so split into
    pieces of at most the limit in bytes or truncated to the first (the bug: comparing the
    character count with the bound, which keeps the value whole)."""
    datasets = pytest.importorskip("datasets", reason="datasets is a test-only dependency")
    limit = 1000
    text = _value(limit)
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"text": [text, "short"]}), tmp_path / "in" / "v.parquet")
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": [text, "short"]}).save_to_disk(str(tmp_path / "in" / "hf"))
    cfg = PreprocessConfig([str(tmp_path / "in")], str(tmp_path / "o"), max_doc_bytes=limit,
                           long_docs=policy, format="parquet", progress=False)  # fmt: skip
    res = preprocess(cfg)
    got = _pieces(tmp_path / "o")
    raw = text.encode()
    sources = [s for s in got if not s.endswith("short")]
    assert len(got) == 2 and len(sources) == 2  # the parquet file and the Arrow folder
    for src in sources:
        pieces = [p for p in got[src] if p != b"short"]
        assert all(len(p) <= limit for p in pieces), [len(p) for p in pieces]
        if policy == "split":
            assert len(pieces) == 2 and b"".join(pieces) == raw
        else:
            assert len(pieces) == 1 and raw.startswith(pieces[0]) and len(pieces[0]) > limit // 2
    counts = res.manifest["counts"]
    assert counts["split" if policy == "split" else "truncated"] == 2


# --- mixlen eval: the explicit held-out split wins ----------------------------------------------------


def test_eval_split_options_win_over_the_runs():
    """--seed and --val-fraction given: those, not the checkpoint's data.seed / val_fraction
    (the bug: the run's value taking precedence); not given: the run's; neither: 0.01 and 0."""
    from trainer.eval.cli import EvalOptions, _eval_ids

    n, run = 5000, {"data": {"seed": 5, "val_fraction": 0.2}}
    ids = np.arange(n, dtype=np.int64)

    def want(seed: int, frac: float) -> list[int]:
        return ids[held_out_mask(ids, seed, frac)].tolist()

    opts = EvalOptions("m", "d")
    assert _eval_ids(opts, run, n).tolist() == want(5, 0.2)
    assert _eval_ids(opts, {}, n).tolist() == want(0, 0.01)
    mine = EvalOptions("m", "d", seed=9, val_fraction=0.05)
    assert _eval_ids(mine, run, n).tolist() == want(9, 0.05)
    assert want(9, 0.05) != want(5, 0.2) and want(9, 0.2) != want(5, 0.2)
    assert _eval_ids(EvalOptions("m", "d", seed=9), run, n).tolist() == want(9, 0.2)
