"""`mixlen preprocess --overwrite` of a local dataset that is being read is refused, before any
work and again at the swap, naming the readers' pids; a killed reader blocks nothing; a reader
opening the dataset during the swap reads the new one. The reference is the dataset's own bytes
before and after, and the tokens a fresh fetcher reads."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from datapipe.errors import InputError
from datapipe.fetch import FetchConfig
from datapipe.ingest import preprocess as preprocess_mod
from datapipe.ingest.preprocess import PreprocessConfig, preprocess
from datapipe.inuse import READERS_FILE, ReadersLock, no_readers

pytestmark = pytest.mark.timeout(120)


def _corpus(tmp_path: Path, word: str, n: int = 30) -> Path:
    src = tmp_path / f"src-{word}"
    src.mkdir()
    for i in range(n):
        (src / f"f{i:03d}.txt").write_text(f"{word} {i} " * 30)
    return src


def _cfg(src: Path, out: Path) -> PreprocessConfig:
    return PreprocessConfig([str(src)], str(out), overwrite=True, shard_bytes=2000, progress=False)


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.iterdir() if p.name != READERS_FILE}


def _first_tokens(root: Path) -> list[int]:
    with FetchConfig().build(str(root)) as fetcher:
        return fetcher.fetch(np.array([[0, 0, int(fetcher.lengths[0])]])).input_ids.tolist()


def _never(run) -> None:
    raise AssertionError("tokenizing began")


def _reader(root: str, ready) -> None:  # a forked process holding a fetcher open, till killed
    with FetchConfig().build(root):
        ready.set()
        time.sleep(60)


@pytest.mark.serial  # forks
def test_overwrite_of_a_dataset_being_read_is_refused(tmp_path: Path) -> None:
    """Another process reads the dataset: --overwrite stops at once naming its pid, and the
    dataset's bytes are untouched (before: the reader later died on missing shards). Once the
    reader is killed (SIGKILL: no cleanup), the overwrite goes through."""
    out = tmp_path / "ds"
    preprocess(_cfg(_corpus(tmp_path, "old"), out))
    before = _files(out)
    new = _corpus(tmp_path, "new")
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=_reader, args=(str(out), ready))
    proc.start()
    try:
        assert ready.wait(60)
        engine = preprocess_mod.ENGINES["local"]
        preprocess_mod.ENGINES["local"] = _never
        try:
            with pytest.raises(InputError, match=rf"^--out {out}: the dataset there is being read "
                                                 rf"\(pid {proc.pid}\), by"):  # fmt: skip
                preprocess(_cfg(new, out))  # before any tokenizing
        finally:
            preprocess_mod.ENGINES["local"] = engine
        assert _files(out) == before
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    preprocess(_cfg(new, out))
    assert _files(out) != before
    fresh = tmp_path / "fresh"
    preprocess(_cfg(new, fresh))
    assert _first_tokens(out) == _first_tokens(fresh)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "fresh", "src-new", "src-old"]


def test_a_reader_that_opens_during_the_run_stops_the_swap(tmp_path: Path, monkeypatch) -> None:
    """A reader opens the dataset after the first check, while the run tokenizes: the swap is
    refused, naming this very process, the old dataset stays byte for byte, and the run's
    finished dataset is kept beside it as `DIR.new-PID` (a fresh run's tokens). A reader
    closed, or dropped unclosed, leaves no lock behind."""
    out = tmp_path / "ds"
    preprocess(_cfg(_corpus(tmp_path, "old"), out))
    before = _files(out)
    engine = preprocess_mod.ENGINES["local"]
    opened: list = []

    def engine_then_a_reader(run):
        result = engine(run)
        opened.append(FetchConfig().build(str(out)))
        return result

    monkeypatch.setitem(preprocess_mod.ENGINES, "local", engine_then_a_reader)
    new = _corpus(tmp_path, "new")
    me = os.getpid()
    kept = tmp_path / f"ds.new-{me}"
    with pytest.raises(InputError, match=rf"being read \(this process, pid {me}: a reader of it "
                       rf"not closed\?\).*This run's dataset is complete in {kept}: put it "):  # fmt: skip
        preprocess(_cfg(new, out))
    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", kept.name, "src-new", "src-old"]
    first = _files(kept)
    opened.pop().close()  # the next run starts; its engine opens a reader again
    with pytest.raises(InputError, match=rf"complete in {kept}-[0-9a-f]{{8}}: "):
        preprocess(_cfg(new, out))  # the same pid again: a name of its own, the first kept
    assert _files(kept) == first and len(list(tmp_path.glob(f"{kept.name}-*"))) == 1
    shutil.rmtree(next(tmp_path.glob(f"{kept.name}-*")))
    for reader in opened:
        reader.close()
    monkeypatch.setitem(preprocess_mod.ENGINES, "local", engine)
    fresh = tmp_path / "fresh"
    preprocess(_cfg(new, fresh))
    assert _files(kept) == {k: v for k, v in _files(fresh).items() if k != "manifest.json"} | {
        "manifest.json": (kept / "manifest.json").read_bytes()}  # fmt: skip
    assert _first_tokens(kept) == _first_tokens(fresh)
    dropped = FetchConfig().build(str(out))  # never closed
    del dropped
    gc.collect()
    preprocess(_cfg(new, out))
    assert _files(out) != before


def test_a_reader_waiting_on_the_swap_reads_the_new_dataset(tmp_path: Path) -> None:
    """A reader that opens while the writer holds the lock for its renames waits, then finds the
    lock file replaced with the folder and locks the new one's."""
    old, new = tmp_path / "ds", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    ReadersLock(str(old)).close()  # a reader came before: the lock file exists
    got: list[ReadersLock] = []
    with no_readers(str(old), str(old)):
        t = threading.Thread(target=lambda: got.append(ReadersLock(str(old))))
        t.start()
        t.join(0.3)
        assert t.is_alive(), "the reader waits while the writer swaps"
        os.rename(old, tmp_path / "aside")
        os.rename(new, old)
    t.join(10)
    assert got[0].fd is not None
    assert os.fstat(got[0].fd).st_ino == os.stat(old / READERS_FILE).st_ino
    with pytest.raises(InputError, match="is being read"):
        with no_readers(str(old), "ds"):
            pass
    got[0].close()
    with no_readers(str(old), "ds"):
        pass


@pytest.mark.timeout(30)
def test_a_lock_file_that_is_not_a_regular_file_is_never_opened(tmp_path: Path) -> None:
    """A FIFO, a folder or a symlink named `.readers.lock` (never made by mixlen): the reader
    neither blocks on the FIFO nor follows the link (nothing made at its target); the dataset is
    read and overwritten unguarded."""
    target = tmp_path / "elsewhere"
    for kind in ("fifo", "dir", "symlink"):
        root = tmp_path / kind
        root.mkdir()
        lock = root / READERS_FILE
        {"fifo": os.mkfifo, "dir": os.mkdir, "symlink": lambda p: os.symlink(target, p)}[kind](lock)
        reader = ReadersLock(str(root))
        assert reader.fd is None, kind
        with no_readers(str(root), kind):
            pass
        assert not target.exists()


def test_verify_holds_the_lock_while_it_checks(tmp_path: Path, monkeypatch) -> None:
    """`mixlen verify` reads the manifest, the index and every shard: an `--overwrite` meanwhile
    would have it check two datasets' files against each other. It is refused while verify runs
    (the dataset untouched), and goes through once verify has ended sound."""
    from datapipe import verify as verify_mod

    src, out = _corpus(tmp_path, "alpha"), tmp_path / "ds"
    preprocess(_cfg(src, out))
    before = _files(out)
    checking, go_on = threading.Event(), threading.Event()
    real = verify_mod.check_shard_file

    def slow_check(path: str, entry: dict) -> None:
        checking.set()
        assert go_on.wait(30)
        real(path, entry)

    monkeypatch.setattr(verify_mod, "check_shard_file", slow_check)
    reports: list = []
    t = threading.Thread(target=lambda: reports.append(verify_mod.verify_dataset(str(out), False)))
    t.start()
    assert checking.wait(30)
    monkeypatch.setattr(preprocess_mod, "_prepare", _never)
    with pytest.raises(InputError, match="is being read"):
        preprocess(_cfg(_corpus(tmp_path, "beta"), out))
    go_on.set()
    t.join(30)
    assert reports[0].ok, reports[0].problems
    assert _files(out) == before
    monkeypatch.undo()
    preprocess(_cfg(tmp_path / "src-beta", out))
    assert _files(out) != before
