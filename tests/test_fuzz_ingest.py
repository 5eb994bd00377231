"""Fuzz `mixlen preprocess` with hostile inputs: random bytes under every input suffix, JSON Lines
with deep nesting, huge lines, odd records and mixed encodings, gzip/zstd streams cut anywhere.
Every run must end with exit 0 (bad inputs skipped and counted) or exit 2 (a message), never a
traceback or a hang; a dataset it writes must pass `mixlen verify`, and every stored sample must
decode to a text the inputs really held (the reference: the texts the test generated)."""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datapipe.fetch import FetchConfig
from datapipe.verify import verify_dataset
from tools.cli import main as cli_main

ENCODINGS = ("utf-8", "utf-8-sig", "latin-1", "utf-16", "cp1252")

texts = st.text(min_size=0, max_size=40)
records = st.one_of(
    texts.map(lambda t: ("ok", t)),  # a good record
    st.integers(1, 3000).map(lambda d: ("raw", "[" * d + "]" * (d % 2))),  # deep nesting
    st.integers(1, 300_000).map(lambda n: ("ok", "z" * n)),  # a huge line
    st.sampled_from(
        ['{"text": 5}', '{"txt": "a"}', "[1, 2]", "null", '"s"', "{", '{"text": "\\ud800"}']
    ).map(lambda r: ("raw", r)),
    st.tuples(texts, st.sampled_from(ENCODINGS)).map(lambda te: ("enc", te)),
)


@st.composite
def input_file(draw) -> tuple[str, bytes, list[str]]:
    """(suffix, bytes, texts a correct reader may take from it)."""
    kind = draw(st.sampled_from(["random", "jsonl", "text"]))
    if kind == "random":
        suffix = draw(st.sampled_from([".jsonl", ".jsonl.gz", ".jsonl.zst", ".txt", ".parquet"]))
        data = draw(st.binary(max_size=3000))
        possible = []
        if suffix == ".txt":
            try:
                possible = [data.decode("utf-8")]
            except UnicodeDecodeError:
                pass
        return suffix, data, possible
    if kind == "text":
        text, enc = draw(st.tuples(texts, st.sampled_from(ENCODINGS)))
        try:
            data = text.encode(enc)
        except UnicodeEncodeError:
            data = text.encode("utf-8", "replace")
        try:
            possible = [data.decode("utf-8")]
        except UnicodeDecodeError:
            possible = []
        return ".txt", data, possible
    lines, possible = [], []
    for what, value in draw(st.lists(records, max_size=12)):
        if what == "ok":
            lines.append(json.dumps({"text": value}).encode())
            possible.append(value)
        elif what == "raw":
            lines.append(value.encode())
        else:  # a record whose bytes are in another encoding (ensure_ascii off)
            text, enc = value
            try:
                line = json.dumps({"text": text}, ensure_ascii=False).encode(enc)
            except UnicodeEncodeError:
                continue
            lines.append(line)
            possible.append(text)
            try:  # bytes of another encoding may also be valid UTF-8 (latin-1 "Â\x80" is U+0080)
                possible.append(json.loads(line.decode("utf-8"))["text"])
            except (UnicodeDecodeError, ValueError, KeyError, TypeError):
                pass
    data = b"\n".join(lines) + (b"\n" if lines else b"")
    wrap = draw(st.sampled_from(["", ".gz", ".zst"]))
    if wrap == ".gz":
        data = gzip.compress(data)
    elif wrap == ".zst":
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    if wrap and draw(st.booleans()):  # cut the stream anywhere
        data = data[: draw(st.integers(0, max(len(data) - 1, 0)))]
    return ".jsonl" + wrap, data, possible


def _stored_texts(root: str) -> list[str]:
    """Every sample's bytes tokens (BOS and EOS stripped) decoded back to text."""
    with FetchConfig().build(root) as fetcher:
        n = len(fetcher.lengths)
        pieces = np.stack([np.arange(n), np.zeros(n, np.int64), fetcher.lengths], axis=1)
        mb = fetcher.fetch(pieces)
    cuts = np.cumsum(fetcher.lengths)[:-1]
    out = []
    for toks in np.split(mb.input_ids, cuts):
        assert toks[0] == 256 and toks[-1] == 257
        out.append(bytes(toks[1:-1].astype(np.uint8).tolist()).decode("utf-8"))
    return out


@pytest.mark.timeout(300)
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    files=st.lists(input_file(), min_size=1, max_size=4), fmt=st.sampled_from(["mds", "parquet"])
)
def test_preprocess_survives_hostile_inputs(files, fmt) -> None:
    with tempfile.TemporaryDirectory() as d:
        paths, possible = [], set()
        for i, (suffix, data, texts_) in enumerate(files):
            p = Path(d) / f"in{i}{suffix}"
            p.write_bytes(data)
            paths.append(str(p))
            possible.update(t for t in texts_ if t)
        out = str(Path(d) / "out")
        import contextlib
        import io

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = cli_main(["preprocess", *paths, "--out", out, "--no-progress", "--format", fmt])
        assert rc in (0, 2), err.getvalue()
        assert "Traceback" not in err.getvalue()
        if rc == 2:
            assert not Path(out).exists()
            assert "error:" in err.getvalue()
            return
        rep = verify_dataset(out)
        assert rep.ok, rep.problems
        assert rep.samples >= 1
        stored = _stored_texts(out)
        assert set(stored) <= possible, set(stored) - possible
