"""The README's training example balances: `mixlen train configs/debug.toml --set data.path=DATASET
--nproc 4` (the README's rank count; the planner's balance at other rank counts is
tests/test_plan_balance.py's) on standard-library sources tokenized with the BPE the demo uses
(capacity 16,384, 8,192-token steps). Packing to C left rank 0 running
every step alone (imbalance 4.000); then, with short samples spread, a ~8K-token sample that fits
one rank kept 4 ranks at measured 3.16, planned 3.89 (ByteScale's smallest-ring rule,
`widen = false`). With widen, the default, every rank gets work and the report shows both figures
under 1.3."""

from __future__ import annotations

import json
import re
import sysconfig
from pathlib import Path

import pytest

from tools.cli import main as cli_main
from trainer.testing.ranks import run_cli_ranks

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def stdlib_slice(tmp_path_factory) -> Path:
    """A slice of the standard library in the demo's BPE (29 samples, one of them ~8K tokens)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    data = tmp_path_factory.mktemp("balance") / "stdlib"
    args = ["preprocess", stdlib, "--glob", "json/*.py", "--glob", "email/*.py", "--glob",
            "collections/*.py", "--tokenizer", str(ROOT / "tests/assets/bpe-stdlib.json"),
            "--max-len", "16384", "--out", str(data), "--quiet"]  # fmt: skip
    assert cli_main(args) == 0
    return data


@pytest.mark.slow
@pytest.mark.timeout(480)  # it also preprocesses; CI boxes may be loaded
def test_readme_example_uses_every_rank(stdlib_slice, tmp_path) -> None:
    nproc = 4
    data = stdlib_slice
    run = tmp_path / "run"
    sets = [f'data.path="{data}"', "train.steps=2", "train.eval_interval=0",
            f'metrics.dir="{run}"', f'checkpoint.dir="{run / "ckpt"}"']  # fmt: skip
    argv = ["train", str(ROOT / "configs/debug.toml"), "--nproc", str(nproc), "--quiet"]
    argv += [x for s in sets for x in ("--set", s)]
    # the ranks `--nproc` would start, forked from the test's preloaded server instead of
    # torchrun's fresh interpreters (~9 s of imports each; the launch has its own tests)
    run_cli_ranks(argv, nproc, timeout=400, env={"MIXLEN_DIST_TIMEOUT": "300"})
    report = (run / "balance.md").read_text()
    m = re.search(
        r"imbalance \(max/mean of run totals\): measured ([\d.]+), planned ([\d.]+)", report
    )
    assert m, report
    measured, planned = float(m.group(1)), float(m.group(2))
    assert planned < 1.3 and measured < 1.3, report
    for line in open(run / "metrics.jsonl"):
        rec = json.loads(line)
        assert min(rec["microbatches_per_rank"]) >= 1, rec  # no idle rank in any step
