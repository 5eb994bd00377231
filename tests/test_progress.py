"""Progress and logs: every long-running command draws a tqdm bar (count, ETA, rate) on a terminal
(a pseudo-terminal of 100 columns here), none with --quiet or when output is not a terminal; `mixlen
train` logs through `logging` with rank prefixes, information from rank 0 only by default."""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

from tools.cli import main as cli_main
from trainer.testing.ranks import run_cli_ranks

pytestmark = pytest.mark.timeout(240)
# "| 12/24 [00:01<00:01, 9.50plan/s]" or "| 1.2M/3.4M [00:01<00:02, 1.1MB/s, docs=...]", or for
# slow units "| 1/3 [00:06<00:12, 6.32s/step, loss=...]": count/total, elapsed<ETA, rate
BAR = re.compile(
    r"\|\s*[\d.]+[kMGT]?/[\d.]+[kMGT]? \[\d\d:\d\d<\d\d:\d\d,\s*[\d.]+\s?[kMGT]?(\w+/s|s/\w+)[,\]]"
)


def run_tty(args: list[str], timeout: float = 180) -> str:
    """`mixlen ARGS` with stdout and stderr on a 100x30 pseudo-terminal; returns all it wrote."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("TQDM_DISABLE", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.cli", *args],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the terminal's last writer closed it
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        rc = proc.wait(timeout=30)
    finally:
        os.close(master)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    out = b"".join(chunks).decode("utf-8", "replace")
    assert rc == 0, out[-3000:]
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """A small corpus, its dataset, a foreign MDS dataset (for `mixlen index`) and a train config."""
    from _train_worker import make_dataset, train_config

    from trainer.config.toml import to_toml

    tmp = tmp_path_factory.mktemp("progress")
    ds = make_dataset(str(tmp / "ds"), n_docs=200)
    from streaming import MDSWriter

    rng = np.random.default_rng(1)
    with MDSWriter(
        out=str(tmp / "foreign"), columns={"ids": "ndarray:uint16"}, size_limit=4000
    ) as w:
        for n in rng.integers(1, 300, 60):
            w.write({"ids": rng.integers(0, 1000, n).astype(np.uint16)})
    cfg = train_config(
        ds, str(tmp / "run"), parallel={"policy": "single"}, checkpoint={"dir": None}
    )
    cfg.train.steps, cfg.train.eval_interval, cfg.metrics.progress = 3, 0, True
    (tmp / "train.toml").write_text(to_toml(cfg))
    return {"tmp": tmp, "ds": ds, "jsonl": ds + ".jsonl"}


def commands(inputs: dict) -> dict[str, list[str]]:
    t = inputs["tmp"]
    plan = [
        "--ranks",
        "4",
        "--capacity",
        "256",
        "--global-batch-tokens",
        "1024",
        "--model",
        "debug",
    ]
    return {
        "preprocess": ["preprocess", inputs["jsonl"], "--out", str(t / "pp"), "--overwrite"],
        "index": ["index", str(t / "foreign"), "--tokens-field", "ids", "--overwrite"],
        "plan": ["plan", inputs["ds"], *plan, "--steps", "12"],
        "simulate": ["simulate", "--ranks", "8", "--capacity", "4096", "--context", "32768",
                     "--global-batch-tokens", "262144", "--steps", "2", "--model", "debug"],
        "verify": ["verify", inputs["ds"]],
        "train": ["train", str(t / "train.toml")],
    }  # fmt: skip


class FakeTerminal(io.StringIO):
    """stderr that says it is a terminal (what the commands check before drawing a bar)."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _fresh_logging():
    """`mixlen train --quiet` in this process leaves the mixlen logger at WARNING: reset it."""
    yield
    logging.getLogger("mixlen").handlers.clear()


@pytest.mark.parametrize("name", ["preprocess", "index", "plan", "simulate", "verify", "train"])
def test_bar_on_a_terminal_none_with_quiet(inputs: dict, name: str, monkeypatch) -> None:
    """In this process, with stderr a (fake) terminal: a bar with count, ETA and rate; none with
    --quiet."""
    args = commands(inputs)[name]
    got = {}
    for quiet in (False, True):
        term = FakeTerminal()
        with monkeypatch.context() as m:
            m.setattr(sys, "stderr", term)
            assert cli_main(args + ["--quiet"] * quiet) == 0
        got[quiet] = term.getvalue()
        logging.getLogger("mixlen").handlers.clear()
    assert BAR.search(got[False]), f"{name}: no bar with count, ETA and rate:\n{got[False][-2000:]}"
    assert not BAR.search(got[True]) and "%|" not in got[True], got[True][-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plan", "train"])
def test_bar_on_a_real_terminal(inputs: dict, name: str) -> None:
    """The same through a pseudo-terminal (a separate process): the bar draws, and train's logged
    step lines come through it whole."""
    out = run_tty(commands(inputs)[name])
    assert BAR.search(out), f"{name}: no progress bar with count, ETA and rate in:\n{out[-2000:]}"
    if name == "train":
        assert len(re.findall(r"step +\d+ +loss", out)) == 3


def test_input_progress_adds_up_to_the_bytes_on_disk(corpus: dict) -> None:
    """The preprocess bar advances by bytes on disk: its steps add up to the inputs' sizes, for
    plain, compressed and parquet inputs and text files alike, and never go backwards."""
    from datapipe.ingest.inputs import find_inputs
    from datapipe.ingest.sources import TokenizeSettings, iter_blocks
    from datapipe.ingest.tokenizer import TokenizerSpec
    from datapipe.progress import InputProgress, input_sizes

    files = find_inputs(corpus["inputs"], ["**/*"])
    sizes = input_sizes(files)
    assert sum(sizes.values()) == sum(os.path.getsize(f) for f in files)
    track = InputProgress(sizes)
    steps = []
    # --max-doc-bytes 100: the longer text files come in pieces, each advancing the bar
    settings = TokenizeSettings(TokenizerSpec(), max_doc_bytes=100)
    kinds = set()
    for block in iter_blocks(files, settings):
        kinds.add(block.kind)
        track.advance(block)
        steps.append(track.pop())
    steps.append(track.rest())
    assert min(steps) >= 0 and sum(steps) == track.total
    assert "piece" in kinds


def test_rank_prefixes_and_rank_filter() -> None:
    from trainer.logs import get_logger, setup_logging

    def lines(rank: int, world: int, ranks: str, quiet: bool = False) -> list[str]:
        buf = io.StringIO()
        setup_logging(rank, world, ranks, quiet, stream=buf)
        log = get_logger("train")
        log.info("info %d", rank)
        log.warning("warn %d", rank)
        return buf.getvalue().splitlines()

    try:
        assert lines(0, 1, "0") == ["info 0", "warn 0"]
        assert lines(0, 4, "0") == ["[rank 0/4] info 0", "[rank 0/4] warn 0"]
        assert lines(2, 4, "0") == ["[rank 2/4] warn 2"]  # information from rank 0 only
        assert lines(2, 4, "all") == ["[rank 2/4] info 2", "[rank 2/4] warn 2"]
        assert lines(0, 4, "0", quiet=True) == ["[rank 0/4] warn 0"]
        with pytest.raises(ValueError, match="--log-ranks"):
            setup_logging(0, 1, "some")
    finally:
        logging.getLogger("mixlen").handlers.clear()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_train_two_ranks_log_ranks_all(inputs: dict) -> None:
    """2 ranks (those `--nproc 2` starts, forked from the test's preloaded server: torchrun's
    launch has its own tests): rank 0's step lines and summary, rank 1's own step lines, each with
    its prefix; without --log-ranks all rank 1 says nothing."""
    argv = ["train", str(inputs["tmp"] / "train.toml"), "--nproc", "2", "--log-ranks", "all",
            "--set", 'parallel.policy="hdp"']  # fmt: skip
    logs = inputs["tmp"] / "logs"
    run_cli_ranks(argv, 2, timeout=140, env={"MIXLEN_DIST_TIMEOUT": "60"}, logs=logs)
    out = [x for r in (0, 1) for x in (logs / f"rank{r}.stderr").read_text().splitlines()]
    assert sum(bool(re.match(r"\[rank 0/2\] step +\d+ +loss", x)) for x in out) == 3
    assert sum(bool(re.match(r"\[rank 1/2\] step \d+: \d+ micro-batches", x)) for x in out) == 3
    assert any(x.startswith("[rank 0/2] metrics:") for x in out)
    assert not any(x.startswith("[rank 1/2] metrics:") for x in out)
    recs = [json.loads(x) for x in open(Path(inputs["tmp"]) / "run" / "metrics.jsonl")]
    assert [r["step"] for r in recs] == [1, 2, 3]


def test_input_sizes_of_a_folder_count_its_subfolders(tmp_path: Path) -> None:
    """A folder input (a saved DatasetDict keeps its splits in subfolders) weighs every file
    under it, counted here from the bytes written; a missing input weighs 0."""
    from datapipe.progress import input_sizes

    ds = tmp_path / "saved"
    for rel, n in (("dataset_dict.json", 30), ("train/data-00000.arrow", 5000),
                   ("train/state.json", 70), ("test/data-00000.arrow", 900)):  # fmt: skip
        (ds / rel).parent.mkdir(parents=True, exist_ok=True)
        (ds / rel).write_bytes(b"x" * n)
    (tmp_path / "a.jsonl").write_bytes(b"y" * 123)
    got = input_sizes([ds, tmp_path / "a.jsonl", tmp_path / "gone.jsonl"])
    want = {str(ds): 6000, str(tmp_path / "a.jsonl"): 123, str(tmp_path / "gone.jsonl"): 0}
    assert got == want
