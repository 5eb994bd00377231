"""`mixlen preprocess` under hostile input and a hostile environment: truncated and random
compressed files, inputs that are all bad, two runs into one output, outputs that overlap the
inputs, a full disk, leftovers of killed runs. Each fault ends in a clear message naming the file
or flag (exit 2) or a complete dataset; never a traceback, never a partial dataset."""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _faults import dead_pid, file_size_limit, tree_digest

from datapipe.errors import InputError, MixlenError
from datapipe.index import read_index
from datapipe.ingest.preprocess import PAUSE_HOOK_ENV, PreprocessConfig, preprocess
from datapipe.verify import verify_dataset
from tools.cli import main as cli_main


def _lines(n: int, tag: str = "doc") -> bytes:
    return "".join(
        json.dumps({"text": f"{tag} {i} " + "w" * (i % 50)}) + "\n" for i in range(n)
    ).encode()


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    rc = cli_main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return rc, err


def test_truncated_compressed_inputs_are_bad_files(tmp_path: Path, capsys) -> None:
    """A .jsonl.zst missing its last byte and a .jsonl.gz missing its tail are counted and named
    (not read as shorter files); --strict stops with the file's name; the good file survives."""
    import zstandard

    good, data = tmp_path / "good.jsonl", _lines(300)
    good.write_bytes(data)
    zst = tmp_path / "cut.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(data)[:-1])
    gz = tmp_path / "cut.jsonl.gz"
    gz.write_bytes(gzip.compress(data)[:-12])
    # reference: zstd's own streaming decoder says the frame is incomplete
    with pytest.raises(zstandard.ZstdError):
        zstandard.ZstdDecompressor().decompress(zst.read_bytes())
    warnings: list[str] = []
    res = preprocess(
        PreprocessConfig([str(good), str(zst), str(gz)], str(tmp_path / "out"), progress=False),
        warn=warnings.append,
    )
    assert res.manifest["counts"]["bad"] >= 2
    assert any(str(zst) in w and "truncated zstd stream" in w for w in warnings), warnings
    assert any(str(gz) in w for w in warnings), warnings
    assert verify_dataset(str(tmp_path / "out")).ok
    # --strict: stops at the truncated file, naming it; nothing written
    for bad in (zst, gz):
        out = tmp_path / f"strict-{bad.suffix}"
        rc, err = _run(
            ["preprocess", str(bad), "--out", str(out), "--strict", "--no-progress"], capsys
        )
        assert rc == 2 and str(bad) in err
        assert not out.exists()


def test_multi_frame_zst_reads_every_frame(tmp_path: Path) -> None:
    import zstandard

    c = zstandard.ZstdCompressor()
    path = tmp_path / "frames.jsonl.zst"
    path.write_bytes(c.compress(_lines(100, "a")) + c.compress(_lines(50, "b")))
    res = preprocess(PreprocessConfig([str(path)], str(tmp_path / "out"), progress=False))
    assert res.manifest["num_samples"] == 150 and res.manifest["counts"]["bad"] == 0


def test_random_bytes_and_all_bad_inputs_are_errors(tmp_path: Path, capsys) -> None:
    """Random bytes as .jsonl.zst: exit 2 naming the file. Every input bad (binary files, a
    parquet without the text column): exit 2, not an empty dataset with exit 0."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    junk = tmp_path / "junk.jsonl.zst"
    junk.write_bytes(rng.bytes(5000))
    rc, err = _run(
        ["preprocess", str(junk), "--out", str(tmp_path / "o1"), "--no-progress"], capsys
    )
    assert rc == 2 and str(junk) in err and "no samples" in err
    assert not (tmp_path / "o1").exists()
    binary = tmp_path / "bin"
    binary.mkdir()
    for i in range(3):
        (binary / f"b{i}.txt").write_bytes(b"\xff\xfe" + rng.bytes(300))
    pq.write_table(pa.table({"body": ["x", "y"]}), tmp_path / "nocol.parquet")
    rc, err = _run(
        ["preprocess", str(binary), str(tmp_path / "nocol.parquet"), "--out", str(tmp_path / "o2")],
        capsys,
    )
    assert rc == 2 and "no samples" in err and "4 bad inputs" in err
    assert not (tmp_path / "o2").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _paused_run(cfg: PreprocessConfig, marker: Path, monkeypatch) -> tuple[threading.Thread, dict]:
    """Start `preprocess(cfg)` in a thread that pauses after its first shard until `marker` is
    removed; returns the thread and a dict receiving its result or error."""
    monkeypatch.setenv(PAUSE_HOOK_ENV, str(marker))
    box: dict = {}

    def body() -> None:
        try:
            box["result"] = preprocess(cfg)
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            box["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert t.is_alive(), box
        assert time.monotonic() < deadline
        time.sleep(0.02)
    monkeypatch.delenv(PAUSE_HOOK_ENV)
    return t, box


def test_a_killed_worker_ends_the_run(tmp_path: Path, monkeypatch) -> None:
    """A worker process killed mid-run (the out-of-memory killer, say): the run fails at once
    naming the inputs in flight, leaving nothing; it had waited forever for the lost block."""
    import multiprocessing
    import signal

    import datapipe.ingest.sources as sources

    monkeypatch.setattr(sources, "BLOCK_FILES", 2)  # 30 blocks
    src = _corpus(tmp_path)
    out, marker = tmp_path / "out", tmp_path / "paused"
    cfg = PreprocessConfig([str(src)], str(out), format="parquet", shard_bytes=2000, workers=2,
                           progress=False)  # fmt: skip
    t, box = _paused_run(cfg, marker, monkeypatch)
    workers = [p for p in multiprocessing.active_children() if "resource" not in p.name]
    assert workers, multiprocessing.active_children()
    os.kill(workers[0].pid, signal.SIGKILL)
    marker.unlink()
    t.join(60)
    assert not t.is_alive(), "the run hung"
    err = box.get("error")
    assert isinstance(err, MixlenError), box
    assert "a preprocess worker process died" in str(err) and str(src / "f") in str(err)
    assert not out.exists() and [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _corpus(root: Path, n: int = 60) -> Path:
    src = root / "src"
    src.mkdir(parents=True)
    for i in range(n):
        (src / f"f{i:03d}.txt").write_text(f"document {i} " * 40)
    return src


def test_two_runs_into_one_output(tmp_path: Path, monkeypatch) -> None:
    """While one run writes --out, a second one (even with --overwrite) fails at once naming the
    first one's pid; the first completes; the result is one complete dataset."""
    src = _corpus(tmp_path)
    out, marker = tmp_path / "out", tmp_path / "paused"
    cfg = PreprocessConfig([str(src)], str(out), format="parquet", shard_bytes=2000, progress=False)
    t, box = _paused_run(cfg, marker, monkeypatch)
    try:
        second = PreprocessConfig([str(src)], str(out), overwrite=True, progress=False)
        with pytest.raises(InputError, match=f"another mixlen preprocess \\(pid {os.getpid()}\\)"):
            preprocess(second)
    finally:
        marker.unlink()
        t.join(60)
    assert "error" not in box, box
    rep = verify_dataset(str(out))
    assert rep.ok and rep.samples == 60, rep.problems
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no lock, no temporaries


def test_output_made_during_a_run_is_not_replaced(tmp_path: Path, monkeypatch) -> None:
    """The final rename re-checks: a directory another program made at --out meanwhile is left as
    it is and the run fails naming --out."""
    src = _corpus(tmp_path)
    out, marker = tmp_path / "out", tmp_path / "paused"
    cfg = PreprocessConfig([str(src)], str(out), format="parquet", shard_bytes=2000, progress=False)
    t, box = _paused_run(cfg, marker, monkeypatch)
    out.mkdir()
    (out / "theirs.txt").write_text("someone else's")
    marker.unlink()
    t.join(60)
    assert isinstance(box.get("error"), InputError) and "appeared while" in str(box["error"])
    assert sorted(p.name for p in out.iterdir()) == ["theirs.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


@pytest.mark.parametrize("where", ["equal", "inside", "holds-input-file"])
def test_out_overlapping_an_input_is_refused(tmp_path: Path, capsys, where: str) -> None:
    src = _corpus(tmp_path, 5)
    before = tree_digest(src)
    inputs = [str(src)]
    out = {"equal": src, "inside": src / "ds"}.get(where, tmp_path)
    if where == "holds-input-file":
        inputs = [str(src / "f000.txt")]
    argv = ["preprocess", *inputs, "--out", str(out), "--overwrite", "--no-progress"]
    rc, err = _run(argv, capsys)
    assert rc == 2 and f"--out {out}" in err
    assert tree_digest(src) == before, "the corpus was touched"


def test_file_as_out_and_out_under_a_file(tmp_path: Path, capsys) -> None:
    src = _corpus(tmp_path, 5)
    target = tmp_path / "target"
    target.write_text("a regular file")
    rc, _ = _run(
        ["preprocess", str(src), "--out", str(target), "--overwrite", "--no-progress"], capsys
    )
    assert rc == 0 and (target / "manifest.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "target"]  # no .target.old-PID
    (tmp_path / "plain").write_text("x")
    rc, err = _run(["preprocess", str(src), "--out", str(tmp_path / "plain" / "ds")], capsys)
    assert rc == 2 and "is a file, not a directory" in err and "--out" in err


def test_profile_capacity_zero(tmp_path: Path, capsys) -> None:
    src = _corpus(tmp_path, 3)
    preprocess(PreprocessConfig([str(src)], str(tmp_path / "ds"), progress=False))
    rc, err = _run(["profile", str(tmp_path / "ds"), "--capacity", "0"], capsys)
    assert rc == 2 and "--capacity must be >= 1" in err


@pytest.mark.parametrize("fmt", ["mds", "wds", "parquet"])
def test_full_disk_keeps_the_previous_dataset(tmp_path: Path, capsys, fmt: str) -> None:
    """Shards that cannot be written (RLIMIT_FSIZE): a clear error naming --out, nothing partial
    left, the dataset already at --out untouched (byte for byte) and still readable."""
    src = _corpus(tmp_path, 200)
    out = tmp_path / "out"
    preprocess(PreprocessConfig([str(src)], str(out), format=fmt, progress=False))
    before = tree_digest(out)
    argv = ["preprocess", str(src), str(src), "--out", str(out), "--overwrite", "--no-progress",
            "--format", fmt, "--glob", "**/*", "--max-len", "64"]  # fmt: skip
    with file_size_limit(20_000):
        rc = cli_main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and f"--out {out}: writing failed (disk full" in err, err
    assert "Traceback" not in err and "Exception ignored" not in err
    assert tree_digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    assert verify_dataset(str(out)).ok


def test_leftovers_of_killed_runs_do_not_block(tmp_path: Path) -> None:
    """A dead run's lock file, temporary directory and moved-aside old output: the next run
    proceeds, removes the temporary and puts the old output back first (so it needs --overwrite
    to replace it, like any existing output); a moved-aside output beside an existing one is
    removed."""
    src = _corpus(tmp_path, 5)
    out = tmp_path / "out"
    pid = dead_pid()
    (tmp_path / ".out.lock").write_text(str(pid))
    (tmp_path / f".out.partial-{pid}").mkdir()
    (tmp_path / f".out.partial-{pid}" / "shard-00000.parquet").write_bytes(b"half")
    old = tmp_path / f".out.old-{pid}"
    preprocess(PreprocessConfig([str(src)], str(old), progress=False))
    before = tree_digest(old)
    warnings: list[str] = []
    with pytest.raises(InputError, match="already exists"):
        preprocess(PreprocessConfig([str(src)], str(out), progress=False), warn=warnings.append)
    assert tree_digest(out) == before and any("restored" in w for w in warnings)
    # another dead run's moved-aside output, now beside an existing one: removed, not restored
    stale = tmp_path / f".out.old-{dead_pid()}"
    stale.mkdir()
    (stale / "manifest.json").write_text("{}")
    preprocess(PreprocessConfig([str(src)], str(out), overwrite=True, progress=False))
    assert read_index(str(out)).manifest["num_samples"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_bad_json_records_are_counted_not_raised(tmp_path: Path) -> None:
    """Records that used to escape as tracebacks: deep nesting (RecursionError), an integer past
    Python's digit limit (ValueError), a lone surrogate (not encodable as UTF-8)."""
    path = tmp_path / "odd.jsonl"
    path.write_text(
        "[" * 100_000 + "\n"
        + json.dumps({"text": "1"}).replace('"1"', "1" * 5000) + "\n"
        + '{"text": "lone \\ud800 surrogate"}\n'
        + json.dumps({"text": "fine"}) + "\n"
    )  # fmt: skip
    warnings: list[str] = []
    res = preprocess(
        PreprocessConfig([str(path)], str(tmp_path / "out"), progress=False, max_reported=10),
        warn=warnings.append,
    )
    assert res.manifest["counts"]["bad"] == 3 and res.manifest["num_samples"] == 1
    assert [w.split(": ", 1)[0] for w in warnings] == [f"skipped {path}:{i}" for i in (1, 2, 3)]
    with pytest.raises(MixlenError, match=f"{path}:1: invalid JSON: nested too deeply"):
        preprocess(PreprocessConfig([str(path)], str(tmp_path / "o2"), strict=True, progress=False))


def test_overwrite_keeps_the_old_output_until_the_new_one_is_in_place(
    tmp_path: Path, monkeypatch
) -> None:
    """`--overwrite` moves the old output aside, renames the new one into place and only then
    deletes the old one: a run stopped between the two renames leaves the old dataset (moved
    aside, for the next run to put back), never no dataset at all."""
    from datapipe.ingest import output

    out, new = tmp_path / "out", tmp_path / ".out.partial-1"
    for d, text in ((out, "old"), (new, "new")):
        d.mkdir()
        (d / "manifest.json").write_text(text)
    real_rename = os.rename

    def rename(src, dst) -> None:
        if Path(src) == new:
            raise KeyboardInterrupt  # SIGTERM, as SigtermAsInterrupt raises it
        real_rename(src, dst)

    monkeypatch.setattr(output.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        output.commit(new, out, str(out), overwrite=True)
    kept = {p.parent.name: p.read_text() for p in tmp_path.rglob("manifest.json")}
    assert kept == {f".out.old-{os.getpid()}": "old", new.name: "new"}
