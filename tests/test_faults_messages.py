"""Errors a user sees name what the user wrote (a file, a row, a flag, a key), never an internal
field, and arrive as one message with exit code 2, not a traceback: config files, --set
overrides, and data faults met while training."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _faults import cli_error, dead_pid, flip_byte
from _train_worker import make_dataset, train_config

from datapipe.errors import ConfigError, InputError
from tools.cli import main as cli_main
from trainer.config.toml import load_config, to_toml

ROOT = Path(__file__).resolve().parent.parent
INTERNAL = re.compile(r"\bnum_ranks\b|\bnum_islands\b|\bstream\.\w|\bfetch\.\w|\bmds_access\b")


def test_error_messages_name_no_internal_fields() -> None:
    """Every `raise` in datapipe/, trainer/, tools/: no literal part of its message names an
    internal field (`num_ranks`, `stream.path`, ...); names go through datapipe.settings.Names."""
    found = []
    for pkg in ("datapipe", "trainer", "tools"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Raise) or node.exc is None:
                    continue
                mapped = set()  # arguments of names(...) / key(...) / k(...): looked up, not shown
                for sub in ast.walk(node.exc):
                    if isinstance(sub, ast.Call):
                        f = sub.func
                        name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")
                        if name in ("k", "key", "names", "off"):
                            mapped.update(id(a) for a in sub.args)
                for sub in ast.walk(node.exc):
                    if (
                        isinstance(sub, ast.Constant)
                        and isinstance(sub.value, str)
                        and id(sub) not in mapped
                        and INTERNAL.search(sub.value)
                    ):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {sub.value!r}")
    assert found == []


def test_config_errors_name_the_file_or_the_override(tmp_path, capsys) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text('[data]\npath = "x"\n[train]\nlr = "fast"\n')
    with pytest.raises(ConfigError, match=f"^{cfg}: train.lr: expected float, got str 'fast'"):
        load_config(cfg)
    cfg.write_text('[data]\npath = "x"\n')
    with pytest.raises(ConfigError, match="^--set train.steps: must be >= 1, got 0"):
        load_config(cfg, ["train.steps=0"])
    cfg.write_text('[data]\npath = "x"\n[train]\nsteps = 0\n')
    with pytest.raises(ConfigError, match=f"^{cfg}: train.steps: must be >= 1"):
        load_config(cfg, ["train.lr=0.1"])
    cfg.write_bytes(b"\x00\xff\xfe binary")
    with pytest.raises(ConfigError, match=f"^{cfg}: not"):
        load_config(cfg)
    cfg.write_text("[train\n")
    assert cli_main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"{cfg}: not valid TOML" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("data") / "ds"))


def _train(dataset: str, run: Path, capsys) -> tuple[int, str]:
    cfg = run.parent / f"{run.name}.toml"
    c = train_config(dataset, str(run), parallel={"policy": "single"}, checkpoint={"dir": None})
    cfg.write_text(to_toml(c))
    rc = cli_main(["train", str(cfg), "--set", "train.steps=3", "--set", "metrics.progress=false"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def test_data_faults_met_while_training_name_shard_and_sample(dataset, tmp_path, capsys) -> None:
    """While training: a token id outside the vocabulary names the shard, sample and position;
    a corrupt shard names the shard; exit 2, one message."""
    import shutil

    bad = tmp_path / "oov"
    shutil.copytree(dataset, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["vocab_size"] = 100  # the data holds byte ids up to 257
    (bad / "manifest.json").write_text(json.dumps(m))
    rc, err = _train(str(bad), tmp_path / "r1", capsys)
    assert rc == 2 and re.search(
        r"shard\.\d+\.mds: sample \d+, token \d+ has id \d+, outside", err
    ), err
    flipped = tmp_path / "flipped"
    shutil.copytree(dataset, flipped)
    name = m["shards"][0]["name"]
    flip_byte(flipped / name)
    rc, err = _train(str(flipped), tmp_path / "r2", capsys)
    assert rc == 2 and f"{name}: XXH3-64 checksum" in err and err.count("error:") == 1, err


def test_huge_numbers_are_refused_by_name(tmp_path, capsys) -> None:
    """Issue case 5: integers the planner's int64 arithmetic cannot hold are refused at
    validation naming the key or flag (exit 2, no traceback), in a config, a --set override and
    on `mixlen plan`'s command line."""
    cfg = tmp_path / "run.toml"
    cfg.write_text('[data]\npath = "x"\n')
    with pytest.raises(ConfigError, match=r"^--set parallel.capacity: must be <= 4,294,967,296"):
        load_config(cfg, ["parallel.capacity=99999999999999999999"])
    for key in ("train.global_batch_tokens", "parallel.max_context", "train.steps", "data.seed"):
        with pytest.raises(ConfigError, match=f"^--set {key}: must be <= "):
            load_config(cfg, [f"{key}={1 << 80}"])
    shaped = tmp_path / "shaped.toml"  # another [model] override in the file: the --set is named
    shaped.write_text('[model]\nname = "debug"\nvocab_size = 300\n[data]\npath = "x"\n')
    with pytest.raises(ConfigError, match=r"^--set model.rope_theta: rope_theta must be > 1"):
        load_config(shaped, ["model.rope_theta=-1"])
    # a message about two keys, one of them from --set: both sources named (the file alone was)
    with pytest.raises(ConfigError, match=rf"^{cfg} and --set data.sources: data.path and da"):
        load_config(cfg, ['data.sources=[{path="y"}]'])
    with pytest.raises(ConfigError, match=r"^--set train.stop_after: train.stop_after = 3 ends"):
        load_config(None, ['data.path="x"', "train.stop_after=3"])
    ds = make_dataset(str(tmp_path / "ds"), n_docs=20)
    base = ["plan", ds, "--ranks", "4", "--global-batch-tokens", "4096", "--model", "debug"]
    for flags, key in [
        (["--capacity", "99999999999999999999"], "--capacity"),
        (["--capacity", str(1 << 62)], "--capacity"),
        (["--capacity", "64", "--max-context", str(1 << 62)], "--max-context"),
        (["--capacity", "64", "--seed", str(1 << 64)], "--seed"),
    ]:
        assert cli_main(base[:1] + base[1:] + flags) == 2
        err = capsys.readouterr().err
        assert f"mixlen plan: error: {key}: must be <= " in err and "Traceback" not in err, err
    big = ["plan", ds, "--ranks", str(1 << 40), "--capacity", "64", "--global-batch-tokens", "64"]
    assert cli_main(big) == 2
    assert "--ranks: must be an int in [1, 1048576]" in capsys.readouterr().err
    gbt = ["plan", ds, "--ranks", "2", "--capacity", "64", "--global-batch-tokens", str(1 << 62)]
    assert cli_main(gbt) == 2
    assert "--global-batch-tokens: must be an integer in [1, " in capsys.readouterr().err
    for value in ("nan", "inf", "-1"):  # named by the flag, not the cost model's key
        assert cli_main([*base, "--capacity", "64", "--offload", "--offload-gbps", value]) == 2
        assert "--offload-gbps must be a finite number > 0" in capsys.readouterr().err


def test_config_files_and_numbers_refused_by_the_cli(tmp_path, capsys) -> None:
    """Issue cases 1 and 5 through `mixlen train`: /dev/zero, a FIFO or a 17 MiB file as the
    config (read forever before; now refused before reading, naming it), and a --set capacity
    beyond int64's reach (an OverflowError traceback in the planner before)."""
    fifo, big = tmp_path / "fifo.toml", tmp_path / "big.toml"
    os.mkfifo(fifo)
    with open(big, "wb") as f:
        f.truncate(17 << 20)
    for path, phrase in (
        ("/dev/zero", "a character device, not a regular file"),
        (fifo, "a FIFO (named pipe), not a regular file"),
        (big, "17,825,792 bytes, over the 16,777,216-byte limit"),
    ):
        assert f"mixlen train: error: {path}: a config file is {phrase}" in cli_error(
            ["train", str(path)], capsys
        )
    cfg = tmp_path / "run.toml"
    cfg.write_text('[data]\npath = "x"\n')
    err = cli_error(["train", str(cfg), "--set", "parallel.capacity=99999999999999999999"], capsys)
    assert "--set parallel.capacity: must be <= 4,294,967,296" in err


# every bounded integer flag of the subcommands (beside plan's, checked above): the command
# line that reaches it, its lower and upper bound
INT_FLAGS = [
    ("preprocess", ["in.txt", "--out", "o"], "--chunk-tokens", 1, 1 << 31),
    ("preprocess", ["in.txt", "--out", "o"], "--max-len", 1, 1 << 40),
    ("preprocess", ["in.txt", "--out", "o"], "--workers", 1, 4096),
    ("eval", ["model", "data"], "--max-tokens", 1, 1 << 40),
    ("eval", ["model", "data"], "--nproc", 1, 1 << 16),
    ("eval", ["model", "data"], "--capacity", 1, 1 << 32),
    ("eval", ["model", "data"], "--seed", 0, (1 << 63) - 1),
    ("calibrate", [], "--nproc", 1, 1 << 16),
    ("calibrate", [], "--vocab-size", 1, 1 << 32),
    ("calibrate", [], "--repeats", 1, 1000),
    ("calibrate", [], "--threads", 1, 4096),
    ("calibrate", [], "--ranks-per-node", 0, 1 << 16),
    ("export", ["ckpt", "--hf", "out"], "--island", 0, (1 << 16) - 1),
    ("export", ["ckpt", "--hf", "out"], "--max-position-embeddings", 1, 1 << 36),
    ("export", ["ckpt", "--hf", "out"], "--shard-size", 1 << 20, 1 << 40),
    ("train", ["run.toml"], "--nproc", 1, 1 << 16),
    ("train", ["run.toml"], "--max-restarts", 0, 10_000),
]


def test_integer_flags_are_bounded(capsys) -> None:
    """Issue: every integer CLI argument has an upper bound. Below, above, 30 digits and not a
    number: exit 2 from the parser naming the flag and the range, before anything runs."""
    for command, base, flag, lo, hi in INT_FLAGS:
        for bad, shown in ((lo - 1, f"{lo - 1:,}"), (hi + 1, f"{hi + 1:,}"),
                           ("9" * 30, "a 30-digit integer"), ("2**62", None)):  # fmt: skip
            with pytest.raises(SystemExit) as exc:
                cli_main([command, *base, flag, str(bad)])
            err = capsys.readouterr().err
            assert exc.value.code == 2 and "Traceback" not in err, err
            want = (
                f"must be an integer in [{lo:,}, {hi:,}], got {shown}"
                if shown
                else "expected an integer, got '2**62'"
            )
            assert f"mixlen {command}: error: argument {flag}: {want}" in err, err
    from datapipe.ingest.config import PreprocessConfig  # the same bounds from Python

    with pytest.raises(InputError, match=r"^--workers: must be an integer in \[1, 4,096\]"):
        PreprocessConfig(["in.txt"], "o", workers=5000).validate(["local"])


@pytest.mark.timeout(300)  # one training and three through the command line
def test_checkpoint_refusals_name_file_field_and_job(tmp_path, capsys) -> None:
    """Through `mixlen train` (exit 2, no traceback): a 400-digit integer in a checkpoint's rng
    file (checksums recomputed, as an attacker would) names the file and the field, not 'cannot
    be loaded (OverflowError...)' (issue case 6); the same in run.json's scheduler; a
    checkpoint.dir locked by a live job names that job (case 4)."""
    from _train_worker import make_dataset as make

    from trainer.checkpoint.files import write_checksums
    from trainer.checkpoint.lock import LOCK_FILE
    from trainer.train import run_training

    ds = make(str(tmp_path / "ds"), n_docs=30)
    run = tmp_path / "r"
    c = train_config(ds, str(run), parallel={"policy": "single"}, train={"steps": 2})
    c.train.eval_interval = 0
    run_training(c)
    step = run / "ckpt" / "step-00000002"
    c.checkpoint.resume, c.train.steps, c.metrics.progress = True, 3, False
    cfg = tmp_path / "resume.toml"
    cfg.write_text(to_toml(c))
    rng_text, run_text = (step / "rng-00000.json").read_text(), (step / "run.json").read_text()
    rng = json.loads(rng_text)
    rng["python"]["words"][3] = int("9" * 400)
    (step / "rng-00000.json").write_text(json.dumps(rng))
    write_checksums(str(step))
    err = cli_error(["train", str(cfg)], capsys)
    assert f"{step / 'rng-00000.json'}: field python.words[3]: expected an integer in " in err
    assert "400-digit" in err
    (step / "rng-00000.json").write_text(rng_text)
    info = json.loads(run_text)
    info["scheduler"]["last_epoch"] = int("9" * 400)
    (step / "run.json").write_text(json.dumps(info))
    write_checksums(str(step))
    err = cli_error(["train", str(cfg)], capsys)
    assert f"{step / 'run.json'}: field scheduler.last_epoch: expected an integer" in err
    (step / "run.json").write_text(run_text)
    write_checksums(str(step))
    other = subprocess.Popen(["sleep", "60"])  # a live job's lock
    try:
        holder = {"job": "job-A", "host": socket.gethostname(), "pid": other.pid}
        (run / "ckpt" / LOCK_FILE).write_text(json.dumps(holder))
        err = cli_error(["train", str(cfg)], capsys)
    finally:
        other.kill()
        other.wait()
    assert f"checkpoint.dir {run / 'ckpt'}: another job is using it (job job-A, pid " in err


def test_a_lock_is_taken_back_only_by_a_real_run_id(tmp_path, monkeypatch) -> None:
    """torchrun's --rdzv-id defaults to "none": two independent jobs both had run id "none", and
    the second took the first's live lock over ("no longer running"). "none" identifies nothing;
    a live holder on this host is never taken over; the same real run id takes its lock back
    after a restart (the old rank 0 dead here, or on another host); a reused pid is stale."""
    from trainer.checkpoint.lock import LOCK_FILE, DirLock, started

    host, lock = socket.gethostname(), tmp_path / LOCK_FILE

    def attempt(env: str, **holder) -> DirLock | str:
        """Acquire under run id `env` over a lock written by `holder`: the lock, or the refusal."""
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", env)
        lock.write_text(json.dumps(holder))
        d = DirLock(str(tmp_path))
        try:
            d.acquire()
        except ConfigError as exc:
            assert json.loads(lock.read_text()) == holder  # refused: the lock is left as it was
            return str(exc)
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        d.release()
        assert not lock.exists()
        return d

    other = subprocess.Popen(["sleep", "60"])  # a live process of another job on this host
    try:
        t0 = started(other.pid)
        assert t0 is not None
        for job in (f"{host}:{other.pid}", "none"):  # its lock as written now, and before the fix
            msg = attempt("none", job=job, host=host, pid=other.pid, started=t0)
            assert f"another job is using it (job {job}, pid {other.pid} on this host" in msg
        msg = attempt("run-7", job="run-7", host=host, pid=other.pid, started=t0)
        assert "(job run-7, pid" in msg  # alive here: another launch with the same --rdzv-id
        reused = attempt("none", job="job-A", host=host, pid=other.pid, started=t0 + 1)
        assert reused.took_over["job"] == "job-A" and reused.reason == "no longer running"
    finally:
        other.kill()
        other.wait()
    msg = attempt("none", job="none", host="node-2", pid=4242)
    assert "(job none, pid 4242 on host node-2" in msg and '--rdzv-id other than "none"' in msg
    assert "on host node-2" in attempt("run-7", job="job-A", host="node-2", pid=4242)
    moved = attempt("run-7", job="run-7", host="node-2", pid=4242)  # rank 0 restarted elsewhere
    assert moved.reason == "on host node-2: this job, restarted with the same torchrun run id"
    here = attempt("run-7", job="run-7", host=host, pid=dead_pid())
    assert here.reason == "no longer running: this job, restarted"
    # this pid with another start time: an earlier process (it used to count as this one's)
    mine = {"host": host, "pid": os.getpid(), "started": started(os.getpid())}
    earlier = attempt("none", job="job-E", **{**mine, "started": mine["started"] + 1})
    assert earlier.took_over["job"] == "job-E" and earlier.reason == "no longer running"
    assert attempt("none", job="job-S", **mine).took_over is None  # its own
    # another PID namespace or boot under the same host name (containers): another host
    for key in ("pidns", "boot"):
        msg = attempt("none", job="job-C", **mine, **{key: "elsewhere"})
        assert f"pid {os.getpid()} on host {host} (in another PID namespace or boot" in msg
        moved = attempt("run-7", job="run-7", **mine, **{key: "elsewhere"})
        assert moved.reason.endswith("this job, restarted with the same torchrun run id")


def test_a_lock_is_written_whole_and_taken_over_once(tmp_path, monkeypatch) -> None:
    """The lock was created empty and filled afterwards: a crash in between left an empty lock
    that nobody could take ("job ?, pid None"). Two starters that judged the same stale lock
    both removed it and both went on to hold one; now one holds it and the other names it."""
    import threading
    import types

    import trainer.checkpoint.lock as lock_mod
    from trainer.checkpoint.lock import LOCK_FILE, DirLock, started

    def crash(*args, **kw):
        raise RuntimeError("killed while writing the lock")

    monkeypatch.setattr(lock_mod, "json", types.SimpleNamespace(dump=crash, load=json.load))
    with pytest.raises(RuntimeError):
        DirLock(str(tmp_path)).acquire()
    assert os.listdir(tmp_path) == []  # neither an empty lock nor its temporary file
    monkeypatch.setattr(lock_mod, "json", json)
    host, path = socket.gethostname(), tmp_path / LOCK_FILE
    path.write_text(json.dumps({"job": "gone", "host": host, "pid": dead_pid()}))
    real_read, meet = DirLock._read, threading.Barrier(2)

    def read(self):  # both starters read the stale lock before either replaces it
        found = real_read(self)
        with contextlib.suppress(threading.BrokenBarrierError):
            meet.wait(timeout=1)  # (one waits in vain where the other holds the guard)
        if threading.current_thread().name == "b":
            time.sleep(0.2)  # "a" removes the stale lock and writes its own first
        return found

    monkeypatch.setattr(DirLock, "_read", read)
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    results: dict[str, object] = {}
    try:
        for name, proc in zip("ab", procs):  # two live starters of two jobs on this host
            d = DirLock(str(tmp_path))
            who = {"job": f"job-{name}", "host": host, "pid": proc.pid}
            d._mine = lambda who=who, pid=proc.pid: {**who, "started": started(pid)}

            def start(d=d, name=name) -> None:
                try:
                    d.acquire()
                    results[name] = d
                except ConfigError as exc:
                    results[name] = str(exc)

            results[name] = threading.Thread(target=start, name=name)
        threads = list(results.values())
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        held = [d for d in results.values() if isinstance(d, DirLock)]
        (refused,) = [m for m in results.values() if isinstance(m, str)]
        assert len(held) == 1 and held[0].took_over["job"] == "gone"
        holder = json.loads(path.read_text())
        assert f"another job is using it (job {holder['job']}, pid {holder['pid']} " in refused
        assert sorted(os.listdir(tmp_path)) == [LOCK_FILE]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _launch(cfg: Path) -> subprocess.Popen:
    """`mixlen train CFG --quiet` in a subprocess, with torchrun's default run id "none" (what
    two multi-node jobs started without --rdzv-id both have)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env["TORCHELASTIC_RUN_ID"] = "none"
    return subprocess.Popen(
        [sys.executable, "-m", "tools.cli", "train", str(cfg), "--quiet"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _wait(until, seconds: float) -> bool:
    """Poll `until()` for up to `seconds`; its last result."""
    deadline = time.monotonic() + seconds
    while not until() and time.monotonic() < deadline:
        time.sleep(0.2)
    return bool(until())


@pytest.mark.slow
@pytest.mark.timeout(400)  # waits of 150 + 150 + 60 s on a loaded 2-core machine
def test_two_trainings_into_one_checkpoint_dir_then_sigterm(dataset, tmp_path) -> None:
    """Issue cases 4 and 6: two `mixlen train` started 1 s apart into one checkpoint.dir (both
    with run id "none"): the second used to replace the first's checkpoints; now it exits 2 naming
    the first's job, no traceback, writing nothing there. SIGTERM to the first (it exited 143
    silently) prints "interrupted at step N; last complete checkpoint: ..." and exits 143; every
    checkpoint left is the first's and verifies against its checksums; the lock is released."""
    from trainer.checkpoint.files import read_checksums, verify_files
    from trainer.checkpoint.save import complete_checkpoints

    ckpt, procs = tmp_path / "ckpt", []
    for name in ("a", "b"):
        c = train_config(dataset, str(tmp_path / name), parallel={"policy": "single"})
        c.train.steps, c.train.eval_interval = 10_000, 0
        c.checkpoint.dir, c.checkpoint.interval, c.checkpoint.keep = str(ckpt), 1, 3
        (tmp_path / f"{name}.toml").write_text(to_toml(c))
        procs.append(_launch(tmp_path / f"{name}.toml"))
        time.sleep(1)
    try:
        assert _wait(lambda: any(p.poll() is not None for p in procs), 150), "neither ended"
        (loser,) = [p for p in procs if p.poll() is not None]  # whichever came second
        winner = procs[1 - procs.index(loser)]
        err = loser.communicate()[1]
        assert loser.returncode == 2 and "Traceback" not in err, err[-2000:]
        job = f"{socket.gethostname()}:{winner.pid}"
        assert f"checkpoint.dir {ckpt}: another job is using it (job {job}, pid {winner.pid} " \
            "on this host" in err, err  # fmt: skip
        saved = _wait(lambda: len(complete_checkpoints(str(ckpt))) >= 2, 150)
        assert saved, f"no two checkpoints in 150 s: {sorted(os.listdir(ckpt))}"
        winner.send_signal(signal.SIGTERM)
        err = winner.communicate(timeout=60)[1]
    finally:
        for p in procs:
            p.kill()
    assert winner.returncode == 143, err[-2000:]
    m = re.search(r"mixlen train: interrupted at step (\d+) \(SIGTERM\); last complete "
                  r"checkpoint: (\S+)", err)  # fmt: skip
    assert m and "Traceback" not in err, err[-2000:]
    step, path = int(m.group(1)), Path(m.group(2))
    assert path.name in (f"step-{step - 1:08d}", f"step-{step:08d}")
    left = complete_checkpoints(str(ckpt))
    assert str(path) == left[0] and sorted(os.listdir(ckpt)) == sorted(Path(d).name for d in left)
    run_dir = str(tmp_path / ("a" if winner is procs[0] else "b"))
    for d in left:
        assert verify_files(d, read_checksums(d), 0, 1) == []
        assert json.loads((Path(d) / "run.json").read_text())["config"]["metrics"]["dir"] == run_dir


def test_lock_sweeps_temporary_files_a_killed_starter_left(tmp_path) -> None:
    """A starter killed between writing its lock's temporary file and removing it leaves the
    file; the next run that takes the lock removes those older than an hour and leaves a fresh
    one (another starter may be writing it) and other files alone."""
    from trainer.checkpoint.lock import LOCK_FILE, DirLock

    old = tmp_path / f"{LOCK_FILE}.4242.deadbeef.tmp"
    fresh = tmp_path / f"{LOCK_FILE}.4343.cafef00d.tmp"
    other = tmp_path / "step-00000010.old.tmp"
    for path in (old, fresh, other):
        path.write_text("{}")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    os.utime(other, (two_hours_ago, two_hours_ago))
    d = DirLock(str(tmp_path))
    d.acquire()
    assert not old.exists() and fresh.exists() and other.exists()
    d.release()
