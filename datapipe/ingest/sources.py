"""Reading the inputs in blocks, in input order (the main process, or a Ray task): file bytes,
JSON Lines, parquet and Arrow text batches. A block is tokenized by `worker.process_block`,
possibly in another process; results come back in order, so the output never depends on the
number of workers.

Every read is bounded by `--max-doc-bytes` (B): a JSON line is read with a bounded readline (a
longer one is a bad line, skipped without being held), a text file over B is cut into pieces of
at most B bytes (`--long-docs split`), read up to one piece (`truncate`) or not at all (`drop`),
and parquet/Arrow batches are sized to about BLOCK_BYTES from the files' metadata.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from datapipe.errors import InputError
from datapipe.files import NotRegularFile, not_regular_reason, open_regular
from datapipe.ingest import hf_export
from datapipe.ingest.chat import TemplateSource
from datapipe.ingest.inputs import input_kind
from datapipe.ingest.rows import SFT_FIELDS, row_kind
from datapipe.ingest.tokenizer import TokenizerSpec

BLOCK_BYTES = 4 << 20  # raw bytes per block handed to a worker
BLOCK_FILES = 256  # plain-text files per block
MAX_DOC_BYTES = 256 << 20  # --max-doc-bytes default
CUT_WINDOW = 64 << 10  # a piece ends at a line break or space in its last 64 KiB when it can
_SKIP_CHUNK = 1 << 20


@dataclass(frozen=True)
class TokenizeSettings:
    """What reading and tokenizing need (pickled into worker processes and Ray tasks)."""

    tokenizer: TokenizerSpec
    text_field: str = "text"
    max_len: int | None = None
    long_docs: str = "split"
    max_doc_bytes: int = MAX_DOC_BYTES
    min_tokens: int = 0
    chat: TemplateSource | None = None  # conversations' chat template (datapipe.ingest.chat)


@dataclass
class Block:
    """Raw documents to tokenize. ``kind``: "text" (``items``: whole files), "jsonl" (raw
    lines), "parquet" (values), "rows" (parquet or Arrow rows of conversations or
    prompt-completion pairs: dicts of their fields, ``row_kind`` says which), "piece" (bytes [start, end) of a text file over
    --max-doc-bytes: piece number ``part``, or the kept head under --long-docs truncate with
    part -1), "long" (a text file over --max-doc-bytes dropped unread) or "error"."""

    kind: str
    path: str
    start: int = 0  # first line (jsonl, 1-based), row (parquet, 0-based) or byte (piece)
    items: list = field(default_factory=list)  # text: paths; jsonl: raw lines; parquet: values
    nbytes: int = 0
    error: str | None = None  # a read error found by the main process (kind == "error")
    end: int = 0  # piece: the byte after its last
    part: int = 0  # piece: its number (-1: the head kept by --long-docs truncate)
    row_kind: str = ""  # rows: "messages" or "prompt_completion" (datapipe.ingest.rows)

    def where(self) -> str:
        """The input it comes from (a text block: its first file and how many follow)."""
        if self.kind != "text":
            return self.path
        more = len(self.items) - 1
        return self.items[0] + (f" (or one of the {more} text files after it)" if more else "")


class _ZstdStream(io.RawIOBase):
    """Decompressed bytes of a `.zst` file, frame after frame; unlike `stream_reader`, a file that
    ends inside a frame raises EOFError (a truncated file is bad input, not a shorter one), and
    corrupt data raises ValueError."""

    def __init__(self, f: io.BufferedIOBase, zstandard) -> None:
        self._z = zstandard
        self._f = f
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


@contextlib.contextmanager
def _open_text_stream(path: Path) -> Iterator[io.BufferedIOBase]:
    """A binary stream of the file's (decompressed) bytes; a regular file only."""
    name = path.name.lower()
    zstandard = None
    if name.endswith((".zst", ".zstd")):
        try:
            import zstandard
        except ImportError as exc:
            raise InputError(
                f"{path}: reading .zst input needs the 'zstandard' package: pip install 'mixlen[zst]'"
            ) from exc
    with open_regular(path) as f:
        if zstandard is not None:
            with io.BufferedReader(_ZstdStream(f, zstandard), 1 << 20) as r:
                yield r
        elif name.endswith(".gz"):
            with gzip.GzipFile(fileobj=f, mode="rb") as g:
                yield g
        else:
            yield f


def _skip_line(raw) -> int:
    """Read and forget the rest of a line (bounded chunks); the bytes skipped."""
    n = 0
    while True:
        chunk = raw.readline(_SKIP_CHUNK)
        n += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return n


def _iter_jsonl(path: Path, limit: int) -> Iterator[Block]:
    """Blocks of raw lines; a line over `limit` bytes (its newline aside) is an "error" block
    naming the line, never held whole."""
    block = Block("jsonl", str(path), start=1)
    line_no = 0
    try:
        with _open_text_stream(path) as raw:
            while line := raw.readline(limit + 1):
                line_no += 1
                if len(line) > limit and not line.endswith(b"\n"):
                    n = len(line) + _skip_line(raw)
                    if block.items:
                        yield block
                    yield Block(
                        "error",
                        f"{path}:{line_no}",
                        nbytes=n,
                        error=f"line of {n:,} bytes is longer than --max-doc-bytes ({limit:,})",
                    )
                    block = Block("jsonl", str(path), start=line_no + 1)
                    continue
                if not block.items:
                    block.start = line_no
                block.items.append(line)
                block.nbytes += len(line)
                if block.nbytes >= BLOCK_BYTES:
                    yield block
                    block = Block("jsonl", str(path), start=line_no + 1)
    except NotRegularFile as exc:  # replaced since the inputs were listed
        yield Block("error", str(path), error=exc.reason)
        return
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


def batch_rows(value_bytes: float) -> int:
    """Rows per parquet/Arrow batch for values of about `value_bytes` each: BLOCK_BYTES a batch,
    between 1 and 4096 rows."""
    return int(max(1, min(4096, BLOCK_BYTES // max(1.0, value_bytes))))


def _parquet_value_bytes(pf, fields: tuple[str, ...]) -> float:
    """The largest average uncompressed bytes per row of `fields` over the row groups."""
    md = pf.metadata
    cols = [j for j in range(md.num_columns) if md.schema.column(j).path.split(".")[0] in fields]
    worst = 0.0
    for i in range(md.num_row_groups):
        rg = md.row_group(i)
        for j in cols:
            worst = max(worst, rg.column(j).total_uncompressed_size / max(1, rg.num_rows))
    return worst


def _iter_parquet(path: Path, text_field: str) -> Iterator[Block]:
    import pyarrow.parquet as pq

    try:
        problem = not_regular_reason(path)  # checked first: pyarrow would block on a FIFO
    except OSError as exc:
        problem = f"cannot read file: {exc.strerror or exc}"
    if problem:
        yield Block("error", str(path), error=problem)
        return
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:
        yield Block("error", str(path), error=f"cannot read parquet file: {exc}")
        return
    with contextlib.closing(pf):
        names = pf.schema_arrow.names
        kind = row_kind(names, text_field)
        if kind is None:
            yield Block(
                "error",
                str(path),
                error=f"missing text field {text_field!r} (columns: {', '.join(names)}); "
                "instruction data has messages, or prompt and completion",
            )
            return
        fields = (text_field,) if kind == "text" else tuple(f for f in SFT_FIELDS if f in names)
        row = 0
        try:
            rows = batch_rows(_parquet_value_bytes(pf, fields))
            for batch in pf.iter_batches(batch_size=rows, columns=list(fields)):
                nbytes = batch.nbytes
                if kind == "text":
                    values = batch.column(0).to_pylist()
                    yield Block("parquet", str(path), start=row, items=values, nbytes=nbytes)
                else:
                    values = batch.to_pylist()
                    yield Block("rows", str(path), start=row, items=values, nbytes=nbytes,
                                row_kind=kind)  # fmt: skip
                row += len(values)
        except Exception as exc:
            yield Block("error", f"{path}#{row}", error=f"cannot read parquet file: {exc}")


def cut_points(read: Callable[[int, int], bytes], size: int, limit: int) -> list[int]:
    """Where to cut `size` bytes into pieces of at most `limit` bytes: [0, c1, ..., size].
    `read(n, offset)` gives bytes. A piece ends after the last line break in its last
    CUT_WINDOW bytes (at most half the piece), else after the last space or tab there, else
    before the last UTF-8 character start, so valid UTF-8 stays valid in every piece."""
    cuts = [0]
    window = max(1, min(CUT_WINDOW, limit // 2))
    while size - cuts[-1] > limit:
        lo = cuts[-1]
        hi = lo + limit
        start = max(lo + 1, hi - window)
        buf = read(hi + 1 - start, start)  # bytes start..hi; the one at hi starts the next piece
        head = buf[: hi - start]
        cut = hi
        for sep in (b"\n", b" ", b"\t"):
            k = head.rfind(sep)
            if k >= 0:
                cut = start + k + 1
                break
        else:
            for k in range(len(buf) - 1, max(0, len(buf) - 5), -1):
                if buf[k] & 0xC0 != 0x80:  # not a continuation byte: a character starts here
                    cut = start + k
                    break
        cuts.append(cut)
    cuts.append(size)
    return cuts


def _long_text_blocks(path: Path, size: int, s: TokenizeSettings) -> Iterator[Block]:
    """A text file over --max-doc-bytes: pieces, the kept head, or one dropped document."""
    if s.long_docs == "drop":
        yield Block("long", str(path), nbytes=size)
        return
    try:
        with open_regular(path) as f:
            fd = f.fileno()
            cuts = cut_points(lambda n, off: os.pread(fd, n, off), size, s.max_doc_bytes)
    except (NotRegularFile, OSError) as exc:
        reason = getattr(exc, "reason", None) or f"cannot read file: {exc.strerror or exc}"
        yield Block("error", str(path), error=reason)
        return
    if s.long_docs == "truncate":
        yield Block("piece", str(path), start=0, end=cuts[1], nbytes=size, part=-1)
        return
    for j in range(len(cuts) - 1):
        a, b = cuts[j], cuts[j + 1]
        yield Block("piece", str(path), start=a, end=b, nbytes=b - a, part=j)


def iter_blocks(files: list[Path], s: TokenizeSettings) -> Iterator[Block]:
    """Raw blocks of all inputs, in input order."""
    text = Block("text", "")
    for f in files:
        kind = input_kind(f)
        if kind == "text":
            try:
                size = f.stat().st_size
            except OSError:
                size = 0
            if size > s.max_doc_bytes:
                if text.items:
                    yield text
                    text = Block("text", "")
                yield from _long_text_blocks(f, size, s)
                continue
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
            yield from _iter_jsonl(f, s.max_doc_bytes)
        elif kind == "hf":
            yield from hf_export.iter_saved_dataset(f, s.text_field, Block, batch_rows)
        else:
            yield from _iter_parquet(f, s.text_field)
    if text.items:
        yield text
