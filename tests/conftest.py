"""Shared fixtures: small corpora, and cleanup of what mosaicml-streaming leaves behind."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_STREAMING_LEFTOVER = re.compile(r"^\d{6}_")


def _leftovers() -> tuple[set[str], set[str]]:
    shm = (
        {n for n in os.listdir("/dev/shm") if _STREAMING_LEFTOVER.match(n)}
        if os.path.isdir("/dev/shm")
        else set()
    )
    tmp = {n for n in os.listdir("/tmp") if n.endswith("_filelock")}
    return shm, tmp


@pytest.fixture(scope="session", autouse=True)
def _streaming_cleanup():
    """mosaicml-streaming leaves shared memory and /tmp file locks (its #781, #893): remove ours
    (the library's own clean_stale_shared_memory would also unlink other running jobs' memory)."""
    shm0, tmp0 = _leftovers()
    yield
    if "streaming" in sys.modules:  # dead processes' segments only, never a live job's
        from datapipe.formats.mds import clean_stale_streaming

        clean_stale_streaming()
    shm1, tmp1 = _leftovers()
    for n in shm1 - shm0:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join("/dev/shm", n))
    for n in tmp1 - tmp0:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join("/tmp", n))


@contextlib.contextmanager
def open_streaming_dataset(local: str):
    """A StreamingDataset over a local MDS dir, cleaned up (shared memory) on exit."""
    from streaming import StreamingDataset

    from datapipe.formats.mds import clean_stale_streaming, release_streaming_prefix

    clean_stale_streaming()
    ds = StreamingDataset(local=local, batch_size=1, shuffle=False)
    prefix = int(ds._shm_prefix_int)
    try:
        yield ds
    finally:
        del ds
        release_streaming_prefix(prefix)


DOCS = [
    "hello world",
    "",  # empty: skipped and counted
    "ünïcödé → multi-byte ✓ " * 7,
    "x" * 300,  # longer than small chunk sizes
    "short",
    "def f():\n    return 42\n" * 40,
]


@pytest.fixture
def corpus(tmp_path: Path) -> dict:
    """A mixed corpus: JSON Lines (plain, gz, zst), parquet and a directory of text files.

    Returns the input paths and the expected documents in input order (the reference).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    src = tmp_path / "src"
    src.mkdir()
    texts = src / "texts"
    texts.mkdir()
    expected: list[str] = []
    lines = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS))
    (src / "a.jsonl").write_text(lines)
    expected += DOCS
    with gzip.open(src / "b.jsonl.gz", "wt") as f:
        f.write(lines)
    expected += DOCS
    (src / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    expected += DOCS
    pq.write_table(pa.table({"text": DOCS[::-1]}), src / "d.parquet")
    expected += DOCS[::-1]
    for i, t in enumerate(DOCS):
        (texts / f"doc{i:02d}.txt").write_text(t)
    expected += DOCS  # sorted file names = DOCS order
    inputs = [str(src / n) for n in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet")] + [
        str(texts)
    ]
    return {"inputs": inputs, "expected": expected, "tmp": tmp_path}


@pytest.fixture
def one_torch_thread():
    """torch on one thread during the test (as each rank runs), the previous count restored."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
