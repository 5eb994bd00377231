"""The settings of `mixlen preprocess` (one field per command-line option) and their checks."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from datapipe.errors import InputError
from datapipe.formats import FORMATS
from datapipe.ingest.sources import MAX_DOC_BYTES
from datapipe.settings import MAX_INT

LONG_DOC_POLICIES = ("split", "truncate", "drop")
MIN_DOC_BYTES = 64  # --max-doc-bytes lower limit: room for whole UTF-8 characters and a cut
MAX_CHUNK_TOKENS = 1 << 31  # --chunk-tokens: a shard row's tokens, 8 GiB of uint32 at most
MAX_WORKERS = 4096  # --workers: processes on one machine


@dataclass
class PreprocessConfig:
    """Arguments of `mixlen preprocess`."""

    inputs: list[str]
    out: str
    format: str = "mds"
    tokenizer: str | None = None  # None or "bytes": UTF-8 bytes; else a tokenizer.json path
    tokenizer_from: str | None = None  # a saved tokenizer folder (tokenizer.json + its configs)
    chat_template: str | None = None  # a Jinja template file (else the tokenizer folder's)
    text_field: str = "text"
    globs: list[str] = field(default_factory=lambda: ["**/*"])
    excludes: list[str] = field(default_factory=list)
    chunk_tokens: int = 65536
    max_len: int | None = None
    long_docs: str = "split"
    max_doc_bytes: int = MAX_DOC_BYTES  # larger documents: split/truncated/dropped (long_docs)
    min_tokens: int = 0  # samples shorter than this are dropped (counted as `short`)
    workers: int = 1
    strict: bool = False
    overwrite: bool = False
    shard_bytes: int = 1 << 26
    progress: bool | None = None  # None: only on a terminal
    max_reported: int = 5
    engine: str = "local"  # a key of datapipe.ingest.engines.ENGINES
    ray_address: str | None = None  # --engine ray: join this cluster (None: a local runtime)
    staging: str | None = None  # remote --out: local directory to write in before the upload

    def validate(self, engines: Collection[str]) -> None:
        """Reject bad settings with a message naming the option; `engines`: the known engine
        names (the keys of datapipe.ingest.engines.ENGINES, which imports this module)."""
        if not self.inputs:
            raise InputError("no inputs given")
        if self.format not in FORMATS:
            raise InputError(f"--format {self.format!r}: expected one of {', '.join(FORMATS)}")
        if self.long_docs not in LONG_DOC_POLICIES:
            raise InputError(
                f"--long-docs {self.long_docs!r}: expected one of {', '.join(LONG_DOC_POLICIES)}"
            )
        if not 1 <= self.chunk_tokens <= MAX_CHUNK_TOKENS:
            raise InputError(
                f"--chunk-tokens: must be an integer in [1, {MAX_CHUNK_TOKENS:,}], "
                f"got {self.chunk_tokens}"
            )
        if self.max_len is not None and not 1 <= self.max_len <= MAX_INT:
            raise InputError(
                f"--max-len: must be an integer in [1, {MAX_INT:,}], got {self.max_len}"
            )
        if not MIN_DOC_BYTES <= self.max_doc_bytes < 1 << 40:
            raise InputError(
                f"--max-doc-bytes must be between {MIN_DOC_BYTES} bytes and 1 TiB, "
                f"got {self.max_doc_bytes}"
            )
        if not 0 <= self.min_tokens < 1 << 40:
            raise InputError(f"--min-tokens must be >= 0, got {self.min_tokens}")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise InputError(
                f"--workers: must be an integer in [1, {MAX_WORKERS:,}], got {self.workers}"
            )
        if self.engine not in engines:
            raise InputError(f"--engine {self.engine!r}: expected one of {', '.join(engines)}")
        if self.ray_address is not None and self.engine != "ray":
            raise InputError("--ray-address needs --engine ray")
        if self.tokenizer is not None and self.tokenizer_from is not None:
            raise InputError("--tokenizer and --tokenizer-from: give one of them, not both")
        if not 1 <= self.shard_bytes < 1 << 32:
            raise InputError(
                f"--shard-size must be between 1 byte and 4 GiB, got {self.shard_bytes}"
            )
