"""Shared fixtures: small corpora, and cleanup of what mosaicml-streaming leaves behind; how the
suite runs on several pytest-xdist workers (`make test`: `-n 2 --dist loadfile`): spawned ranks
forked from a preloaded forkserver, files with slow tests handed out first, `serial` tests alone."""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ("_s3",)  # the `server` and `s3` fixtures of the object-store tests
_STREAMING_LEFTOVER = re.compile(r"^\d{6}_")
_LEFTOVERS_AT_START = pytest.StashKey[tuple[set[str], set[str]]]()
_SESSION_LOCK = pytest.StashKey["_SessionLock"]()
_WARM = pytest.StashKey["_Warm"]()


def _leftovers() -> tuple[set[str], set[str]]:
    shm = (
        {n for n in os.listdir("/dev/shm") if _STREAMING_LEFTOVER.match(n)}
        if os.path.isdir("/dev/shm")
        else set()
    )
    tmp = {n for n in os.listdir("/tmp") if n.endswith("_filelock")}
    return shm, tmp


# what trainer.parallel.comm.spawn's workers import: forked from one server that imported these
# once (a fresh interpreter pays ~9 s for torch and the streaming library, which imports
# transformers), instead of each importing them again; torch._dynamo is what torch imports the
# first time a model is initialised under a device context (trainer.model.transformer.build);
# mixlen's own training, evaluation and calibration modules come next (~0.8 s a worker), and
# pandas, which pyarrow imports the first time it converts a numpy array (~0.6 s a worker)
SPAWN_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "numpy",
    "numba",
    "pyarrow.parquet",
    "pandas",
    "streaming",
    "trainer.train",
    "trainer.eval.run",
    "trainer.calibrate",
    "trainer.parallel.procexit",
    "tools.cli",
]


def _xdist_worker(config: pytest.Config) -> bool:
    """Is this process one of pytest-xdist's workers (not the controller, not a plain run)?"""
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    """pytest-xdist's workers share a lock (`serial` tests); the controller (or a plain run)
    notes the streaming leftovers already there, which are never removed."""
    if _xdist_worker(config):
        config.stash[_SESSION_LOCK] = _SessionLock(config.workerinput["testrunuid"])
        return
    config.stash[_LEFTOVERS_AT_START] = _leftovers()
    if getattr(config.option, "numprocesses", None):
        if not config.option.testrunuid:
            import uuid

            config.option.testrunuid = uuid.uuid4().hex  # the workers' files, removed at the end
        config.stash[_WARM] = _Warm(config.option.testrunuid)


def _run_file(uid: str, ext: str) -> str:
    """One of a pytest-xdist run's shared files (the workers' lock, the warm-up's status)."""
    return os.path.join(tempfile.gettempdir(), f"pytest-mixlen-{uid}{ext}")


class _Warm:
    """`python -m datapipe.plan.warm` (every numba kernel compiled once, so that spawned ranks
    find them cached) run by pytest-xdist's controller while the workers collect, instead of
    before pytest starts (~20 s of compiling on a fresh checkout beside ~10 s of collecting);
    its exit status goes to the run's `.warm` file, which each worker waits for before its
    first test (`wait`)."""

    def __init__(self, uid: str) -> None:
        import subprocess
        import threading

        self.path = _run_file(uid, ".warm")
        self.proc = subprocess.Popen([sys.executable, "-m", "datapipe.plan.warm"], cwd=ROOT)
        self.thread = threading.Thread(target=self._report, daemon=True)
        self.thread.start()

    def _report(self) -> None:
        code = self.proc.wait()
        with open(self.path + ".tmp", "w") as f:
            f.write(str(code))
        os.replace(self.path + ".tmp", self.path)

    def exit_code(self) -> int:
        """The warm-up's exit status, once it has ended (0: the kernels compiled)."""
        self.thread.join()
        return self.proc.returncode

    @staticmethod
    def wait(uid: str, timeout_s: float = 600.0) -> None:
        """On a worker: until the controller's warm-up has ended (or timeout_s: the tests then
        compile what they need themselves)."""
        import time

        deadline = time.monotonic() + timeout_s
        while not os.path.exists(_run_file(uid, ".warm")) and time.monotonic() < deadline:
            time.sleep(0.1)


class _SessionLock:
    """The workers of one pytest-xdist run take it around each test: shared by any test,
    exclusive for a `serial` one, which then runs with no other test of the run in progress
    (setup and teardown of module fixtures included). A turnstile file, held by a serial test
    from before it waits until it is done, lets no new test start meanwhile."""

    def __init__(self, uid: str) -> None:
        self.gate = open(_run_file(uid, ".gate"), "a+")  # noqa: SIM115 (held for the session)
        self.lock = open(_run_file(uid, ".lock"), "a+")  # noqa: SIM115

    def close(self) -> None:
        self.gate.close()
        self.lock.close()

    @contextlib.contextmanager
    def hold(self, exclusive: bool) -> Iterator[None]:
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(self.gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self.lock, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(self.gate, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """Each test under the run's lock (pytest-xdist workers only)."""
    lock = item.config.stash.get(_SESSION_LOCK, None)
    if lock is None:
        return (yield)
    with lock.hold(item.get_closest_marker("serial") is not None):
        return (yield)


# the files that took longest (pytest --durations, this 2-core box), longest first: handed out
# first, so that no worker is left running one of them alone at the end (only the order of the
# files depends on this list)
LONGEST = [
    "test_tensor_parallel.py",
    "test_faults_slow.py",
    "test_balance_example.py",
    "test_ray_engine.py",
    "test_calibrate.py",
    "test_islands.py",
    "test_train.py",
    "test_hf_train.py",
    "test_zero.py",
    "test_hostile_launch.py",
    "test_loss.py",
    "test_reference_trainer.py",
    "test_faults_messages.py",
    "test_sft_train.py",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On pytest-xdist workers (each collects the same order, as xdist requires): the LONGEST
    files first, then those with a slow test, then the rest, each file's tests in their order."""
    if not _xdist_worker(config):
        return
    slow = {i.path.name for i in items if i.get_closest_marker("slow")}

    def rank(item: pytest.Item) -> tuple[int, int]:
        name = item.path.name
        if name in LONGEST:
            return 0, LONGEST.index(name)
        return (1 if name in slow else 2), 0

    items.sort(key=rank)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Spawned ranks (trainer.parallel.comm.spawn) fork from a server that imported
    SPAWN_PRELOAD once. On a pytest-xdist worker it starts now if a slow (multi-process) test is
    collected, its imports running beside the first tests; elsewhere at the first spawn. A
    worker then waits for the controller's numba warm-up (`_Warm`) to end."""
    worker = _xdist_worker(session.config)
    if "torch" in sys.modules:  # else nothing collected uses torch: no rank will be spawned
        from trainer.parallel.comm import set_spawn_preload, start_spawn_server

        set_spawn_preload(SPAWN_PRELOAD)
        if worker and any(i.get_closest_marker("slow") for i in session.items):
            start_spawn_server()
    if worker:
        _Warm.wait(session.config.workerinput["testrunuid"])


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The run fails if the controller's numba warm-up did."""
    warm = session.config.stash.get(_WARM, None)
    code = warm.exit_code() if warm is not None else 0
    if code:
        print(f"\npython -m datapipe.plan.warm failed (exit code {code})", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    """mosaicml-streaming leaves shared memory and /tmp file locks (its #781, #893): remove ours
    (the library's own clean_stale_shared_memory would also unlink other running jobs' memory).
    Done once, by the process that saw the session start: with pytest-xdist the controller, after
    every worker has left (a worker finishing early would unlink another's live segments)."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    if forkserver is not None:  # reaped, so that its workers' CPU time counts as this process's
        with contextlib.suppress(AttributeError, OSError):
            forkserver._forkserver._stop()
    if _SESSION_LOCK in config.stash:
        config.stash[_SESSION_LOCK].close()
    if _xdist_worker(config) or _LEFTOVERS_AT_START not in config.stash:
        return
    shm0, tmp0 = config.stash[_LEFTOVERS_AT_START]
    uid = getattr(config.option, "testrunuid", None)  # pytest-xdist's controller
    for ext in (".gate", ".lock", ".warm") if uid else ():
        with contextlib.suppress(OSError):
            os.unlink(_run_file(uid, ext))
    if "streaming" in sys.modules:  # dead processes' segments only, never a live job's
        from datapipe.formats.mds import clean_stale_streaming

        clean_stale_streaming()
    shm1, tmp1 = _leftovers()
    for n in shm1 - shm0:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join("/dev/shm", n))
    for n in tmp1 - tmp0:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join("/tmp", n))


@contextlib.contextmanager
def open_streaming_dataset(local: str):
    """A StreamingDataset over a local MDS dir, cleaned up (shared memory) on exit."""
    from streaming import StreamingDataset

    from datapipe.formats.mds import clean_stale_streaming, release_streaming_prefix

    clean_stale_streaming()
    ds = StreamingDataset(local=local, batch_size=1, shuffle=False)
    prefix = int(ds._shm_prefix_int)
    try:
        yield ds
    finally:
        del ds
        release_streaming_prefix(prefix)


DOCS = [
    "hello world",
    "",  # empty: skipped and counted
    "ünïcödé → multi-byte ✓ " * 7,
    "x" * 300,  # longer than small chunk sizes
    "short",
    "def f():\n    return 42\n" * 40,
]


@pytest.fixture
def corpus(tmp_path: Path) -> dict:
    """A mixed corpus: JSON Lines (plain, gz, zst), parquet and a directory of text files.

    Returns the input paths and the expected documents in input order (the reference).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    src = tmp_path / "src"
    src.mkdir()
    texts = src / "texts"
    texts.mkdir()
    expected: list[str] = []
    lines = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS))
    (src / "a.jsonl").write_text(lines)
    expected += DOCS
    with gzip.open(src / "b.jsonl.gz", "wt") as f:
        f.write(lines)
    expected += DOCS
    (src / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    expected += DOCS
    pq.write_table(pa.table({"text": DOCS[::-1]}), src / "d.parquet")
    expected += DOCS[::-1]
    for i, t in enumerate(DOCS):
        (texts / f"doc{i:02d}.txt").write_text(t)
    expected += DOCS  # sorted file names = DOCS order
    inputs = [str(src / n) for n in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet")] + [
        str(texts)
    ]
    return {"inputs": inputs, "expected": expected, "tmp": tmp_path}


@pytest.fixture
def one_torch_thread():
    """torch on one thread during the test (as each rank runs), the previous count restored."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
