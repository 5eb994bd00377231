"""`mixlen preprocess --engine ray`: the dataset equals the local engine's (index, sources, every
sample's tokens), a failing task fails the run naming the input and leaves nothing, the manifest
records the engine, and a second driver joins the running runtime with --ray-address.

Ray starts once for this module (15-30 s on 2 cores); every run here reuses it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT
from readback import read_rows, samples_from_rows
from test_ingest import check_dataset, ref_tokens

from datapipe.errors import InputError, MixlenError
from datapipe.index import read_index
from datapipe.ingest.preprocess import PreprocessConfig, preprocess
from datapipe.verify import verify_dataset

pytest.importorskip("ray", reason="Ray Data is the optional extra mixlen[ray] (in .[dev])")
pytestmark = pytest.mark.timeout(300)

FAIL_MARK = "planted-task-failure"


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray runtime (2 CPUs, loopback) for the module; session files in a short temp
    directory (Ray's unix socket paths must stay short), removed at the end."""
    from datapipe.ingest.engines import ray as ray_engine

    tmp = tempfile.mkdtemp(prefix="mxray", dir="/tmp")
    hooks = ("RAY_TMPDIR", ray_engine.FAIL_HOOK_ENV, ray_engine.KILL_HOOK_ENV)
    saved = {k: os.environ.get(k) for k in hooks}
    os.environ["RAY_TMPDIR"] = tmp
    os.environ[ray_engine.FAIL_HOOK_ENV] = FAIL_MARK  # workers inherit these at start
    os.environ[ray_engine.KILL_HOOK_ENV] = os.path.join(tmp, "kill")  # armed by a test only
    os.makedirs(os.path.join(tmp, "kill"))
    try:
        with ray_engine.ray_runtime(2):
            import ray

            yield ray.get_runtime_context().gcs_address
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(tmp, ignore_errors=True)


def _both(corpus: dict, fmt: str, **kw) -> tuple[Path, Path]:
    outs = []
    for engine in ("local", "ray"):
        out = corpus["tmp"] / f"{engine}-{fmt}"
        preprocess(
            PreprocessConfig(
                corpus["inputs"],
                str(out),
                format=fmt,
                engine=engine,
                workers=2,
                progress=False,
                **kw,
            )
        )
        outs.append(out)
    return outs[0], outs[1]


@pytest.mark.parametrize("fmt", ["mds", "wds", "parquet"])
def test_ray_dataset_equals_local(ray_session, corpus: dict, fmt: str, monkeypatch) -> None:
    from datapipe.ingest.engines import ray as ray_engine

    monkeypatch.setattr(ray_engine, "TASK_BYTES", 600)  # several tasks on the small corpus
    chunk = 48
    local, ray_out = _both(corpus, fmt, chunk_tokens=chunk, shard_bytes=1500, max_len=200)
    a, b = read_index(str(local), with_source=True), read_index(str(ray_out), with_source=True)
    # index semantics: same ids, lengths, rows per sample and sources, in the same order
    np.testing.assert_array_equal(b.sample_id, np.arange(len(b)))
    np.testing.assert_array_equal(a.num_tokens, b.num_tokens)
    np.testing.assert_array_equal(a.num_rows, b.num_rows)
    assert a.source == b.source
    for key in ("num_samples", "num_tokens", "num_rows", "counts", "dtype", "tokenizer"):
        assert a.manifest[key] == b.manifest[key], key
    assert a.manifest["counts"]["split"] > 0, "long documents split: ids move across tasks"
    assert b.manifest["engine"]["name"] == "ray" and b.manifest["engine"]["tasks"] > 2
    assert a.manifest["engine"] == {"name": "local"}
    assert b.manifest["args"]["engine"] == "ray"
    # every sample's tokens, read by the format's own library, equal the local engine's
    got_a = samples_from_rows(read_rows(str(local), a.manifest))
    got_b = samples_from_rows(read_rows(str(ray_out), b.manifest))
    assert sorted(got_a) == sorted(got_b) == list(range(len(a)))
    for sid in got_a:
        np.testing.assert_array_equal(got_a[sid], got_b[sid])
    # and the independent reference (bytes tokenizer, split at max_len), checksums, locations
    expected = []
    for text in corpus["expected"]:
        if text:
            t = ref_tokens(text)
            expected += [t[i : i + 200] for i in range(0, len(t), 200)]
    check_dataset(str(ray_out), expected, chunk)
    assert verify_dataset(str(ray_out), progress=False).ok  # mixlen verify: checksums, every row
    # the layout: shards in part folders directly under the output, no spill or part indexes
    names = sorted(p.name for p in ray_out.iterdir())
    assert ".spill" not in names and all(n.startswith("part-") for n in names if "." not in n)
    for s in b.manifest["shards"]:
        assert s["name"].startswith("part-") and s["name"].count("/") == 1
    for part in ray_out.glob("part-*"):
        assert not (part / "index.parquet").exists() and not (part / "shards.json").exists()
    if fmt == "parquet":  # --workers 1 and 3 (tasks not capped by size): the same bytes
        monkeypatch.setattr(ray_engine, "TASK_BYTES", 1 << 26)
        runs = [corpus["tmp"] / f"ray-w{k}" for k in (1, 3)]
        for k, out in zip((1, 3), runs):
            preprocess(PreprocessConfig(corpus["inputs"], str(out), format=fmt, engine="ray",
                                        workers=k, progress=False, shard_bytes=1500))  # fmt: skip
        m1, m3 = (read_index(str(out)).manifest for out in runs)
        assert m1["shards"] == m3["shards"] and m1["engine"]["tasks"] == m3["engine"]["tasks"] > 2
        for name in ["index.parquet"] + [s["name"] for s in m1["shards"]]:
            assert (runs[0] / name).read_bytes() == (runs[1] / name).read_bytes(), name
    if fmt == "mds":  # merged index.json lists the manifest's shards in the same order
        idx = json.loads((ray_out / "index.json").read_text())
        assert [s["raw_data"]["basename"] for s in idx["shards"]] == [
            s["name"] for s in b.manifest["shards"]
        ]


def test_a_worker_killed_while_writing_is_retried_to_the_same_bytes(
    ray_session, corpus: dict, monkeypatch
) -> None:
    """A worker process that dies in a write task, its shards written but not its index, or its
    part complete and its spill removed before the task returned: Ray runs the task again in a
    new worker, which finds the dead one's files. The dataset equals an undisturbed run's, file
    for file."""
    from datapipe.ingest.engines import ray as ray_engine

    monkeypatch.setattr(ray_engine, "TASK_BYTES", 600)
    kill = Path(os.environ[ray_engine.KILL_HOOK_ENV])
    runs = {}
    for point in ("", "shards", "done"):  # "": nothing killed
        if point:
            (kill / "ARM").write_text(point)
        out = corpus["tmp"] / f"ray-killed-{point or 'none'}"
        # parquet: each worker started in place of a killed one would import the streaming
        # library for MDS (~6 s of CPU); the kill points and the retry are the format's writer's
        preprocess(PreprocessConfig(corpus["inputs"], str(out), engine="ray", workers=2,
                                    format="parquet", progress=False, shard_bytes=1500,
                                    max_len=200))  # fmt: skip
        if point:
            assert (kill / "FIRED").exists() and not (kill / "ARM").exists(), "no kill"
            (kill / "FIRED").unlink()
        runs[point] = (out, read_index(str(out)))
    calm, ref = runs.pop("")
    assert ref.manifest["engine"]["tasks"] > 2
    files = sorted(p.relative_to(calm) for p in calm.rglob("*"))
    for point, (out, got) in runs.items():
        assert got.manifest["shards"] == ref.manifest["shards"], point
        assert sorted(p.relative_to(out) for p in out.rglob("*")) == files, point
        for name in ["index.parquet"] + [s["name"] for s in ref.manifest["shards"]]:
            assert (calm / name).read_bytes() == (out / name).read_bytes(), (point, name)
        assert verify_dataset(str(out), progress=False).ok


def test_an_input_that_kills_every_worker_fails_the_run(ray_session, corpus: dict) -> None:
    """An input whose task's worker dies on every try (the kernel's OOM killer, a crash in a
    native library): the run fails after a few tries, naming the input, instead of Ray's
    retrying for ever; nothing is left behind."""
    from datapipe.ingest.engines import ray as ray_engine

    bad = Path(corpus["inputs"][0]).with_name("deadly.jsonl")
    bad.write_text(json.dumps({"text": "kills its reader"}) + "\n")
    always = Path(os.environ[ray_engine.KILL_HOOK_ENV]) / "ALWAYS"
    always.write_text(bad.name)
    out = corpus["tmp"] / "ray-deadly"
    cfg = PreprocessConfig(
        [*corpus["inputs"], str(bad)], str(out), engine="ray", workers=2, progress=False
    )
    try:
        with pytest.raises(MixlenError) as exc:
            preprocess(cfg)
    finally:
        always.unlink()
        bad.unlink()
    assert str(exc.value).startswith(f"--engine ray: {bad}: the worker process of its tokenize")
    assert f"died on each of {ray_engine.TASK_TRIES} tries" in str(exc.value)
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".ray-deadly")]


def test_failed_task_names_the_input_and_leaves_no_dataset(ray_session, corpus: dict) -> None:
    bad = Path(corpus["inputs"][0]).with_name(f"{FAIL_MARK}.jsonl")
    bad.write_text(json.dumps({"text": "fine"}) + "\n")
    out = corpus["tmp"] / "ray-fail"
    cfg = PreprocessConfig(
        [*corpus["inputs"], str(bad)], str(out), engine="ray", workers=2, progress=False
    )
    with pytest.raises(MixlenError, match=f"{bad}: RuntimeError: planted failure") as exc:
        preprocess(cfg)
    assert not isinstance(exc.value, InputError)
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".ray-fail")]


def test_strict_bad_record_first_in_input_order(ray_session, corpus: dict) -> None:
    src = corpus["tmp"] / "strict"
    src.mkdir()
    for i in range(4):  # files 1 and 3 have a bad line: file 1's is reported
        lines = [json.dumps({"text": f"doc {i} {j}"}) for j in range(5)]
        if i in (1, 3):
            lines[2] = "{not json"
        (src / f"f{i}.jsonl").write_text("\n".join(lines) + "\n")
    out = corpus["tmp"] / "ray-strict"
    with pytest.raises(InputError, match=rf"{src / 'f1.jsonl'}:3: invalid JSON"):
        preprocess(
            PreprocessConfig(
                [str(src)], str(out), engine="ray", strict=True, format="parquet", progress=False
            )
        )
    assert not out.exists()
    # without --strict both are skipped, counted and reported in input order, like the local engine
    warned: list[str] = []
    res = preprocess(
        PreprocessConfig([str(src)], str(out), engine="ray", format="parquet", progress=False),
        warn=warned.append,
    )
    assert res.manifest["counts"]["bad"] == 2 and res.manifest["num_samples"] == 18
    assert [w.split(":")[0] for w in warned] == [
        f"skipped {src / 'f1.jsonl'}",
        f"skipped {src / 'f3.jsonl'}",
    ]


@pytest.mark.slow
def test_cli_joins_a_running_cluster(ray_session, corpus: dict) -> None:
    """A second driver (the CLI in a subprocess) joins this module's runtime with --ray-address;
    its workers run the driver's mixlen (runtime_env py_modules)."""
    out = corpus["tmp"] / "joined"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    base = [sys.executable, "-m", "tools.cli", "preprocess", *corpus["inputs"], "--engine", "ray"]
    cmd = [*base, "--out", str(out), "--ray-address", ray_session, "--format", "parquet"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and "Traceback" not in proc.stderr
    m = read_index(str(out)).manifest
    assert m["engine"] == {"name": "ray", "address": ray_session, "tasks": m["engine"]["tasks"]}
    expected = [ref_tokens(t) for t in corpus["expected"] if t]
    check_dataset(str(out), expected, m["chunk_tokens"])
    # nothing listens there: a clear error at once (ray.init itself would retry for minutes)
    bad = [*base, "--out", str(out) + "2", "--ray-address", "127.0.0.1:1"]
    proc = subprocess.run(bad, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--ray-address 127.0.0.1:1: cannot connect" in proc.stderr
    assert not Path(str(out) + "2").exists()


def test_ray_counts_like_local(ray_session, tmp_path: Path, monkeypatch) -> None:
    """Every new count agrees between the engines: special files, blank documents, samples
    under --min-tokens, a text file over --max-doc-bytes (pieces), a JSON line over it (bad),
    characters a lossy tokenizer drops (unknown_chars); the same documents are named, the same
    samples stored, and --strict stops at the same document."""
    from test_lossy import CASES

    from datapipe.ingest.engines import ray as ray_engine

    monkeypatch.setattr(ray_engine, "TASK_BYTES", 300)  # several tasks
    tok = tmp_path / "tok.json"
    tok.write_text(json.dumps(CASES["whitespace"]))
    src = tmp_path / "src"
    src.mkdir()
    texts = ["ab c", "   ", "zzzz ab", "a", "ab " * 200, "c b a", "\n\t", "abz"]
    (src / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (src / "b.txt").write_text("ab c\n" * 100)  # 500 bytes: pieces of at most 300
    (src / "c.txt").write_text(" \n ")
    os.mkfifo(src / "fifo")
    os.symlink("loop", src / "loop")
    manifests, indexes = {}, {}
    for engine in ("local", "ray"):
        out = tmp_path / engine
        # parquet: a Ray worker started for MDS would import the streaming library (~6 s of CPU)
        cfg = PreprocessConfig([str(src)], str(out), engine=engine, workers=2, min_tokens=4,
                               max_doc_bytes=300, tokenizer=str(tok), format="parquet",
                               progress=False)  # fmt: skip
        manifests[engine] = preprocess(cfg, warn=lambda msg: None).manifest
        indexes[engine] = read_index(str(out), with_source=True)
    a, b = manifests["local"], manifests["ray"]
    assert a["counts"] == b["counts"] and a["reported"] == b["reported"]
    c = a["counts"]
    assert (c["special"], c["blank"], c["bad"], c["unknown_docs"]) == (2, 3, 1, 2), c
    assert c["short"] >= 1 and c["split"] == 1 and c["unknown_chars"] == 5
    assert indexes["local"].source == indexes["ray"].source
    np.testing.assert_array_equal(indexes["local"].num_tokens, indexes["ray"].num_tokens)
    os.remove(src / "fifo")
    os.remove(src / "loop")
    errors = []
    for engine in ("local", "ray"):
        cfg = PreprocessConfig([str(src)], str(tmp_path / f"s-{engine}"), engine=engine,
                               tokenizer=str(tok), strict=True, progress=False)  # fmt: skip
        with pytest.raises(InputError) as exc:
            preprocess(cfg, warn=lambda msg: None)
        errors.append(str(exc.value))
    assert errors[0] == errors[1] and errors[0].startswith(f"{src / 'a.jsonl'}:3: 4 characters")
