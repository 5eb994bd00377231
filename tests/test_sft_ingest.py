"""`mixlen preprocess` on instruction data: conversations and prompt-completion rows (JSON Lines
and parquet) stored with their loss mask in all three formats, read back with each storage
library's own reader and checked against transformers' rendering and an independent per-turn
mask; the index's loss_tokens, the manifest's totals, `--max-len` pieces, no_target samples, text
rows before conversations, and bad rows named and counted (--strict stops at the first)."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
from test_sft_chat import CONVERSATIONS, FORMATS, make_folder, reference_tokenizer

from datapipe.errors import InputError
from datapipe.index import (
    INDEX_FILE,
    LossColumns,
    read_index,
    read_loss_columns,
    read_loss_tokens,
    write_index,
)
from datapipe.ingest.preprocess import PreprocessConfig, preprocess

FORMAT_NAMES = ("mds", "wds", "parquet")


def read_masked_rows(root: str, manifest: dict) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Each sample's (tokens, trained bool mask), from every row's `tokens` and `trained_spans`
    read with the storage library's own reader (independent of mixlen's readers)."""
    return samples_of_rows(read_masked_storage_rows(root, manifest))


def read_masked_storage_rows(root: str, manifest: dict) -> list[tuple]:
    """Every storage row's (sample_id, chunk, tokens, trained_spans), in storage order, read
    with the storage library's own reader."""
    fmt = manifest["format"]
    rows = []
    if fmt == "mds":
        from conftest import open_streaming_dataset

        with open_streaming_dataset(root) as ds:
            for i in range(len(ds)):
                r = ds[i]
                rows.append((int(r["sample_id"]), int(r["chunk"]), r["tokens"], r["trained_spans"]))
    elif fmt == "wds":
        import webdataset as wds

        # docs/FORMAT.md: a shard's rows, then its own `__mixlen_trained__` sample (uint32: the
        # shard's R rows' R + 1 offsets, then their spans back to back)
        urls = [os.path.join(root, s["name"]) for s in manifest["shards"]]
        load = lambda b: np.load(io.BytesIO(b), allow_pickle=False)  # noqa: E731
        shard: list[tuple] = []
        for r in wds.WebDataset(urls, shardshuffle=False):
            if r["__key__"] == "__mixlen_trained__":
                arr = load(r["trained_spans.npy"])
                assert arr.dtype == np.uint32 and {u for *_, u in shard} == {r["__url__"]}
                off, values = arr[: len(shard) + 1], arr[len(shard) + 1 :]
                assert off[0] == 0 and off[-1] == len(values)
                rows += [(*x[:3], values[off[k] : off[k + 1]]) for k, x in enumerate(shard)]
                shard = []
                continue
            assert [k for k in r if not k.startswith("__")] == ["tokens.npy"]  # a member a row
            sid, chunk = r["__key__"][1:].split("_c")
            shard.append((int(sid), int(chunk), load(r["tokens.npy"]), r["__url__"]))
        assert not shard  # every shard closes with its spans
    else:
        import pyarrow.parquet as pq

        for s in manifest["shards"]:
            t = pq.read_table(os.path.join(root, s["name"])).to_pylist()
            for r in t:  # trained_spans: binary, little-endian uint32 pairs (docs/FORMAT.md)
                spans = np.frombuffer(r["trained_spans"], "<u4")
                rows.append((r["sample_id"], r["chunk"], r["tokens"], spans))
    return rows


def samples_of_rows(rows: list[tuple]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Storage rows (sample_id, chunk, tokens, trained_spans) joined into each sample's
    (tokens, trained bool mask)."""
    out: dict[int, tuple[list, list]] = {}
    for sid, chunk, toks, spans in rows:
        toks = np.asarray(toks, np.int64)
        mask = np.zeros(len(toks), bool)
        for s, e in np.asarray(spans, np.int64).reshape(-1, 2):
            mask[s:e] = True
        t, m = out.setdefault(sid, ([], []))
        assert chunk == len(t)
        t.append(toks)
        m.append(mask)
    return {sid: (np.concatenate(t), np.concatenate(m)) for sid, (t, m) in out.items()}


def write_jsonl(path, rows) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def run(tmp_path, inputs, name="out", **kw):
    cfg = PreprocessConfig(inputs=[str(p) for p in inputs], out=str(tmp_path / name), **kw)
    return preprocess(cfg, warn=lambda m: None)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return make_folder(str(tmp_path_factory.mktemp("qwen2")), "qwen2")


def turn_runs(tok, conv) -> list[list[int]]:
    """The independent reference mask: each assistant turn's content and <|im_end|>, tokenized
    alone (the ChatML format)."""
    turn = FORMATS["qwen2"]["turn"]
    return [
        tok(turn(m["content"]), add_special_tokens=False)["input_ids"]
        for m in conv
        if m["role"] == "assistant"
    ]


def runs_of(toks: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return [toks[s:e].tolist() for s, e in edges.reshape(-1, 2)]


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_conversations_stored_with_their_mask(fmt, qwen, tmp_path):
    ref = reference_tokenizer(qwen)
    rows = [{"messages": c} for c in CONVERSATIONS]
    rows.append({"text": "a plain document: every token trained"})
    rows.append({"prompt": "2+2=", "completion": "4"})
    rows.append({"prompt": CONVERSATIONS[1][:3], "completion": CONVERSATIONS[1][3:]})
    write_jsonl(tmp_path / "chat.jsonl", rows)
    res = run(tmp_path, [tmp_path / "chat.jsonl"], format=fmt, tokenizer_from=qwen, chunk_tokens=16)
    m = res.manifest
    assert m["loss_mask"] == "trained_spans" and m["chat_template"]["sha256"]
    got = read_masked_rows(res.out, m)
    assert sorted(got) == list(range(len(rows)))
    for i, conv in enumerate(CONVERSATIONS):  # tokens as transformers renders them, turns masked
        toks, mask = got[i]
        assert toks.tolist() == list(ref.apply_chat_template(conv, tokenize=True))
        assert runs_of(toks, mask) == turn_runs(ref, conv)
    toks, mask = got[len(CONVERSATIONS)]  # the text row: every token (EOS added, as documents)
    assert mask.all() and toks.tolist() == ref(rows[3]["text"])["input_ids"] + [ref.eos_token_id]
    toks, mask = got[len(CONVERSATIONS) + 1]  # "4" is the completion (no EOS in this config)
    assert runs_of(toks, mask) == [
        ref("4", add_special_tokens=False)["input_ids"] + [ref.eos_token_id]
    ]
    toks, mask = got[len(CONVERSATIONS) + 2]  # only the completion's assistant turn
    assert runs_of(toks, mask) == turn_runs(ref, CONVERSATIONS[1])[1:]
    # the index's loss_tokens: trained tokens after each sample's first, from the rows read back
    want = [int(got[i][1][1:].sum()) for i in range(len(rows))]
    idx = read_index(res.out)
    assert idx.loss_tokens.tolist() == want == read_loss_tokens(res.out).tolist()
    assert m["num_loss_tokens"] == sum(want)
    assert m["counts"]["no_target"] == 0 and m["counts"]["documents"] == len(rows)


def test_wds_shard_layout(qwen, tmp_path):
    """A masked webdataset shard (docs/FORMAT.md): its rows' `<key>.tokens.npy` members in
    (sample, chunk) order, then one `__mixlen_trained__.trained_spans.npy` member, last; a dataset
    without a mask has none."""
    import tarfile

    rows = [{"messages": c} for c in CONVERSATIONS] * 3 + [{"text": "a document " * 9}]
    write_jsonl(tmp_path / "c.jsonl", rows)
    res = run(tmp_path, [tmp_path / "c.jsonl"], format="wds", tokenizer_from=qwen, chunk_tokens=16,
              shard_bytes=1500)  # fmt: skip
    idx = read_index(res.out)
    shards = res.manifest["shards"]
    assert len(shards) > 2
    want: list[list[str]] = [[] for _ in shards]
    for sid in range(len(rows)):  # every sample's rows, in the shard the index names
        n = int(idx.num_rows[sid])
        want[int(idx.shard[sid])] += [f"s{sid:010d}_c{j:06d}.tokens.npy" for j in range(n)]
    for s, names in zip(shards, want):
        with tarfile.open(os.path.join(res.out, s["name"])) as tf:
            assert [m.name for m in tf] == [*names, "__mixlen_trained__.trained_spans.npy"]
    write_jsonl(tmp_path / "t.jsonl", rows[-1:])
    res = run(tmp_path, [tmp_path / "t.jsonl"], name="text", format="wds", tokenizer_from=qwen)
    with tarfile.open(os.path.join(res.out, res.manifest["shards"][0]["name"])) as tf:
        assert [m.name for m in tf] == ["s0000000000_c000000.tokens.npy"]


def test_wds_spans_member_failing_leaves_nothing(qwen, tmp_path, monkeypatch):
    """The disk filling up as a shard's spans member is written (its second shard): preprocess
    fails naming --out, and neither the output nor its temporary directory is left."""
    import errno

    from datapipe.errors import MixlenError
    from datapipe.formats import wds

    calls = []

    def full(row_spans):
        calls.append(len(row_spans))
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(row_spans)

    real = wds.shard_spans
    monkeypatch.setattr(wds, "shard_spans", full)
    write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS] * 3)
    with pytest.raises(MixlenError, match=r"--out .*out: writing failed \(disk full"):
        run(tmp_path, [tmp_path / "c.jsonl"], format="wds", tokenizer_from=qwen, chunk_tokens=16,
            shard_bytes=1500)  # fmt: skip
    assert len(calls) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def reference_mask(ref, conv) -> tuple[list[int], np.ndarray]:
    """transformers' ids of a conversation and the per-turn reference mask over them (each
    assistant turn's runs found in order)."""
    whole = list(ref.apply_chat_template(conv, tokenize=True))
    mask = np.zeros(len(whole), bool)
    start = 0
    for run_ids in turn_runs(ref, conv):
        k = next(k for k in range(start, len(whole)) if whole[k : k + len(run_ids)] == run_ids)
        mask[k : k + len(run_ids)] = True
        start = k + len(run_ids)
    return whole, mask


def test_parquet_rows_and_max_len_pieces(qwen, tmp_path):
    """Parquet conversations; --max-len split cuts tokens and mask together, and a piece with no
    trained position (none after its first token) is no_target, never stored; --long-docs
    truncate keeps the head's mask."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ref = reference_tokenizer(qwen)
    conv = CONVERSATIONS[1]
    whole, ref_mask = reference_mask(ref, conv)
    pq.write_table(pa.table({"messages": [conv]}), tmp_path / "c.parquet")
    res = run(tmp_path, [tmp_path / "c.parquet"], tokenizer_from=qwen, max_len=7, format="parquet")
    got = read_masked_rows(res.out, res.manifest)
    sources = read_index(res.out, with_source=True).source
    stored = {int(src.rsplit("@", 1)[1]): got[i] for i, src in enumerate(sources)}
    starts = range(0, len(whole), 7)
    want = {k for k, e in enumerate(starts) if ref_mask[e + 1 : e + 7].any()}
    assert set(stored) == want and 0 < len(want) < len(starts)
    for k, (toks, mask) in stored.items():
        assert toks.tolist() == whole[7 * k : 7 * k + 7]
        np.testing.assert_array_equal(mask, ref_mask[7 * k : 7 * k + 7])
    assert res.manifest["counts"]["no_target"] == len(starts) - len(want)
    assert res.manifest["counts"]["split"] == 1
    res = run(tmp_path, [tmp_path / "c.parquet"], name="t", tokenizer_from=qwen, max_len=40,
              long_docs="truncate")  # fmt: skip
    ((toks, mask),) = read_masked_rows(res.out, res.manifest).values()
    assert toks.tolist() == whole[:40]
    np.testing.assert_array_equal(mask, ref_mask[:40])


def test_text_rows_before_conversations(qwen, tmp_path):
    """A file of text rows, then one of conversations: the dataset is written with the mask (the
    run starts again once it meets the first conversation), as if the order were the other."""
    write_jsonl(tmp_path / "a.jsonl", [{"text": f"document {i}"} for i in range(3)] + ["{bad"])
    write_jsonl(tmp_path / "b.jsonl", [{"messages": c} for c in CONVERSATIONS])
    warned: list[str] = []
    cfg = PreprocessConfig(
        inputs=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")],
        out=str(tmp_path / "out"),
        tokenizer_from=qwen,
    )
    res = preprocess(cfg, warn=warned.append)
    assert res.manifest["loss_mask"] and res.manifest["num_samples"] == 6
    assert res.manifest["counts"]["bad"] == 1 and len(warned) == 1  # warned about once
    got = read_masked_rows(res.out, res.manifest)
    assert all(got[i][1].all() for i in range(3)) and not got[3][1].all()
    # a text-only dataset has no mask column and no loss columns
    res = run(tmp_path, [tmp_path / "a.jsonl"], name="text", tokenizer_from=qwen)
    assert "loss_mask" not in res.manifest and read_index(res.out).loss is None
    assert res.manifest["num_loss_tokens"] == res.manifest["num_tokens"] - 3


BAD_ROWS = [
    ({"messages": {"role": "user"}}, "messages is dict, expected a list of messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]: unknown role 'robot'"),
    ({"messages": [{"role": "user"}]}, "messages[0]: missing content"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "no assistant turn"),
    ({"prompt": "p", "completion": 3}, "expected both strings or both message lists"),
    ({"question": "?"}, "missing text field 'text' (or messages, or prompt and completion)"),
]


def test_bad_rows_named_and_counted(qwen, tmp_path):
    rows = [{"messages": CONVERSATIONS[0]}] + [r for r, _ in BAD_ROWS]
    write_jsonl(tmp_path / "bad.jsonl", rows)
    res = run(tmp_path, [tmp_path / "bad.jsonl"], tokenizer_from=qwen, max_reported=10)
    assert res.manifest["counts"]["bad"] == len(BAD_ROWS)
    assert res.manifest["num_samples"] == 1 and res.manifest["counts"]["documents"] == 1
    path = str(tmp_path / "bad.jsonl")
    assert [w for w, _ in res.bad_examples] == [f"{path}:{i + 2}" for i in range(len(BAD_ROWS))]
    assert all(why in got for (_, got), (_, why) in zip(res.bad_examples, BAD_ROWS))
    with pytest.raises(InputError, match=r"bad.jsonl:2: messages is dict"):
        run(tmp_path, [tmp_path / "bad.jsonl"], name="strict", tokenizer_from=qwen, strict=True)
    assert not os.path.exists(tmp_path / "strict")  # nothing half-written


def test_template_refusals(tmp_path):
    """A conversation without a chat template (the bytes tokenizer, a folder without one) is a
    bad row naming what to do; a template that fails on a row is a bad row."""
    write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}, {"text": "kept"}])
    res = run(tmp_path, [tmp_path / "c.jsonl"])
    assert res.bad_examples[0][1].startswith("no chat template: give --chat-template FILE")
    tpl = tmp_path / "t.jinja"
    tpl.write_text(
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
    )
    res = run(tmp_path, [tmp_path / "c.jsonl"], name="o2", chat_template=str(tpl))
    assert "one message only" in res.bad_examples[0][1]
    folder = make_folder(str(tmp_path / "tok"), "qwen2")
    os.remove(os.path.join(folder, "tokenizer_config.json"))
    res = run(tmp_path, [tmp_path / "c.jsonl"], name="o3", tokenizer_from=folder)
    assert "no chat template in the tokenizer folder" in res.bad_examples[0][1]
    assert res.manifest["counts"]["bad"] == 1 and res.manifest["num_samples"] == 1
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": {"default": "{{ messages }}"}}, f)
    res = run(tmp_path, [tmp_path / "c.jsonl"], name="o4", tokenizer_from=folder)
    assert "chat_template is dict, expected a string" in res.bad_examples[0][1]
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": [{"name": "default", "template": None}]}, f)
    res = run(tmp_path, [tmp_path / "c.jsonl"], name="o5", tokenizer_from=folder)
    assert "chat_template's 'default' template is NoneType" in res.bad_examples[0][1]


def test_lone_surrogates_through_a_bpe_tokenizer_are_named(qwen, tmp_path):
    """A lone surrogate ("\\ud800" in JSON) in a document, a message or a prompt is that row's
    refusal as "not valid Unicode" (the `tokenizers` library's own error is a TypeError)."""
    lines = [
        '{"text": "a \\ud800 b"}',
        '{"messages": [{"role": "user", "content": "hi \\udfff"}, '
        '{"role": "assistant", "content": "ok"}]}',
        '{"prompt": "p \\ud800", "completion": "c"}',
        '{"text": "' + "a " * 50_000 + '\\udfff"}',  # past a piece: the position in the text
        '{"text": "fine"}',
    ]
    (tmp_path / "s.jsonl").write_text("\n".join(lines) + "\n")
    res = run(tmp_path, [tmp_path / "s.jsonl"], tokenizer_from=qwen, max_reported=10)
    assert [w for w, _ in res.bad_examples] == [f"{tmp_path / 's.jsonl'}:{i}" for i in (1, 2, 3, 4)]
    for _, reason in res.bad_examples:
        assert reason.startswith("text is not valid Unicode (surrogates not allowed at ")
    assert res.bad_examples[3][1].endswith(" at 100000)")
    assert res.manifest["num_samples"] == 1


def test_profile_shows_trained_share_by_length_bucket(qwen, tmp_path, capsys):
    """`mixlen profile --json`: per power-of-two length bucket, the trained tokens (read back from
    the shards) and their share; the table prints a % trained column."""
    from tools.cli import main as cli_main

    rows = [{"messages": c} for c in CONVERSATIONS] + [{"text": "t " * n} for n in (3, 40, 90)]
    write_jsonl(tmp_path / "c.jsonl", rows)
    res = run(tmp_path, [tmp_path / "c.jsonl"], tokenizer_from=qwen)
    got = read_masked_rows(res.out, res.manifest)
    assert cli_main(["profile", res.out, "--json"]) == 0
    prof = json.loads(capsys.readouterr().out)
    want: dict[int, list[int]] = {}
    for toks, mask in got.values():
        lo = 1 << (len(toks).bit_length() - 1)
        w = want.setdefault(lo if lo > 1 else 0, [0, 0])
        w[0] += int(mask[1:].sum())
        w[1] += len(toks)
    assert {b["lo"]: [b["loss_tokens"], b["tokens"]] for b in prof["buckets"]} == want
    assert prof["num_loss_tokens"] == res.manifest["num_loss_tokens"]
    assert cli_main(["profile", res.out]) == 0
    assert "% trained" in capsys.readouterr().out
    # as a mixture's source, beside one without a loss mask: the same figures for it alone
    write_jsonl(tmp_path / "t.jsonl", [{"text": "u " * n} for n in (5, 50)])
    plain = run(tmp_path, [tmp_path / "t.jsonl"], name="plain", tokenizer_from=qwen)
    assert cli_main(["profile", res.out, plain.out, "--json"]) == 0
    masked, other = json.loads(capsys.readouterr().out)["sources"]
    assert masked["buckets"] == prof["buckets"] and masked["num_loss_tokens"] == sum(
        w[0] for w in want.values()
    )
    assert "num_loss_tokens" not in other
    assert cli_main(["profile", res.out, plain.out]) == 0
    assert capsys.readouterr().out.count("% trained") == 1


def test_saved_dataset_of_conversations(qwen, tmp_path):
    """A Hugging Face save_to_disk folder with a `messages` column gives the same samples and
    masks as the JSON Lines file of the same rows."""
    import datasets

    rows = [{"messages": c} for c in CONVERSATIONS]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    write_jsonl(tmp_path / "c.jsonl", rows)
    a = run(tmp_path, [tmp_path / "hf"], name="a", tokenizer_from=qwen)
    b = run(tmp_path, [tmp_path / "c.jsonl"], name="b", tokenizer_from=qwen)
    got_a, got_b = read_masked_rows(a.out, a.manifest), read_masked_rows(b.out, b.manifest)
    assert sorted(got_a) == sorted(got_b) == list(range(len(rows)))
    for i in got_a:
        assert got_a[i][0].tolist() == got_b[i][0].tolist()
        assert got_a[i][1].tolist() == got_b[i][1].tolist()


def test_a_tokenizer_file_gives_the_template_its_own_eos(tmp_path) -> None:
    """`--tokenizer FILE --chat-template FILE` (no folder naming special tokens): a template's
    `{{ eos_token }}` is the EOS that frames the tokenizer's documents, as transformers renders
    it for that tokenizer, and each assistant turn's EOS is trained (it rendered as "", so the
    model never saw an end of turn)."""
    from transformers import PreTrainedTokenizerFast

    from datapipe.ingest.tokenizer import HFTokenizer

    bpe = os.path.join(os.path.dirname(__file__), "assets", "bpe-stdlib.json")
    tok = HFTokenizer(bpe)
    eos = tok.special_names()["eos_token"]
    template = tmp_path / "zephyr.jinja"  # each turn ends with eos_token
    template.write_text(
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"messages": conv}) + "\n")
    res = preprocess(PreprocessConfig(inputs=[str(src)], out=str(tmp_path / "out"),
                                      tokenizer=bpe, chat_template=str(template), progress=False))  # fmt: skip
    ((ids, mask),) = read_masked_rows(res.out, res.manifest).values()
    ref = PreTrainedTokenizerFast(tokenizer_file=bpe, eos_token=eos)
    want = ref.apply_chat_template(conv, chat_template=template.read_text(), tokenize=True)
    assert ids.tolist() == list(want) and ids.tolist().count(tok.eos_id) == 2
    trained = ids[mask.astype(bool)].tolist()
    answer = ref("Hello there", add_special_tokens=False).input_ids
    assert trained[-1] == tok.eos_id and trained[:-1] == answer


def test_index_mask_columns_checked(tmp_path) -> None:
    """A masked index's columns as read_index checks them, by hand: spans that touch ([0, 2) then
    [2, 4)) are disjoint and pass, with loss_tokens the trained tokens after the first; a span
    that overlaps the one before, one past its sample, or a wrong loss_tokens is refused naming
    the row."""
    lengths = np.array([6, 5], np.int64)

    def read(values: list, loss: list, offsets=(0, 4, 6)):
        cols = LossColumns(np.array(loss), np.array(offsets, np.int64), np.array(values))
        path = tmp_path / INDEX_FILE
        write_index(str(path), lengths, np.zeros(2), np.array([0, 1]), np.ones(2), ["a", "b"], cols)
        return read_loss_columns(tmp_path, {}, lengths)

    assert read([0, 2, 2, 4, 1, 5], [3, 4]).loss_tokens.tolist() == [3, 4]  # tokens 1-3; 1-4
    for values, loss, match in (
        ([0, 3, 2, 4, 1, 5], [3, 4], r"row 0: trained span \[2, 4\) .* overlaps"),
        ([0, 2, 2, 4, 1, 6], [3, 5], r"row 1: trained span \[1, 6\) .* outside its 5 tokens"),
        ([0, 2, 2, 4, 1, 5], [3, 3], "row 1: loss_tokens is 3, its trained_spans give 4"),
    ):
        with pytest.raises(InputError, match=match):
            read(values, loss)
