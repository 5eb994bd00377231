"""Tokenizing one block of raw documents (in a worker process, a Ray task, or inline): parse,
decode, tokenize (text rows as documents; conversations and prompt-completion rows through their
renderer, datapipe.ingest.rows, with their trained spans), apply `--max-len`/`--long-docs`,
`--max-doc-bytes` and `--min-tokens`, count every outcome. Bad records are noted, never raised."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from datapipe.files import NotRegularFile, open_regular
from datapipe.ingest.chat import ChatTemplate
from datapipe.ingest.lossy import Lost
from datapipe.ingest.rows import KINDS, RowError, row_kind
from datapipe.ingest.sources import Block, TokenizeSettings, cut_points
from datapipe.ingest.tokenizer import Tokenizer

# what a block counts (the run adds the notes' counters: bad, special, unknown_docs)
BLOCK_COUNT_KEYS = (
    "documents",
    "empty",
    "blank",
    "split",
    "truncated",
    "dropped",
    "short",
    "no_target",
    "unknown_chars",
)

_WORKER: dict = {}


@dataclass
class BlockResult:
    """Tokenized documents of one block, in order, the outcome counts, and the notes: (kind,
    where, reason) in input order, kind "bad" (skipped) or "unknown" (characters lost)."""

    sources: list[str] = field(default_factory=list)
    tokens: list[np.ndarray] = field(default_factory=list)
    # each sample's trained spans (flat [start, end) pairs, int64); None: every token trained
    spans: list[np.ndarray | None] = field(default_factory=list)
    notes: list[tuple[str, str, str]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BLOCK_COUNT_KEYS, 0))
    nbytes: int = 0

    def bad(self, where: str, reason: str) -> None:
        self.notes.append(("bad", where, reason))


def init_worker(settings: TokenizeSettings) -> None:
    """Pool initializer: build the tokenizer once per process."""
    _WORKER["settings"] = settings
    _WORKER["tokenizer"] = settings.tokenizer.build()
    chat = settings.chat
    _WORKER["chat"] = ChatTemplate(chat) if chat is not None and chat.text is not None else None


def _utf8_error(exc: UnicodeDecodeError) -> str:
    return f"not valid UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def loss_tokens_of(spans: np.ndarray) -> int:
    """Labelled positions of a sample with these trained spans: its trained tokens at index >= 1
    (position i's target is token i + 1)."""
    pairs = np.asarray(spans, np.int64).reshape(-1, 2)
    return int(np.clip(pairs[:, 1] - np.maximum(pairs[:, 0], 1), 0, None).sum())


def cut_spans(spans: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The spans inside tokens [lo, hi), relative to lo."""
    pairs = np.clip(np.asarray(spans, np.int64).reshape(-1, 2), lo, hi) - lo
    return pairs[pairs[:, 1] > pairs[:, 0]].reshape(-1)


def _add_sample(
    res: BlockResult,
    source: str,
    ids: np.ndarray,
    s: TokenizeSettings,
    spans: np.ndarray | None = None,
) -> None:
    if len(ids) < s.min_tokens:
        res.counts["short"] += 1
        return
    if spans is not None and loss_tokens_of(spans) == 0:
        res.counts["no_target"] += 1  # nothing to train on: never stored
        return
    res.sources.append(source)
    res.tokens.append(ids)
    res.spans.append(spans)


def _add_ids(
    res: BlockResult,
    source: str,
    ids: np.ndarray,
    s: TokenizeSettings,
    spans: np.ndarray | None = None,
) -> None:
    """A tokenized document or row: empty, over --max-len (--long-docs), or a sample."""
    n = len(ids)
    if n == 0:
        res.counts["empty"] += 1
        return
    if s.max_len is not None and n > s.max_len:
        if s.long_docs == "drop":
            res.counts["dropped"] += 1
            return
        if s.long_docs == "truncate":
            res.counts["truncated"] += 1
            ids = ids[: s.max_len]
            spans = None if spans is None else cut_spans(spans, 0, s.max_len)
        else:
            res.counts["split"] += 1
            for part, start in enumerate(range(0, n, s.max_len)):
                end = start + s.max_len
                piece = None if spans is None else cut_spans(spans, start, end)
                _add_sample(res, f"{source}@{part}", ids[start:end], s, piece)
            return
    _add_sample(res, source, ids, s, spans)


def _tokenize(
    res: BlockResult, source: str, text: str, tok: Tokenizer, s: TokenizeSettings
) -> bool:
    """Tokenize one document (or one piece of a long one) into samples; False if it is bad."""
    if text.isspace():
        res.counts["blank"] += 1
        return True
    try:
        ids = tok.encode(text)
        lost = tok.lost_chars(text) if tok.lossy else None
    except UnicodeEncodeError as exc:  # lone surrogates ("\ud800" in JSON) are not UTF-8
        res.bad(source, f"text is not valid Unicode ({exc.reason} at {exc.start})")
        return False
    except Exception as exc:  # the tokenizer refused it (e.g. a missing unk token)
        res.bad(source, f"the tokenizer failed: {type(exc).__name__}: {exc}")
        return False
    _note_lost(res, source, lost)
    _add_ids(res, source, ids, s)
    return True


def _note_lost(res: BlockResult, where: str, lost: Lost | None) -> None:
    """Count the characters a lossy tokenizer dropped of a document or row, and name it."""
    if lost:
        res.counts["unknown_chars"] += lost.count
        res.notes.append(("unknown", where, lost.describe()))


def _add_row(res: BlockResult, where: str, row: dict, kind: str, s: TokenizeSettings) -> None:
    """A conversation or prompt-completion row: rendered by its kind's renderer (a bad row is
    noted with its reason), then stored with its trained spans like a document's tokens."""
    tok: Tokenizer = _WORKER["tokenizer"]
    chat = s.chat
    missing = chat.missing if chat is not None else "no chat template"
    try:
        ids, spans, lost = KINDS[kind](row, tok, _WORKER.get("chat"), missing)
    except RowError as exc:
        res.bad(where, str(exc))
        return
    except UnicodeEncodeError as exc:  # lone surrogates ("\ud800" in JSON) are not UTF-8
        res.bad(where, f"text is not valid Unicode ({exc.reason} at {exc.start})")
        return
    res.counts["documents"] += 1
    _note_lost(res, where, lost)
    _add_ids(res, where, ids, s, spans)


def _add_doc(
    res: BlockResult, source: str, text: object, tok: Tokenizer, s: TokenizeSettings
) -> None:
    """One document's text (a JSON or parquet value): checked, then tokenized whole, or, over
    --max-doc-bytes, cut into pieces / truncated / dropped per --long-docs."""
    if not isinstance(text, str):
        res.bad(source, f"text field {s.text_field!r} is {type(text).__name__}, expected a string")
        return
    res.counts["documents"] += 1
    if not text:
        res.counts["empty"] += 1
        return
    try:
        small = len(text) <= s.max_doc_bytes // 4 or _utf8_len(text) <= s.max_doc_bytes
    except UnicodeEncodeError:
        small = False  # lone surrogates: found below
    if small:
        if not _tokenize(res, source, text, tok, s):
            res.counts["documents"] -= 1  # a bad record is not a document
        return
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        res.counts["documents"] -= 1
        res.bad(source, f"text is not valid Unicode ({exc.reason} at {exc.start})")
        return
    if s.long_docs == "drop":
        res.counts["dropped"] += 1
        return
    cuts = cut_points(lambda n, off: raw[off : off + n], len(raw), s.max_doc_bytes)
    if s.long_docs == "truncate":
        res.counts["truncated"] += 1
        _tokenize(res, source, raw[: cuts[1]].decode("utf-8"), tok, s)
        return
    res.counts["split"] += 1
    for j in range(len(cuts) - 1):
        _tokenize(res, f"{source}@{j}", raw[cuts[j] : cuts[j + 1]].decode("utf-8"), tok, s)


def _read_upto(f, n: int, whole: bool) -> bytes:
    """At most `n` bytes from `f`. A read allocates what it asks for, so a whole file is asked
    for its size (at least 64 KiB: /proc files say 0) and only then, if more is there, the rest."""
    first = min(n, max(os.fstat(f.fileno()).st_size + 1, 1 << 16)) if whole else n
    raw = f.read(first)
    if len(raw) == first < n:
        raw += f.read(n - first)
    return raw


def _read_text(
    res: BlockResult, where: str, path: str, start: int, size: int, whole: bool
) -> str | None:
    """At most `size` bytes of a text file from byte `start`, as text; None after noting why
    not. A `whole` file longer than `size` has grown since it was listed: bad."""
    try:
        with open_regular(path) as f:
            if start:
                f.seek(start)
            raw = _read_upto(f, size + whole, whole)
    except NotRegularFile as exc:  # replaced since the inputs were listed
        res.bad(where, exc.reason)
        return None
    except OSError as exc:
        res.bad(where, f"cannot read file: {exc.strerror or exc}")
        return None
    if len(raw) > size:
        res.bad(where, "the file grew past --max-doc-bytes since it was listed")
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = f" (piece from byte {start:,})" if start else ""
        res.bad(where, _utf8_error(exc) + at)
        return None


def _text_files(res: BlockResult, block: Block, tok: Tokenizer, s: TokenizeSettings) -> None:
    for path in block.items:
        text = _read_text(res, path, path, 0, s.max_doc_bytes, whole=True)
        if text is not None:
            _add_doc(res, path, text, tok, s)


def _text_piece(res: BlockResult, block: Block, tok: Tokenizer, s: TokenizeSettings) -> None:
    """A piece of a text file over --max-doc-bytes (or its head under --long-docs truncate)."""
    if block.part <= 0:
        res.counts["documents"] += 1
        res.counts["truncated" if block.part < 0 else "split"] += 1
    source = block.path if block.part < 0 else f"{block.path}@{block.part}"
    text = _read_text(res, source, block.path, block.start, block.end - block.start, False)
    if text is not None:
        _tokenize(res, source, text, tok, s)


def _jsonl(res: BlockResult, block: Block, tok: Tokenizer, s: TokenizeSettings) -> None:
    for i, line in enumerate(block.items):
        where = f"{block.path}:{block.start + i}"
        if not line.strip():
            continue
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            res.bad(where, _utf8_error(exc))
            continue
        except json.JSONDecodeError as exc:
            res.bad(where, f"invalid JSON: {exc.msg} (column {exc.colno})")
            continue
        except RecursionError:
            res.bad(where, "invalid JSON: nested too deeply")
            continue
        except ValueError as exc:  # e.g. an integer beyond Python's digit limit
            res.bad(where, f"invalid JSON: {exc}")
            continue
        if not isinstance(obj, dict):
            res.bad(where, f"expected a JSON object, got {type(obj).__name__}")
            continue
        kind = row_kind(obj, s.text_field)
        if kind is None:
            res.bad(
                where,
                f"missing text field {s.text_field!r} (or messages, or prompt and completion)",
            )
            continue
        if kind == "text":
            _add_doc(res, where, obj[s.text_field], tok, s)
        else:
            _add_row(res, where, obj, kind, s)


def _parquet(res: BlockResult, block: Block, tok: Tokenizer, s: TokenizeSettings) -> None:
    for i, text in enumerate(block.items):
        where = f"{block.path}#{block.start + i}"
        if text is None:
            res.bad(where, f"text field {s.text_field!r} is null")
            continue
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as exc:
                res.bad(where, _utf8_error(exc))
                continue
        _add_doc(res, where, text, tok, s)


def process_block(block: Block) -> BlockResult:
    """Parse and tokenize one block; bad records are noted, never raised."""
    s: TokenizeSettings = _WORKER["settings"]
    tok: Tokenizer = _WORKER["tokenizer"]
    res = BlockResult(nbytes=block.nbytes)
    if block.kind == "error":
        res.bad(block.path, block.error or "unreadable")
    elif block.kind == "text":
        _text_files(res, block, tok, s)
    elif block.kind == "piece":
        _text_piece(res, block, tok, s)
    elif block.kind == "long":  # over --max-doc-bytes with --long-docs drop: never read
        res.counts["documents"] += 1
        res.counts["dropped"] += 1
    elif block.kind == "jsonl":
        _jsonl(res, block, tok, s)
    elif block.kind == "parquet":
        _parquet(res, block, tok, s)
    elif block.kind == "rows":  # parquet / Arrow rows of a conversation or prompt-completion kind
        for i, row in enumerate(block.items):
            _add_row(res, f"{block.path}#{block.start + i}", row, block.row_kind, s)
    else:  # pragma: no cover - internal
        raise AssertionError(block.kind)
    return res
