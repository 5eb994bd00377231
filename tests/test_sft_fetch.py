"""The loss mask through the fetch: labels of any pieces (zigzag ring chunks, pieces cut by a
mixture's max_sample_tokens units, storage rows split by --chunk-tokens) in all three formats
equal a plain reference built from the rows each storage library reads back; the index's counts
(LossMask) against brute force; shards that disagree with the index are refused."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sft_ingest import read_masked_rows

from datapipe.errors import InputError
from datapipe.fetch import FetchConfig
from datapipe.index import LossColumns, read_index
from datapipe.ingest.preprocess import PreprocessConfig, preprocess
from datapipe.mix.fetch import MixtureFetcher
from datapipe.pack_kernel import mark_trained
from datapipe.plan.loss import IGNORE_INDEX, LossMask, spans_of_mask
from datapipe.plan.zigzag import member_ranges

TEMPLATE = "tests/assets/chat_templates/demo-bpe.jinja"


def conversations(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "é", "✓", "zeta\n", "eta  "]
    rows = []
    for i in range(n):
        msgs = []
        for _ in range(int(rng.integers(1, 4))):
            q = " ".join(rng.choice(words, size=int(rng.integers(1, 30))))
            a = " ".join(rng.choice(words, size=int(rng.integers(1, 12))))
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        rows.append({"messages": msgs} if i % 4 else {"text": f"plain document {i}"})
    return rows


def sft_dataset(root, fmt: str, n: int = 24, chunk: int = 37, shard_bytes: int = 1 << 26) -> str:
    """A small masked dataset (bytes tokenizer, the demo's template) in `fmt`."""
    src = root / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in conversations(n)))
    cfg = PreprocessConfig(
        inputs=[str(src)], out=str(root / fmt), format=fmt, chunk_tokens=chunk,
        chat_template=TEMPLATE, shard_bytes=shard_bytes,
    )  # fmt: skip
    return preprocess(cfg, warn=lambda m: None).out


def reference_labels(tokens: np.ndarray, mask: np.ndarray, a: int, b: int, n: int) -> list:
    """Positions a..b-1 of a sample (or unit) of n tokens: the next token if it is trained and
    inside the sample, else IGNORE_INDEX."""
    return [int(tokens[i + 1]) if i + 1 < n and mask[i + 1] else IGNORE_INDEX for i in range(a, b)]


@pytest.fixture(scope="module", params=["mds", "wds", "parquet"])
def dataset(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    # webdataset in several shards: each has its own spans member (row offsets local to it)
    path = sft_dataset(root, request.param, shard_bytes=8192 if request.param == "wds" else 1 << 26)
    return path, read_masked_rows(path, read_index(path).manifest)


def test_labels_of_ring_chunks_and_pieces(dataset):
    """Each sample split zigzag over k = 1..4 ranks (and arbitrary pieces, and whole): every
    member's labels are its positions' reference labels; together they hold each trained target
    once."""
    path, rows = dataset
    rng = np.random.default_rng(1)
    with FetchConfig().build(path) as fetcher:
        assert fetcher.index.loss is not None
        for sid, (toks, mask) in rows.items():
            n = len(toks)
            for k in (1, 2, 3, 4):
                seen = 0
                for p in range(k):
                    pieces = [(sid, a, b) for a, b in member_ranges(n, k, p) if b > a]
                    if not pieces:
                        continue
                    mb = fetcher.fetch(np.array(pieces))
                    want = [x for _, a, b in pieces for x in reference_labels(toks, mask, a, b, n)]
                    assert mb.labels.tolist() == want
                    seen += mb.num_labels
                assert seen == int(mask[1:].sum()) == fetcher.index.loss_tokens[sid]
            a = int(rng.integers(0, n))
            b = int(rng.integers(a + 1, n + 1))
            mb = fetcher.fetch(np.array([(sid, a, b)]))
            assert mb.labels.tolist() == reference_labels(toks, mask, a, b, n)
            for b in {n, max(n - 1, 1)}:  # all the sample's targets (checked by its loss_tokens)
                mb = fetcher.fetch(np.array([(sid, 0, b)]))
                assert mb.labels.tolist() == reference_labels(toks, mask, 0, b, n)


def test_mixture_units_carry_their_mask(dataset, tmp_path):
    """[P, 7] unit pieces of a masked source and an unmasked one: a unit is a sample of its own
    (its last position unlabelled); its labels follow the source's mask, the unmasked source's
    every token; LossMask.unit_tokens is the labels the unit's pieces get."""
    path, rows = dataset
    text = sft_dataset_text(tmp_path)
    fetchers = [FetchConfig().build(path), FetchConfig().build(text)]
    try:
        mix = MixtureFetcher(fetchers)
        text_rows = {i: (t, np.ones(len(t), bool)) for i, t in enumerate(_text_tokens(text))}
        rng = np.random.default_rng(2)
        for key in range(60):
            src = key % 2
            source_rows = rows if src == 0 else text_rows
            sid = int(rng.integers(0, len(source_rows)))
            toks, mask = source_rows[sid]
            start = int(rng.integers(0, len(toks)))
            length = int(rng.integers(1, len(toks) - start + 1))
            a = int(rng.integers(0, length))
            b = int(rng.integers(a + 1, length + 1))
            unit_t, unit_m = toks[start : start + length], mask[start : start + length]
            mb = mix.fetch(np.array([(key, a, b, src, sid, start, length)]))
            assert mb.labels.tolist() == reference_labels(unit_t, unit_m, a, b, length)
            assert mb.position_ids.tolist() == list(range(a, b))
            whole = mix.fetch(np.array([(key, 0, length, src, sid, start, length)]))
            got = fetchers[src].index.loss_mask.unit_tokens([sid], [start], [length])
            assert whole.num_labels == int(got[0]) == int(unit_m[1:].sum())
    finally:
        for f in fetchers:
            f.close()


def sft_dataset_text(root) -> str:
    src = root / "text.jsonl"
    src.write_text(
        "".join(json.dumps({"text": f"a text document {i} " * 3}) + "\n" for i in range(40))
    )
    cfg = PreprocessConfig(inputs=[str(src)], out=str(root / "text"), chunk_tokens=29)
    return preprocess(cfg, warn=lambda m: None).out


def _text_tokens(path: str) -> list[np.ndarray]:
    from readback import read_rows, samples_from_rows

    by_id = samples_from_rows(read_rows(path, read_index(path).manifest))
    return [by_id[i] for i in range(len(by_id))]


def test_shards_disagreeing_with_the_index_are_refused(dataset):
    """The shards' labels disagreeing with the index are refused, naming the sample and the
    tokens: a whole sample's with its loss_tokens (one less, and one more, here), a piece's with
    its spans (the first one token shorter here)."""
    path, rows = dataset
    with FetchConfig().build(path) as fetcher:
        sid = next(s for s, (_, m) in rows.items() if not m.all())
        n = len(rows[sid][0])
        loss, index = fetcher.index.loss, fetcher.index
        fewer, more = loss.loss_tokens.copy(), loss.loss_tokens.copy()
        fewer[sid] -= 1
        more[sid] += 1
        shorter = loss.values.copy()
        shorter[loss.offsets[sid] + 1] -= 1
        for a, bad in (
            (0, LossColumns(fewer, loss.offsets, loss.values)),
            (0, LossColumns(more, loss.offsets, loss.values)),
            (1, LossColumns(loss.loss_tokens, loss.offsets, shorter)),
        ):
            fetcher.index = dataclasses.replace(index, loss=bad)
            with pytest.raises(
                InputError, match=rf"sample {sid}, tokens {a + 1}\.\.{n}: the shards' trained"
            ):
                fetcher.fetch(np.array([(sid, a, n)]))


@settings(max_examples=60, deadline=None)
@given(
    masks=st.lists(st.lists(st.booleans(), min_size=0, max_size=30), min_size=1, max_size=6),
    data=st.data(),
)
def test_loss_mask_counts_equal_brute_force(masks, data):
    """LossMask.trained / unit_tokens over flat spans against counting the booleans."""
    spans = [spans_of_mask(np.array(m, bool)) for m in masks]
    offsets = np.zeros(len(spans) + 1, np.int64)
    np.cumsum([len(s) for s in spans], out=offsets[1:])
    lm = LossMask(offsets, np.concatenate(spans) if spans else np.zeros(0, np.int64))
    for sid, m in enumerate(masks):
        n = len(m)
        lo = data.draw(st.integers(0, n))
        hi = data.draw(st.integers(0, n))
        assert lm.trained([sid], [lo], [hi])[0] == sum(m[lo:hi])
        if n:
            start = data.draw(st.integers(0, n - 1))
            length = data.draw(st.integers(1, n - start))
            assert lm.unit_tokens([sid], [start], [length])[0] == sum(m[start + 1 : start + length])
    assert LossMask().trained([0], [3], [10])[0] == 7  # no mask: every token


def test_mds_direct_decode_of_spans_equals_the_library(tmp_path):
    """The MDS reader's direct decode of tokens and spans (one buffer per step) against the
    library's decode_sample path."""
    path = sft_dataset(tmp_path, "mds", n=40, chunk=23)
    with FetchConfig().build(path) as direct, FetchConfig().build(path) as library:
        library.reader.direct = False
        rows = np.arange(int(direct.index.num_rows.sum()))
        got, want = direct.reader.read_rows_masked(rows), library.reader.read_rows_masked(rows)
        for x, y in zip(got, want):
            np.testing.assert_array_equal(x, y)
        assert all(direct.reader._spans_ok.values()) and direct.reader._spans_ok
        assert not library.reader._spans_ok  # decoded by the library


@pytest.fixture(scope="module")
def wds_dataset(tmp_path_factory) -> str:
    """A masked webdataset of several shards, each with its own spans member."""
    return sft_dataset(tmp_path_factory.mktemp("wds"), "wds", n=40, chunk=23, shard_bytes=6000)


def test_wds_rows_and_spans_equal_webdatasets_read(wds_dataset):
    """The reader's rows and spans (the spans cut from each shard's one member, by the shard's
    own row offsets) against every row read back with webdataset's reader, for random sets of
    rows across shards; a masked row reads its token member alone."""
    from test_sft_ingest import read_masked_storage_rows

    ref = read_masked_storage_rows(wds_dataset, read_index(wds_dataset).manifest)
    rng = np.random.default_rng(4)
    with FetchConfig().build(wds_dataset) as fetcher:
        reader = fetcher.reader
        assert len(reader.shard_names) > 3
        for size in (len(ref), 1, 2, 5, 17):
            rows = np.sort(rng.choice(len(ref), size, replace=False))
            before = reader.stats.bytes
            toks, counts, spans, span_counts = reader.read_rows_masked(rows)
            want = [ref[r] for r in rows]
            np.testing.assert_array_equal(toks, np.concatenate([w[2] for w in want]))
            assert counts.tolist() == [len(w[2]) for w in want]
            np.testing.assert_array_equal(spans, np.concatenate([w[3] for w in want]))
            assert span_counts.tolist() == [len(w[3]) for w in want]
            npy = [128 + reader.dtype.itemsize * len(w[2]) for w in want]  # header and data
            assert reader.stats.bytes - before == sum(npy)


def _rewrite_shard(root: str, k: int, edit) -> str:
    """Shard k rewritten as edit(its members as [name, bytes]) gives, the manifest's checksums
    updated (so only the reader's own checks can refuse it); the shard's path."""
    import io
    import tarfile

    from datapipe.integrity import checksum_file, dataset_fingerprint

    manifest = json.loads((root / "manifest.json").read_text())
    entry = manifest["shards"][k]
    path = root / entry["name"]
    with tarfile.open(path) as tf:
        members = [[m.name, tf.extractfile(m).read()] for m in tf]
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in edit(members):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    entry["bytes"], entry["xxh3_64"] = path.stat().st_size, checksum_file(str(path))
    manifest["dataset_fingerprint"] = dataset_fingerprint(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))
    return str(path)


def _npy_bytes(arr: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def _per_row_layout(members: list) -> list:
    """The layout before one spans member per shard: each row's spans in a member of its own."""
    import io

    *rows, (_, data) = members
    arr = np.load(io.BytesIO(data))
    off, values = arr[: len(rows) + 1], arr[len(rows) + 1 :]
    out = []
    for r, (name, toks) in enumerate(rows):
        key = name.split(".")[0]
        out += [[name, toks], [f"{key}.trained_spans.npy", _npy_bytes(values[off[r] : off[r + 1]])]]
    return out


def _spans_edit(change):
    """An edit of the spans member's array (the shard's R rows: R + 1 offsets, then values)."""

    def edit(members: list) -> list:
        import io

        arr = np.load(io.BytesIO(members[-1][1]))
        members[-1][1] = _npy_bytes(change(arr, len(members) - 1))
        return members

    return edit


def _with(arr: np.ndarray, at: int, value: int) -> np.ndarray:
    arr = arr.copy()
    arr[at] = value
    return arr


REFUSED = {
    "per-row members (older datasets)": (
        _per_row_layout,
        r"one \.trained_spans\.npy member per row, the layout mixlen wrote before .* re-run "
        r"`mixlen preprocess` to rewrite this dataset",
    ),
    "no spans member": (lambda m: m[:-1], r"0 __mixlen_trained__\.trained_spans\.npy members"),
    "spans before the rows": (lambda m: m[-1:] + m[:-1], r"expected one, after the shard's rows"),
    "int64 values": (_spans_edit(lambda a, r: a.astype(np.int64)), "expected a 1-D uint32 array"),
    "an offset too many": (
        _spans_edit(lambda a, r: np.concatenate([a[: r + 1], [a[r]], a[r + 1 :]]).astype(a.dtype)),
        "row offsets from 0 to",
    ),
    "odd count": (
        _spans_edit(lambda a, r: _with(a, 1, a[1] + 1)),
        r"row 0's offsets 0\.\.\d+ do not hold whole",
    ),
    "fewer values than offsets": (_spans_edit(lambda a, r: a[:r]), "fewer than the"),
    "offsets not from 0": (_spans_edit(lambda a, r: _with(a, 0, 2)), "row offsets from 2 to"),
    "a token member too many": (
        lambda m: [["extra." + m[0][0].split(".", 1)[1], m[0][1]], *m],
        r"\d+ \.tokens\.npy members, manifest says",
    ),
    "backwards span": (
        _spans_edit(lambda a, r: _with(a, r + 1, a[r + 2] + 1)),
        "row 0 has a span that ends before it starts",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_wds_spans_member_checked(case, wds_dataset, tmp_path):
    """A shard whose spans member is missing, misplaced, of the older per-row layout or not a
    consistent array is refused when first read, naming the shard file (its checksums agree:
    the reader's own checks refuse it)."""
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(wds_dataset, root)
    edit, message = REFUSED[case]
    path = _rewrite_shard(root, 1, edit)
    with FetchConfig().build(str(root)) as fetcher:
        rows = np.arange(int(fetcher.reader.shard_starts[1]), int(fetcher.reader.shard_starts[2]))
        with pytest.raises(InputError, match=f"{path}: .*{message}"):
            fetcher.reader.read_rows_masked(rows)


def test_wds_members_np_load_reads_when_not_cut_directly(wds_dataset, tmp_path):
    """A shard whose token members are big-endian `.npy` (np.load reads them; the direct cut
    would not): its first member's check against np.load sends its rows through np.load, with
    the same spans; the other shards are still cut directly."""
    import io
    import shutil

    from test_sft_ingest import read_masked_storage_rows

    root = tmp_path / "copy"
    shutil.copytree(wds_dataset, root)

    def big_endian(members: list) -> list:
        for m in members[:-1]:
            m[1] = _npy_bytes(np.load(io.BytesIO(m[1])).astype(">u2"))
        return members

    _rewrite_shard(root, 1, big_endian)
    ref = read_masked_storage_rows(str(root), read_index(str(root)).manifest)
    with FetchConfig().build(str(root)) as fetcher:
        reader = fetcher.reader
        rows = np.arange(int(reader.shard_starts[3]))  # shards 0, 1 and 2
        toks, counts, spans, span_counts = reader.read_rows_masked(rows)
        assert reader._npy_ok == {0: True, 1: False, 2: True}
    np.testing.assert_array_equal(toks, np.concatenate([ref[r][2] for r in rows]))
    assert counts.tolist() == [len(ref[r][2]) for r in rows]
    np.testing.assert_array_equal(spans, np.concatenate([ref[r][3] for r in rows]))
    assert span_counts.tolist() == [len(ref[r][3]) for r in rows]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 12), st.lists(st.integers(0, 16), max_size=6)), max_size=6)
)
def test_mark_trained_marks_each_rows_spans_within_that_row(rows):
    """pack_kernel.mark_trained against plain Python: row r's spans mark its own tokens only; a
    span reaching past its row (a corrupt shard) is cut at the row's end, so it cannot mark the
    next row's tokens (the label check then sees the shard disagree with the index)."""
    lens = [n for n, _ in rows]
    spans = [sorted(v)[: len(v) // 2 * 2] for _, v in rows]
    row_off = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]).astype(np.int64)
    span_off = np.concatenate([[0], np.cumsum([len(v) for v in spans], dtype=np.int64)])
    flat = np.array([x for v in spans for x in v], dtype=np.uint32)
    trained = np.zeros(int(row_off[-1]), np.uint8)
    mark_trained(row_off, span_off.astype(np.int64), flat, trained)
    want = [0] * int(row_off[-1])
    for r, v in enumerate(spans):
        for s, e in zip(v[0::2], v[1::2]):
            for t in range(s, min(e, lens[r])):
                want[int(row_off[r]) + t] = 1
    assert trained.tolist() == want


def test_whole_sample_pieces_map_to_their_source_at_every_boundary() -> None:
    """[P, 3] pieces in global ids (held-out sets) become [P, 7] unit pieces: global id g is
    sample g - offset of the source whose range holds it, the first and last of each included
    (a hand-written table)."""

    class Stub:
        def __init__(self, lengths: list[int]) -> None:
            self.lengths = np.array(lengths, np.int64)
            self.index = self.config = None

    mix = MixtureFetcher([Stub([3, 5]), Stub([7]), Stub([2, 4, 6])])  # type: ignore[list-item]
    pieces = np.array([[g, 0, 1] for g in range(6)], np.int64)
    got = mix.to_units(pieces)
    want = [  # (g, a, b, source, sample, start, length)
        [0, 0, 1, 0, 0, 0, 3],
        [1, 0, 1, 0, 1, 0, 5],
        [2, 0, 1, 1, 0, 0, 7],
        [3, 0, 1, 2, 0, 0, 2],
        [4, 0, 1, 2, 1, 0, 4],
        [5, 0, 1, 2, 2, 0, 6],
    ]
    assert got.tolist() == want
