"""Characters a Hugging Face tokenizer drops without a trace, counted exactly.

Of the `tokenizers` models only BPE loses input silently: a character whose initial symbol is not
in the vocabulary becomes the unk token when the model has one, its bytes when `byte_fallback`
is on, and nothing at all otherwise (WordPiece, WordLevel and Unigram emit their unk token or
raise, which preprocess reports as a bad document). So the check runs only for a BPE model with
neither, and not when a ByteLevel pre-tokenizer feeds it bytes and all 256 byte symbols are in the
vocabulary (GPT-2 style: nothing can be lost).

The count is of the model's input: the text after the tokenizer's normalizer (e.g. lowercased)
and pre-tokenizer. What the pre-tokenizer removes by design (the whitespace a `Whitespace` or
`BertPreTokenizer` splits on, a `CharDelimiterSplit` delimiter) never reaches the model and is not
lost; whitespace a ByteLevel or Metaspace pre-tokenizer hands the model is, if the vocabulary lacks
its symbol. BPE's rule is applied to each word as the model sees it: the first character must be
in the vocabulary as itself, the others with `continuing_subword_prefix`, the last with
`end_of_word_suffix`. For a ByteLevel tokenizer the model sees bytes; a character counts once if
any of its bytes is dropped. Text matching an added token is left out, as the tokenizer matches
those before the model (tokens with `single_word`/`lstrip`/`rstrip` rules are matched as plain
substrings here).

Cost: one pass over the normalized text's distinct characters (or byte histogram) per document;
only a document holding a character outside the vocabulary is pre-tokenized again and checked
word by word.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the optional `tokenizers` package, imported by the tokenizer that uses this
    from tokenizers import Tokenizer as HFTokenizer

_WHITESPACE_PRE_TOKENIZERS = ("Whitespace", "WhitespaceSplit", "BertPreTokenizer")
_PYTHON_ONLY_SPACE = frozenset("\x1c\x1d\x1e\x1f")  # isspace() in Python, not White_Space


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> symbol map, which the ByteLevel pre-tokenizer uses."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@dataclass(frozen=True)
class Lost:
    """Characters of one document the tokenizer dropped: how many, and the first of them."""

    count: int
    first: str

    def describe(self) -> str:
        return (
            f"{self.count:,} character{'s' if self.count != 1 else ''} outside the tokenizer's "
            f"vocabulary dropped (first {self.first!r}; it has no unk token or byte fallback)"
        )


def _chain(component: dict | None) -> list[dict]:
    """A normalizer or pre-tokenizer and, for a Sequence, its members (flattened)."""
    if not component:
        return []
    if component.get("type") == "Sequence":
        members = component.get("pretokenizers") or component.get("normalizers") or []
        return [c for m in members for c in _chain(m)]
    return [component]


class LossCheck:
    """Counts what a BPE tokenizer without unk token or byte fallback drops (module docstring).
    Build with `LossCheck.build`, which returns None for a tokenizer that loses nothing."""

    def __init__(self, tok: HFTokenizer, spec: dict) -> None:
        model = spec["model"]
        self._norm, self._pre = tok.normalizer, tok.pre_tokenizer
        self.vocab = model["vocab"]
        self.prefix = model.get("continuing_subword_prefix") or ""
        self.suffix = model.get("end_of_word_suffix") or ""
        self.ignore_merges = bool(model.get("ignore_merges"))
        pre = _chain(spec.get("pre_tokenizer"))
        kinds = {p.get("type") for p in pre} | {
            n.get("type") for n in _chain(spec.get("normalizer"))
        }
        self.byte_level = "ByteLevel" in kinds
        self.prefix_space = any(
            p.get("type") == "ByteLevel" and p.get("add_prefix_space") for p in pre
        )
        self.drops_space = bool(kinds & set(_WHITESPACE_PRE_TOKENIZERS))
        meta = [p for p in pre if p.get("type") == "Metaspace"]
        self.metaspace = meta[0].get("replacement", "\u2581") if meta else None
        self.known = self._known_everywhere()
        self.byte_symbol = bytes_to_unicode()
        self.symbol_byte = {c: b for b, c in self.byte_symbol.items()}
        self.unknown_bytes = np.array(
            [self.byte_symbol[b] not in self.known for b in range(256)], dtype=bool
        )
        added = sorted(
            (t.content for t in tok.get_added_tokens_decoder().values() if t.content), key=len
        )
        self.added = re.compile("|".join(re.escape(t) for t in reversed(added))) if added else None

    @classmethod
    def build(cls, tok: HFTokenizer, spec: dict) -> LossCheck | None:
        """A check for tokenizer `tok` (its tokenizer.json as a dict), or None when it cannot
        drop a character (another model, an unk token, byte fallback, a full byte alphabet)."""
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or model.get("byte_fallback"):
            return None
        if model.get("unk_token") is not None:  # unk, or an error naming it: never silent
            return None
        check = cls(tok, spec)
        if check.byte_level and not check.unknown_bytes.any():
            return None
        return check

    def _known_everywhere(self) -> set[str]:
        """Characters whose symbol is in the vocabulary in every position of a word."""
        p, x = self.prefix, self.suffix
        forms = [lambda c: c]
        if p:
            forms.append(lambda c: p + c)
        if x:
            forms += [lambda c: c + x] + ([lambda c: p + c + x] if p else [])
        chars = {t for t in self.vocab if len(t) == 1}
        chars |= {t[len(p)] for t in self.vocab if p and len(t) == len(p) + 1 and t.startswith(p)}
        return {c for c in chars if all(f(c) in self.vocab for f in forms)}

    def _maybe_lossy(self, text: str) -> bool:
        """False when no character of `text` can be dropped (the fast path)."""
        if self._norm is not None:
            text = self._norm.normalize_str(text)
        if self.byte_level:
            hist = np.bincount(np.frombuffer(text.encode("utf-8"), np.uint8), minlength=256)
            if self.prefix_space:
                hist[0x20] += 1
            return bool(hist[self.unknown_bytes].any())
        chars = set(text)
        if self.metaspace is not None:
            chars.add(self.metaspace)  # spaces become it, and it may be prepended
            chars.discard(" ")
        unknown = chars - self.known
        if self.drops_space:
            unknown = {c for c in unknown if not c.isspace() or c in _PYTHON_ONLY_SPACE}
        return bool(unknown)

    def _words(self, text: str) -> list[str]:
        """The words the model sees: normalized, pre-tokenized, added tokens left out."""
        from tokenizers import PreTokenizedString

        pieces = self.added.split(text) if self.added else [text]
        norm, pre = self._norm, self._pre
        words: list[str] = []
        for piece in pieces:
            if not piece:
                continue
            pts = PreTokenizedString(piece)
            if norm is not None:
                pts.normalize(norm.normalize)
            if pre is not None:
                pre.pre_tokenize(pts)
            words += [w for w, _, _ in pts.get_splits()]
        return words

    def _dropped(self, word: str) -> list[int]:
        """Positions of `word` (as the model sees it) that BPE drops."""
        if self.ignore_merges and word in self.vocab:
            return []
        p, x, vocab, last = self.prefix, self.suffix, self.vocab, len(word) - 1
        out = []
        for i, c in enumerate(word):
            s = p + c if p and i else c
            if x and i == last:
                s += x
            if s not in vocab:
                out.append(i)
        return out

    def _lost_bytes(self, word: str, dropped: list[int]) -> tuple[int, str]:
        """(characters, the first one) of a ByteLevel word whose byte symbols `dropped` are
        lost: a character counts once however many of its bytes are."""
        raw = bytes(self.symbol_byte[c] for c in word)
        owner, start = [], 0  # the first byte of the character each byte belongs to
        for i, b in enumerate(raw):
            if b & 0xC0 != 0x80:
                start = i
            owner.append(start)
        chars = sorted({owner[i] for i in dropped})
        end = next((i for i in range(chars[0] + 1, len(raw)) if owner[i] != chars[0]), len(raw))
        return len(chars), raw[chars[0] : end].decode("utf-8", "replace")

    def lost(self, text: str) -> Lost | None:
        """The characters of `text` the tokenizer drops (None: none)."""
        if not self._maybe_lossy(text):
            return None
        count, first = 0, ""
        for word in self._words(text):
            if not set(word) - self.known:
                continue
            dropped = self._dropped(word)
            if not dropped:
                continue
            if self.byte_level:
                n, c = self._lost_bytes(word, dropped)
            else:
                n, c = len(dropped), word[dropped[0]]
            count += n
            first = first or c
        return Lost(count, first) if count else None
