"""`mixlen profile` (against a plain-Python reference) and `mixlen index` for foreign MDS datasets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash
from conftest import ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.errors import InputError
from datapipe.index import read_index
from datapipe.ingest.index_mds import index_mds
from datapipe.ingest.preprocess import PreprocessConfig, preprocess
from datapipe.profile import format_profile, length_profile
from tools.cli import main as cli_main


def ref_profile(lengths: list[int], capacity: int | None) -> dict:
    """Plain-Python reference: sorted-list percentiles, bit_length buckets."""
    s = sorted(lengths)
    n, total = len(s), sum(s)
    pct = {p: s[int(np.floor(p / 100 * (n - 1)))] for p in (50, 90, 99)}
    buckets: dict[int, list[int]] = {}
    for x in lengths:
        b = max(x.bit_length() - 1, 0)
        buckets.setdefault(b, [0, 0])
        buckets[b][0] += 1
        buckets[b][1] += x
    out = {
        "num_samples": n,
        "num_tokens": total,
        "min": s[0],
        "max": s[-1],
        "p50": pct[50],
        "p90": pct[90],
        "p99": pct[99],
        "buckets": [
            (0 if b == 0 else 1 << b, 1 << (b + 1), c, t) for b, (c, t) in sorted(buckets.items())
        ],
    }
    if capacity is not None:
        long = [x for x in lengths if x > capacity]
        out["long_token_share"] = sum(long) / total if total else 0.0
        out["long_samples"] = len(long)
    return out


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(st.integers(0, 70000), st.sampled_from([1, 2, 1023, 1024, 1025, 65536])),
        min_size=1,
        max_size=200,
    ),
    st.one_of(st.none(), st.integers(1, 70000)),
)
def test_length_profile_matches_reference(lengths: list[int], capacity: int | None) -> None:
    got = length_profile(np.array(lengths), capacity)
    ref = ref_profile(lengths, capacity)
    for k in ("num_samples", "num_tokens", "min", "max", "p50", "p90", "p99"):
        assert got[k] == ref[k], k
    assert [(b["lo"], b["hi"], b["samples"], b["tokens"]) for b in got["buckets"]] == ref["buckets"]
    if capacity is not None:
        assert got["long_samples"] == ref["long_samples"]
        assert got["long_token_share"] == pytest.approx(ref["long_token_share"])


def test_trained_share_per_bucket_and_the_text_by_hand() -> None:
    """Each bucket's trained share is of its own tokens (lengths 2 and 3 in [2, 4): 2 of 5
    trained; 8: all); the text shows the percentiles numpy gives (method lower)."""
    prof = length_profile(np.array([2, 3, 8]), None, np.array([1, 1, 8]))
    assert {b["lo"]: b["loss_share"] for b in prof["buckets"]} == {2: 2 / 5, 8: 1.0}
    lengths = np.arange(1, 101)
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99], method="lower").astype(int)
    assert f"p50 {p50}  p90 {p90}  p99 {p99}  max 100" in format_profile(length_profile(lengths))


def test_profile_cli_json_plot_and_light_imports(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    sizes = rng.lognormal(5, 1.5, 60).astype(int) + 1
    for i, n in enumerate(sizes):
        (src / f"{i}.txt").write_text("a" * int(n))
    out = tmp_path / "ds"
    preprocess(PreprocessConfig([str(src)], str(out), format="parquet", progress=False))
    png = tmp_path / "p.png"
    code = (
        "import sys, json; from tools.cli import main; rc = main(sys.argv[1:]); "
        "heavy = [m for m in ('torch', 'streaming', 'numba') if m in sys.modules]; "
        "print('HEAVY', json.dumps(heavy)); sys.exit(rc)"
    )
    cmd = [
        sys.executable,
        "-c",
        code,
        "profile",
        str(out),
        "--capacity",
        "300",
        "--json",
        "--plot",
        str(png),
    ]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    prof = json.loads(r.stdout.splitlines()[0])
    assert r.stdout.splitlines()[1] == "HEAVY []", (
        "profile must not import torch, streaming or numba"
    )
    expected = sorted(int(n) + 2 for n in sizes)  # bytes + BOS + EOS
    for key in (
        "num_samples",
        "num_tokens",
        "min",
        "p50",
        "p90",
        "p99",
        "max",
        "buckets",
        "long_token_share",
    ):
        assert key in prof
    assert prof["num_samples"] == len(expected) and prof["max"] == expected[-1]
    assert prof["long_token_share"] == pytest.approx(
        sum(x for x in expected if x > 300) / sum(expected)
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli_main(["profile", str(tmp_path / "nope")]) == 2


def test_index_foreign_mds(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from streaming import MDSWriter

    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 3000, 50)
    root = tmp_path / "foreign"
    max_token = 0
    with MDSWriter(
        out=str(root), columns={"ids": "ndarray:uint32", "meta": "str"}, size_limit=20000
    ) as w:
        for i, n in enumerate(lengths):
            ids = rng.integers(0, 70000, n).astype(np.uint32)
            max_token = max(max_token, int(ids.max()))
            w.write({"ids": ids, "meta": f"doc{i}"})
    with pytest.raises(InputError, match="no column 'tokens'"):
        index_mds(str(root))
    assert cli_main(["index", str(root), "--tokens-field", "ids"]) == 0
    idx = read_index(str(root))
    np.testing.assert_array_equal(idx.num_tokens, lengths)
    mds = json.loads((root / "index.json").read_text())
    assert len(mds["shards"]) > 1
    rows_per_shard = [s["samples"] for s in mds["shards"]]
    np.testing.assert_array_equal(np.bincount(idx.shard), rows_per_shard)
    np.testing.assert_array_equal(idx.global_first_row, np.arange(len(lengths)))
    m = idx.manifest
    assert m["rows_are_samples"] and m["tokens_field"] == "ids" and m["dtype"] == "uint32"
    assert m["chunk_tokens"] == int(lengths.max())
    assert m["vocab_size"] == max_token + 1 and m["bos_id"] is None and m["eos_id"] is None
    # one manifest entry per MDS shard, each with its file's size and XXH3-64 checksum
    assert [s["name"] for s in m["shards"]] == [s["raw_data"]["basename"] for s in mds["shards"]]
    for s in m["shards"]:
        assert "bytes" in s and "xxh3_64" in s, s
        data = (root / s["name"]).read_bytes()
        assert s["bytes"] == len(data)
        assert s["xxh3_64"] == xxhash.xxh3_64(data).hexdigest()
    assert cli_main(["index", str(root), "--tokens-field", "ids"]) == 2  # exists: needs --overwrite
    assert "--overwrite" in capsys.readouterr().err
    (root / "index.parquet").write_bytes(b"stale")
    assert cli_main(["index", str(root), "--tokens-field", "ids", "--overwrite"]) == 0
    assert capsys.readouterr().out.startswith(f"indexed {len(lengths)} samples")
    np.testing.assert_array_equal(read_index(str(root)).num_tokens, lengths)  # rebuilt
    assert cli_main(["profile", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_tokens"] == int(lengths.sum())
    # read for training from its own column (the str column beside it decodes too)
    from datapipe.fetch import FetchConfig

    want = np.random.default_rng(1)
    want.integers(1, 3000, 50)
    ids = [want.integers(0, 70000, n).astype(np.uint32) for n in lengths]
    for access in ("reader", "dataset"):
        with FetchConfig(mds_access=access).build(str(root)) as fetcher:
            mb = fetcher.fetch(np.array([[7, 0, int(lengths[7])], [3, 5, 9]], np.int64))
        np.testing.assert_array_equal(mb.input_ids, np.concatenate([ids[7], ids[3][5:9]]))


def _write_mds(root: Path, rows: list[np.ndarray], encoding: str = "ndarray:int32") -> None:
    from streaming import MDSWriter

    with MDSWriter(out=str(root), columns={"tokens": encoding}) as w:
        for ids in rows:
            w.write({"tokens": ids})


def test_index_refuses_what_training_would_not_read(tmp_path: Path) -> None:
    """`mixlen index` refuses a negative token id (naming shard, row and position), a token
    dtype mixlen does not read, a truncated shard (naming it) and an MDS dataset with no rows
    (and takes MDS's dtype-less `ndarray` encoding); a negative id in a dataset
    indexed before this check (the shard rewritten, its checksum too) is refused by `verify`
    and by the fetch, naming the sample and position."""
    from datapipe.fetch import FetchConfig
    from datapipe.integrity import FINGERPRINT_KEY, checksum_file, dataset_fingerprint
    from datapipe.verify import verify_dataset

    good = [np.array([5, 3, 7], np.int32), np.array([1, 2, 3, 4], np.int32)]
    bad = [good[0], np.array([1, 2, -3, 4], np.int32)]
    _write_mds(tmp_path / "neg", bad)
    with pytest.raises(InputError, match=r"shard\.00000\.mds row 1: .* holds token id -3 at "
                       r"position 2; token ids are never negative"):  # fmt: skip
        index_mds(str(tmp_path / "neg"))
    _write_mds(tmp_path / "i16", [g.astype(np.int16) for g in good], "ndarray:int16")
    with pytest.raises(InputError, match="holds int16 token ids; mixlen reads uint8, uint16"):
        index_mds(str(tmp_path / "i16"))
    _write_mds(tmp_path / "cut", [np.arange(1000, dtype=np.int32)] * 5)
    shard = tmp_path / "cut" / "shard.00000.mds"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2 + 1])
    with pytest.raises(InputError, match=r"shard\.00000\.mds row \d: cannot be read .*truncated"):
        index_mds(str(tmp_path / "cut"))
    _write_mds(tmp_path / "empty", [])
    with pytest.raises(InputError, match="holds no rows"):
        index_mds(str(tmp_path / "empty"))
    generic = tmp_path / "generic"  # MDS's dtype-less ndarray encoding (each row says its own)
    _write_mds(generic, good, "ndarray")
    index_mds(str(generic))
    with FetchConfig().build(str(generic)) as fetcher:
        got = fetcher.fetch(np.array([[1, 0, 4], [0, 0, 3]], np.int64)).input_ids
    np.testing.assert_array_equal(got, np.concatenate([good[1], good[0]]))
    root = tmp_path / "old"
    _write_mds(root, good)
    index_mds(str(root))
    shard = root / "shard.00000.mds"
    shard.write_bytes((tmp_path / "neg" / "shard.00000.mds").read_bytes())
    m = json.loads((root / "manifest.json").read_text())
    m["shards"][0]["xxh3_64"] = checksum_file(str(shard))
    m[FINGERPRINT_KEY] = dataset_fingerprint(m)
    (root / "manifest.json").write_text(json.dumps(m))
    problems = verify_dataset(str(root)).problems
    assert len(problems) == 1 and "row 1 holds token id -3, outside the vocabulary" in problems[0]
    with FetchConfig().build(str(root)) as fetcher, pytest.raises(InputError) as exc:
        fetcher.fetch(np.array([[1, 0, 4]], np.int64))
    assert "shard.00000.mds: sample 1, token 2 has id -3, outside the vocabulary" in str(exc.value)


def test_verify_flags_a_token_id_equal_to_the_vocabulary_size(tmp_path: Path) -> None:
    """Ids run from 0 to vocab_size - 1: an MDS dataset whose largest id is 7 verifies with
    vocab_size 8 and is refused with 7, naming the row holding the 7."""
    from datapipe.verify import verify_dataset

    root = tmp_path / "d"
    _write_mds(root, [np.array([5, 3, 7], np.int32), np.array([1, 2, 3, 4], np.int32)])
    index_mds(str(root))
    m = json.loads((root / "manifest.json").read_text())
    assert m["vocab_size"] == 8 and verify_dataset(str(root)).ok
    (root / "manifest.json").write_text(json.dumps({**m, "vocab_size": 7}))
    problems = verify_dataset(str(root)).problems
    assert len(problems) == 1 and "row 0 holds token id 7, outside the vocabulary" in problems[0]
