"""Tokenizers for preprocessing: UTF-8 bytes (default), a Hugging Face `tokenizer.json`, or a saved
tokenizer folder (`save_pretrained` output: tokenizer.json plus the config files naming BOS/EOS)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from datapipe.errors import InputError
from datapipe.files import CONFIG_FILE_LIMIT, read_bounded_bytes, read_bounded_text
from datapipe.ingest.lossy import LossCheck, Lost

BYTES_BOS = 256
BYTES_EOS = 257
BYTES_VOCAB = 258
_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "[SEP]")
_BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]")
# files of a saved tokenizer folder that name its special tokens; later files win (transformers'
# from_pretrained lets special_tokens_map.json override tokenizer_config.json)
_SPECIAL_FILES = ("tokenizer_config.json", "special_tokens_map.json")
TOKENIZER_FILE_LIMIT = 1 << 30  # tokenizer.json: refused above this size (large vocabularies)
# `tokenizers` holds 160-175 bytes per character of text while it encodes (offsets, alignments,
# token strings): a longer text is encoded in pieces of about this many characters where that
# gives the same ids (`pieces_safe`), so a document of --max-doc-bytes needs ~2x its size
PIECE_CHARS = 1 << 16
_CUT = re.compile(r"(?<=\S) (?=\S)")  # a space between two non-spaces
_SPLITTING_PRE = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer", "ByteLevel"}
_PER_CHAR_NORM = {"Lowercase", "NFC", "NFD", "NFKC", "NFKD", "BertNormalizer"}


def pieces_safe(spec: dict) -> bool:
    """Are a text's ids the concatenation of its pieces' ids, cut before a space between two
    non-spaces? Yes when the pre-tokenizer splits there anyway (ByteLevel with its regex,
    Whitespace, WhitespaceSplit, Bert), the normalizer maps characters one by one, no
    post-processor adds tokens (none or ByteLevel), no added token holds a space or takes the
    spaces after it (rstrip: it would take the space a piece starts with), and neither
    truncation nor padding is set (each piece would be cut or padded; HFTokenizer turns both
    off, so a document is kept whole either way)."""
    if spec.get("truncation") or spec.get("padding"):
        return False
    pre, norm, post = (spec.get(k) or {} for k in ("pre_tokenizer", "normalizer", "post_processor"))
    if pre.get("type") not in _SPLITTING_PRE or pre.get("use_regex") is False:
        return False
    norms = (
        norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm] if norm else []
    )
    if any(n.get("type") not in _PER_CHAR_NORM for n in norms):
        return False
    added = spec.get("added_tokens") or []
    return post.get("type") in (None, "ByteLevel") and not any(
        t.get("rstrip") or any(c.isspace() for c in str(t.get("content", ""))) for t in added
    )


def text_pieces(text: str, size: int) -> Iterator[str]:
    """`text` cut into pieces of at least `size` characters (the last may be shorter), each cut
    before a space between two non-spaces (a piece is longer where there is none)."""
    start = 0
    while len(text) - start > size:
        m = _CUT.search(text, start + size)
        if m is None:
            break
        yield text[start : m.start()]
        start = m.start()
    yield text[start:]


@dataclass(frozen=True)
class TokenizerSpec:
    """What to tokenize with: ``kind`` is "bytes", "hf" (``path`` is a tokenizer.json) or
    "hf-dir" (``path`` is a saved tokenizer folder)."""

    kind: str = "bytes"
    path: str | None = None

    def build(self) -> Tokenizer:
        if self.kind == "bytes":
            return BytesTokenizer()
        if self.kind == "hf":
            if not self.path:
                raise InputError("--tokenizer needs a path to a tokenizer.json")
            return HFTokenizer(self.path)
        if self.kind == "hf-dir":
            if not self.path:
                raise InputError("--tokenizer-from needs a saved tokenizer folder")
            return HFTokenizer.from_folder(self.path)
        raise InputError(
            f"unknown tokenizer kind {self.kind!r}: expected 'bytes' or a tokenizer.json path"
        )

    @staticmethod
    def parse(value: str | None, folder: str | None = None) -> TokenizerSpec:
        """From the CLI values: `--tokenizer` None or "bytes" for bytes, else a tokenizer.json
        path; `--tokenizer-from` a saved tokenizer folder."""
        if folder is not None:
            return TokenizerSpec("hf-dir", os.path.abspath(folder))
        if value is None or value == "bytes":
            return TokenizerSpec("bytes")
        return TokenizerSpec("hf", os.path.abspath(value))


class Tokenizer:
    """Turns one document's text into token ids, with BOS/EOS where the tokenizer has them."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    lossy: bool = False  # can drop characters silently (then `lost_chars` counts them)

    @property
    def dtype(self) -> np.dtype:
        """uint16 when every id fits, else uint32."""
        return np.dtype(np.uint16) if self.vocab_size <= 65536 else np.dtype(np.uint32)

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`text`'s ids as they are, no BOS/EOS added (a chat template writes its own special
        tokens), and each token's first and end character in `text`."""
        raise NotImplementedError

    def frame(self, ids: np.ndarray) -> tuple[np.ndarray, int, int]:
        """`ids` with BOS first and EOS last where the tokenizer has them and they are not there
        already (as `encode` frames a document), and how many were added in front and behind."""
        front = self.bos_id is not None and (len(ids) == 0 or ids[0] != self.bos_id)
        back = self.eos_id is not None and (len(ids) == 0 or ids[-1] != self.eos_id)
        parts = [np.array([self.bos_id], self.dtype)] if front else []
        parts += [np.asarray(ids, self.dtype)]
        parts += [np.array([self.eos_id], self.dtype)] if back else []
        return np.concatenate(parts), int(front), int(back)

    def special_names(self) -> dict[str, str]:
        """The BOS and EOS as strings, keyed as a chat template reads them (bos_token,
        eos_token); none where the tokenizer has no token strings."""
        return {}

    def lost_chars(self, text: str) -> Lost | None:
        """The characters of `text` that `encode` drops without a trace (None: none)."""
        return None

    def describe(self) -> dict:
        raise NotImplementedError


class BytesTokenizer(Tokenizer):
    """UTF-8 bytes (ids 0..255) framed by BOS=256 and EOS=257; nothing to download or train."""

    vocab_size = BYTES_VOCAB
    bos_id = BYTES_BOS
    eos_id = BYTES_EOS

    def encode(self, text: str) -> np.ndarray:
        raw = text.encode("utf-8")
        out = np.empty(len(raw) + 2, dtype=np.uint16)
        out[0] = BYTES_BOS
        out[1:-1] = np.frombuffer(raw, dtype=np.uint8)
        out[-1] = BYTES_EOS
        return out

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raw = text.encode("utf-8")
        ids = np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)
        if len(raw) == len(text):
            starts = np.arange(len(text), dtype=np.int64)
        else:  # each byte belongs to its character: UTF-8 widths from the code points
            cp = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
            widths = 1 + (cp >= 0x80) + (cp >= 0x800) + (cp >= 0x10000)
            starts = np.repeat(np.arange(len(text), dtype=np.int64), widths.astype(np.int64))
        return ids, starts, starts + 1

    def describe(self) -> dict:
        return {"kind": "bytes"}


def _encode(tok: Any, text: str, **kw: bool) -> Any:  # a `tokenizers` Tokenizer, its Encoding
    """`tok.encode(text)`; text that is not valid Unicode (lone surrogates, "\\ud800" in JSON)
    raises UnicodeEncodeError, as the bytes tokenizer does, not the library's TypeError."""
    try:
        return tok.encode(text, **kw)
    except TypeError:
        text.encode("utf-8")  # raises UnicodeEncodeError naming the position
        raise


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer.json; adds its BOS/EOS tokens when it has them and its
    post-processor did not already. BOS/EOS are the ids of `bos`/`eos` when given (a saved
    folder's config), else the first known name (<s>, </s>, <|endoftext|>, ...) in the vocab."""

    def __init__(
        self, path: str, bos: str | None = None, eos: str | None = None, folder: str | None = None
    ) -> None:
        flag = "--tokenizer-from" if folder else "--tokenizer"
        try:
            from tokenizers import Tokenizer as _HFTok
        except ImportError as exc:  # pragma: no cover - depends on the optional extra
            raise InputError(
                f"{flag} needs the 'tokenizers' package: pip install 'mixlen[hf]'"
            ) from exc
        try:
            raw = read_bounded_bytes(path, TOKENIZER_FILE_LIMIT, "the tokenizer file")
            text = raw.decode("utf-8")
            self._tok = _HFTok.from_str(text)
            spec = json.loads(text)
        except InputError:
            raise
        except OSError as exc:
            raise InputError(f"{path}: cannot read tokenizer file: {exc.strerror or exc}") from exc
        except Exception as exc:
            raise InputError(f"{path}: not a valid Hugging Face tokenizer.json ({exc})") from exc
        # a document is kept whole: not cut at the file's truncation length, no pad ids added
        self._tok.no_truncation()
        self._tok.no_padding()
        self._spec_text = text  # for the offsets copy (encode_offsets), built when first used
        self._offsets_tok = None
        if isinstance(spec, dict):
            spec = {**spec, "truncation": None, "padding": None}  # as it encodes now
        self._loss = LossCheck.build(self._tok, spec) if isinstance(spec, dict) else None
        self.piecewise = isinstance(spec, dict) and pieces_safe(spec)
        self.piece_chars = PIECE_CHARS
        self.lossy = self._loss is not None
        self.path, self.folder = path, folder
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        if folder is None:
            self.bos_id = next((vocab[t] for t in _BOS_CANDIDATES if t in vocab), None)
            self.eos_id = next((vocab[t] for t in _EOS_CANDIDATES if t in vocab), None)
            return
        for key, name in (("bos_token", bos), ("eos_token", eos)):
            if name is not None and name not in vocab:
                raise InputError(
                    f"{folder}: {key} {name!r} from its config is not in tokenizer.json's vocabulary"
                )
        self.bos_id = vocab[bos] if bos is not None else None
        self.eos_id = vocab[eos] if eos is not None else None

    @classmethod
    def from_folder(cls, folder: str) -> HFTokenizer:
        """A saved tokenizer folder: tokenizer.json, BOS/EOS named by tokenizer_config.json (or
        special_tokens_map.json); a token set to null there is not added."""
        if not os.path.isdir(folder):
            raise InputError(f"--tokenizer-from {folder}: not a directory")
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.exists(path):
            other = [
                n
                for n in ("tokenizer.model", "vocab.json", "vocab.txt")
                if os.path.exists(os.path.join(folder, n))
            ]
            hint = f" (it has {', '.join(other)}: re-save it as a fast tokenizer)" if other else ""
            raise InputError(f"--tokenizer-from {folder}: no tokenizer.json{hint}")
        names = special_token_names(folder)
        return cls(path, names.get("bos_token"), names.get("eos_token"), folder=folder)

    def encode(self, text: str) -> np.ndarray:
        if self.piecewise and len(text) > self.piece_chars:
            try:
                parts = [
                    np.asarray(_encode(self._tok, p, add_special_tokens=False).ids, self.dtype)
                    for p in text_pieces(text, self.piece_chars)
                ]
            except UnicodeEncodeError:
                text.encode("utf-8")  # the position in the whole text, not in its piece
                raise
        else:
            parts = [np.asarray(_encode(self._tok, text).ids, dtype=self.dtype)]
        first = next((p[0] for p in parts if len(p)), None)
        last = next((p[-1] for p in reversed(parts) if len(p)), None)
        if self.bos_id is not None and (first is None or first != self.bos_id):
            parts.insert(0, np.array([self.bos_id], dtype=self.dtype))
        if self.eos_id is not None and (last is None or last != self.eos_id):
            parts.append(np.array([self.eos_id], dtype=self.dtype))
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As transformers' `tokenizer(text, add_special_tokens=False)` tokenizes a rendered
        conversation. The offsets come from a copy without post-processor, which gives the
        same ids (add_special_tokens=False adds none) but does not trim spaces off offsets (a
        token of spaces would have none)."""
        if self._offsets_tok is None:
            from tokenizers import Tokenizer as _HFTok

            self._offsets_tok = _HFTok.from_str(self._spec_text)
            self._offsets_tok.no_truncation()
            self._offsets_tok.no_padding()
            self._offsets_tok.post_processor = None
        enc = _encode(self._offsets_tok, text, add_special_tokens=False)
        offs = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
        return np.asarray(enc.ids, dtype=self.dtype), offs[:, 0].copy(), offs[:, 1].copy()

    def special_names(self) -> dict[str, str]:
        pairs = (("bos_token", self.bos_id), ("eos_token", self.eos_id))
        names = {key: self._tok.id_to_token(i) for key, i in pairs if i is not None}
        return {key: name for key, name in names.items() if name}

    def lost_chars(self, text: str) -> Lost | None:
        return self._loss.lost(text) if self._loss is not None else None

    def describe(self) -> dict:
        if self.folder is not None:
            return {"kind": "hf-dir", "path": self.folder, "sha256": self.sha256}
        return {"kind": "hf", "path": self.path, "sha256": self.sha256}


def special_token_names(
    folder: str, keys: tuple[str, ...] = ("bos_token", "eos_token")
) -> dict[str, str | None]:
    """Special tokens (bos_token/eos_token unless `keys` says) of a saved tokenizer folder: a
    string, an AddedToken dict (its "content") or null; special_tokens_map.json wins over
    tokenizer_config.json, as in transformers."""
    names: dict[str, str | None] = {}
    for fname in _SPECIAL_FILES:
        p = os.path.join(folder, fname)
        if not os.path.exists(p):
            continue
        try:
            conf = json.loads(read_bounded_text(p, CONFIG_FILE_LIMIT, "the tokenizer config"))
        except (OSError, json.JSONDecodeError, RecursionError) as exc:
            raise InputError(f"{p}: cannot read tokenizer config ({exc})") from None
        if not isinstance(conf, dict):
            raise InputError(f"{p}: expected a JSON object")
        for key in keys:
            if key not in conf:
                continue
            v = conf[key]
            if isinstance(v, dict):
                v = v.get("content")
            if v is not None and not isinstance(v, str):
                raise InputError(f"{p}: {key} must be a string, an AddedToken or null, got {v!r}")
            names[key] = v
    return names
