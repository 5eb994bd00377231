"""Chat templates: found in a saved tokenizer folder or given as a file, rendered as transformers'
`apply_chat_template` renders them (a Jinja2 ImmutableSandboxedEnvironment with trim_blocks and
lstrip_blocks, the loop-controls extension, `raise_exception`, `strftime_now`, a `tojson` that
does not escape HTML, `{% generation %}` blocks rendered as their body, and the tokenizer's
special tokens as variables), and the trained characters of a conversation: each assistant
turn's text after the generation prompt, up to its end-of-turn (docs/instruction-data.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from datapipe.errors import InputError
from datapipe.files import CONFIG_FILE_LIMIT, read_bounded_text
from datapipe.ingest.tokenizer import special_token_names

__all__ = ["ChatTemplate", "RowError", "TemplateSource", "find_template", "trained_regions"]

TEMPLATE_FILE = "chat_template.jinja"  # what transformers 4.4x+ saves beside tokenizer_config.json
# the special tokens transformers passes to a template (its SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class RowError(Exception):
    """A row that cannot be rendered: its reason, as `file:line: reason` reports it."""


@dataclass(frozen=True)
class TemplateSource:
    """A chat template's text, where it came from (for messages) and the special tokens the
    tokenizer folder names (template variables); `missing` says why there is none."""

    text: str | None = None
    where: str = ""
    special: tuple[tuple[str, object], ...] = ()
    missing: str = ""


def find_template(
    template_file: str | None, folder: str | None, framing: Mapping[str, str] | None = None
) -> TemplateSource:
    """`--chat-template FILE`, else the tokenizer folder's chat_template.jinja, else its
    tokenizer_config.json `chat_template` (a string, or named templates with a "default");
    a folder's special tokens either way, else `framing` (a tokenizer file's own BOS/EOS
    names: a template's `eos_token` is the EOS that frames documents, never an empty string).
    A `--chat-template` that does not compile stops here; a folder's unusable template becomes
    the reason its conversation rows are refused."""
    special: dict[str, object] = dict(framing or {})
    if folder is not None:
        special = {k: v for k, v in special_token_names(folder, SPECIAL_KEYS).items() if v}
        extra = _config(folder).get("additional_special_tokens")
        if isinstance(extra, list):
            special["additional_special_tokens"] = [
                t.get("content") if isinstance(t, dict) else t for t in extra
            ]
    items = tuple(sorted(special.items()))
    if template_file is not None:
        text = _read(template_file, "--chat-template")
        src = TemplateSource(text, template_file, items)
    elif folder is not None:
        # the folder's template matters to conversation rows only: a problem with it is their
        # refusal (each counted, --strict stops), never a text-only run's
        try:
            src = _folder_template(folder, items)
            if src.text is not None:
                ChatTemplate(src)
        except InputError as exc:
            return TemplateSource(special=items, missing=str(exc))
        return src
    else:
        src = TemplateSource(
            special=items,
            missing="no chat template: give --chat-template FILE or --tokenizer-from a folder "
            "that has one",
        )
    if src.text is not None:
        ChatTemplate(src)  # compiles: a syntax error names the file and line now
    return src


def _read(path: str, what: str) -> str:
    try:
        return read_bounded_text(path, CONFIG_FILE_LIMIT, "the chat template")
    except FileNotFoundError:
        raise InputError(f"{what} {path}: not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{what} {path}: cannot read it ({exc})") from None


def _config(folder: str) -> dict:
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.exists(path):
        return {}
    try:
        conf = json.loads(read_bounded_text(path, CONFIG_FILE_LIMIT, "the tokenizer config"))
    except (OSError, json.JSONDecodeError, RecursionError) as exc:
        raise InputError(f"{path}: cannot read tokenizer config ({exc})") from None
    return conf if isinstance(conf, dict) else {}


def _folder_template(folder: str, special: tuple) -> TemplateSource:
    jinja = os.path.join(folder, TEMPLATE_FILE)
    if os.path.exists(jinja):
        return TemplateSource(_read(jinja, "--tokenizer-from"), jinja, special)
    where = os.path.join(folder, "tokenizer_config.json")
    value = _config(folder).get("chat_template")
    if isinstance(value, list):  # named templates, as transformers saves several
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            raise InputError(
                f"{where}: chat_template has named templates ({', '.join(map(str, named))}) but "
                "no 'default'; give --chat-template FILE"
            )
        value = named["default"]
        what, expected = "chat_template's 'default' template", "a string"
    else:
        what, expected = "chat_template", "a string or a list of named templates"
    if isinstance(value, str):
        return TemplateSource(value, f"{where} chat_template", special)
    # a conversation row is refused with this reason; text rows need no template
    if value is None and what == "chat_template":
        why = (
            f"no chat template in the tokenizer folder {folder} (neither {TEMPLATE_FILE} nor "
            "tokenizer_config.json's chat_template)"
        )
    else:
        why = f"{where}: {what} is {type(value).__name__}, expected {expected}"
    return TemplateSource(special=special, missing=f"{why}: give --chat-template FILE")


class ChatTemplate:
    """A compiled chat template; `render` is apply_chat_template's text (tokenize=False)."""

    def __init__(self, src: TemplateSource) -> None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        assert src.text is not None
        self.where = src.where
        self.special = dict(src.special)

        class Generation(jinja2.ext.Extension):
            """`{% generation %}...{% endgeneration %}`: renders its body (the mask comes from
            the turns, not from these markers)."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                call = self.call_method("_body")
                return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
            return json.dumps(
                x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                sort_keys=sort_keys,
            )  # fmt: skip

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(src.text)
        except jinja2.TemplateSyntaxError as exc:
            raise InputError(
                f"{src.where}:{exc.lineno}: chat template syntax error: {exc.message}"
            ) from None

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The conversation's text; RowError when the template raises (its own
        raise_exception, or a failure on these messages)."""
        try:
            return self._template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special,
            )
        except Exception as exc:
            raise RowError(f"the chat template failed: {type(exc).__name__}: {exc}") from None


ROLES = ("system", "user", "assistant")


def check_messages(messages: object, key: str = "messages") -> list[dict]:
    """The messages of a row, checked: a non-empty list of {role, content} objects with a known
    role and string content; RowError naming the first that is not."""
    if not isinstance(messages, list):
        raise RowError(f"{key} is {type(messages).__name__}, expected a list of messages")
    if not messages:
        raise RowError(f"{key} is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RowError(f"{key}[{i}] is {type(m).__name__}, expected an object")
        role = m.get("role")
        if role not in ROLES:
            raise RowError(f"{key}[{i}]: unknown role {role!r} (expected {', '.join(ROLES)})")
        if "content" not in m or m["content"] is None:
            raise RowError(f"{key}[{i}]: missing content")
        if not isinstance(m["content"], str):
            got = type(m["content"]).__name__
            raise RowError(f"{key}[{i}].content is {got}, expected a string")
    return messages


def _opening(template: ChatTemplate, turn: dict, rendered: str) -> str:
    """The rendering before a conversation's first turn, an assistant's (`rendered`: that turn
    alone): the empty conversation with the generation prompt where that starts `rendered`;
    else (a template whose empty rendering differs, such as one adding its default system prompt
    only inside its loop, or one reading messages[0]) `rendered` up to where two renderings with
    different contents part."""
    try:
        before = template.render([], True)
    except RowError:
        before = None
    if before is not None and rendered.startswith(before):
        return before
    a, b = (template.render([{**turn, "content": c}], False) for c in ("A", "B"))
    return a[: len(os.path.commonprefix([a, b]))]


def trained_regions(
    template: ChatTemplate, messages: list[dict], first: int = 0
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and its trained character ranges: for each assistant turn at
    index >= `first`, the text the turn adds after the generation prompt, without the
    whitespace that separates it from the next turn (so its end-of-turn token is the last
    trained). Each turn is found by rendering the conversation up to it, with and without it;
    a template whose shorter renderings are not prefixes of the whole is refused."""
    full = template.render(messages, False)
    for i, m in enumerate(messages):
        text = m["content"].strip()
        if text and text not in full:
            raise RowError(
                f"the chat template's rendering does not contain messages[{i}]'s text "
                f"({template.where})"
            )
    regions = []
    for k in range(first, len(messages)):
        if messages[k]["role"] != "assistant":
            continue
        after = template.render(messages[: k + 1], False)
        if k == 0:
            before = _opening(template, messages[0], after)
        else:
            before = template.render(messages[:k], True)
        if not (after.startswith(before) and full.startswith(after)):
            raise RowError(
                f"messages[{k}]: the chat template renders the conversation up to this turn "
                "differently from the whole conversation's start (it rewrites earlier turns), "
                "so the turn's trained tokens cannot be located"
            )
        regions.append((len(before), max(len(after.rstrip()), len(before))))
    return full, regions
