"""Corpus inputs: find documents, read them in blocks, and tokenize blocks (in worker processes).

The main process reads raw blocks (file bytes, JSON Lines, parquet text batches) in input order; a
block is tokenized by `process_block`, possibly in another process; results come back in order, so
the output never depends on the number of workers.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from datapipe.errors import InputError
from datapipe.ingest.tokenizer import Tokenizer, TokenizerSpec

BLOCK_BYTES = 4 << 20  # raw bytes per block handed to a worker
BLOCK_FILES = 256  # plain-text files per block
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.zstd")


def input_kind(path: Path) -> str:
    """'jsonl', 'parquet' or 'text', from the file name."""
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def glob_regex(pattern: str) -> re.Pattern:
    """Compile a glob over relative POSIX paths: `*`, `?` and `[...]` stay inside one component,
    `**` spans any number of directories (zero included)."""
    out = []
    parts = pattern.strip("/").split("/")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            out.append(".*" if last else "(?:[^/]+/)*")
            continue
        out.append(_component(part))
        if not last:
            out.append("/")
    return re.compile("".join(out) + r"\Z")


def _component(part: str) -> str:
    rx, i = [], 0
    while i < len(part):
        c = part[i]
        if c == "*":
            rx.append("[^/]*")
        elif c == "?":
            rx.append("[^/]")
        elif c == "[":
            j = part.find("]", i + 1)
            if j < 0:
                rx.append(re.escape(c))
            else:
                body = part[i + 1 : j]
                neg = body.startswith("!")
                body = (body[1:] if neg else body).replace("\\", "\\\\").replace("^", "\\^")
                rx.append(("[^" if neg else "[") + body + "]")
                i = j
        else:
            rx.append(re.escape(c))
        i += 1
    return "".join(rx)


def _walk(top: Path, include: list[re.Pattern], exclude: list[re.Pattern]) -> list[Path]:
    """Files under `top` matching an include pattern and no exclude pattern; excluded
    directories are not entered."""
    found = []
    for dirpath, dirnames, filenames in os.walk(top):
        rel_dir = os.path.relpath(dirpath, top)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
        dirnames[:] = [
            d
            for d in dirnames
            if not any(x.match(rel_dir + d) or x.match(rel_dir + d + "/") for x in exclude)
        ]
        for name in filenames:
            rel = rel_dir + name
            if any(x.match(rel) for x in include) and not any(x.match(rel) for x in exclude):
                found.append(rel)
    return [top / r for r in sorted(found)]


def find_inputs(inputs: list[str], globs: list[str], excludes: tuple[str, ...] = ()) -> list[Path]:
    """Expand files and directories into an ordered, de-duplicated file list. Inside a directory,
    files are kept when their relative path matches a glob and no exclude (`**` spans
    directories; a directory matching an exclude, or `pattern/*`, is skipped whole)."""
    include = [glob_regex(g) for g in globs]
    exclude = [glob_regex(x) for x in excludes]
    exclude += [glob_regex(x[: -len(s)]) for x in excludes for s in ("/*", "/**") if x.endswith(s)]
    out: list[Path] = []
    seen: set[str] = set()
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            files = _walk(p, include, exclude)
        elif p.exists():
            files = [p]
        else:
            raise InputError(f"{item}: input not found")
        for f in files:
            key = os.path.normpath(os.path.abspath(f))
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out


@dataclass
class Block:
    """Raw documents to tokenize: ``kind`` is text/jsonl/parquet/error."""

    kind: str
    path: str
    start: int = 0  # first line (jsonl, 1-based) or row (parquet, 0-based)
    items: list = field(default_factory=list)  # text: paths; jsonl: raw lines; parquet: values
    nbytes: int = 0
    error: str | None = None  # a read error found by the main process (kind == "error")


@dataclass
class BlockResult:
    """Tokenized documents of one block, in order, with the outcome counts."""

    sources: list[str] = field(default_factory=list)
    tokens: list[np.ndarray] = field(default_factory=list)
    bad: list[tuple[str, str]] = field(default_factory=list)  # (where, reason)
    documents: int = 0
    empty: int = 0
    split: int = 0
    truncated: int = 0
    dropped: int = 0
    nbytes: int = 0


class _ZstdStream(io.RawIOBase):
    """Decompressed bytes of a `.zst` file, frame after frame; unlike `stream_reader`, a file that
    ends inside a frame raises EOFError (a truncated file is bad input, not a shorter one), and
    corrupt data raises ValueError."""

    def __init__(self, path: Path, zstandard) -> None:
        self._z = zstandard
        self._f = open(path, "rb")
        self._d = zstandard.ZstdDecompressor().decompressobj()
        self._pending = b""  # compressed bytes not fed yet (the start of the next frame)
        self._in_frame = False
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._out:
            chunk = self._pending or self._f.read(1 << 16)
            self._pending = b""
            if not chunk:
                if self._in_frame:
                    raise EOFError("truncated zstd stream: the file ends inside a frame")
                return 0
            try:
                data = self._d.decompress(chunk)
            except self._z.ZstdError as exc:
                raise ValueError(f"corrupt zstd data ({exc})") from None
            self._in_frame = not self._d.eof
            if self._d.eof:  # a frame ended: what follows starts the next one
                self._pending = self._d.unused_data
                self._d = self._z.ZstdDecompressor().decompressobj()
            self._out = memoryview(data)
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def _open_text_stream(path: Path):
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith((".zst", ".zstd")):
        try:
            import zstandard
        except ImportError as exc:
            raise InputError(
                f"{path}: reading .zst input needs the 'zstandard' package: pip install 'mixlen[zst]'"
            ) from exc
        return io.BufferedReader(_ZstdStream(path, zstandard), 1 << 20)
    return open(path, "rb")


def _iter_jsonl(path: Path) -> Iterator[Block]:
    block = Block("jsonl", str(path), start=1)
    line_no = 0
    try:
        with _open_text_stream(path) as raw:
            for line in raw:
                line_no += 1
                if not block.items:
                    block.start = line_no
                block.items.append(line)
                block.nbytes += len(line)
                if block.nbytes >= BLOCK_BYTES:
                    yield block
                    block = Block("jsonl", str(path), start=line_no + 1)
    except InputError:
        raise
    except (OSError, EOFError, ValueError) as exc:  # unreadable, truncated or corrupt compression
        if block.items:
            yield block
        where = f"{path}:{line_no + 1}" if line_no else str(path)
        yield Block("error", where, error=f"cannot read file: {exc}")
        return
    if block.items:
        yield block


def _iter_parquet(path: Path, text_field: str) -> Iterator[Block]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:
        yield Block("error", str(path), error=f"cannot read parquet file: {exc}")
        return
    names = pf.schema_arrow.names
    if text_field not in names:
        yield Block(
            "error",
            str(path),
            error=f"missing text field {text_field!r} (columns: {', '.join(names)})",
        )
        return
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=4096, columns=[text_field]):
            values = batch.column(0).to_pylist()
            nbytes = batch.nbytes
            yield Block("parquet", str(path), start=row, items=values, nbytes=nbytes)
            row += len(values)
    except Exception as exc:
        yield Block("error", f"{path}#{row}", error=f"cannot read parquet file: {exc}")


def iter_blocks(files: list[Path], text_field: str) -> Iterator[Block]:
    """Raw blocks of all inputs, in input order."""
    text = Block("text", "")
    for f in files:
        kind = input_kind(f)
        if kind == "text":
            try:
                size = f.stat().st_size
            except OSError:
                size = 0
            text.items.append(str(f))
            text.nbytes += size
            if text.nbytes >= BLOCK_BYTES or len(text.items) >= BLOCK_FILES:
                yield text
                text = Block("text", "")
            continue
        if text.items:
            yield text
            text = Block("text", "")
        if kind == "jsonl":
            yield from _iter_jsonl(f)
        else:
            yield from _iter_parquet(f, text_field)
    if text.items:
        yield text


# ---- worker side ---------------------------------------------------------------------------

_WORKER: dict = {}


@dataclass(frozen=True)
class TokenizeSettings:
    """What a worker needs to tokenize blocks."""

    tokenizer: TokenizerSpec
    text_field: str = "text"
    max_len: int | None = None
    long_docs: str = "split"


def init_worker(settings: TokenizeSettings) -> None:
    """Pool initializer: build the tokenizer once per process."""
    _WORKER["settings"] = settings
    _WORKER["tokenizer"] = settings.tokenizer.build()


def _utf8_error(exc: UnicodeDecodeError) -> str:
    return f"not valid UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"


def _add_doc(
    res: BlockResult, source: str, text: object, tok: Tokenizer, s: TokenizeSettings
) -> None:
    if not isinstance(text, str):
        res.bad.append(
            (source, f"text field {s.text_field!r} is {type(text).__name__}, expected a string")
        )
        return
    res.documents += 1
    if not text:
        res.empty += 1
        return
    try:
        ids = tok.encode(text)
    except UnicodeEncodeError as exc:  # lone surrogates ("\ud800" in JSON) are not UTF-8
        res.documents -= 1
        res.bad.append((source, f"text is not valid Unicode ({exc.reason} at {exc.start})"))
        return
    n = len(ids)
    if n == 0:
        res.empty += 1
        return
    if s.max_len is not None and n > s.max_len:
        if s.long_docs == "drop":
            res.dropped += 1
            return
        if s.long_docs == "truncate":
            res.truncated += 1
            ids = ids[: s.max_len]
        else:
            res.split += 1
            for part, start in enumerate(range(0, n, s.max_len)):
                res.sources.append(f"{source}@{part}")
                res.tokens.append(ids[start : start + s.max_len])
            return
    res.sources.append(source)
    res.tokens.append(ids)


def process_block(block: Block) -> BlockResult:
    """Parse and tokenize one block; bad records are collected, never raised."""
    s: TokenizeSettings = _WORKER["settings"]
    tok: Tokenizer = _WORKER["tokenizer"]
    res = BlockResult(nbytes=block.nbytes)
    if block.kind == "error":
        res.bad.append((block.path, block.error or "unreadable"))
    elif block.kind == "text":
        for path in block.items:
            try:
                with open(path, "rb") as f:
                    raw = f.read()
            except OSError as exc:
                res.bad.append((path, f"cannot read file: {exc.strerror or exc}"))
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                res.bad.append((path, _utf8_error(exc)))
                continue
            _add_doc(res, path, text, tok, s)
    elif block.kind == "jsonl":
        for i, line in enumerate(block.items):
            where = f"{block.path}:{block.start + i}"
            if not line.strip():
                continue
            try:
                obj = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as exc:
                res.bad.append((where, _utf8_error(exc)))
                continue
            except json.JSONDecodeError as exc:
                res.bad.append((where, f"invalid JSON: {exc.msg} (column {exc.colno})"))
                continue
            except RecursionError:
                res.bad.append((where, "invalid JSON: nested too deeply"))
                continue
            except ValueError as exc:  # e.g. an integer beyond Python's digit limit
                res.bad.append((where, f"invalid JSON: {exc}"))
                continue
            if not isinstance(obj, dict):
                res.bad.append((where, f"expected a JSON object, got {type(obj).__name__}"))
                continue
            if s.text_field not in obj:
                res.bad.append((where, f"missing text field {s.text_field!r}"))
                continue
            text = obj[s.text_field]
            _add_doc(res, where, text, tok, s)
    elif block.kind == "parquet":
        for i, text in enumerate(block.items):
            where = f"{block.path}#{block.start + i}"
            if text is None:
                res.bad.append((where, f"text field {s.text_field!r} is null"))
                continue
            if isinstance(text, bytes):
                try:
                    text = text.decode("utf-8")
                except UnicodeDecodeError as exc:
                    res.bad.append((where, _utf8_error(exc)))
                    continue
            _add_doc(res, where, text, tok, s)
    else:  # pragma: no cover - internal
        raise AssertionError(block.kind)
    return res
