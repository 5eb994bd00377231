"""`mixlen preprocess`: round trips through the libraries' own readers, long docs, bad input,
determinism across worker counts, atomic output."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import xxhash
from conftest import ROOT
from readback import read_rows, samples_from_rows

from datapipe.errors import InputError
from datapipe.index import read_index
from datapipe.ingest.preprocess import PreprocessConfig, preprocess
from tools.cli import main as cli_main

BOS, EOS = 256, 257


def ref_tokens(text: str) -> np.ndarray:
    """Independent reference of the bytes tokenizer."""
    return np.array([BOS, *text.encode("utf-8"), EOS], dtype=np.int64)


def check_dataset(root: str, expected_tokens: list[np.ndarray], chunk: int) -> None:
    """Index, manifest and shards (read by the library readers) agree with the reference."""
    idx = read_index(root, with_source=True)
    m = idx.manifest
    assert m["num_samples"] == len(expected_tokens) == len(idx)
    assert m["num_tokens"] == sum(len(t) for t in expected_tokens)
    np.testing.assert_array_equal(idx.sample_id, np.arange(len(idx)))
    np.testing.assert_array_equal(idx.num_tokens, [len(t) for t in expected_tokens])
    np.testing.assert_array_equal(idx.num_rows, [-(-len(t) // chunk) for t in expected_tokens])
    rows = read_rows(root, m)
    assert len(rows) == m["num_rows"] == int(idx.num_rows.sum())
    assert all(len(r[2]) <= chunk for r in rows)
    got = samples_from_rows(rows)
    assert sorted(got) == list(range(len(expected_tokens)))
    for sid, exp in enumerate(expected_tokens):
        np.testing.assert_array_equal(got[sid].astype(np.int64), exp)
    # index.parquet locates every sample's first row: global row = shard offset + first_row
    g = idx.global_first_row
    for sid in range(len(idx)):
        assert rows[g[sid]][:2] == (sid, 0)
    check_shard_checksums(root, m)
    for i, s in enumerate(m["shards"]):
        assert np.sum(idx.shard == i) == s["samples"]


def check_shard_checksums(root: str, manifest: dict) -> None:
    """Every shard entry of the manifest records its file's size and XXH3-64 (FORMAT.md)."""
    assert manifest["shards"], "no shards"
    for s in manifest["shards"]:
        assert "bytes" in s and "xxh3_64" in s, s
        data = Path(root, s["name"]).read_bytes()
        assert s["bytes"] == len(data)
        assert s["xxh3_64"] == xxhash.xxh3_64(data).hexdigest()


@pytest.mark.parametrize("fmt", ["mds", "wds", "parquet"])
def test_round_trip_all_formats(corpus: dict, fmt: str) -> None:
    out = corpus["tmp"] / f"out-{fmt}"
    chunk = 64
    res = preprocess(
        PreprocessConfig(
            corpus["inputs"],
            str(out),
            format=fmt,
            chunk_tokens=chunk,
            shard_bytes=2048,
            progress=False,
        )
    )
    expected = [ref_tokens(t) for t in corpus["expected"] if t]
    check_dataset(str(out), expected, chunk)
    # the bytes tokenizer's ids: 0..255 for bytes, BOS 256, EOS 257, 258 ids in all
    written = json.loads((out / "manifest.json").read_text())
    assert written == res.manifest
    assert (written["bos_id"], written["eos_id"], written["vocab_size"]) == (256, 257, 258)
    assert written["tokenizer"] == {"kind": "bytes"} and written["dtype"] == "uint16"
    c = res.manifest["counts"]
    assert c["documents"] == len(corpus["expected"])
    assert c["empty"] == sum(1 for t in corpus["expected"] if not t)
    assert c["bad"] == 0
    assert len(res.manifest["shards"]) > 1, "small shard size must roll over"
    assert not list(corpus["tmp"].glob(".out-*")), "no temporary directory left behind"


@pytest.mark.parametrize("fmt", ["mds", "wds", "parquet", "wds-masked"])
def test_shard_size_bounds_every_shard_of_several_samples(tmp_path: Path, fmt: str) -> None:
    """--shard-size bounds each shard file that holds more than one sample; a tar's end of
    archive and record padding come on top (up to 11 KiB: 1,024 bytes padded to a 10 KiB
    record), its members (a header, the .npy header, the padding to 512 bytes) are counted."""
    src = tmp_path / "in.jsonl"
    rng = np.random.default_rng(1)
    masked = fmt.endswith("-masked")  # prompt-completion rows: a loss mask, the tar's spans member
    fmt = fmt.removesuffix("-masked")
    row = (lambda n: {"prompt": "q" * (n // 3), "completion": "a" * n}) if masked else (
        lambda n: {"text": "x" * n})  # fmt: skip
    src.write_text("".join(json.dumps(row(int(n))) + "\n" for n in rng.integers(100, 900, 300)))
    limit = 20_480
    out = tmp_path / fmt
    res = preprocess(PreprocessConfig([str(src)], str(out), format=fmt, shard_bytes=limit,
                                      progress=False))  # fmt: skip
    assert bool(res.manifest.get("loss_mask")) == masked
    idx = read_index(str(out))
    per_shard = np.bincount(idx.shard)
    sizes = [os.path.getsize(out / s["name"]) for s in idx.manifest["shards"]]
    assert len(sizes) > 4 and per_shard.min() > 1
    end = -(-(limit + 1024) // 10240) * 10240 - limit if fmt == "wds" else 0
    assert max(sizes) <= limit + end, sizes
    if fmt == "wds":  # the members alone, as tar lists them, within the bound
        import tarfile

        for s in idx.manifest["shards"]:
            with tarfile.open(out / s["name"]) as tf:
                assert sum(512 + -(-m.size // 512) * 512 for m in tf.getmembers()) <= limit
    if fmt != "parquet":  # (parquet compresses) and the shards are not left near-empty
        assert sum(sizes) > 0.6 * limit * len(sizes)


def test_hf_tokenizer_round_trip(corpus: dict) -> None:
    from tokenizers import Tokenizer

    asset = ROOT / "tests" / "assets" / "bpe-stdlib.json"
    tok = Tokenizer.from_file(str(asset))
    vocab = tok.get_vocab()
    bos, eos = vocab["<s>"], vocab["</s>"]
    out = corpus["tmp"] / "out-hf"
    res = preprocess(
        PreprocessConfig(
            corpus["inputs"],
            str(out),
            format="parquet",
            tokenizer=str(asset),
            chunk_tokens=16,
            progress=False,
        )
    )
    assert res.manifest["dtype"] == "uint16" and res.manifest["vocab_size"] == tok.get_vocab_size()
    assert res.manifest["tokenizer"]["kind"] == "hf"
    # the ids, read from the tokenizer file itself: <s> and </s> are its added tokens 0 and 1, and
    # its ids run 0..vocab_size-1
    spec = json.loads(asset.read_text())
    added = {t["content"]: t["id"] for t in spec["added_tokens"]}
    ids = set(spec["model"]["vocab"].values()) | set(added.values())
    assert (bos, eos) == (added["<s>"], added["</s>"]) == (0, 1)
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["bos_id"], manifest["eos_id"]) == (0, 1)
    assert manifest["vocab_size"] == max(ids) + 1 == len(ids) == 4096
    assert manifest["tokenizer"]["sha256"] == hashlib.sha256(asset.read_bytes()).hexdigest()
    expected = [np.array([bos, *tok.encode(t).ids, eos]) for t in corpus["expected"] if t]
    check_dataset(str(out), expected, 16)


@pytest.mark.parametrize("policy", ["split", "truncate", "drop"])
def test_long_docs(corpus: dict, policy: str) -> None:
    max_len = 50
    out = corpus["tmp"] / f"out-{policy}"
    res = preprocess(
        PreprocessConfig(
            corpus["inputs"],
            str(out),
            format="parquet",
            max_len=max_len,
            long_docs=policy,
            chunk_tokens=32,
            progress=False,
        )
    )
    full = [ref_tokens(t) for t in corpus["expected"] if t]
    n_long = sum(len(t) > max_len for t in full)
    assert n_long > 0
    expected: list[np.ndarray] = []
    for t in full:
        if len(t) <= max_len:
            expected.append(t)
        elif policy == "split":
            expected += [t[i : i + max_len] for i in range(0, len(t), max_len)]
        elif policy == "truncate":
            expected.append(t[:max_len])
    check_dataset(str(out), expected, 32)
    c = res.manifest["counts"]
    assert c[{"split": "split", "truncate": "truncated", "drop": "dropped"}[policy]] == n_long
    assert sum(c[k] for k in ("split", "truncated", "dropped")) == n_long
    if policy == "split":  # no token is lost
        assert res.manifest["num_tokens"] == sum(len(t) for t in full)


def _bad_corpus(tmp: Path) -> tuple[list[str], list[str]]:
    """Inputs with one of each bad case; returns inputs and the expected 'file:line' markers."""
    d = tmp / "bad"
    d.mkdir()
    (d / "a.jsonl").write_bytes(
        b'{"text": "good one"}\n'
        b"{not json}\n"
        b'{"title": "no text"}\n'
        b'{"text": "bad \xff byte"}\n'
        b'{"text": 7}\n'
        b'["a list"]\n'
        b'{"text": "good two"}\n'
    )
    (d / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "gz"}\n')[:-12])  # truncated gzip
    t = d / "texts"
    t.mkdir()
    (t / "ok.txt").write_text("fine")
    (t / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (d / "c.parquet").write_bytes(b"PAR1 this is not parquet")
    inputs = [str(d / "a.jsonl"), str(d / "b.jsonl.gz"), str(t), str(d / "c.parquet")]
    markers = [
        f"{d / 'a.jsonl'}:2",
        f"{d / 'a.jsonl'}:3",
        f"{d / 'a.jsonl'}:4",
        f"{d / 'a.jsonl'}:5",
        f"{d / 'a.jsonl'}:6",
        f"{d / 'b.jsonl.gz'}",
        f"{t / 'latin1.txt'}",
        f"{d / 'c.parquet'}",
    ]
    return inputs, markers


def test_bad_input_skipped_and_reported(tmp_path: Path) -> None:
    inputs, markers = _bad_corpus(tmp_path)
    warnings: list[str] = []
    res = preprocess(
        PreprocessConfig(
            inputs, str(tmp_path / "out"), format="parquet", progress=False, max_reported=100
        ),
        warn=warnings.append,
    )
    assert res.manifest["counts"]["bad"] == len(markers)
    assert len(warnings) == len(markers)
    for w, marker in zip(warnings, markers):
        assert marker in w, (marker, w)
    reasons = " | ".join(warnings)
    for phrase in (
        "invalid JSON",
        "missing text field 'text'",
        "not valid UTF-8",
        "expected a string",
        "cannot read",
    ):
        assert phrase in reasons
    # the good documents survive
    check_dataset(
        str(tmp_path / "out"), [ref_tokens(t) for t in ("good one", "good two", "fine")], 65536
    )


def test_bad_input_strict_names_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    inputs, markers = _bad_corpus(tmp_path)
    with pytest.raises(InputError, match=f"^{markers[0]}: invalid JSON"):
        preprocess(
            PreprocessConfig(
                inputs, str(tmp_path / "out"), format="parquet", strict=True, progress=False
            )
        )
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.partial-*"))
    # through the CLI: exit code 2, a one-line message, no traceback
    rc = cli_main(
        [
            "preprocess",
            *inputs,
            "--out",
            str(tmp_path / "out"),
            "--format",
            "parquet",
            "--strict",
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{markers[0]}: invalid JSON" in err and "Traceback" not in err
    rc = cli_main(["preprocess", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o2")])
    assert rc == 2 and "input not found" in capsys.readouterr().err


def test_workers_byte_identical(
    tmp_path: Path, corpus: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datapipe.ingest.sources as sources

    monkeypatch.setattr(sources, "BLOCK_FILES", 2)  # many blocks, so order across workers matters
    monkeypatch.setattr(sources, "BLOCK_BYTES", 256)
    inputs = corpus["inputs"] * 3
    digests = {}
    for fmt in ("mds", "parquet"):
        for workers in (1, 2):
            out = tmp_path / f"{fmt}-w{workers}"
            res = preprocess(
                PreprocessConfig(
                    inputs,
                    str(out),
                    format=fmt,
                    workers=workers,
                    chunk_tokens=64,
                    shard_bytes=4096,
                    progress=False,
                )
            )
            files = sorted(p.name for p in out.iterdir() if p.name != "manifest.json")
            digests[(fmt, workers)] = {
                n: hashlib.sha256((out / n).read_bytes()).hexdigest() for n in files
            }
            m = dict(res.manifest)
            m["args"] = {k: v for k, v in m["args"].items() if k not in ("workers", "out")}
            digests[(fmt, workers, "manifest")] = json.dumps(m, sort_keys=True)
        assert len(digests[(fmt, 1)]) > 3
        assert digests[(fmt, 1)] == digests[(fmt, 2)]
        assert digests[(fmt, 1, "manifest")] == digests[(fmt, 2, "manifest")]


def test_existing_output_refused_then_overwritten(tmp_path: Path, corpus: dict) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    cfg = PreprocessConfig(corpus["inputs"], str(out), format="parquet", progress=False)
    with pytest.raises(InputError, match="already exists; pass --overwrite"):
        preprocess(cfg)
    assert (out / "keep.txt").read_text() == "user data"
    cfg.overwrite = True
    preprocess(cfg)
    assert not (out / "keep.txt").exists() and (out / "manifest.json").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("sig", "workers", "group"),
    [
        (signal.SIGKILL, 2, False),
        (signal.SIGTERM, 1, False),
        (signal.SIGINT, 2, True),
        (signal.SIGTERM, 2, True),
    ],  # fmt: skip
)
def test_interrupted_run_leaves_no_output(
    tmp_path: Path, sig: signal.Signals, workers: int, group: bool
) -> None:
    """Killed, stopped, or Ctrl-C or a scheduler's stop (SIGINT, SIGTERM to the whole process
    group) with two workers waiting for blocks: the run ends at once (workers had died holding the pool's lock, and the run
    waited for it forever), leaving nothing but what SIGKILL cannot clean, and no worker
    process (one whose main process was killed outright had stayed, waiting for blocks)."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"f{i:03d}.txt").write_text(f"document {i} " * 200)
    out = tmp_path / "out"
    marker = tmp_path / "paused"
    env = dict(os.environ, MIXLEN_TEST_PAUSE_AFTER_FIRST_SHARD=str(marker), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "tools.cli", "preprocess", str(src), "--out", str(out), "--format", "parquet",
           "--shard-size", "4KiB", "--no-progress", "--workers", str(workers)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "preprocess never reached its first shard"
            time.sleep(0.05)
        partial = list(tmp_path.glob(".out.partial-*"))
        assert len(partial) == 1 and any(partial[0].glob("shard-*.parquet")), (
            "paused mid-way with a shard written"
        )
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) >= (2 if workers > 1 else 0), children  # the resource tracker too
        os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        deadline = time.monotonic() + 10
        while any(_running(int(c)) for c in children):
            assert time.monotonic() < deadline, [c for c in children if _running(int(c))]
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if sig != signal.SIGKILL:
        assert proc.returncode == 130 and err.decode().strip() == "mixlen preprocess: interrupted"
    assert not out.exists()
    leftovers = list(tmp_path.glob(".out.partial-*"))
    if sig != signal.SIGKILL:
        assert leftovers == [], "SIGTERM and Ctrl-C clean the temporary directory"
    for p in leftovers:  # SIGKILL cannot clean up: nothing there looks complete
        assert not (p / "manifest.json").exists() and not (p / "index.parquet").exists()
    # the next run succeeds and removes the dead run's temporary directory
    preprocess(PreprocessConfig([str(src)], str(out), format="parquet", progress=False))
    assert read_index(str(out)).manifest["num_samples"] == 40
    assert list(tmp_path.glob(".out.partial-*")) == []


def _running(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_index_parquet_columns(tmp_path: Path, corpus: dict) -> None:
    out = tmp_path / "o"
    preprocess(PreprocessConfig(corpus["inputs"], str(out), format="wds", progress=False))
    t = pq.read_table(out / "index.parquet")
    assert t.column_names == ["sample_id", "num_tokens", "shard", "first_row", "num_rows", "source"]
    src = t.column("source").to_pylist()
    assert src[0].endswith("a.jsonl:1") and any("d.parquet#" in s for s in src)


def test_find_inputs_globs_match_pathlib(tmp_path: Path) -> None:
    from datapipe.ingest.inputs import find_inputs

    names = [
        "a.py",
        "b.txt",
        "x/c.py",
        "x/y/d.py",
        "x/y/e.pyc",
        "site-packages/f.py",
        "site-packages/z/g.py",
        "doc1.txt",
    ]
    for n in names:
        (tmp_path / n).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / n).write_text(n)
    for pattern in ["**/*.py", "*.py", "**/*", "x/**/*.py", "doc[0-9].txt", "[!a]*.py"]:
        ref = sorted(p for p in tmp_path.glob(pattern) if p.is_file())
        assert find_inputs([str(tmp_path)], [pattern]) == ref, pattern
    got = find_inputs([str(tmp_path)], ["**/*.py"], ("site-packages/*",))
    assert [p.relative_to(tmp_path).as_posix() for p in got] == ["a.py", "x/c.py", "x/y/d.py"]


def test_blank_documents_and_min_tokens(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Whitespace-only documents are counted as `blank` (not stored); `--min-tokens N` drops
    every sample shorter than N tokens (BOS/EOS included; pieces of a split document too),
    counted as `short`. Checked against a by-hand reference of the bytes tokenizer."""
    texts = ["hello", "   ", "", "\n\t \u00a0\u2003", "ab", "x" * 12, "a b", " \n"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "texts").mkdir()
    for name, t in (("1.txt", "  \n\n"), ("2.txt", "doc")):
        (tmp_path / "texts" / name).write_text(t)
    inputs = [str(tmp_path / "d.jsonl"), str(tmp_path / "texts")]
    docs = [*texts, "  \n\n", "doc"]
    # by hand: "hello" 7 tokens, "ab" 4, "x"*12 14 -> split at 8: 8 + 6, "a b" 5, "doc" 5
    blank = ["   ", "\n\t \u00a0\u2003", " \n", "  \n\n"]
    for min_tokens, kept, short in (
        (0, ["hello", "ab", "x0", "x1", "a b", "doc"], 0),
        (5, ["hello", "x0", "x1", "a b", "doc"], 1),  # "ab" (4)
        (7, ["hello", "x0"], 4),  # and "a b", "doc" (5), the last piece (6)
    ):
        out = tmp_path / f"out{min_tokens}"
        argv = ["preprocess", *inputs, "--out", str(out), "--format", "parquet", "--max-len", "8"]
        rc = cli_main([*argv, "--min-tokens", str(min_tokens), "--quiet"])
        summary = capsys.readouterr().out
        full = {t: ref_tokens(t) for t in docs if t and not t.isspace()}
        pieces = {f"x{i}": full["x" * 12][8 * i : 8 * i + 8] for i in range(2)}
        expected = [pieces[k] if k in pieces else full[k] for k in kept]
        assert rc == 0
        check_dataset(str(out), expected, 65536)
        c = read_index(str(out)).manifest["counts"]
        assert c["blank"] == len(blank) and c["empty"] == 1 and c["short"] == short
        assert c["documents"] == len(docs) and c["split"] == 1
        assert f"blank {len(blank)}," in summary and f"short {short} " in summary
        assert read_index(str(out)).manifest["min_tokens"] == min_tokens
    rc = cli_main(["preprocess", *inputs, "--out", str(tmp_path / "o"), "--min-tokens", "-1"])
    assert rc == 2 and "--min-tokens must be >= 0, got -1" in capsys.readouterr().err
