"""Data-aware fetch: exact tokens/labels/positions on all formats, read bound, prefetch, leftovers."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from datapipe.errors import InputError
from datapipe.fetch import FetchConfig, Prefetcher
from datapipe.index import uri_key
from datapipe.ingest.preprocess import PreprocessConfig, preprocess
from datapipe.ingest.tokenizer import BytesTokenizer
from datapipe.plan.loss import IGNORE_INDEX
from datapipe.plan.zigzag import member_ranges

FORMATS = ["mds", "wds", "parquet"]
CHUNK = 37  # small storage chunk: samples span many rows (and MDS shards)


def make_dataset(root: Path, fmt: str, n: int = 150, seed: int = 0) -> tuple[Path, np.ndarray]:
    """Preprocess n JSONL documents of lognormal size; returns (dataset dir, lengths)."""
    texts = doc_texts(n, seed)
    src = root.parent / f"{root.name}.jsonl"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    preprocess(
        PreprocessConfig(
            inputs=[str(src)],
            out=str(root),
            format=fmt,
            chunk_tokens=CHUNK,
            shard_bytes=8000 if fmt == "wds" else 4000,  # a tar member takes 1 KiB or more
            progress=False,
        )
    )
    return root, np.array([len(t) + 2 for t in texts], np.int64)


def doc_texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    sizes = np.maximum(1, rng.lognormal(np.log(60), 1.0, n)).astype(int)
    alphabet = np.array(list("abcdefghijklmnopqrstuvwxyz ,.ABCDEFGHIJ0123456789"))
    return ["".join(rng.choice(alphabet, size=k)) for k in sizes]


def reference_tokens(n: int, seed: int) -> list[np.ndarray]:
    """Each sample's tokens, straight from the tokenizer (independent of storage)."""
    tok = BytesTokenizer()
    return [tok.encode(t).astype(np.int64) for t in doc_texts(n, seed)]


def reference_microbatch(pieces: np.ndarray, ref: list[np.ndarray]) -> dict[str, list[int]]:
    """Per-position reference, one Python step per token."""
    out: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": [], "cu": [0]}
    for s, a, b in pieces.tolist():
        toks = ref[s]
        for p in range(a, b):
            out["input_ids"].append(int(toks[p]))
            out["labels"].append(int(toks[p + 1]) if p + 1 < len(toks) else IGNORE_INDEX)
            out["position_ids"].append(p)
        out["cu"].append(out["cu"][-1] + b - a)
    return out


def random_pieces(
    lengths: np.ndarray, rng: np.random.Generator, n_microbatches: int = 4, per_mb: int = 6
) -> list[np.ndarray]:
    """Random pieces: whole samples, sample tails (b == L), and inner ranges."""
    out = []
    for _ in range(n_microbatches):
        rows = []
        for s in rng.choice(len(lengths), size=per_mb, replace=False):
            L = int(lengths[s])
            kind = rng.integers(3)
            if kind == 0 or L < 2:
                a, b = 0, L
            elif kind == 1:
                a, b = int(rng.integers(0, L)), L
            else:
                a = int(rng.integers(0, L - 1))
                b = int(rng.integers(a + 1, L))
            rows.append((int(s), a, b))
        out.append(np.array(rows, np.int64))
    return out


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, np.ndarray]]:
    base = tmp_path_factory.mktemp("fetch")
    return {fmt: make_dataset(base / fmt, fmt, n=150, seed=1) for fmt in FORMATS}


def _check_against_reference(fetcher, pieces_list, ref) -> None:
    mbs = fetcher.fetch_step(pieces_list)
    assert len(mbs) == len(pieces_list)
    for pieces, mb in zip(pieces_list, mbs, strict=True):
        want = reference_microbatch(pieces, ref)
        assert mb.input_ids.dtype == fetcher.reader.dtype and mb.cu_seqlens.dtype == np.int32
        assert mb.labels.dtype == mb.position_ids.dtype == np.int32
        assert mb.input_ids.tolist() == want["input_ids"]
        assert mb.labels.tolist() == want["labels"]
        assert mb.position_ids.tolist() == want["position_ids"]
        assert mb.cu_seqlens.tolist() == want["cu"]


@pytest.mark.parametrize("fmt", FORMATS + ["mds-dataset"])
def test_fetch_matches_reference_tokens(datasets, fmt: str) -> None:
    root, lengths = datasets[fmt.split("-")[0]]
    ref = reference_tokens(150, 1)
    assert [len(r) for r in ref] == lengths.tolist()
    access = "dataset" if fmt == "mds-dataset" else "reader"
    manifest = json.loads((root / "manifest.json").read_text())
    assert len(manifest["shards"]) > 3  # several shards (MDS splits samples across them)
    with FetchConfig(mds_access=access).build(str(root)) as fetcher:
        assert np.array_equal(fetcher.lengths, lengths)
        rng = np.random.default_rng(hash(fmt) % 1000)
        for _ in range(5):
            _check_against_reference(fetcher, random_pieces(lengths, rng), ref)
        # every sample whole, in one step
        whole = np.stack([np.arange(150), np.zeros(150, np.int64), lengths], axis=1)
        _check_against_reference(fetcher, [whole[:75], whole[75:]], ref)
        assert fetcher.fetch_step([]) == []
        empty = fetcher.fetch(np.zeros((0, 3), np.int64))
        assert empty.num_tokens == 0 and empty.cu_seqlens.tolist() == [0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_zigzag_union_over_ranks_equals_whole_samples(datasets, fmt: str) -> None:
    """A sample split zigzag over k ranks: positions, inputs and labels union to the whole sample."""
    root, lengths = datasets[fmt]
    ref = reference_tokens(150, 1)
    samples = [int(s) for s in np.argsort(lengths)[-3:]] + [int(np.argmin(lengths))]
    with FetchConfig().build(str(root)) as fetcher:
        for k in (1, 2, 3, 4):
            per_rank = []
            for p in range(k):
                pieces = [(s, *r) for s in samples for r in member_ranges(int(lengths[s]), k, p)]
                pieces = np.array([q for q in pieces if q[2] > q[1]], np.int64).reshape(-1, 3)
                per_rank.append(pieces)
            mbs = fetcher.fetch_step(per_rank)
            for s in samples:
                L = int(lengths[s])
                pos, inp, lab = [], [], []
                for mb in mbs:
                    for i, (ps, _, _) in enumerate(mb.pieces.tolist()):
                        if ps != s:
                            continue
                        lo, hi = mb.cu_seqlens[i], mb.cu_seqlens[i + 1]
                        pos += mb.position_ids[lo:hi].tolist()
                        inp += mb.input_ids[lo:hi].tolist()
                        lab += mb.labels[lo:hi].tolist()
                order = np.argsort(pos)
                assert np.array_equal(np.asarray(pos)[order], np.arange(L))
                assert np.array_equal(np.asarray(inp)[order], ref[s])
                assert np.array_equal(np.asarray(lab)[order], np.append(ref[s][1:], IGNORE_INDEX))
                assert int(np.count_nonzero(np.asarray(lab) != IGNORE_INDEX)) == L - 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_bytes_read_within_one_chunk_per_piece_end(datasets, fmt: str) -> None:
    root, lengths = datasets[fmt]
    rng = np.random.default_rng(4)
    itemsize = 2
    with FetchConfig().build(str(root)) as fetcher:
        for _ in range(4):
            pieces = random_pieces(lengths, rng, n_microbatches=1, per_mb=8)[0]
            before = fetcher.reader.stats.rows, fetcher.reader.stats.token_bytes
            before_bytes = fetcher.reader.stats.bytes
            fetcher.fetch(pieces)
            rows = fetcher.reader.stats.rows - before[0]
            token_bytes = fetcher.reader.stats.token_bytes - before[1]
            nbytes = fetcher.reader.stats.bytes - before_bytes
            # brute force: rows j of sample s with [j*C, (j+1)*C) overlapping [a, min(b+1, L))
            needed = set()
            for s, a, b in pieces.tolist():
                end = min(b + 1, int(lengths[s]))
                needed |= {
                    (s, j)
                    for j in range(0, -(-int(lengths[s]) // CHUNK))
                    if j * CHUNK < end and (j + 1) * CHUNK > a
                }
            assert rows == len(needed)
            assigned = int((pieces[:, 2] - pieces[:, 1]).sum())
            bound = itemsize * (assigned + 2 * CHUNK * len(pieces))
            assert token_bytes <= bound
            # file bytes: payload plus small per-row headers (MDS/tar/parquet framing)
            per_row = {"mds": 64, "wds": 1024, "parquet": 64}[fmt]
            assert nbytes <= bound + per_row * 2 * len(needed) + (
                2 * itemsize * CHUNK * len(pieces) if fmt == "parquet" else 0
            )


def test_prefetch_matches_direct_fetch_and_measures_wait(datasets) -> None:
    root, lengths = datasets["mds"]
    rng = np.random.default_rng(5)
    steps = [(f"step{i}", random_pieces(lengths, rng, n_microbatches=2)) for i in range(6)]
    with FetchConfig(prefetch_depth=2).build(str(root)) as fetcher:
        direct = [fetcher.fetch_step(mbs) for _, mbs in steps]
        with fetcher.prefetch(iter(steps)) as pf:
            got = list(pf)
            assert pf.steps == 6 and pf.total_wait_s >= pf.last_wait_s >= 0.0
        assert [k for k, _ in got] == [k for k, _ in steps]
        for (_, mbs), want in zip(got, direct, strict=True):
            for m, w in zip(mbs, want, strict=True):
                assert np.array_equal(m.input_ids, w.input_ids) and np.array_equal(
                    m.labels, w.labels
                )

        # the worker runs ahead: while the consumer "computes", the next step gets fetched
        fetched = threading.Event()

        def slow_steps():
            yield "a", steps[0][1]
            yield "b", steps[1][1]
            fetched.set()

        with Prefetcher(fetcher, slow_steps(), depth=1) as pf:
            next(pf)
            assert fetched.wait(10)  # produced while the consumer held step "a"
            time.sleep(0.05)
            assert next(pf)[0] == "b" and pf.last_wait_s < 1.0

        def bad_steps():
            yield "ok", steps[0][1]
            yield "bad", [np.array([[0, 5, 3]], np.int64)]

        with Prefetcher(fetcher, bad_steps()) as pf:
            assert next(pf)[0] == "ok"
            with pytest.raises(ValueError, match="start < end"):
                next(pf)
        # closing mid-stream does not hang
        pf = Prefetcher(fetcher, iter(steps * 10), depth=1)
        next(pf)
        pf.close()
        assert not pf._thread.is_alive()


def test_to_torch_and_bad_pieces(datasets) -> None:
    root, lengths = datasets["parquet"]
    with FetchConfig().build(str(root)) as fetcher:
        mb = fetcher.fetch(np.array([[3, 0, int(lengths[3])]], np.int64))
        t = mb.to_torch()
        assert (
            t["input_ids"].tolist() == mb.input_ids.tolist()
            and str(t["cu_seqlens"].dtype) == "torch.int32"
        )
        assert mb.num_labels == int(lengths[3]) - 1
        n3 = int(lengths[3])
        for bad in ([10_000, 0, 1], [len(lengths), 0, 1], [-1, 0, 1]):
            with pytest.raises(ValueError, match="outside"):
                fetcher.fetch(np.array([bad], np.int64))
        for bad in ([3, 0, n3 + 1], [3, 5, 5], [3, 6, 5], [3, -1, 2]):  # empty, reversed, out
            with pytest.raises(
                ValueError, match=rf"piece \[{bad[0]}, {bad[1]}, {bad[2]}\]: .*start < end"
            ):
                fetcher.fetch(np.array([[3, 0, 2], bad], np.int64))


def _leftovers() -> set[str]:
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    locks = {f for f in os.listdir(tempfile.gettempdir()) if f.endswith("_filelock")}
    return shm | locks


@pytest.mark.serial  # compares /dev/shm and /tmp before and after
@pytest.mark.parametrize("fmt", FORMATS)
def test_remote_dataset_downloads_through_streaming_into_cache(
    datasets, fmt, tmp_path, monkeypatch
) -> None:
    """A 'remote' (a plain directory, served by CloudDownloader's local downloader) is fetched
    into the cache dir on demand: metadata first, then only the shards a step touches."""
    import datapipe.index as stream_mod

    root, lengths = datasets[fmt]
    monkeypatch.setattr(stream_mod, "is_remote", lambda p: str(p) == str(root))
    ref = reference_tokens(150, 1)
    cache = tmp_path / "cache"
    folder = cache / uri_key(str(root))  # the dataset's own folder in the cache
    before = _leftovers()
    with FetchConfig().build(str(root), str(cache)) as fetcher:
        assert fetcher.reader.remote == str(root) and fetcher.reader.local == str(folder)
        manifest = json.loads((folder / "manifest.json").read_text())
        assert not any((folder / s["name"]).exists() for s in manifest["shards"])
        pieces = np.array([[0, 0, int(lengths[0])]], np.int64)
        _check_against_reference(fetcher, [pieces], ref)
        got = [s["name"] for s in manifest["shards"] if (folder / s["name"]).exists()]
        assert 1 <= len(got) < len(manifest["shards"])
    assert _leftovers() == before
    files = os.listdir(folder)  # metadata (MDS: index.json too) and the shards it read
    assert {"manifest.json", "index.parquet", *got} <= set(files) and not [
        f for f in files if ".part" in f
    ]
    # downloads killed part-way (a dead process's part file, and the SDK's own temporary name
    # after it) are removed by the next reader of the host; a live process's stay
    import subprocess
    import sys

    from datapipe.files import host_tag

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)  # fmt: skip
    name = manifest["shards"][-1]["name"]
    tag = f"{name}.part-{host_tag()}"
    left = {f"{tag}-{dead}-0a1b2c3d": False, f"{tag}-{dead}-0a1b2c3d.aB3dE6gH": False,
            f"{tag}-{os.getppid()}-0a1b2c3d": True}  # fmt: skip
    for n in left:
        (folder / n).write_bytes(b"x" * 10)
    (folder / "part-00000").mkdir()  # the Ray engine's shards sit in part folders
    (folder / "part-00000" / f"{tag}-{dead}-0a1b2c3d").write_bytes(b"x")
    with FetchConfig().build(str(root), str(cache)):
        pass
    assert os.listdir(folder / "part-00000") == []
    (folder / "part-00000").rmdir()
    assert sorted(os.listdir(folder)) == sorted([*files, *(n for n, k in left.items() if k)])
    # a full disk under the cache: a cached dataset is still opened; an uncached one is refused
    # naming the cache folder (before: an OSError traceback at every open)
    import errno

    import datapipe.store

    def full(remote: str, local: str, *a, replace: bool = False, **k) -> None:
        if not os.path.exists(local) or replace:  # what is cached needs no writing
            raise OSError(errno.ENOSPC, "No space left on device", local)

    monkeypatch.setattr(datapipe.store, "download", full)
    with FetchConfig().build(str(root), str(cache)) as fetcher:
        assert len(fetcher.lengths) == len(lengths)
    with pytest.raises(InputError, match=r"path: cannot write the dataset's cache in .*other"):
        FetchConfig().build(str(root), str(tmp_path / "empty"))


@pytest.mark.serial  # compares /dev/shm and /tmp before and after
def test_streaming_dataset_access_leaves_no_shm_or_filelocks(
    datasets, tmp_path, monkeypatch
) -> None:
    import subprocess
    import sys

    import datapipe.index as stream_mod
    from datapipe.files import host_tag

    root, lengths = datasets["mds"]
    before = _leftovers()
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)  # fmt: skip
    # a remote dataset's reader copies shards into its own folder, removed by close(): a killed
    # reader's is removed by the next one on its host; a live one's, or another host's, stays
    left = {f"mds-{host_tag()}-{dead}-0a1b2c3d": False, f"mds-{host_tag()}-{os.getppid()}-0": True,
            f"mds-otherhost-{dead}-0a1b2c3d": True}  # fmt: skip
    for name in left:
        (tmp_path / "cTrue" / name).mkdir(parents=True)
    for remote in (False, True):
        if remote:
            monkeypatch.setattr(stream_mod, "is_remote", lambda p: str(p) == str(root))
        cfg = FetchConfig(mds_access="dataset")
        with cfg.build(str(root), str(tmp_path / f"c{remote}")) as fetcher:
            mb = fetcher.fetch(np.array([[7, 0, int(lengths[7])]], np.int64))
            assert mb.num_tokens == int(lengths[7])
            assert _leftovers() != before or not os.path.isdir("/dev/shm")  # it did use shm
    assert _leftovers() == before
    kept = sorted(n for n in os.listdir(tmp_path / "cTrue") if n.startswith("mds-"))
    assert kept == sorted(n for n, k in left.items() if k)


@pytest.mark.parametrize("dtype", [np.uint16, np.int64])
def test_pack_matches_reference(dtype) -> None:
    """The packing kernel against the per-token reference (storage and in-memory dtypes)."""
    from datapipe.fetch import pack_microbatch

    ref = reference_tokens(150, 1)
    lengths = np.array([len(r) for r in ref], np.int64)
    rng = np.random.default_rng(11)
    for _ in range(10):
        pieces = random_pieces(lengths, rng, n_microbatches=1, per_mb=9)[0]
        # spans laid out back to back with junk in between, as rows would be
        spans, starts, pos = [], [], 0
        for s, a, b in pieces.tolist():
            junk = rng.integers(0, 300, size=int(rng.integers(0, 5)))
            span = ref[s][a : min(b + 1, len(ref[s]))]
            spans += [junk, span]
            starts.append(pos + len(junk))
            pos += len(junk) + len(span)
        flat = np.concatenate(spans).astype(dtype)
        mb = pack_microbatch(pieces, lengths, flat, np.array(starts))
        assert mb.input_ids.dtype == dtype
        want = reference_microbatch(pieces, ref)
        assert mb.input_ids.tolist() == want["input_ids"]
        assert mb.labels.tolist() == want["labels"]
        assert mb.position_ids.tolist() == want["position_ids"]
        assert mb.cu_seqlens.tolist() == want["cu"]


def test_rows_disagreeing_with_index_are_reported(datasets) -> None:
    from datapipe.errors import InputError

    root, lengths = datasets["wds"]
    with FetchConfig().build(str(root)) as fetcher:
        s = int(np.argmax(lengths))
        fetcher.lengths = lengths.copy()
        fetcher.lengths[s] += 1  # the index now disagrees with the stored last row
        with pytest.raises(InputError, match=f"sample {s}"):
            fetcher.fetch(np.array([[s, 0, int(lengths[s])]], np.int64))


@pytest.mark.serial  # forks
def test_ranks_fetching_one_uncached_remote_dataset_at_once(tmp_path, monkeypatch) -> None:
    """Four processes of one host open a 'remote' dataset through one cold cache and read every
    shard at the same moment (a job's ranks at its first step): each reads the right tokens; none
    finds another's half-written copy (before: 'checksum differs', 'truncated', or a missing
    '.tmp' in 3 of 4 ranks: the downloaders of oci, azure, dbfs, sftp and local paths write to
    a fixed `NAME.tmp`)."""
    import multiprocessing as mp

    import streaming.base.storage  # noqa: F401 (imported once, not by each forked rank)

    import datapipe.index as stream_mod

    texts = ["x" * 400_000 + str(i) for i in range(6)]  # 6 shards of 400 KB: a long copy each
    src = tmp_path / "big.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    root = tmp_path / "remote"
    preprocess(PreprocessConfig([str(src)], str(root), format="parquet", chunk_tokens=1 << 16,
                                shard_bytes=1 << 18, progress=False))  # fmt: skip
    monkeypatch.setattr(stream_mod, "is_remote", lambda p: str(p) == str(root))
    cache, ctx = str(tmp_path / "cache"), mp.get_context("fork")
    barrier, out = ctx.Barrier(4), ctx.Queue()

    def rank(i: int) -> None:
        try:
            with FetchConfig().build(str(root), cache) as fetcher:
                barrier.wait(30)
                got = [fetcher.fetch(np.array([[s, 0, n]])).input_ids[1:-1]
                       for s, n in enumerate(fetcher.lengths.tolist())]  # fmt: skip
                out.put((i, [bytes(g.astype(np.uint8)).decode() == t for g, t in zip(got, texts)]))
        except Exception as exc:  # reported, not raised in the child
            out.put((i, f"{type(exc).__name__}: {exc}"))

    procs = [ctx.Process(target=rank, args=(i,)) for i in range(4)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
    assert results == {i: [True] * len(texts) for i in range(4)}, results


def test_prefetcher_stays_exhausted() -> None:
    """Once its steps are used up the Prefetcher keeps raising StopIteration at every next()
    (the iterator protocol: a second loop over it ends at once, never blocks); what it yielded
    first is each step's micro-batch of the in-memory tokens."""
    from datapipe.fetch import MemoryFetcher

    fetcher = MemoryFetcher([np.arange(10, 16), np.arange(20, 23)])
    steps = [("a", [np.array([[0, 0, 6]])]), ("b", [np.array([[1, 1, 3]])])]
    with Prefetcher(fetcher, iter(steps), depth=1) as pf:
        got = [(k, mbs[0].input_ids.tolist()) for k, mbs in pf]
        assert got == [("a", [10, 11, 12, 13, 14, 15]), ("b", [21, 22])]
        again: list = []
        t = threading.Thread(target=lambda: again.extend([next(pf, "end"), list(pf)]), daemon=True)
        t.start()
        t.join(10)  # returns at once; a Prefetcher that blocks here fails the test, not hangs it
        assert again == ["end", []]
