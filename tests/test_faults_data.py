"""Corrupt and hostile datasets: every fault is caught before its bytes are used, with an error
naming the shard (or index row, or manifest field) and what is wrong; `mixlen verify` lists them
all. The reference for "what the data should be" is the tokenizer's own output (test_fetch)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _faults import flip_byte, truncate
from test_fetch import FORMATS, make_dataset, reference_tokens

from datapipe.errors import InputError
from datapipe.fetch import FetchConfig
from datapipe.index import read_index, read_manifest
from datapipe.verify import verify_dataset
from tools.cli import main as cli_main

N, SEED = 150, 1


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("pristine")
    return {fmt: make_dataset(base / fmt, fmt, n=N, seed=SEED)[0] for fmt in FORMATS}


@pytest.fixture
def copy(pristine, tmp_path):
    """A fresh copy of a pristine dataset to damage."""

    def make(fmt: str) -> Path:
        dst = tmp_path / fmt
        shutil.copytree(pristine[fmt], dst)
        return dst

    return make


def _manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


def _write_manifest(root: Path, m: dict) -> None:
    (root / "manifest.json").write_text(json.dumps(m))


def _sample_in_shard(root: Path, shard: int) -> int:
    idx = read_index(str(root))
    return int(np.flatnonzero(idx.shard == shard)[0])


def _whole(fetcher, s: int) -> np.ndarray:
    return np.array([[s, 0, int(fetcher.lengths[s])]], np.int64)


@pytest.mark.parametrize("fmt", FORMATS)
def test_flipped_byte_in_a_shard_is_caught_on_first_open(copy, fmt: str) -> None:
    """One inverted byte: the fetch refuses the shard naming it (the checksum is checked before a
    byte is decoded); samples of other shards still read correctly."""
    root = copy(fmt)
    name = _manifest(root)["shards"][2]["name"]
    ref = reference_tokens(N, SEED)
    bad, good = _sample_in_shard(root, 2), _sample_in_shard(root, 0)
    # flip a byte of one of `bad`'s tokens where they are stored raw (MDS, npy members; parquet
    # may dictionary-encode them: then the shard's middle byte)
    data = (root / name).read_bytes()
    at = data.find(ref[bad][1:9].astype("<u2").tobytes())
    flip_byte(root / name, at + 2 if at >= 0 else None)
    with FetchConfig().build(str(root)) as fetcher:
        with pytest.raises(InputError, match=f"{name}: XXH3-64 checksum .* differs"):
            fetcher.fetch(_whole(fetcher, bad))
        assert fetcher.fetch(_whole(fetcher, good)).input_ids.tolist() == ref[good].tolist()
    if at >= 0:  # without the check the flipped token would be trained on silently
        with FetchConfig(verify=False).build(str(root)) as fetcher:
            got = fetcher.fetch(_whole(fetcher, bad)).input_ids
        assert (got != ref[bad]).sum() == 1
    else:
        assert fmt == "parquet"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the library's overflow on the bad offsets
def test_damaged_mds_shard_without_checksums_names_the_shard_through_the_library(copy) -> None:
    """`verify = false` with `mds_access = "dataset"`: a shard whose row offsets are damaged
    fails as an InputError naming it, not the library's bare ValueError."""
    root = copy("mds")
    name = _manifest(root)["shards"][1]["name"]
    flip_byte(root / name, 20)
    flip_byte(root / name)
    with FetchConfig(verify=False, mds_access="dataset").build(str(root)) as fetcher:
        with pytest.raises(InputError, match=f"{name}: cannot read its rows"):
            for s in range(N):
                fetcher.fetch(_whole(fetcher, s))


def test_mds_offsets_out_of_order_name_the_shard(copy) -> None:
    """`verify = false`, the default reader: a shard whose offset table goes backwards (two
    offsets swapped, the file's size unchanged) is refused at its first read, naming the shard and
    its offset table, not read as rows of negative length."""
    root = copy("mds")
    name = _manifest(root)["shards"][1]["name"]
    with open(root / name, "r+b") as f:
        head = np.frombuffer(f.read(4 * 8), "<u4").copy()
        head[2], head[3] = head[3], head[2]  # offsets of rows 1 and 2 (head[0] is the row count)
        f.seek(0)
        f.write(head.tobytes())
    with FetchConfig(verify=False).build(str(root)) as fetcher:
        with pytest.raises(InputError, match=f"{name}: .*offset table is truncated or corrupt"):
            fetcher.fetch(_whole(fetcher, _sample_in_shard(root, 1)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_or_deleted_shard_is_caught_when_opening_the_dataset(copy, fmt: str) -> None:
    root = copy(fmt)
    shards = _manifest(root)["shards"]
    truncate(root / shards[1]["name"])
    with pytest.raises(InputError, match=f"{shards[1]['name']}: \\d+ bytes, manifest.json says"):
        FetchConfig().build(str(root))
    with pytest.raises(InputError) as exc:  # the advice verify leaves out of its own report
        FetchConfig().build(str(root))
    assert str(exc.value).endswith("(truncated); run `mixlen verify`")
    (root / shards[1]["name"]).unlink()
    with pytest.raises(
        InputError, match=f"{shards[1]['name']}: shard listed in manifest.json is missing"
    ):
        FetchConfig().build(str(root))


@pytest.mark.parametrize("fmt", FORMATS)
def test_shard_truncated_while_training_names_the_shard(copy, fmt: str) -> None:
    """A shard that shrinks after it was opened and verified (pread past its end): an error naming
    it, not a decoding traceback or short tokens."""
    root = copy(fmt)
    with FetchConfig().build(str(root)) as fetcher:
        idx = read_index(str(root))
        shard = int(idx.shard[-1])
        name = fetcher.reader.shard_names[shard]
        fetcher.fetch(_whole(fetcher, _sample_in_shard(root, shard)))  # opened and verified
        truncate(root / name, 0.3)
        last = len(idx) - 1
        with pytest.raises(InputError, match=name):
            fetcher.fetch(_whole(fetcher, last))


def test_index_disagreeing_with_the_shards(copy, capsys) -> None:
    """Edits of index.parquet: caught by the manifest's checksum of it; without that checksum (an
    older dataset), by the index's own consistency with the shards (naming the row) or, for a
    length that keeps the row count, by the fetch and by `mixlen verify` (naming the sample)."""
    root = copy("parquet")
    ipath = root / "index.parquet"
    table = pq.read_table(ipath)
    cols = table.to_pydict()

    def write(edits: dict) -> None:
        d = {k: list(v) for k, v in cols.items()}
        for (col, row), value in edits.items():
            d[col][row] = value
        pq.write_table(pa.table(d, schema=table.schema), ipath)

    s = int(np.argmax(cols["num_tokens"]))
    write({("num_tokens", s): cols["num_tokens"][s] + 1})
    with pytest.raises(InputError, match="index.parquet: XXH3-64 checksum differs"):
        read_index(str(root))
    m = _manifest(root)
    del m["index_xxh3_64"], m["dataset_fingerprint"]  # as written before either field
    _write_manifest(root, m)
    # one token more, or fewer, in the same number of rows: only the stored rows can tell
    for more in (-1, 1):
        write({("num_tokens", s): cols["num_tokens"][s] + more})
        with FetchConfig().build(str(root)) as fetcher:
            with pytest.raises(InputError, match=f"sample {s}, chunk \\d+\\) holds \\d+ tokens"):
                fetcher.fetch(_whole(fetcher, s))
    rep = verify_dataset(str(root))
    assert len(rep.problems) == 1 and "index.parquet implies" in rep.problems[0]
    assert cli_main(["verify", str(root)]) == 1
    assert "1 problem(s)" in capsys.readouterr().err
    # structural edits, each named by its row
    chunk = m["chunk_tokens"]
    for edit, phrase in [
        ({("num_rows", 3): cols["num_rows"][3] + 1}, "row 3 (sample 3): num_rows"),
        ({("shard", 5): 999}, "row 5 (sample 5): shard 999"),
        ({("first_row", 7): cols["first_row"][7] + 1}, "row 7 (sample 7)"),
        ({("sample_id", 9): 10}, "row 9 (sample 9): sample_id 10"),
        ({("num_tokens", 0): cols["num_tokens"][0] + chunk}, "row 0 (sample 0): num_rows"),
    ]:
        write(edit)
        with pytest.raises(InputError, match=re.escape(phrase)):
            read_index(str(root))
        with pytest.raises(InputError, match=re.escape(phrase)):
            FetchConfig().build(str(root))
    # dropped rows and a wrong column type
    pq.write_table(table.slice(0, N - 1), ipath)
    with pytest.raises(InputError, match=f"{N - 1} rows but manifest.json num_samples is {N}"):
        read_index(str(root))
    pq.write_table(
        table.set_column(1, "num_tokens", pa.array([str(x) for x in cols["num_tokens"]])), ipath
    )
    with pytest.raises(InputError, match="column 'num_tokens' has type string"):
        read_index(str(root))
    ipath.write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match="index.parquet: not a valid index"):
        read_index(str(root))


@pytest.mark.parametrize(
    "name,phrase",
    [
        ("../outside.mds", "'..' component"),
        ("/etc/passwd", "absolute path"),
        ("a/../../outside.mds", "'..' component"),
        ("", "non-empty file name"),
        (7, "non-empty file name"),
    ],
)
def test_manifest_shard_names_must_stay_inside(copy, name, phrase: str) -> None:
    """A manifest cannot make a reader open a file outside the dataset directory."""
    root = copy("mds")
    shutil.copy(root / _manifest(root)["shards"][0]["name"], root.parent / "outside.mds")
    m = _manifest(root)
    m["shards"][0]["name"] = name
    _write_manifest(root, m)
    for call in (read_manifest, read_index, lambda p: FetchConfig().build(p)):
        with pytest.raises(InputError, match=f"manifest.json: shards\\[0\\].name: .*{phrase}"):
            call(str(root))
    assert (
        verify_dataset(str(root)).problems[0].endswith(phrase)
        or phrase in verify_dataset(str(root)).problems[0]
    )


@pytest.mark.parametrize(
    "edit,phrase",
    [
        (lambda m: m.pop("shards"), "missing key 'shards'"),
        (lambda m: m.__setitem__("num_samples", "many"), "num_samples: expected an integer"),
        (lambda m: m.__setitem__("chunk_tokens", 0), "chunk_tokens: expected an integer in \\[1, "),
        (lambda m: m.__setitem__("chunk_tokens", 10**30), "chunk_tokens: expected an integer in"),
        (lambda m: m["shards"][0].__setitem__("rows", 10**30), "shards\\[0\\].rows: expected an"),
        (lambda m: m["shards"][1].__setitem__("rows", -1), "shards\\[1\\].rows"),
        (lambda m: m["shards"][1].__setitem__("xxh3_64", "zz"), "shards\\[1\\].xxh3_64"),
        (lambda m: m.__setitem__("dtype", "float32"), "dtype: expected one of"),
        (lambda m: m.__setitem__("loss_mask", "yes"), 'loss_mask: expected "trained_spans"'),
        (lambda m: m.__setitem__("bos_id", "x"), "bos_id: expected a token id"),
        (lambda m: m.__setitem__("eos_id", -1), "eos_id: expected a token id"),
        (lambda m: m.__setitem__("shards", {"a": 1}), "shards: expected a list"),
        (lambda m: m["shards"].append(dict(m["shards"][0])), "listed twice"),
    ],
)
def test_malformed_manifest_names_file_and_field(copy, capsys, edit, phrase) -> None:
    root = copy("wds")
    m = _manifest(root)
    edit(m)
    _write_manifest(root, m)
    with pytest.raises(InputError, match=f"{root}/manifest.json: .*{phrase}"):
        read_manifest(str(root))
    assert cli_main(["profile", str(root)]) == 2
    err = capsys.readouterr().err
    assert "manifest.json" in err and "Traceback" not in err


def test_manifest_not_json(copy, capsys) -> None:
    root = copy("wds")
    for data, phrase in [
        (b"{", "invalid JSON"),
        (b"\xff\xfe\x00", "not a JSON manifest"),
        (b"[1]", "expected a JSON object"),
    ]:
        (root / "manifest.json").write_bytes(data)
        with pytest.raises(InputError, match=phrase):
            read_manifest(str(root))
    assert cli_main(["verify", str(root)]) == 1
    assert "manifest.json" in capsys.readouterr().err


def test_mds_pickled_columns_are_never_read(copy, tmp_path) -> None:
    """An MDS index.json declaring a `pkl` column would make the library unpickle shard bytes:
    refused before any shard is opened (here the payload would create a marker file)."""
    import pickle

    root = copy("mds")
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    obj = json.loads((root / "index.json").read_text())
    for sh in obj["shards"]:
        sh["column_encodings"][0] = "pkl"
    (root / "index.json").write_text(json.dumps(obj))
    assert pickle.dumps(Payload())  # the kind of bytes a pkl column would hold
    for access in ("reader", "dataset"):
        with pytest.raises(InputError, match="column encoding 'pkl' would unpickle data"):
            FetchConfig(mds_access=access).build(str(root))
    assert not marker.exists()


@pytest.mark.parametrize("enc", ["ndarray:float16", "ndarray:uint32", "str", "json", None])
def test_a_token_column_of_another_encoding_is_refused(copy, enc) -> None:
    """MDS's index.json is not under the manifest's checksums: a token column whose encoding
    is not an ndarray of the manifest's dtype (float16 read every id as about 0 and trained on
    them; str or json ended in an AttributeError), or a missing one, is refused naming the
    shard, the column and what was expected, by the reader, the dataset access and verify."""
    root = copy("mds")
    obj = json.loads((root / "index.json").read_text())
    k = obj["shards"][0]["column_names"].index("tokens")
    if enc is None:
        obj["shards"][0]["column_names"][k] = "ids"
    else:
        obj["shards"][0]["column_encodings"][k] = enc
    (root / "index.json").write_text(json.dumps(obj))
    name = obj["shards"][0]["raw_data"]["basename"]
    want = f"shard {name} column 'tokens' has encoding {enc!r}; expected 'ndarray:uint16'"
    for access in ("reader", "dataset"):
        with pytest.raises(InputError, match=re.escape(want)):
            FetchConfig(mds_access=access).build(str(root))
    assert any(want in p for p in verify_dataset(str(root)).problems)


@pytest.mark.parametrize(
    ("edit", "want"),
    [
        ("tokens:float64", "column 'tokens' is list<double>, expected list<uint16>"),
        ("tokens:int64", "column 'tokens' is list<int64>, expected list<uint16>"),
        ("tokens:uint16", None),  # the same type, rewritten by another writer: still read
        ("drop:sample_id", "no column 'sample_id' (expected int64)"),
    ],
)
def test_a_parquet_shard_of_another_schema_is_refused(copy, edit: str, want: str | None) -> None:
    """A shard rewritten by another tool with its manifest entry to match (size, no checksum):
    a token column of another type had its values cast (x + 0.5 read as x), and a missing
    column passed; now the reader and verify name the shard and the column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = copy("parquet")
    m = _manifest(root)
    entry = m["shards"][0]
    path = root / entry["name"]
    table = pq.read_table(path)
    kind, what = edit.split(":")
    if kind == "drop":
        table = table.drop_columns([what])
    else:
        k = table.column_names.index("tokens")
        typ = pa.list_(pa.from_numpy_dtype(np.dtype(what)))
        table = table.set_column(k, "tokens", table.column(k).cast(typ))
    pq.write_table(table, path)
    entry["bytes"] = path.stat().st_size
    del entry["xxh3_64"], m["dataset_fingerprint"]
    _write_manifest(root, m)
    with FetchConfig().build(str(root)) as fetcher:
        if want is None:  # pq.write_table names the list's item `element`
            assert "list<element: uint16>" in str(pq.read_schema(path))
            assert fetcher.fetch(_whole(fetcher, _sample_in_shard(root, 0))).input_ids.size
            no_sum = f"{path}: manifest.json records no xxh3_64 checksum for it"
            assert verify_dataset(str(root)).problems == [no_sum]  # read, but flagged
            return
        with pytest.raises(InputError, match=re.escape(f"{path}: {want}")):
            fetcher.fetch(_whole(fetcher, _sample_in_shard(root, 0)))
    assert f"{path}: {want}" in verify_dataset(str(root)).problems  # the path once


def test_a_parquet_shard_with_a_row_more_is_refused(copy) -> None:
    """A shard rewritten with one row more than manifest.json says (its size entry to match, no
    checksum): the reader names the shard and both counts (fewer rows: the index check's)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = copy("parquet")
    m = _manifest(root)
    entry = m["shards"][0]
    path = root / entry["name"]
    table = pq.read_table(path)
    pq.write_table(pa.concat_tables([table, table.slice(table.num_rows - 1)]), path)
    entry["bytes"] = path.stat().st_size
    del entry["xxh3_64"], m["dataset_fingerprint"]
    _write_manifest(root, m)
    want = f"{path}: {table.num_rows + 1} rows, manifest.json says {table.num_rows}"
    with FetchConfig().build(str(root)) as fetcher:
        with pytest.raises(InputError, match=re.escape(want)):
            fetcher.fetch(_whole(fetcher, _sample_in_shard(root, 0)))


def test_out_of_vocabulary_token_names_shard_sample_and_position(copy) -> None:
    """Token ids at or above the vocabulary (here: a manifest claiming a smaller vocabulary than
    its data) are refused by the fetch naming the shard, the sample and the token's position."""
    root = copy("mds")
    m = _manifest(root)
    m["vocab_size"] = 100  # 'a'..'z' are 97..122: most samples hold ids >= 100
    _write_manifest(root, m)
    ref = reference_tokens(N, SEED)
    s = next(i for i, t in enumerate(ref) if (t >= 100).any() and len(t) > 80)
    pos = int(np.argmax(ref[s] >= 100))  # the reference: the first offending position
    with FetchConfig().build(str(root)) as fetcher:
        shard = fetcher.reader.shard_names[
            fetcher.reader.shard_of_row(int(fetcher.global_first_row[s]) + pos // fetcher.chunk)
        ]
        with pytest.raises(InputError) as exc:
            fetcher.fetch(_whole(fetcher, s))
    msg = str(exc.value)
    assert f"{shard}: sample {s}, token {pos} has id {int(ref[s][pos])}" in msg
    assert "manifest.json vocab_size = 100" in msg
    rep = verify_dataset(str(root))
    assert rep.problems and "outside the vocabulary" in rep.problems[0]
    top = int(ref[s].max())  # the boundary: an id must be below vocab_size
    for vocab in (top, top + 1):
        _write_manifest(root, {**m, "vocab_size": vocab})
        with FetchConfig().build(str(root)) as fetcher:
            if vocab == top:
                with pytest.raises(InputError, match=f"has id {top}"):
                    fetcher.fetch(_whole(fetcher, s))
            else:
                assert int(fetcher.fetch(_whole(fetcher, s)).input_ids.max()) == top


def test_verify_lists_every_problem(copy, capsys) -> None:
    root = copy("parquet")
    shards = _manifest(root)["shards"]
    assert cli_main(["verify", str(root)]) == 0
    assert f"ok: {root}: {len(shards)} shards" in capsys.readouterr().out
    flip_byte(root / shards[0]["name"])
    truncate(root / shards[3]["name"])
    (root / shards[5]["name"]).unlink()
    assert cli_main(["verify", str(root)]) == 1
    err = capsys.readouterr().err
    assert "3 problem(s)" in err and "mixlen verify" not in err
    for i, phrase in [(0, "checksum"), (3, "truncated"), (5, "missing")]:
        assert any(shards[i]["name"] in line and phrase in line for line in err.splitlines()), err
    assert cli_main(["verify", str(root / "nope")]) == 2


@pytest.mark.serial  # the new /dev/shm segments must be the killed run's
def test_stale_streaming_state_of_a_killed_run(pristine, tmp_path) -> None:
    """A process killed (SIGKILL) while it had a StreamingDataset open leaves shared memory and
    /tmp filelocks; an old filelock with no memory at all (another dead run's) would stop the
    library's own cleanup at its prefix. The next StreamingDataset access removes both kinds,
    never a live process's memory, and reads correct tokens."""
    import tempfile
    import time

    root = pristine["mds"]
    ref = reference_tokens(N, SEED)
    shm_before = set(os.listdir("/dev/shm"))
    prefix_file = tmp_path / "prefix"
    pid = os.fork()
    if pid == 0:  # the run that gets killed
        try:
            from multiprocessing import resource_tracker

            from streaming import StreamingDataset

            # a killed job's resource tracker dies with it: nobody unlinks its segments
            resource_tracker.register = resource_tracker.unregister = lambda *a, **k: None
            ds = StreamingDataset(local=str(root), batch_size=1, shuffle=False)
            ds.get_item(0)
            prefix = ds._shm_prefix_int
            for name in ("barrier_filelock", "cache_filelock"):
                with open(os.path.join(tempfile.gettempdir(), f"{prefix:06}_{name}"), "w"):
                    pass
            prefix_file.write_text(str(prefix))
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    prefix = int(prefix_file.read_text())
    dead_shm = set(os.listdir("/dev/shm")) - shm_before
    assert dead_shm and all(n.startswith(f"{prefix:06}_") for n in dead_shm)
    dead_inodes = {os.stat(f"/dev/shm/{n}").st_ino for n in dead_shm}  # names may be reused
    locks = [
        os.path.join(tempfile.gettempdir(), f"{prefix:06}_{n}_filelock")
        for n in ("barrier", "cache")
    ]
    lock_inodes = {p: os.stat(p).st_ino for p in locks}
    old_lock = os.path.join(tempfile.gettempdir(), "999990_cache_filelock")
    with open(old_lock, "w"):
        pass
    os.utime(old_lock, (time.time() - 3600, time.time() - 3600))
    with FetchConfig(mds_access="dataset").build(str(root)) as fetcher:
        assert not dead_inodes & {os.stat(f"/dev/shm/{n}").st_ino for n in os.listdir("/dev/shm")}
        assert not os.path.exists(old_lock)
        for p, ino in lock_inodes.items():  # gone (or a new file of the new run's)
            assert not os.path.exists(p) or os.stat(p).st_ino != ino
        live = {n for n in os.listdir("/dev/shm") if n.startswith(f"{fetcher.reader._prefix:06}_")}
        from datapipe.formats.mds import clean_stale_streaming

        assert live and not live & set(clean_stale_streaming())  # ours is mapped: kept
        for s in (0, 42, N - 1):
            assert fetcher.fetch(_whole(fetcher, s)).input_ids.tolist() == ref[s].tolist()
