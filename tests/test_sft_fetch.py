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


def sft_dataset(root, fmt: str, n: int = 24, chunk: int = 37) -> str:
    """A small masked dataset (bytes tokenizer, the demo's template) in `fmt`."""
    src = root / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in conversations(n)))
    cfg = PreprocessConfig(
        inputs=[str(src)], out=str(root / fmt), format=fmt, chunk_tokens=chunk,
        chat_template=TEMPLATE,
    )  # fmt: skip
    return preprocess(cfg, warn=lambda m: None).out


def reference_labels(tokens: np.ndarray, mask: np.ndarray, a: int, b: int, n: int) -> list:
    """Positions a..b-1 of a sample (or unit) of n tokens: the next token if it is trained and
    inside the sample, else IGNORE_INDEX."""
    return [int(tokens[i + 1]) if i + 1 < n and mask[i + 1] else IGNORE_INDEX for i in range(a, b)]


@pytest.fixture(scope="module", params=["mds", "wds", "parquet"])
def dataset(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    path = sft_dataset(root, request.param)
    return path, read_masked_rows(path, read_index(path).manifest)


def test_labels_of_ring_chunks_and_pieces(dataset):
    """Each sample split zigzag over k = 1..4 ranks (and arbitrary pieces): every member's
    labels are its positions' reference labels; together they hold each trained target once."""
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
    path, rows = dataset
    with FetchConfig().build(path) as fetcher:
        sid = next(s for s, (_, m) in rows.items() if not m.all())
        loss = fetcher.index.loss
        values = loss.values.copy()
        first = loss.offsets[sid]
        values[first + 1] -= 1  # the index's first span of `sid` one token shorter
        bad = LossColumns(loss.loss_tokens, loss.offsets, values)
        fetcher.index = dataclasses.replace(fetcher.index, loss=bad)
        n = len(rows[sid][0])
        with pytest.raises(
            InputError, match=rf"sample {sid}, tokens 1\.\.{n}: the shards' trained"
        ):
            fetcher.fetch(np.array([(sid, 0, n)]))


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
