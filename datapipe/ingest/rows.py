"""What a JSON Lines or parquet row is, from its fields (as TRL's dataset types): `messages` (a
conversation), `prompt` and `completion` (plain strings, or message lists), else the text field.
One renderer per kind turns a row into token ids and its trained spans (docs/instruction-data.md);
text rows go through the document path (datapipe.ingest.worker) and train every token.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import NamedTuple

import numpy as np

from datapipe.ingest.chat import ChatTemplate, RowError, check_messages, trained_regions
from datapipe.ingest.lossy import Lost
from datapipe.ingest.tokenizer import Tokenizer
from datapipe.plan.loss import spans_of_mask

__all__ = ["KINDS", "Rendered", "RowError", "row_kind", "token_mask"]

SFT_FIELDS = ("messages", "prompt", "completion")  # the fields of the kinds besides text


class Rendered(NamedTuple):
    """A row's token ids, its trained tokens as flat [start, end) pairs (int64), and the
    characters of its text a lossy tokenizer dropped (None: none)."""

    ids: np.ndarray
    spans: np.ndarray
    lost: Lost | None = None


def row_kind(fields: Collection[str], text_field: str) -> str | None:
    """The kind of a row ("messages", "prompt_completion" or "text") from the fields it (or a
    parquet file's schema) has, in that order of precedence; None when it has none of them."""
    if "messages" in fields:
        return "messages"
    if "prompt" in fields and "completion" in fields:
        return "prompt_completion"
    if text_field in fields:
        return "text"
    return None


def token_mask(starts: np.ndarray, ends: np.ndarray, regions: list[tuple[int, int]]) -> np.ndarray:
    """Which tokens (character ranges [starts, ends)) touch a region: a token is trained when it
    holds any trained character, as transformers' assistant mask takes every token that holds
    one (a token without characters counts as holding the one at its start)."""
    ends = np.maximum(ends, starts + 1)
    mask = np.zeros(starts.shape[0], dtype=bool)
    for c0, c1 in regions:
        if c1 > c0:
            mask |= (starts < c1) & (ends > c0)
    return mask


def _encode(tok: Tokenizer, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tokenizer's ids and character offsets of `text`; what the tokenizer itself refuses
    is this row's refusal (lone surrogates go up as UnicodeEncodeError, named by the caller)."""
    try:
        return tok.encode_offsets(text)
    except UnicodeEncodeError:
        raise
    except Exception as exc:  # the tokenizer library's own errors, whatever their type
        raise RowError(f"the tokenizer failed: {type(exc).__name__}: {exc}") from exc


def _conversation(
    tok: Tokenizer, template: ChatTemplate | None, missing: str, msgs: list, first: int
) -> Rendered:
    if not any(m["role"] == "assistant" for m in msgs[first:]):
        what = "the completion has" if first else "the conversation has"
        raise RowError(f"no assistant turn: {what} nothing to train on")
    if template is None:
        raise RowError(missing)
    text, regions = trained_regions(template, msgs, first)
    ids, starts, ends = _encode(tok, text)
    return Rendered(ids, spans_of_mask(token_mask(starts, ends, regions)), _lost(tok, text))


def _lost(tok: Tokenizer, text: str) -> Lost | None:
    """What a lossy tokenizer dropped of `text` (counted as a document's are)."""
    return tok.lost_chars(text) if tok.lossy else None


def render_messages(
    row: dict, tok: Tokenizer, template: ChatTemplate | None, missing: str
) -> Rendered:
    """A `messages` row: the conversation through the chat template; its assistant turns are
    trained."""
    msgs = check_messages(row["messages"])
    return _conversation(tok, template, missing, msgs, 0)


def render_prompt_completion(
    row: dict, tok: Tokenizer, template: ChatTemplate | None, missing: str
) -> Rendered:
    """A `prompt`/`completion` row. Strings: the text prompt + completion, framed by BOS/EOS as
    a document is; the completion's tokens and the EOS are trained. Message lists: the
    conversation prompt + completion through the chat template; the completion's assistant
    turns are trained."""
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        ids, starts, ends = _encode(tok, prompt + completion)
        mask = token_mask(starts, ends, [(len(prompt), len(prompt) + len(completion))])
        framed, front, back = tok.frame(ids)
        full = np.concatenate([np.zeros(front, bool), mask, np.ones(back, bool)])
        return Rendered(framed, spans_of_mask(full), _lost(tok, prompt + completion))
    if isinstance(prompt, list) and isinstance(completion, list):
        msgs = check_messages(prompt, "prompt") + check_messages(completion, "completion")
        return _conversation(tok, template, missing, msgs, len(prompt))
    raise RowError(
        f"prompt is {type(prompt).__name__} and completion {type(completion).__name__}: "
        "expected both strings or both message lists"
    )


Renderer = Callable[[dict, Tokenizer, "ChatTemplate | None", str], Rendered]
KINDS: dict[str, Renderer] = {
    "messages": render_messages,
    "prompt_completion": render_prompt_completion,
}
