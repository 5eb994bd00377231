"""Tokenizers that cannot represent some input (issue 23 case 3): a tokenizer.json whose BPE
vocabulary lacks characters of the text and has no unk token or byte fallback stored "zzzz" as
BOS+EOS, exit 0, "bad 0". Now the dropped characters are counted per run and per document
(`unknown_chars`, `unknown_docs`), the first documents are named, --strict stops at the first
one, and a warning comes before tokenizing. The count is checked against an independent
reference: the same tokenizer with an unk token, whose unk tokens' offsets mark every character
the model could not represent."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from conftest import ROOT
from hypothesis import example, given, settings
from hypothesis import strategies as st

from datapipe.errors import InputError
from datapipe.index import read_index
from datapipe.ingest.lossy import bytes_to_unicode
from datapipe.ingest.preprocess import PreprocessConfig, preprocess
from datapipe.ingest.tokenizer import HFTokenizer
from tools.cli import main as cli_main

SPECIAL = ["<s>", "</s>"]


def _spec(model: dict, pre: dict | None = None, normalizer: dict | None = None) -> dict:
    """A tokenizer.json: <s> and </s> as added tokens 0 and 1, then the model's vocabulary."""
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for t in model.pop("tokens"):
        vocab.setdefault(t, len(vocab))
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, t in enumerate(SPECIAL)
    ]  # fmt: skip
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre,
        "post_processor": None,
        "decoder": None,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": vocab,
            "merges": [],
            **model,
        },  # fmt: skip
    }


BYTE_SYMBOLS = bytes_to_unicode()
CASES = {  # name -> tokenizer.json; all lose the characters their vocabularies lack
    "whitespace": _spec(
        {"tokens": list("abc") + ["ab"], "merges": [["a", "b"]]}, {"type": "Whitespace"}
    ),  # fmt: skip
    "byte-level": _spec(
        {"tokens": [BYTE_SYMBOLS[b] for b in b"abc \n"] + [BYTE_SYMBOLS[0xC3]]},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ),
    "metaspace-lowercase": _spec(
        {"tokens": ["a", "b", "c", "\u2581"]},
        {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
        {"type": "Lowercase"},
    ),
    "prefix": _spec(
        {"tokens": ["a", "b", "##a", "##c", "c"], "continuing_subword_prefix": "##"},
        {"type": "WhitespaceSplit"},
    ),
    "byte-level-prefix-space": _spec(  # the space it prepends is not in the vocabulary
        {"tokens": [BYTE_SYMBOLS[b] for b in b"abc\n"] + [BYTE_SYMBOLS[0xC3]]},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    ),
}


def _write(tmp: Path, spec: dict, name: str = "tok.json") -> str:
    path = tmp / name
    path.write_text(json.dumps(spec))
    return str(path)


def _reference_lost(spec: dict, text: str) -> int:
    """Characters the model cannot represent, by the library itself: the same tokenizer with an
    unk token (not fused); each unk token's offsets cover one character it stands for."""
    from tokenizers import Tokenizer

    ref = json.loads(json.dumps(spec))
    ref["model"]["unk_token"] = "<unk>"
    ref["model"]["vocab"]["<unk>"] = len(ref["model"]["vocab"])
    tok = Tokenizer.from_str(json.dumps(ref))
    unk = ref["model"]["vocab"]["<unk>"]
    if (ref["pre_tokenizer"] or {}).get("add_prefix_space"):
        # the space prepended to each stretch between added tokens shares its first character's
        # offsets: written out instead, with the prefix off (the same ids, checked)
        ref["pre_tokenizer"]["add_prefix_space"] = False
        parts = re.split("(<s>|</s>)", text)
        spaced = "".join(p if p in SPECIAL or p[:1] in ("", " ") else " " + p for p in parts)
        written = Tokenizer.from_str(json.dumps(ref))
        assert written.encode(spaced).ids == tok.encode(text).ids, text
        tok, text = written, spaced
    enc = tok.encode(text)
    return len({off for i, off in zip(enc.ids, enc.offsets) if i == unk})


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=40, deadline=None)
@given(text=st.text(st.sampled_from(list("abcABz \n\té✓日\x1c\x1f\x85\u2028")), max_size=40))
@example(text="zA é✓日\tabc ab\n<s>z")
@example(text="ab\x1c\x1d c\x1e\x1f\x85\u2028")  # isspace() in Python, not to the library
@example(text="abc")  # only a prepended space is lost
def test_lost_characters_match_the_unk_reference(tmp_path_factory, case: str, text: str) -> None:
    tmp = tmp_path_factory.mktemp(case)
    tok = HFTokenizer(_write(tmp, CASES[case]))
    assert tok.lossy
    lost = tok.lost_chars(text)
    want = _reference_lost(CASES[case], text)
    assert (lost.count if lost else 0) == want, (text, lost)
    if text == "zA é✓日\tabc ab\n<s>z":  # the example: every case loses some of it
        assert want >= 3


def test_unknown_chars_counted_named_and_strict(tmp_path: Path, capsys) -> None:
    """The issue's reproduction ("zzzz" became BOS+EOS with exit 0): counted, the document
    named, a warning before tokenizing; --strict stops at it (exit 2, nothing left behind)."""
    tok = _write(tmp_path, CASES["whitespace"])
    data = tmp_path / "d.jsonl"
    texts = ["ab c", "zzzz", "a z b zz", "abc"]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    warnings: list[str] = []
    res = preprocess(
        PreprocessConfig([str(data)], str(tmp_path / "o"), tokenizer=tok, progress=False),
        warn=warnings.append,
    )
    c = res.manifest["counts"]
    assert c["unknown_chars"] == 4 + 3 and c["unknown_docs"] == 2 and c["bad"] == 0
    assert warnings[0].startswith(f"warning: {tok}: the tokenizer has no unk token and no byte")
    assert warnings[1:] == [
        f"{data}:2: 4 characters outside the tokenizer's vocabulary dropped (first 'z'; it has "
        "no unk token or byte fallback)",
        f"{data}:3: 3 characters outside the tokenizer's vocabulary dropped (first 'z'; it has "
        "no unk token or byte fallback)",
    ]
    assert [w for w, _ in res.manifest["reported"]["unknown"]] == [f"{data}:2", f"{data}:3"]
    # <s> ab c </s>, <s> </s>, <s> a b </s>, <s> ab c </s>
    assert read_index(str(tmp_path / "o")).num_tokens.tolist() == [4, 2, 4, 4]
    out = tmp_path / "strict"
    argv = ["preprocess", str(data), "--tokenizer", tok, "--out", str(out), "--quiet"]
    assert cli_main([*argv, "--strict"]) == 2
    err = capsys.readouterr().err
    assert f"error: {data}:2: 4 characters outside the tokenizer's vocabulary" in err
    assert "Traceback" not in err and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".strict")]
    assert cli_main(argv[:-3] + ["--out", str(tmp_path / "o2"), "--quiet"]) == 0
    assert "unknown_chars 7 in 2 documents" in capsys.readouterr().out


def test_instruction_rows_count_what_they_lose(tmp_path: Path) -> None:
    """A conversation's and a string prompt-completion's dropped characters are counted and the
    row named as a document's are (the answer was trained with them missing, uncounted, and
    --strict let it through); the count is the unk-token reference's over the rendered text."""
    spec = CASES["whitespace"]
    tok = _write(tmp_path, json.loads(json.dumps(spec)))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    conv = [{"role": "user", "content": "ab z"}, {"role": "assistant", "content": "c zz b"}]
    rows = {
        "messages": {"messages": conv},
        "prompt_completion": {"prompt": "zab z", "completion": " cz"},  # both lose some
    }
    want = {"messages": _reference_lost(spec, "<s>ab z</s><s>c zz b</s>"),
            "prompt_completion": _reference_lost(spec, "zab z cz")}  # fmt: skip
    assert want == {"messages": 3, "prompt_completion": 3}
    for kind, row in rows.items():
        data = tmp_path / f"{kind}.jsonl"
        data.write_text(json.dumps(row) + "\n")
        cfg = PreprocessConfig([str(data)], str(tmp_path / kind), tokenizer=tok, progress=False,
                               chat_template=str(template))  # fmt: skip
        res = preprocess(cfg, warn=lambda msg: None)
        c = res.manifest["counts"]
        assert (c["unknown_chars"], c["unknown_docs"]) == (want[kind], 1), (kind, c)
        assert [w for w, _ in res.manifest["reported"]["unknown"]] == [f"{data}:1"]
        strict = dataclasses.replace(cfg, out=str(tmp_path / f"strict-{kind}"), strict=True)
        with pytest.raises(InputError, match=f"{data}:1: {want[kind]} characters? outside"):
            preprocess(strict, warn=lambda msg: None)


def test_tokenizers_that_lose_nothing_are_not_checked(tmp_path: Path) -> None:
    """No check and no warning where nothing can be lost: a byte-level BPE with all 256 byte
    symbols (the demo's), a BPE with an unk token or byte fallback, a WordPiece model."""
    asset = HFTokenizer(str(ROOT / "tests" / "assets" / "bpe-stdlib.json"))
    assert not asset.lossy and asset.lost_chars("zzzz ✓ 日本") is None
    for key, value in (("unk_token", "c"), ("byte_fallback", True)):
        spec = json.loads(json.dumps(CASES["whitespace"]))
        spec["model"][key] = value
        assert not HFTokenizer(_write(tmp_path, spec)).lossy, key
    wp = json.loads(json.dumps(CASES["whitespace"]))
    wp["model"] = {"type": "WordPiece", "unk_token": "a", "continuing_subword_prefix": "##",
                   "max_input_chars_per_word": 100, "vocab": wp["model"]["vocab"]}  # fmt: skip
    assert not HFTokenizer(_write(tmp_path, wp)).lossy
    src = tmp_path / "t.txt"
    src.write_text("zzzz")
    warnings: list[str] = []
    preprocess(
        PreprocessConfig(
            [str(src)],
            str(tmp_path / "o"),
            tokenizer=str(ROOT / "tests" / "assets" / "bpe-stdlib.json"),
            progress=False,
        ),  # fmt: skip
        warn=warnings.append,
    )
    assert warnings == []


def test_a_tokenizer_error_is_a_bad_document(tmp_path: Path) -> None:
    """A BPE whose unk token is missing from its vocabulary raises on unknown text: that
    document is bad, named, and the run goes on (no traceback)."""
    spec = json.loads(json.dumps(CASES["whitespace"]))
    spec["model"]["unk_token"] = "<unk>"  # not in the vocabulary
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"text": "zz"}) + "\n" + json.dumps({"text": "ab"}) + "\n")
    warnings: list[str] = []
    res = preprocess(
        PreprocessConfig(
            [str(src)], str(tmp_path / "o"), tokenizer=_write(tmp_path, spec), progress=False
        ),  # fmt: skip
        warn=warnings.append,
    )
    assert res.manifest["counts"]["bad"] == 1 and res.manifest["num_samples"] == 1
    assert warnings[0].startswith(f"skipped {src}:1: the tokenizer failed: ")
    # the same in a conversation row: that row is bad, named with the tokenizer's refusal
    chats = tmp_path / "c.jsonl"
    turns = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "zz"}]
    ok = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]
    chats.write_text(json.dumps({"messages": turns}) + "\n" + json.dumps({"messages": ok}) + "\n")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    warnings.clear()
    res = preprocess(
        PreprocessConfig(
            [str(chats)],
            str(tmp_path / "o2"),
            tokenizer=_write(tmp_path, spec),
            chat_template=str(template),
            progress=False,
        ),  # fmt: skip
        warn=warnings.append,
    )
    assert res.manifest["counts"]["bad"] == 1 and res.manifest["num_samples"] == 1
    assert warnings[0].startswith(f"skipped {chats}:1: the tokenizer failed: ")


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=40, deadline=None)
@given(text=st.lists(st.sampled_from([*"abcAz \n\t é", "<s>", "</s>"]), max_size=60).map("".join))
@example(text="ab ab  c\n a z</s> b")
def test_long_texts_encode_in_pieces_to_the_same_ids(tmp_path_factory, case, text) -> None:
    """`tokenizers` holds 160-175 bytes per character while it encodes: a long text is encoded in
    pieces (cut before a space between two non-spaces) where that gives the library's own ids
    for the whole text (the reference), never otherwise (Metaspace prepends at each piece)."""
    tok = HFTokenizer(_write(tmp_path_factory.mktemp("t"), CASES[case]))
    whole = tok.encode(text)  # shorter than PIECE_CHARS: one call of the library
    assert tok.piecewise == (case != "metaspace-lowercase")
    tok.piece_chars = 2
    assert tok.encode(text).tolist() == whole.tolist()


def test_pieces_only_where_they_keep_the_whole_text(tmp_path: Path) -> None:
    """An rstrip added token ("</s> a" would lose its space to </s>) keeps a text whole. A
    tokenizer.json's truncation and padding would have cut or padded each piece (pad ids inside
    a document), and cut the whole text at max_length: both are off, whole and in pieces the
    ids are the library's without them (the reference), and `pieces_safe` refuses them."""
    from tokenizers import Tokenizer

    from datapipe.ingest.tokenizer import pieces_safe

    rstrip = json.loads(json.dumps(CASES["byte-level"]))
    rstrip["added_tokens"][1]["rstrip"] = True
    assert not HFTokenizer(_write(tmp_path, rstrip, "rstrip.json")).piecewise
    spec = json.loads(json.dumps(CASES["byte-level"]))
    text = "ab ab  c\n a é</s> b " * 5
    want = Tokenizer.from_str(json.dumps(spec)).encode(text).ids  # neither set
    cut = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    pad = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
           "pad_id": 0, "pad_type_id": 0, "pad_token": "<s>"}  # fmt: skip
    for key, value in (("truncation", cut), ("padding", pad)):
        assert pieces_safe(spec) and not pieces_safe({**spec, key: value})
        tok = HFTokenizer(_write(tmp_path, {**spec, key: value}, f"{key}.json"))
        assert tok.encode(text).tolist()[1:-1] == want and len(want) > 64
        tok.piece_chars = 3
        assert tok.piecewise and tok.encode(text).tolist()[1:-1] == want


def test_a_long_document_is_encoded_in_bounded_memory(tmp_path: Path) -> None:
    """The stdlib BPE (ByteLevel): 100 K characters in pieces of 1,000 give the library's ids
    for the whole text (the reference, ~19 MB to encode), and encoding 1 MiB of text grows the peak memory by a
    few MiB, where the whole text at once took ~190 MiB (measured: 756 MiB for 4 MiB)."""
    import subprocess
    import sys

    from datapipe.ingest.tokenizer import text_pieces

    asset = str(ROOT / "tests" / "assets" / "bpe-stdlib.json")
    tok = HFTokenizer(asset)
    assert tok.piecewise
    words = (ROOT / "docs" / "training.md").read_text()  # prose, tables and code
    text = (words * (100_000 // len(words) + 1))[:100_000]
    want = tok._tok.encode(text).ids
    assert len(list(text_pieces(text, 1000))) > 90
    tok.piece_chars = 1000
    assert tok.encode(text).tolist() == [tok.bos_id, *want, tok.eos_id]
    # the process's own peak (VmHWM, in KiB; ru_maxrss would keep the forking test process's
    # peak, and a test process larger than this one would hide any growth)
    code = (
        "import sys\n"
        "from datapipe.ingest.tokenizer import HFTokenizer\n"
        "def peak():\n"
        "    status = open('/proc/self/status').read()\n"
        "    return int(status.split('VmHWM:')[1].split()[0])\n"
        "tok = HFTokenizer(sys.argv[1])\n"
        "words = open(sys.argv[2]).read()\n"
        "text = (words * ((1 << 20) // len(words) + 1))[: 1 << 20]\n"
        "before = peak()\n"
        "ids = tok.encode(text)\n"
        "print(peak() - before, len(ids))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, asset, str(ROOT / "docs" / "training.md")],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    grew_kib, n = int(out[0]), int(out[1])
    assert n > 250_000 and grew_kib < 32 << 10, out  # ids: under 1 MiB as uint16


@pytest.mark.parametrize("text", ["a<zz>b", "<zz><z", "<zzz> <z>", "ab <zz> z"])
def test_added_tokens_match_longest_first(tmp_path: Path, text: str) -> None:
    """Added tokens where one is a prefix of another (`<z`, `<zz>`): the library takes the
    longest, so "<zz>" loses nothing; the count is the unk reference's."""
    spec = json.loads(json.dumps(CASES["whitespace"]))
    for content in ("<z", "<zz>"):
        spec["model"]["vocab"][content] = i = len(spec["model"]["vocab"])
        spec["added_tokens"].append({**spec["added_tokens"][0], "id": i, "content": content})
    lost = HFTokenizer(_write(tmp_path, spec)).lost_chars(text)
    assert (lost.count if lost else 0) == _reference_lost(spec, text), (text, lost)


def test_a_post_processors_bos_and_eos_are_not_added_twice(tmp_path: Path) -> None:
    """A tokenizer.json whose post-processor frames each text ("<s> $A </s>", built with the
    library): mixlen's ids are the library's own, no second BOS or EOS."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    lib = Tokenizer.from_file(str(ROOT / "tests" / "assets" / "bpe-stdlib.json"))
    lib.post_processor = TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)]
    )
    path = str(tmp_path / "framed.json")
    lib.save(path)
    tok, ref = HFTokenizer(path), Tokenizer.from_file(path)
    for text in ["def f(x):\n    return x", "", " ", "é ✓ 日本" * 50]:
        want = ref.encode(text).ids
        assert want[0] == tok.bos_id and want[-1] == tok.eos_id
        assert tok.encode(text).tolist() == want, text
