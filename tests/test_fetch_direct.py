"""The MDS reader's direct token decode (datapipe.formats.mds_direct): the same tokens as the
library's `decode_sample` on every row, chosen only for the layout it knows and only after a row
of the shard agreed; micro-batches keep the dataset's token dtype and train the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from streaming.base.format.mds.encodings import mds_encode
from test_fetch import make_dataset, reference_microbatch, reference_tokens

from datapipe.fetch import FetchConfig
from datapipe.formats.mds_direct import token_decoder, verified


def mds_row(columns: dict[str, tuple[str, object]]) -> bytes:
    """An MDS row built the way the format describes it: a u32 size per variable-size column,
    then each column's encoded bytes (column order as given)."""
    sizes, body = b"", b""
    for enc, value in columns.values():
        data = mds_encode(enc, value)
        if enc.startswith("ndarray") or enc == "str":
            sizes += len(data).to_bytes(4, "little")
        body += data
    return sizes + body


LAYOUT = (["chunk", "sample_id", "tokens"], ["int32", "int64", "ndarray:uint16"], [4, 8, None])


def library(row: bytes) -> np.ndarray:
    """Reference decode: walk the row by the format's rules, decode with the library's encoding."""
    from streaming.base.format.mds.encodings import mds_decode

    return mds_decode("ndarray:uint16", row[16:])


@pytest.mark.parametrize("n", [1, 255, 256, 70000])
def test_direct_decode_matches_library(n: int) -> None:
    toks = np.random.default_rng(n).integers(0, 65536, n).astype(np.uint16)
    row = mds_row(
        {"chunk": ("int32", 3), "sample_id": ("int64", 9), "tokens": ("ndarray:uint16", toks)}
    )
    dec = token_decoder(*LAYOUT, np.dtype(np.uint16), library)
    assert dec is not None
    got = dec(memoryview(row))
    assert got.dtype == np.uint16 and np.array_equal(got, toks)
    assert verified(dec, library, row) is dec


def test_layout_check_and_fallbacks() -> None:
    names, encs, sizes = LAYOUT
    u16 = np.dtype(np.uint16)
    assert token_decoder(names, encs, sizes, np.dtype(np.uint32), library) is None  # dtype
    assert token_decoder(names, ["int32", "int64", "ndarray"], sizes, u16, library) is None
    assert (
        token_decoder(names, ["int32", "str", "ndarray:uint16"], [4, None, None], u16, library)
        is None
    )
    assert token_decoder(["a", "b", "c"], encs, sizes, u16, library) is None  # no token column
    assert verified(None, library, b"") is library

    # a decoder that disagrees with the library on the shard's first row is not used
    def wrong(row):
        return library(row)[1:]

    toks = np.arange(10, dtype=np.uint16)
    row = mds_row(
        {"chunk": ("int32", 0), "sample_id": ("int64", 0), "tokens": ("ndarray:uint16", toks)}
    )
    assert verified(wrong, library, row) is library
    # a 2-D row goes to the library decoder
    calls = []

    def spy(row):
        calls.append(1)
        return library(row)

    dec = token_decoder(*LAYOUT, u16, spy)
    grid = np.arange(6, dtype=np.uint16).reshape(2, 3)
    row2 = mds_row(
        {"chunk": ("int32", 0), "sample_id": ("int64", 0), "tokens": ("ndarray:uint16", grid)}
    )
    assert dec(row2).shape == (2, 3) and calls == [1]


def test_fetch_direct_equals_library_and_reference(tmp_path) -> None:
    root, lengths = make_dataset(tmp_path / "mds", "mds", n=120, seed=4)
    ref = reference_tokens(120, 4)
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(6):
        ids = rng.choice(120, 20, replace=False)
        a = rng.integers(0, lengths[ids])
        b = a + 1 + rng.integers(0, lengths[ids] - a)
        steps.append([np.stack([ids[i::4], a[i::4], b[i::4]], axis=1) for i in range(4)])
    out = {}
    for direct in (True, False):
        f = FetchConfig().build(str(root))
        f.reader.direct = direct
        out[direct] = [f.fetch_step(s) for s in steps]
        modes = {f.reader._decoders[s].__name__ for s in f.reader._decoders}
        assert modes == ({"decode"} if direct else {"library"})
        assert len(f.reader._decoders) > 1  # several shards, each checked
        f.close()
    for s, got, lib in zip(steps, out[True], out[False]):
        for pieces, m, w in zip(s, got, lib):
            want = reference_microbatch(pieces, ref)
            assert m.input_ids.dtype == np.uint16 and m.labels.dtype == np.int32
            assert m.input_ids.tolist() == want["input_ids"] == w.input_ids.tolist()
            assert m.labels.tolist() == want["labels"] == w.labels.tolist()
            assert m.position_ids.tolist() == want["position_ids"]


def test_model_takes_narrow_ids() -> None:
    """uint16 ids and int32 labels/positions give the loss and gradients of int64 ones."""
    from trainer.model.transformer import build_model, get_config

    model, _ = build_model(get_config("debug"), torch.float64, seed=0)
    ids = np.random.default_rng(0).integers(0, 258, 50)
    pos = np.arange(50)
    out = []
    for it, pt in ((np.uint16, np.int32), (np.int64, np.int64)):
        loss, n = model(
            torch.from_numpy(ids.astype(it)),
            torch.from_numpy(pos.astype(pt)),
            labels=torch.from_numpy(ids.astype(np.int32 if it == np.uint16 else np.int64)),
        )
        loss.backward()
        out.append((float(loss.detach()), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    assert out[0][0] == out[1][0]
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))


def test_token_column_before_a_fixed_column() -> None:
    """The values end where the column's size says when another column follows them."""
    toks = np.arange(300, dtype=np.uint16)
    row = mds_row(
        {"chunk": ("int32", 1), "tokens": ("ndarray:uint16", toks), "z": ("int64", 2**40)}
    )
    size = int.from_bytes(row[:4], "little")
    layout = (["chunk", "tokens", "z"], ["int32", "ndarray:uint16", "int64"], [4, None, 8])

    def lib(r: bytes) -> np.ndarray:
        from streaming.base.format.mds.encodings import mds_decode

        return mds_decode("ndarray:uint16", r[8 : 8 + size])  # u32 size, chunk, then tokens

    dec = token_decoder(*layout, np.dtype(np.uint16), lib)
    assert np.array_equal(dec(row), toks) and verified(dec, lib, row) is dec


def test_decode_rows_in_bulk() -> None:
    """Rows back to back in one buffer: the token columns cut out by array operations equal each
    row's own decode, for the last-column and the sized-column layouts; a 2-D row -> None."""
    from datapipe.formats.mds_direct import decode_rows, token_layout

    rng = np.random.default_rng(3)
    toks = [rng.integers(0, 65536, int(n)).astype(np.uint16) for n in (1, 300, 255, 70000, 9)]
    for last in (True, False):
        cols = {"chunk": ("int32", 0)}
        if last:
            names, encs, sizes = LAYOUT
        else:
            names, encs, sizes = (
                ["chunk", "tokens", "z"],
                ["int32", "ndarray:uint16", "int64"],
                [4, None, 8],
            )
        rows = []
        for t in toks:
            c = (
                {**cols, "sample_id": ("int64", 1), "tokens": ("ndarray:uint16", t)}
                if last
                else {**cols, "tokens": ("ndarray:uint16", t), "z": ("int64", 7)}
            )
            rows.append(mds_row(c))
        buf = np.frombuffer(b"".join(rows), np.uint8)
        starts = np.cumsum([0] + [len(r) for r in rows[:-1]])
        ends = starts + np.array([len(r) for r in rows])
        layout = token_layout(names, encs, sizes, np.dtype(np.uint16))
        flat, counts = decode_rows(layout, buf, starts, ends)
        assert counts.tolist() == [len(t) for t in toks]
        assert np.array_equal(flat, np.concatenate(toks)) and flat.dtype == np.uint16
    grid = mds_row(
        {
            "chunk": ("int32", 0),
            "sample_id": ("int64", 0),
            "tokens": ("ndarray:uint16", np.zeros((2, 3), np.uint16)),
        }
    )
    b2 = np.frombuffer(grid, np.uint8)
    assert decode_rows(token_layout(*LAYOUT, np.dtype(np.uint16)), b2, [0], [len(grid)]) is None


def test_decode_rows_masked_reads_each_columns_own_shape_header() -> None:
    """Rows of mixlen's masked layout (chunk, sample_id, tokens, trained_spans), back to back:
    the direct decode gives each row's tokens and spans as encoded, also where the token and
    span columns' shape headers differ in width (300 tokens: a 2-byte shape; 4 span values: a
    1-byte one; and the other way round), and for 1-byte headers in both."""
    from datapipe.formats.mds_direct import decode_rows_masked, token_layout

    rng = np.random.default_rng(7)
    cases = [(300, 4), (5, 2), (3, 300), (1, 2)]  # (tokens, span values) per row
    toks = [rng.integers(0, 65536, n).astype(np.uint16) for n, _ in cases]
    spans = [np.sort(rng.integers(0, 1000, m)).astype(np.uint32) for _, m in cases]
    rows = [
        mds_row(
            {
                "chunk": ("int32", 0),
                "sample_id": ("int64", i),
                "tokens": ("ndarray:uint16", t),
                "trained_spans": ("ndarray:uint32", s),
            }
        )
        for i, (t, s) in enumerate(zip(toks, spans))
    ]
    buf = np.frombuffer(bytearray(b"".join(rows)), np.uint8)  # writable, as the reader reads
    starts = np.cumsum([0] + [len(r) for r in rows[:-1]])
    ends = starts + np.array([len(r) for r in rows])
    layout = token_layout(
        ["chunk", "sample_id", "tokens", "trained_spans"],
        ["int32", "int64", "ndarray:uint16", "ndarray:uint32"],
        [4, 8, None, None],
        np.dtype(np.uint16),
    )
    assert layout is not None and layout.spans
    flat, counts, flat_spans, span_counts = decode_rows_masked(layout, buf, starts, ends)
    assert counts.tolist() == [n for n, _ in cases]
    assert span_counts.tolist() == [m for _, m in cases]
    assert flat.dtype == np.uint16 and flat.tolist() == np.concatenate(toks).tolist()
    assert flat_spans.tolist() == np.concatenate(spans).tolist()
