"""Preprocessing at its boundaries, against by-hand references of the bytes tokenizer (UTF-8
bytes between BOS 256 and EOS 257): a document of exactly --max-len tokens, a document of
exactly --max-doc-bytes bytes, one byte over, an input named twice, and a tokenizer's own EOS
at the end of a document."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from datapipe.index import read_index
from datapipe.ingest.inputs import scan_inputs
from datapipe.ingest.preprocess import PreprocessConfig, preprocess
from datapipe.ingest.tokenizer import TokenizerSpec


def _run(tmp_path: Path, inputs: list[Path], name: str, **kw):
    cfg = PreprocessConfig([str(p) for p in inputs], str(tmp_path / name), format="parquet",
                           progress=False, **kw)  # fmt: skip
    res = preprocess(cfg)
    return res.manifest, read_index(str(tmp_path / name), with_source=True)


@pytest.mark.parametrize("policy", ["split", "truncate", "drop"])
def test_a_document_of_exactly_max_len_tokens_is_kept_whole(tmp_path: Path, policy) -> None:
    """ "abcdef" is 8 tokens with BOS and EOS: at --max-len 8 it fits, whatever the policy."""
    (tmp_path / "a.txt").write_text("abcdef")
    manifest, idx = _run(tmp_path, [tmp_path / "a.txt"], "o", max_len=8, long_docs=policy)
    assert idx.num_tokens.tolist() == [8] and list(idx.source) == [str(tmp_path / "a.txt")]
    assert not {"split", "truncated", "dropped"} & {k for k, v in manifest["counts"].items() if v}


def test_documents_of_exactly_max_doc_bytes(tmp_path: Path) -> None:
    """A text file and a JSONL line (its newline not counted) of exactly --max-doc-bytes bytes
    are one document each, neither split nor refused; a text file of one byte more under
    `truncate` is cut and counted."""
    limit = 1000
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "exact.txt").write_text("a" * limit)
    text = "b" * (limit - len(json.dumps({"text": ""})))
    line = json.dumps({"text": text})
    assert len(line.encode()) == limit
    (tmp_path / "in" / "rows.jsonl").write_text(line + "\n")
    manifest, idx = _run(tmp_path, [tmp_path / "in"], "o", max_doc_bytes=limit)
    assert sorted(idx.num_tokens.tolist()) == sorted([limit + 2, len(text) + 2])
    assert not any("@" in s for s in idx.source) and not manifest["counts"].get("split")
    (tmp_path / "over").mkdir()
    (tmp_path / "over" / "over.txt").write_text("line\n" * 200 + "c")  # 1,001 bytes
    manifest, idx = _run(tmp_path, [tmp_path / "over"], "t", max_doc_bytes=limit,
                         long_docs="truncate")  # fmt: skip
    assert manifest["counts"].get("truncated") == 1 and idx.num_tokens.tolist() == [limit + 2]


def test_an_input_named_twice_is_read_once(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("alpha")
    got = scan_inputs([str(tmp_path / "d"), str(tmp_path / "d" / "a.txt")], ["**/*"]).files
    assert got == [tmp_path / "d" / "a.txt"]


def test_a_document_ending_in_the_eos_gets_no_second_one() -> None:
    """The tokenizer's EOS written at a document's end is its end (not EOS twice); `frame`
    adds BOS and EOS only where they are not there already."""
    tok = TokenizerSpec("hf", "tests/assets/bpe-stdlib.json").build()
    eos, bos = tok.eos_id, tok.bos_id
    plain = tok.encode("hello world")
    ended = tok.encode("hello world" + tok.special_names()["eos_token"])
    assert ended.tolist() == plain.tolist() and ended[-1] == eos and ended[-2] != eos
    framed, front, back = tok.frame(np.array([eos, 5, 6]))
    assert framed.tolist() == [bos, eos, 5, 6, eos] and (front, back) == (1, 1)
    framed, front, back = tok.frame(np.array([bos, 5, eos]))
    assert framed.tolist() == [bos, 5, eos] and (front, back) == (0, 0)


def test_token_ids_are_stored_in_the_narrowest_dtype_that_holds_them() -> None:
    """uint16 holds ids up to 65,535: a vocabulary of 65,536 fits, one of 65,537 needs uint32
    (its top id 65,536 would wrap to 0 in uint16)."""
    from datapipe.ingest.tokenizer import Tokenizer

    for vocab, dtype in ((65536, np.uint16), (65537, np.uint32)):
        tok = Tokenizer()
        tok.vocab_size = vocab
        assert tok.dtype == np.dtype(dtype)
        assert int(np.array([vocab - 1], tok.dtype)[0]) == vocab - 1
