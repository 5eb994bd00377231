"""Hostile input, round three (issue 23, the data layer): special files among the inputs
(/dev/zero, FIFOs, sockets, symlink loops), reads bounded by --max-doc-bytes (a 2 GB single-line
input in bounded memory), config and manifest files refused above 16 MiB before a byte is read,
and the dataset fingerprint that tells a dataset with a replaced shard from the original. Each
case: its reproduction, the message checked, exit code 2, no traceback, nothing left behind.
(Tokenizers that drop characters: tests/test_lossy.py.)"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ingest import check_dataset, ref_tokens

from datapipe.errors import InputError
from datapipe.files import CONFIG_FILE_LIMIT, read_bounded_text
from datapipe.index import dataset_fingerprint, read_index, read_manifest
from datapipe.ingest.preprocess import PreprocessConfig, preprocess
from datapipe.ingest.sources import cut_points
from tools.cli import main as cli_main

pytestmark = pytest.mark.timeout(120)  # a FIFO that is opened blocks: the timeout names it


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    rc = cli_main([*argv, "--quiet"] if argv[0] == "preprocess" else argv)
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err, cap.err
    return rc, cap.out, cap.err


def _left_behind(parent: Path, name: str) -> list[str]:
    """What a run into parent/name left: the output, its temporary directory, its lock."""
    return sorted(
        p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}.")
    )


def _special_corpus(tmp: Path) -> tuple[Path, dict[str, str]]:
    """A directory with one good file and one of every special entry; returns it and the
    phrase each special entry must be named with."""
    d = tmp / "in"
    d.mkdir()
    (d / "good.txt").write_text("a good document")
    os.symlink("a-loop", d / "a-loop")  # a symlink to itself: sorted first, for --strict
    os.mkfifo(d / "fifo.jsonl")
    os.symlink("/dev/zero", d / "zero.txt")
    os.symlink(d / "missing", d / "broken.txt")
    (tmp / "elsewhere").mkdir()
    (tmp / "elsewhere" / "x.txt").write_text("not read")
    os.symlink(tmp / "elsewhere", d / "dirlink")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(d / "sock"))
    sock.close()
    return d, {
        "a-loop": "a symlink loop",
        "broken.txt": "a broken symlink",
        "dirlink": "a symlink to a directory (not followed",
        "fifo.jsonl": "a FIFO (named pipe), not a regular file",
        "sock": "a socket, not a regular file",
        "zero.txt": "a character device, not a regular file",
    }


def test_special_files_are_skipped_counted_and_named(tmp_path: Path, capsys) -> None:
    """Issue 23 cases 1, 2, 6: a directory holding a FIFO, a symlink to /dev/zero, a socket, a
    symlink loop, a broken symlink and a symlinked directory, beside one good file: each is
    skipped (never opened, so nothing blocks or reads without end), counted as `special` and
    named; --strict stops at the first, the symlink loop, naming it as such."""
    d, phrases = _special_corpus(tmp_path)
    warnings: list[str] = []
    t0 = time.monotonic()
    res = preprocess(
        PreprocessConfig([str(d)], str(tmp_path / "out"), progress=False, max_reported=10),
        warn=warnings.append,
    )
    assert time.monotonic() - t0 < 60
    check_dataset(str(tmp_path / "out"), [ref_tokens("a good document")], 65536)
    m = res.manifest
    assert m["counts"]["special"] == len(phrases) and m["counts"]["bad"] == 0
    named = {Path(where).name: why for where, why in m["reported"]["special"]}
    assert sorted(named) == sorted(phrases)
    for name, phrase in phrases.items():
        assert phrase in named[name], (name, named[name])
        assert any(w.startswith(f"skipped {d / name}: {phrase}") for w in warnings), name
    assert "No such file" not in " ".join(warnings)
    rc, out, _ = _run(["preprocess", str(d), "--out", str(tmp_path / "o2")], capsys)
    assert rc == 0 and f"special {len(phrases)}," in out
    rc, _, err = _run(["preprocess", str(d), "--out", str(tmp_path / "o3"), "--strict"], capsys)
    assert rc == 2 and f"error: {d / 'a-loop'}: a symlink loop (too many levels" in err
    assert _left_behind(tmp_path, "o3") == []


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "symlink-loop", "symlink-to-dev-zero"])
def test_special_input_alone_ends_promptly(tmp_path: Path, capsys, kind: str) -> None:
    """Issue 23 cases 1, 2, 6: `mixlen preprocess /dev/zero` read without bound until the OOM
    killer ended it (23.7 GB, `.o.partial-PID` left); a FIFO as the input hung; a symlink loop
    was "input not found". Now each ends at once: exit 2, the file named for what it is, the
    no-samples error, nothing left behind."""
    path = {"dev-zero": Path("/dev/zero")}.get(kind, tmp_path / "input")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink-loop":
        os.symlink("input", path)
    elif kind == "symlink-to-dev-zero":
        os.symlink("/dev/zero", path)
    phrase = {
        "dev-zero": "a character device, not a regular file",
        "fifo": "a FIFO (named pipe), not a regular file",
        "symlink-loop": "a symlink loop (too many levels of symbolic links)",
        "symlink-to-dev-zero": "a character device, not a regular file",
    }[kind]
    t0 = time.monotonic()
    rc, _, err = _run(["preprocess", str(path), "--out", str(tmp_path / "o")], capsys)
    assert time.monotonic() - t0 < 30
    assert rc == 2 and f"skipped {path}: {phrase}" in err
    assert (
        "no samples: 0 documents read" in err and f"1 special files skipped (first: {path}" in err
    )
    assert "input not found" not in err and "No such file" not in err
    assert _left_behind(tmp_path, "o") == []
    rc, _, err = _run(["preprocess", str(path), "--out", str(tmp_path / "o"), "--strict"], capsys)
    assert rc == 2 and f"error: {path}: {phrase}" in err and _left_behind(tmp_path, "o") == []


def test_json_line_over_max_doc_bytes_is_a_bad_line(tmp_path: Path, capsys) -> None:
    """A JSON line longer than --max-doc-bytes (plain and gzip) is a bad line named by file and
    line, read in bounded pieces and forgotten; the lines around it are kept."""
    texts = ["before", "x" * 5000, "after"]
    data = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    (tmp_path / "a.jsonl").write_bytes(data)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(data))
    inputs = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl.gz")]
    rc, _, err = _run(["preprocess", *inputs, "--out", str(tmp_path / "o"), "--max-doc-bytes",
                       "1000"], capsys)  # fmt: skip
    assert rc == 0
    n = len(json.dumps({"text": texts[1]})) + 1
    for f in inputs:
        assert f"skipped {f}:2: line of {n:,} bytes is longer than --max-doc-bytes (1,000)" in err
    check_dataset(str(tmp_path / "o"), [ref_tokens(t) for t in ("before", "after") * 2], 65536)
    assert read_index(str(tmp_path / "o")).manifest["counts"]["bad"] == 2


def _long_text(n_lines: int) -> str:
    """Lines of mixed width (1-4 byte characters), so pieces end at line breaks."""
    return "".join(f"{i:04d} ünï ✓ 😀 " + "w" * (i % 70) + "\n" for i in range(n_lines))


@pytest.mark.parametrize("policy", ["split", "truncate", "drop"])
def test_text_over_max_doc_bytes(tmp_path: Path, policy: str) -> None:
    """A text file and a parquet value over --max-doc-bytes: split into pieces of at most that
    many bytes (each at a line break, each its own document: FILE@0, FILE@1, ...), truncated to
    the first piece, or dropped; the pieces put together are the document, byte for byte. The
    parquet value is cut exactly like the file."""
    text, limit = _long_text(200), 1000
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "long.txt").write_text(text)
    (tmp_path / "in" / "short.txt").write_text("short")
    pq.write_table(pa.table({"text": [text]}), tmp_path / "in" / "v.parquet")
    cfg = PreprocessConfig([str(tmp_path / "in")], str(tmp_path / "o"), max_doc_bytes=limit,
                           long_docs=policy, format="parquet", progress=False)  # fmt: skip
    res = preprocess(cfg)
    idx = read_index(str(tmp_path / "o"), with_source=True)
    rows = {src: t for src, t in zip(idx.source, _tokens(tmp_path / "o", idx))}
    raw = text.encode()
    pieces: dict[str, list[bytes]] = {}
    for src, toks in rows.items():
        assert toks[0] == 256 and toks[-1] == 257  # each piece is its own document
        base = src.split("@")[0].split("#")[0]
        pieces.setdefault(base, []).append(bytes(toks[1:-1].astype(np.uint8)))
    long_, value = str(tmp_path / "in" / "long.txt"), str(tmp_path / "in" / "v.parquet")
    assert pieces.pop(str(tmp_path / "in" / "short.txt")) == [b"short"]
    c = res.manifest["counts"]
    if policy == "drop":
        assert pieces == {} and c["dropped"] == 2
        return
    assert pieces[long_] == pieces[value]  # the same cuts in memory as on disk
    got = pieces[long_]
    assert all(len(p) <= limit for p in got) and all(p.endswith(b"\n") for p in got[:-1])
    if policy == "truncate":
        assert len(got) == 1 and raw.startswith(got[0]) and c["truncated"] == 2
        assert sorted(rows) == sorted([long_, f"{value}#0", str(tmp_path / "in" / "short.txt")])
        return
    assert b"".join(got) == raw and len(got) > 5 and c["split"] == 2 and c["documents"] == 3
    assert [s for s in rows if s.startswith(long_)] == [f"{long_}@{j}" for j in range(len(got))]


def _tokens(root: Path, idx) -> list[np.ndarray]:
    from readback import read_rows, samples_from_rows

    got = samples_from_rows(read_rows(str(root), idx.manifest))
    return [got[i] for i in range(len(idx))]


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(st.sampled_from(list("ab \n\tü✓😀")), min_size=1, max_size=400),
    limit=st.integers(8, 120),
)
def test_cut_points_property(text: str, limit: int) -> None:
    """Pieces cover the bytes in order, none over the limit, each valid UTF-8; a piece ends
    after a line break when its last window (half the piece) holds one."""
    raw = text.encode()
    cuts = cut_points(lambda n, off: raw[off : off + n], len(raw), limit)
    assert cuts[0] == 0 and cuts[-1] == len(raw) and cuts == sorted(set(cuts))
    for a, b in zip(cuts, cuts[1:]):
        assert 0 < b - a <= limit
        raw[a:b].decode("utf-8")
        if b < len(raw) and b"\n" in raw[max(a + 1, a + limit - limit // 2) : a + limit]:
            assert raw[b - 1 : b] == b"\n"


def test_config_and_manifest_over_16_mib_refused_unread(tmp_path: Path, capsys) -> None:
    """read_bounded_text (the reader trainer configs use too) and the manifest reader refuse a
    file over 16 MiB before reading it (a sparse 2 GiB file: immediate), and anything that is not
    a regular file, naming the file; `mixlen verify` reports it."""
    big = tmp_path / "big.toml"
    with open(big, "wb") as f:
        f.truncate(2 << 30)
    t0 = time.monotonic()
    with pytest.raises(InputError, match=rf"{big}: the config is 2,147,483,648 bytes, over the "
                       rf"{CONFIG_FILE_LIMIT:,}-byte limit; refused before reading"):  # fmt: skip
        read_bounded_text(big, CONFIG_FILE_LIMIT, "the config")
    assert time.monotonic() - t0 < 1
    os.mkfifo(tmp_path / "fifo.toml")
    os.symlink("loop.toml", tmp_path / "loop.toml")
    for path, phrase in (
        (tmp_path / "fifo.toml", "a FIFO (named pipe), not a regular file"),
        (Path("/dev/zero"), "a character device, not a regular file"),
        (tmp_path / "loop.toml", "a symlink loop"),
        (tmp_path, "a directory, not a regular file"),
    ):
        with pytest.raises(InputError, match="^" + re.escape(f"{path}: the config is {phrase}")):
            read_bounded_text(path, CONFIG_FILE_LIMIT, "the config")
    (tmp_path / "ok.toml").write_text("[train]\nlr = 1e-3\n")
    assert read_bounded_text(tmp_path / "ok.toml", CONFIG_FILE_LIMIT, "x") == "[train]\nlr = 1e-3\n"
    with pytest.raises(FileNotFoundError):
        read_bounded_text(tmp_path / "missing.toml", CONFIG_FILE_LIMIT, "x")
    # a dataset whose manifest.json grew to 17 MiB (sparse), or became a FIFO
    (tmp_path / "src.txt").write_text("one document")
    ds = tmp_path / "ds"
    preprocess(PreprocessConfig([str(tmp_path / "src.txt")], str(ds), progress=False))
    os.truncate(ds / "manifest.json", 17 << 20)
    with pytest.raises(InputError, match=r"manifest.json: manifest.json is 17,825,792 bytes, over"):
        read_index(str(ds))
    rc, _, err = _run(["verify", str(ds)], capsys)
    assert rc == 1 and "17,825,792 bytes, over the 16,777,216-byte limit" in err
    os.remove(ds / "manifest.json")
    os.mkfifo(ds / "manifest.json")
    with pytest.raises(InputError, match="manifest.json: manifest.json is a FIFO"):
        read_manifest(str(ds))


def _same_size_twin(tmp_path: Path) -> tuple[Path, Path]:
    """Two datasets whose shards have the same sizes and different bytes."""
    roots = []
    for name, letter in (("a", "x"), ("b", "y")):
        src = tmp_path / f"src-{name}"
        src.mkdir()
        for i in range(20):
            (src / f"{i:02d}.txt").write_text(f"document {i} " + letter * (i * 7))
        out = tmp_path / name
        preprocess(PreprocessConfig([str(src)], str(out), format="parquet", shard_bytes=1500,
                                    progress=False))  # fmt: skip
        roots.append(out)
    return roots[0], roots[1]


def test_replaced_shard_changes_the_fingerprint(tmp_path: Path, capsys) -> None:
    """Issue 23 case 7 (verify): a shard replaced by another dataset's same-size shard, with the
    manifest's checksum updated, used to verify ok. The manifest's dataset fingerprint (over the
    index's and every shard's checksum) then disagrees with the checksums: verify fails naming
    it; and with the fingerprint recomputed too, verify passes but prints another fingerprint
    than the original's, which a resume compares. A manifest without the field (written before
    it) gets the same fingerprint computed."""
    a, b = _same_size_twin(tmp_path)
    ma, mb = read_manifest(str(a)), read_manifest(str(b))
    assert [s["bytes"] for s in ma["shards"]] == [s["bytes"] for s in mb["shards"]]
    original = dataset_fingerprint(str(a))
    assert original == ma["dataset_fingerprint"] != mb["dataset_fingerprint"]
    rc, out, _ = _run(["verify", str(a)], capsys)
    assert rc == 0 and f"dataset fingerprint {original}\n" in out
    # an old manifest (no field): the same fingerprint, computed
    old = dict(ma)
    del old["dataset_fingerprint"]
    (a / "manifest.json").write_text(json.dumps(old))
    assert dataset_fingerprint(str(a)) == dataset_fingerprint(old) == original
    rc, out, _ = _run(["verify", str(a)], capsys)
    assert rc == 0 and f"dataset fingerprint {original} (computed" in out
    # the replacement, checksum updated
    shutil.copyfile(b / mb["shards"][1]["name"], a / ma["shards"][1]["name"])
    edited = dict(ma, shards=[dict(s) for s in ma["shards"]])
    edited["shards"][1]["xxh3_64"] = mb["shards"][1]["xxh3_64"]
    (a / "manifest.json").write_text(json.dumps(edited))
    rc, _, err = _run(["verify", str(a)], capsys)
    assert rc == 1 and f"dataset_fingerprint {original} does not match the checksums" in err
    with pytest.raises(InputError, match="does not match the checksums it lists"):
        read_index(str(a))
    rc, _, err = _run(["profile", str(a)], capsys)  # any command reading the dataset: exit 2
    assert rc == 2 and "dataset_fingerprint" in err and "does not match" in err
    # ... and the fingerprint recomputed: verified, but not the original dataset
    del edited["dataset_fingerprint"]
    edited["dataset_fingerprint"] = dataset_fingerprint(edited)
    (a / "manifest.json").write_text(json.dumps(edited))
    rc, out, _ = _run(["verify", str(a)], capsys)
    assert rc == 0 and edited["dataset_fingerprint"] != original
    assert f"dataset fingerprint {edited['dataset_fingerprint']}\n" in out


# the subprocess that measures the peak RSS of `mixlen preprocess` in it over its start-up: the
# kernel's high-water mark of this process's memory (VmHWM), which starts afresh at exec (unlike
# ru_maxrss, which keeps the forking parent's peak)
_MEASURE = """
import json, sys
import pyarrow.parquet  # the parquet writer's library, loaded before the baseline
from datapipe.ingest import preprocess
from tools.cli import main
def hwm():
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0])
before = hwm()
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "before_kib": before, "peak_kib": hwm()}), file=sys.stderr)
"""


@pytest.mark.slow
def test_peak_memory_of_a_2gb_single_line_input(tmp_path: Path) -> None:
    """A 2 GiB JSON line and a 2 GiB one-line text file (sparse: no disk, a few seconds to read)
    with --max-doc-bytes 64MiB: the line is a bad line, the text is truncated to 64 MiB, and the
    preprocess process's peak RSS stays within its start-up plus 6 x --max-doc-bytes +
    --shard-size (the bytes tokenizer holds text, its UTF-8 bytes and uint16 tokens: ~4x)."""
    line, text = tmp_path / "line.jsonl", tmp_path / "line.txt"
    with open(line, "wb") as f:
        f.truncate(2 << 30)  # zeros: one line, not JSON
        f.seek(2 << 30)
        f.write(b'\n{"text": "after the long line"}\n')
    with open(text, "wb") as f:
        f.truncate(2 << 30)
    limit, shard = 64 << 20, 16 << 20
    argv = ["preprocess", str(line), str(text), "--out", str(tmp_path / "o"), "--format",
            "parquet", "--max-doc-bytes", "64MiB", "--shard-size", "16MiB", "--long-docs",
            "truncate", "--quiet"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *argv], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (
        f"{line}:1: line of {(2 << 30) + 1:,} bytes is longer than --max-doc-bytes" in proc.stderr
    )
    stats = json.loads(proc.stderr.strip().splitlines()[-1])
    grew = (stats["peak_kib"] - stats["before_kib"]) * 1024
    print(f"peak RSS {stats['peak_kib'] / 1024:.0f} MiB, {grew / 2**20:.0f} MiB over start-up")
    assert grew <= 6 * limit + shard, stats
    m = read_index(str(tmp_path / "o")).manifest
    assert m["counts"]["bad"] == 1 and m["counts"]["truncated"] == 1
    assert m["num_tokens"] == (limit + 2) + len("after the long line") + 2


def test_the_fingerprint_is_its_documented_digest() -> None:
    """SHA-256 of "index X" and then "shard Y" per shard in storage order, 32 hex digits: the
    index's checksum and the shards' order count, names and other fields do not."""
    import hashlib

    from datapipe.integrity import dataset_fingerprint

    m = {"index_xxh3_64": "ab12", "shards": [{"name": "p", "xxh3_64": "01"}, {"name": "q"}]}
    text = "index ab12\nshard 01\nshard -"
    assert dataset_fingerprint(m) == hashlib.sha256(text.encode()).hexdigest()[:32]
    other_index = {**m, "index_xxh3_64": "ab13"}
    reordered = {**m, "shards": m["shards"][::-1]}
    renamed = {**m, "shards": [{"name": "x", "xxh3_64": "01"}, {"name": "y", "bytes": 3}]}
    assert dataset_fingerprint(other_index) != dataset_fingerprint(m)
    assert dataset_fingerprint(reordered) != dataset_fingerprint(m)
    assert dataset_fingerprint(renamed) == dataset_fingerprint(m)


def test_row_counts_of_manifest_index_and_shards_must_agree() -> None:
    """Two samples of 8 and 3 tokens in chunks of 4 take 3 storage rows: shards that hold more
    (or fewer) rows, or a manifest num_rows other than its shards' sum, are each named."""
    import numpy as np

    from datapipe.errors import InputError
    from datapipe.integrity import check_index, check_manifest

    cols = {k: np.array(v, np.int64) for k, v in {"sample_id": [0, 1], "num_tokens": [8, 3],
            "shard": [0, 0], "first_row": [0, 2], "num_rows": [2, 1]}.items()}  # fmt: skip

    def manifest(*rows: int) -> dict:
        shards = [{"name": f"s{i}", "rows": r} for i, r in enumerate(rows)]
        return {"format": "parquet", "num_samples": 2, "chunk_tokens": 4, "shards": shards}

    assert check_index(cols, manifest(3), "index.parquet") == []
    for rows in ((3, 2), (5,)):
        assert check_index(cols, manifest(*rows), "index.parquet") == [
            "index.parquet: the samples take 3 storage rows, the shards in manifest.json hold 5"
        ]
    check_manifest({**manifest(3, 2), "num_rows": 5}, "manifest.json")
    for claimed in (4, 6):
        with pytest.raises(InputError, match=f"num_rows is {claimed}, the shards hold 5 rows"):
            check_manifest({**manifest(3, 2), "num_rows": claimed}, "manifest.json")


def test_a_file_of_exactly_the_limit_is_read(tmp_path: Path) -> None:
    """ "At most `limit` bytes": a file of exactly the limit is read whole, one byte more is
    refused (sizes from the bytes written here)."""
    from datapipe.files import read_bounded_bytes

    data = b"k = 1\n" * 100
    (tmp_path / "exact.toml").write_bytes(data)
    assert read_bounded_bytes(tmp_path / "exact.toml", len(data), "the config") == data
    (tmp_path / "over.toml").write_bytes(data + b"\n")
    with pytest.raises(InputError, match=f"is {len(data) + 1:,} bytes, over the {len(data):,}-"):
        read_bounded_bytes(tmp_path / "over.toml", len(data), "the config")
