"""LengthAwareStream resume: in process, across changed settings, from older states, remote
metadata, and four fresh processes agreeing on every batch and resuming exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_stream import REPO, lognormal_lengths, write_length_index

from datapipe.errors import ConfigError
from datapipe.index import uri_key
from datapipe.settings import Names
from datapipe.stream import LengthAwareStream, StreamConfig, resolve_dataset


def test_resume_in_process_matches_uninterrupted_run(tmp_path: Path) -> None:
    lengths = lognormal_lengths(800, seed=4)
    write_length_index(tmp_path / "ds", lengths)
    cfg = StreamConfig(seed=11)
    ref = cfg.open(str(tmp_path / "ds"), 6000)
    assert np.array_equal(ref.lengths, lengths)
    ref_batches = [next(ref) for _ in range(200)]  # several epochs
    assert ref_batches[-1].epoch >= 2
    for k in (0, 1, ref.steps_in_epoch(0) - 1, ref.steps_in_epoch(0), 77):
        s = cfg.open(str(tmp_path / "ds"), 6000)
        for _ in range(k):
            next(s)
        state = json.loads(json.dumps(s.state_dict()))  # must survive a JSON round trip
        t = cfg.open(str(tmp_path / "ds"), 6000)
        t.load_state_dict(state)
        for want in ref_batches[k : k + 40]:
            got = next(t)
            assert got.step == want.step and got.digest() == want.digest()
    other = StreamConfig(seed=12).open(str(tmp_path / "ds"), 6000)
    with pytest.raises(ConfigError, match="seed"):
        other.load_state_dict(state)


# Every key load_state_dict checks, and a stream that differs from the saved one in that key only.
# A dataset of the same number of samples with other lengths differs in lengths_digest alone.
RESUME_KEYS = {
    "seed": ({"seed": 12}, None),
    "global_batch_tokens": ({"global_batch_tokens": 6001}, None),
    "lookahead": ({"lookahead": 63}, None),
    "island": ({"island": 0}, None),
    "num_islands": ({"num_islands": 3}, None),
    "num_samples": ({}, "fewer"),
    "lengths_digest": ({}, "other lengths"),
}


@pytest.mark.parametrize("key", [*RESUME_KEYS, "version"])
def test_resume_refuses_each_changed_key(key: str) -> None:
    """A state saved under other settings is refused with an error naming the key that differs."""
    lengths = lognormal_lengths(800, seed=4)
    saved_cfg = {"global_batch_tokens": 6000, "seed": 11, "island": 1, "num_islands": 2}

    def build(ls: np.ndarray, **changes) -> LengthAwareStream:
        kw = {**saved_cfg, **changes}
        settings = {k: kw.pop(k) for k in ("seed", "lookahead", "oversize") if k in kw}
        return StreamConfig(**settings).build(ls, **kw)

    s = build(lengths)
    for _ in range(5):
        next(s)
    state = json.loads(json.dumps(s.state_dict()))
    # the unchanged stream resumes
    same = build(lengths)
    same.load_state_dict(state)
    assert next(same).digest() == next(s).digest()
    if key == "version":
        other, state = build(lengths), {**state, "version": 3}
    else:
        changes, data = RESUME_KEYS[key]
        other_lengths = lengths
        if data == "fewer":
            other_lengths = lengths[:-1]
        elif data == "other lengths":
            other_lengths = lengths.copy()
            other_lengths[[0, 1]] = other_lengths[[0, 1]] + np.array([1, -1])
            assert other_lengths.sum() == lengths.sum() and len(other_lengths) == len(lengths)
        other = build(other_lengths, **changes)
    with pytest.raises(ConfigError, match=f"stream state: {key}=.* was saved, but this stream has"):
        other.load_state_dict(state)
    # and a state without the key is refused too
    missing = {k: v for k, v in s.state_dict().items() if k != key}
    with pytest.raises(ConfigError, match=f"missing key '{key}'"):
        build(lengths).load_state_dict(missing)


def test_resume_error_names_the_key_as_the_user_wrote_it() -> None:
    lengths = lognormal_lengths(100)
    names = Names("data").using(global_batch_tokens="train.global_batch_tokens")
    a = StreamConfig(seed=1).build(lengths, 3000, names=names)
    b = StreamConfig(seed=2).build(lengths, 3000, names=names)
    with pytest.raises(ConfigError, match=r"data\.seed=1 was saved.*data\.seed=2 \(set it"):
        b.load_state_dict(a.state_dict())


def test_state_saved_before_lookahead_resumes_with_greedy_fill(tmp_path: Path) -> None:
    """A version-1 state (no `lookahead` key: greedy batches) resumes a lookahead=0 stream."""
    lengths = lognormal_lengths(800, seed=5)
    write_length_index(tmp_path / "ds", lengths)
    ds = str(tmp_path / "ds")
    greedy = StreamConfig(lookahead=0)
    ref = greedy.open(ds, 6000)
    ref_batches = [next(ref) for _ in range(30)]
    s = greedy.open(ds, 6000)
    for _ in range(10):
        next(s)
    old = {k: v for k, v in s.state_dict().items() if k != "lookahead"} | {"version": 1}
    t = greedy.open(ds, 6000)
    t.load_state_dict(old)
    assert [next(t).digest() for _ in range(20)] == [b.digest() for b in ref_batches[10:]]
    default = StreamConfig().open(str(tmp_path / "ds"), 6000)
    with pytest.raises(ConfigError, match="lookahead=0 was saved"):
        default.load_state_dict(old)


def test_remote_metadata_goes_through_streaming_downloader(tmp_path: Path, monkeypatch) -> None:
    """A remote dataset (here a plain directory, which CloudDownloader serves with its local
    downloader) is read from copies of manifest.json + index.parquet in the cache dir."""
    from datapipe import index as stream_mod

    lengths = lognormal_lengths(50)
    remote = tmp_path / "remote"
    write_length_index(remote, lengths)
    assert stream_mod.is_remote("s3://bucket/ds") and not stream_mod.is_remote(str(remote))
    monkeypatch.setattr(stream_mod, "is_remote", lambda p: str(p) == str(remote))
    cache = tmp_path / "cache"
    s = StreamConfig().open(str(remote), 5000, cache_dir=str(cache))
    assert np.array_equal(s.lengths, lengths)
    folder = cache / uri_key(str(remote))  # a folder per dataset in a cache
    assert uri_key(f"{remote}/") == uri_key(str(remote))  # the same dataset, written either way
    for name in ("manifest.json", "index.parquet"):
        assert (folder / name).read_bytes() == (remote / name).read_bytes()
    assert resolve_dataset(str(remote), str(cache)) == (str(folder), str(remote))


def _digest_runs(path: str, budget: int, runs: list[list[int]]) -> list[str]:
    import hashlib

    out = []
    for seed, num_islands, island, steps in runs:
        s = StreamConfig(seed=seed).open(path, budget, island=island, num_islands=num_islands)
        h = hashlib.blake2b(digest_size=16)
        for _ in range(steps):
            h.update(next(s).digest())
        out.append(h.hexdigest())
    return out


@pytest.mark.timeout(90)
def test_four_processes_agree_and_resume_in_fresh_process(tmp_path: Path) -> None:
    """One launch of 4 processes: same batches byte for byte, and exact resume after restart."""
    lengths = lognormal_lengths(3000, seed=5)
    ds = tmp_path / "ds"
    write_length_index(ds, lengths)
    budget = 40_000
    runs = [[seed, isl_n, isl, 60] for seed in (0, 1, 987654321) for isl_n, isl in ((1, 0), (3, 2))]
    # uninterrupted reference in this process; state saved mid-epoch after K steps
    cfg = StreamConfig(seed=1)
    ref = cfg.open(str(ds), budget, island=1, num_islands=2)
    k = ref.steps_in_epoch(0) + 3
    ref_batches = [next(ref) for _ in range(k + 30)]
    s = cfg.open(str(ds), budget, island=1, num_islands=2)
    for _ in range(k):
        next(s)
    spec = {
        "path": str(ds),
        "budget": budget,
        "runs": runs,
        "resume": {"seed": 1, "num_islands": 2, "island": 1, "state": s.state_dict(), "steps": 30},
    }
    spec["fetch"] = fetch_spec = _fetch_spec(tmp_path)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(REPO / "tests" / "_stream_worker.py"),
                str(tmp_path / "spec.json"),
                str(tmp_path / f"out{r}.json"),
            ],
            env=env,
            stderr=subprocess.PIPE,
        )
        for r in range(4)
    ]
    try:
        for p in procs:
            _, err = p.communicate(timeout=80)
            assert p.returncode == 0, err.decode()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = [(tmp_path / f"out{r}.json").read_bytes() for r in range(4)]
    assert outs[1] == outs[0] and outs[2] == outs[0] and outs[3] == outs[0]
    out = json.loads(outs[0])
    assert out["runs"] == _digest_runs(str(ds), budget, runs)  # and equal to this process
    assert len(set(out["runs"])) == len(runs)
    assert out["resume"] == [b.digest().hex() for b in ref_batches[k:]]
    assert out["fetch"] == _fetch_digest(fetch_spec)
    # index/stream (and a parquet fetch) never import torch or the streaming library
    assert out["heavy_after_stream"] == [] and out["heavy_after_parquet_fetch"] == []


def _fetch_spec(tmp_path: Path) -> dict:
    """A small parquet dataset (no streaming import in the workers) and one step's pieces: the same launch checks the fetch too."""
    from test_fetch import make_dataset, random_pieces  # tests/ is on sys.path under pytest

    root, lengths = make_dataset(tmp_path / "fetch_pq", "parquet", n=60, seed=9)
    pieces = random_pieces(lengths, np.random.default_rng(3), n_microbatches=3)
    return {"path": str(root), "pieces": [p.tolist() for p in pieces]}


def _fetch_digest(spec: dict) -> str:
    import hashlib

    from datapipe.fetch import FetchConfig

    fetcher = FetchConfig().build(spec["path"])
    try:
        h = hashlib.blake2b(digest_size=16)
        for mb in fetcher.fetch_step([np.asarray(p, dtype=np.int64) for p in spec["pieces"]]):
            for arr in (mb.input_ids, mb.labels, mb.position_ids, mb.cu_seqlens):
                h.update(np.ascontiguousarray(arr).tobytes())
        return h.hexdigest()
    finally:
        fetcher.close()
