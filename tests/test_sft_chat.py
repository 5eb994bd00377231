"""Conversations rendered with chat templates (datapipe.ingest.chat, datapipe.ingest.rows):
mixlen's text and token ids equal transformers' `apply_chat_template` for two real formats shipped
in tests/assets/chat_templates (ChatML as Qwen2 ships it, and a Llama-3-style one), and the trained
tokens are exactly each assistant turn with its end-of-turn token, checked against an independent
per-turn rendering and against transformers' own assistant mask on a `{% generation %}` template.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.errors import InputError
from datapipe.ingest.chat import ChatTemplate, RowError, find_template
from datapipe.ingest.rows import render_messages, render_prompt_completion
from datapipe.ingest.tokenizer import BytesTokenizer, HFTokenizer

ASSETS = os.path.join(os.path.dirname(__file__), "assets")
TEMPLATES = os.path.join(ASSETS, "chat_templates")

# per format: its special tokens, BOS/EOS, and how one assistant turn's trained text reads
FORMATS = {
    "qwen2": {
        "special": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        "config": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "turn": lambda content: content + "<|im_end|>",
    },
    "llama3-style": {
        "special": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "config": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "turn": lambda content: content.strip() + "<|eot_id|>",
    },
}

CONVERSATIONS = [
    [
        {"role": "user", "content": "What does os.path.join do?"},
        {"role": "assistant", "content": "It joins path components."},
    ],
    [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "def f(x):\n    return x  # what is this?"},
        {"role": "assistant", "content": "An identity function:\n\n    f(3) == 3"},
        {"role": "user", "content": "  and spaces   around?  "},
        {"role": "assistant", "content": " Kept by ChatML, trimmed by Llama 3.  "},
    ],
    [
        {"role": "user", "content": "Ünïcödé ✓ and a tab\there"},
        {"role": "assistant", "content": "ok"},
        {"role": "assistant", "content": "two assistant turns in a row"},
        {"role": "user", "content": "last word is the user's"},
    ],
]


def make_folder(path: str, name: str, template_in_config: bool = True, spec: str = "") -> str:
    """A saved tokenizer folder: the project's BPE (or the tokenizer.json text `spec`) with the
    format's special tokens added, its tokenizer_config.json naming them, the chat template in
    the config (or chat_template.jinja)."""
    from tokenizers import AddedToken, Tokenizer

    fmt = FORMATS[name]
    os.makedirs(path, exist_ok=True)
    if spec:
        tok = Tokenizer.from_str(spec)
    else:
        tok = Tokenizer.from_file(os.path.join(ASSETS, "bpe-stdlib.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in fmt["special"]])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(TEMPLATES, f"{name}.jinja")) as f:
        template = f.read()
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **fmt["config"]}
    if template_in_config:
        config["chat_template"] = template
    else:
        with open(os.path.join(path, "chat_template.jinja"), "w") as f:
            f.write(template)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module", params=sorted(FORMATS))
def folder(request, tmp_path_factory):
    inline = request.param == "qwen2"  # one in tokenizer_config.json, one as chat_template.jinja
    return request.param, make_folder(
        str(tmp_path_factory.mktemp(request.param)), request.param, inline
    )


def reference_tokenizer(path: str):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path)


def ours(path: str):
    src = find_template(None, path)
    return HFTokenizer.from_folder(path), ChatTemplate(src), src


def test_rendering_equals_transformers(folder):
    name, path = folder
    ref = reference_tokenizer(path)
    tok, template, src = ours(path)
    assert src.where.endswith("chat_template" if name == "qwen2" else "chat_template.jinja")
    for conv in CONVERSATIONS:
        for gen in (False, True):
            text = template.render(conv, gen)
            assert text == ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
        rendered = render_messages({"messages": conv}, tok, template, "")
        want = ref.apply_chat_template(conv, tokenize=True)
        assert rendered.ids.tolist() == list(want)


def test_special_tokens_map_wins_over_tokenizer_config_as_in_transformers(tmp_path):
    """A folder whose special_tokens_map.json names another EOS than its tokenizer_config.json:
    the template's eos_token, the tokenizer's EOS id and the rendering are transformers'."""
    path = make_folder(str(tmp_path / "f"), "qwen2")  # tokenizer_config.json: <|im_end|>
    with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)
    ref = reference_tokenizer(path)
    tok, template, _ = ours(path)
    assert tok.eos_id == ref.eos_token_id == ref.convert_tokens_to_ids("<|endoftext|>")
    assert template.special["eos_token"] == ref.eos_token


# each special-token variable and tojson, as transformers passes and defines them
VARIABLES_TEMPLATE = (
    "{{ bos_token }}{{ additional_special_tokens[0] }}{% for m in messages %}{{ m | tojson }}"
    "{{ m['content'] | tojson(indent=2) }}{% endfor %}{{ messages | tojson(indent=2) }}"
    "{{ eos_token }}"
)
HTML_CONV = [
    {"role": "user", "content": "<b>Ünïcödé</b> & 'q' \"dq\" ✓ 日本 \u2028 </script>"},
    {"role": "assistant", "content": "<i>é</i> > <"},
]
ADDED = {"content": "<|im_start|>", "lstrip": False, "normalized": False, "rstrip": False,
         "single_word": False, "special": True, "__type": "AddedToken"}  # fmt: skip


@pytest.mark.parametrize(
    "name, config, tokens_map",
    [  # a special_tokens_map.json naming only eos_token keeps the config's bos_token
        ("llama3-style", {"additional_special_tokens": [ADDED]}, {"eos_token": "<|eot_id|>"}),
        ("qwen2", {"additional_special_tokens": ["<|im_start|>"]}, None),  # bos_token: null
    ],
)
def test_template_variables_and_tojson_equal_transformers(tmp_path, name, config, tokens_map):
    """bos_token (kept from tokenizer_config.json when special_tokens_map.json names only
    eos_token; left undefined when null), additional_special_tokens given as AddedToken dicts
    or strings, and tojson (no ASCII or HTML escaping, indent) render as transformers'
    apply_chat_template renders them; the BOS id is transformers'."""
    pytest.importorskip("transformers")
    path = make_folder(str(tmp_path / "f"), name)
    conf_path = os.path.join(path, "tokenizer_config.json")
    with open(conf_path) as f:
        conf = json.load(f)
    with open(conf_path, "w") as f:
        json.dump({**conf, **config}, f)
    if tokens_map is not None:
        with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
            json.dump(tokens_map, f)
    tfile = tmp_path / "vars.jinja"
    tfile.write_text(VARIABLES_TEMPLATE)
    ref = reference_tokenizer(path)
    assert HFTokenizer.from_folder(path).bos_id == ref.bos_token_id
    assert (ref.bos_token_id is None) == (name == "qwen2")
    template = ChatTemplate(find_template(str(tfile), path))
    for conv in (HTML_CONV, HTML_CONV[:1]):
        want = ref.apply_chat_template(conv, chat_template=VARIABLES_TEMPLATE, tokenize=False)
        assert template.render(conv, False) == want
    assert "Ünïcödé</b>" in want and want.startswith(ref.bos_token or "<|im_start|>")


def test_llama3_style_is_the_llama3_format(tmp_path):
    """The hand-written template renders the Llama 3 chat format (spelled out here)."""
    path = make_folder(str(tmp_path), "llama3-style")
    _, template, _ = ours(path)
    conv = CONVERSATIONS[0]
    want = (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat does os.path.join do?"
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nIt joins path components."
        "<|eot_id|>"
    )
    assert template.render(conv, False) == want
    assert template.render(conv[:1], True) == want[: want.index("It joins")]


def test_mask_is_each_assistant_turn_with_its_end_of_turn(folder):
    """Independent reference: the trained runs of ids are exactly the assistant turns' text in
    the format (content and end-of-turn token), each tokenized on its own."""
    name, path = folder
    tok, template, _ = ours(path)
    turn = FORMATS[name]["turn"]
    eot = tok._tok.token_to_id(FORMATS[name]["config"]["eos_token"])
    for conv in CONVERSATIONS:
        ids, spans, _ = render_messages({"messages": conv}, tok, template, "")
        runs = [ids[s:e].tolist() for s, e in spans.reshape(-1, 2)]
        want = [
            tok._tok.encode(turn(m["content"]), add_special_tokens=False).ids
            for m in conv
            if m["role"] == "assistant"
        ]
        assert runs == want
        assert all(r[-1] == eot for r in runs)


GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}<|eot_id|>"
    "{% endgeneration %}{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def test_mask_equals_transformers_assistant_mask(tmp_path):
    """With `{% generation %}` markers transformers computes its own assistant mask; mixlen's
    (found from the turns, ignoring the markers) is the same."""
    _check_masks(tmp_path, "llama3-style", GENERATION_TEMPLATE, CONVERSATIONS)


def _check_masks(tmp_path, name: str, text: str, conversations: list) -> ChatTemplate:
    """Each conversation's ids and trained tokens under template `text` in a `name` folder
    equal transformers' ids and assistant mask; returns mixlen's template."""
    path = make_folder(str(tmp_path), name)
    tfile = tmp_path / "gen.jinja"
    tfile.write_text(text)
    ref = reference_tokenizer(path)
    tok, template = HFTokenizer.from_folder(path), ChatTemplate(find_template(str(tfile), path))
    for conv in conversations:
        out = ref.apply_chat_template(
            conv, chat_template=text, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, spans, _ = render_messages({"messages": conv}, tok, template, "")
        mask = np.zeros(len(ids), bool)
        for s, e in spans.reshape(-1, 2):
            mask[s:e] = True
        assert ids.tolist() == out["input_ids"]
        assert mask.astype(int).tolist() == out["assistant_masks"]
    return template


# ChatML (Qwen2's) with generation markers: a default system prompt added inside the loop
QWEN_GENERATION = (
    "{% for m in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_conversation_the_assistant_opens(tmp_path):
    """The first turn is the assistant's (a greeting) under a template whose empty rendering is
    not the start of the one-turn rendering (Qwen2's default system prompt comes from inside its
    loop): masked as transformers' assistant mask says (it was refused as a template that
    rewrites earlier turns)."""
    opened = [[{"role": "assistant", "content": "Hi! How can I help?"}, *CONVERSATIONS[0]],
              [{"role": "assistant", "content": "  "}, *CONVERSATIONS[2]]]  # fmt: skip
    template = _check_masks(tmp_path, "qwen2", QWEN_GENERATION, opened)
    assert not template.render([CONVERSATIONS[0][1]], False).startswith(template.render([], True))
    # one that reads messages[0] fails on the empty conversation (Llama 3.1's does)
    first = "{% set opener = messages[0]['role'] %}" + QWEN_GENERATION
    template = _check_masks(tmp_path / "first", "qwen2", first, opened)
    with pytest.raises(RowError, match="the chat template failed"):
        template.render([], True)


def test_prompt_completion(folder):
    name, path = folder
    tok, template, _ = ours(path)
    # strings: prompt + completion framed as a document; the completion and EOS are trained
    ids, spans, _ = render_prompt_completion(
        {"prompt": "Q: 2+2?\nA:", "completion": " 4"}, tok, template, ""
    )
    ((s, e),) = spans.reshape(-1, 2)
    assert (
        ids[s:e].tolist()[: e - s - (tok.eos_id is not None)]
        == tok._tok.encode(" 4", add_special_tokens=False).ids
    )
    assert e == len(ids) and (tok.eos_id is None or ids[-1] == tok.eos_id)
    # message lists: only the completion's assistant turns are trained
    conv = CONVERSATIONS[1]
    row = {"prompt": conv[:3], "completion": conv[3:]}
    ids, spans, _ = render_prompt_completion(row, tok, template, "")
    whole, whole_spans, _ = render_messages({"messages": conv}, tok, template, "")
    assert ids.tolist() == whole.tolist()
    np.testing.assert_array_equal(spans, whole_spans[2:])


def test_bytes_prompt_completion():
    tok = BytesTokenizer()
    ids, spans, _ = render_prompt_completion({"prompt": "é?", "completion": "ü"}, tok, None, "")
    assert ids.tolist() == [256, *"é?ü".encode(), 257]
    assert spans.tolist() == [4, 7]  # "ü" (2 bytes) and EOS


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"messages": "hi"}, "messages is str, expected a list"),
        ({"messages": []}, "messages is empty"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]: unknown role 'tool'"),
        ({"messages": [{"role": "user"}]}, "messages[0]: missing content"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content is int"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
        ({"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}, "both strings"),
        (
            {
                "prompt": [{"role": "user", "content": "a"}],
                "completion": [{"role": "user", "content": "b"}],
            },
            "no assistant turn: the completion",
        ),
    ],
)
def test_bad_rows(row, reason, tmp_path):
    path = make_folder(str(tmp_path), "qwen2")
    tok, template, _ = ours(path)
    render = render_messages if "messages" in row else render_prompt_completion
    with pytest.raises(RowError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        render(row, tok, template, "")


def test_bad_templates(tmp_path):
    path = make_folder(str(tmp_path), "qwen2")
    tok = HFTokenizer.from_folder(path)
    conv = {"messages": CONVERSATIONS[0]}
    # fails to render: the template raises
    bad = tmp_path / "raises.jinja"
    bad.write_text("{{ raise_exception('no system message allowed') }}")
    t = ChatTemplate(find_template(str(bad), path))
    with pytest.raises(RowError, match="the chat template failed: TemplateError: no system"):
        render_messages(conv, tok, t, "")
    # does not contain the messages' text
    drop = tmp_path / "drops.jinja"
    drop.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_end|>{% endfor %}")
    t = ChatTemplate(find_template(str(drop), path))
    with pytest.raises(RowError, match=r"does not contain messages\[0\]'s text"):
        render_messages(conv, tok, t, "")
    # rewrites earlier turns (the last turn rendered differently): no prefix, refused
    last = tmp_path / "last.jinja"
    last.write_text(
        "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}|{% endfor %}"
    )
    t = ChatTemplate(find_template(str(last), path))
    with pytest.raises(RowError, match=r"messages\[1\]: the chat template renders"):
        render_messages(conv, tok, t, "")
    # a syntax error stops before anything is read, naming the file and line
    syntax = tmp_path / "syntax.jinja"
    syntax.write_text("line one\n{% for m in messages %}")
    with pytest.raises(InputError, match=r"syntax.jinja:2: chat template syntax error"):
        find_template(str(syntax), path)
    # the same in a tokenizer folder: a text-only run is not stopped, conversation rows are
    # refused with the reason
    import shutil

    folder = tmp_path / "folder"
    shutil.copytree(path, folder)
    (folder / "chat_template.jinja").write_text(syntax.read_text())
    src = find_template(None, str(folder))
    assert src.text is None and "chat template syntax error" in src.missing
    with pytest.raises(RowError, match="chat template syntax error"):
        render_messages(conv, tok, None, src.missing)
    # a folder without a template: conversations are refused with what to do
    os.remove(os.path.join(path, "tokenizer_config.json"))
    src = find_template(None, path)
    assert src.text is None and "give --chat-template FILE" in src.missing
    with pytest.raises(RowError, match="no chat template in the tokenizer folder"):
        render_messages(conv, tok, None, src.missing)


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_byte_tokenizer_offsets_equal_each_characters_utf8_width(text) -> None:
    """The byte tokenizer's character offsets (vectorised from the code points) against each
    character's own UTF-8 encoding."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return  # lone surrogates: refused before offsets
    ids, starts, ends = BytesTokenizer().encode_offsets(text)
    want = np.repeat(np.arange(len(text)), [len(c.encode("utf-8")) for c in text])
    assert np.array_equal(starts, want) and np.array_equal(ends, want + 1)
    assert len(ids) == len(text.encode("utf-8"))


@settings(max_examples=200, deadline=None)
@given(
    spans=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 3)), min_size=1, max_size=12),
    regions=st.lists(st.tuples(st.integers(0, 15), st.integers(0, 15)), max_size=4),
)
def test_token_mask_against_characters(spans, regions) -> None:
    """token_mask against a per-character reference: a token is trained when one of its
    characters is, and a token with no characters (a lone SentencePiece "▁", an added token
    rendered empty) counts as holding the one at its start."""
    from datapipe.ingest.rows import token_mask

    starts = np.array([s for s, _ in spans], dtype=np.int64)
    ends = starts + np.array([w for _, w in spans], dtype=np.int64)
    trained = {c for c0, c1 in regions for c in range(c0, c1)}
    want = [any(c in trained for c in range(s, max(e, s + 1))) for s, e in zip(starts, ends)]
    assert token_mask(starts, ends, regions).tolist() == want
    # a region starting at a zero-width token's offset trains it
    assert token_mask(np.array([0, 3, 3]), np.array([3, 3, 5]), [(3, 5)]).tolist() == [
        False,
        True,
        True,
    ]


def test_a_trimming_post_processor_does_not_move_the_trained_tokens(tmp_path):
    """A GPT-2-style tokenizer (a ByteLevel post-processor that trims spaces off offsets) whose
    vocabulary joins a newline and the spaces after it ("ĊĠ"), under ChatML: an assistant turn
    opening with spaces starts inside such a token. The trained tokens are exactly those holding
    a trained character, by the reference of each token's own bytes laid end to end (trimmed
    offsets gave that token none of its spaces, and left it untrained)."""
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    from datapipe.ingest.chat import trained_regions

    with open(os.path.join(ASSETS, "bpe-stdlib.json")) as f:
        spec = json.load(f)
    model = spec["model"]
    for a, b in [("Ċ", "Ġ"), ("Ċ", "ĠĠ")]:
        model["vocab"][a + b] = len(model["vocab"])
        model["merges"].append([a, b])
    spec["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False,
                              "trim_offsets": True, "use_regex": True}  # fmt: skip
    path = make_folder(str(tmp_path / "trimming"), "qwen2", spec=json.dumps(spec))
    tok, template, _ = ours(path)
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    special = {tok._tok.token_to_id(t): t.encode() for t in FORMATS["qwen2"]["special"]}
    straddled = 0
    for opening in (" ", "  ", "   "):
        conv = [{"role": "user", "content": "Indent it."},
                {"role": "assistant", "content": opening + "return x"}]  # fmt: skip
        ids, spans, _ = render_messages({"messages": conv}, tok, template, "")
        text, regions = trained_regions(template, conv)
        pieces = [
            special[i] if i in special else bytes(to_byte[c] for c in tok._tok.id_to_token(i))
            for i in ids.tolist()
        ]
        assert b"".join(pieces).decode() == text  # ASCII: a byte is a character
        ends = np.cumsum([len(p) for p in pieces])
        starts = ends - [len(p) for p in pieces]
        want = [any(s < c1 and e > c0 for c0, c1 in regions) for s, e in zip(starts, ends)]
        got = np.zeros(len(ids), bool)
        for s, e in spans.reshape(-1, 2):
            got[s:e] = True
        assert got.tolist() == want, (opening, pieces)
        straddled += sum(s < c0 < e for c0, _ in regions for s, e in zip(starts, ends))
    assert straddled >= 2  # the case this test is about did occur
