"""Checks that a dataset's files are what its manifest says, before their bytes are used.

- `check_manifest`: manifest.json's fields have the types and ranges docs/FORMAT.md gives, and
  shard names are plain relative paths (no `..`, no absolute path), so a manifest cannot make a
  reader open a file outside the dataset.
- `check_index`: index.parquet agrees with the manifest (row count, storage rows per sample,
  shard and row ranges, consecutive rows): an index edited by hand or written for other shards is
  refused naming its first bad row.
- `check_shard_file`: a shard's size and XXH3-64 against its manifest entry; the fetch calls it the
  first time a process opens a shard (mosaicml-streaming checks hashes only when it downloads or
  decompresses a shard, never for a local one).

Every error is an InputError naming the file, the field or row, and what was expected. Imports
numpy and xxhash only.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import xxhash

from datapipe.errors import VERIFY_ADVICE, InputError

__all__ = [
    "FINGERPRINT_KEY",
    "INDEX_CHECKSUM_KEY",
    "check_index",
    "check_manifest",
    "check_shard_file",
    "checksum_file",
    "dataset_fingerprint",
    "expected_row_lengths",
    "shard_name_problem",
]

INDEX_CHECKSUM_KEY = "index_xxh3_64"  # manifest.json: XXH3-64 of index.parquet (written last)
FINGERPRINT_KEY = "dataset_fingerprint"  # manifest.json: identity of the data (below)
TOKEN_DTYPES = ("uint8", "uint16", "uint32", "int32", "int64")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


def checksum_file(path: str) -> str:
    """Hex XXH3-64 of a file's bytes (the manifest's per-shard checksum: fast, not cryptographic).
    Hashed through a read-only mapping: no copy out of the page cache."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_64_hexdigest(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if hasattr(m, "madvise"):
                m.madvise(mmap.MADV_SEQUENTIAL)
            return xxhash.xxh3_64_hexdigest(m)


def dataset_fingerprint(manifest: Mapping[str, Any]) -> str:
    """The dataset's identity: 32 hex digits (128 bits) of SHA-256 over index.parquet's
    XXH3-64 and every shard's, in storage order (names, layout and arguments left out: a
    dataset is what its bytes are). Computed from the manifest's checksums, so a manifest
    written before the field existed has one too. A missing checksum enters as "-"."""
    lines = [f"index {manifest.get(INDEX_CHECKSUM_KEY) or '-'}"]
    lines += [f"shard {s.get('xxh3_64') or '-'}" for s in manifest["shards"]]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]


def shard_name_problem(name: object) -> str | None:
    """Why `name` cannot be a shard file name inside a dataset directory (None if it can)."""
    if not isinstance(name, str) or not name:
        return f"expected a non-empty file name, got {name!r}"
    if "\x00" in name or "\\" in name:
        return f"{name!r} contains a NUL or a backslash"
    if name.startswith("/") or os.path.isabs(name):
        return f"{name!r} is an absolute path; shard names are relative to the dataset directory"
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return f"{name!r} has an empty, '.' or '..' component; it must stay inside the dataset"
    return None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_INT_MAX = 1 << 62  # counts and sizes the int64 arithmetic on them holds


def _need_int(where: str, v: object, lo: int) -> None:
    if not _is_int(v) or not lo <= v <= _INT_MAX:  # type: ignore[operator]
        raise InputError(f"{where}: expected an integer in [{lo}, 2^62], got {v!r}")


def check_manifest(manifest: object, mpath: str) -> None:
    """InputError naming `mpath` and the first field of `manifest` that is missing or malformed."""
    if not isinstance(manifest, dict):
        raise InputError(f"{mpath}: expected a JSON object, got {type(manifest).__name__}")
    for key in ("format", "num_samples", "shards", "chunk_tokens"):
        if key not in manifest:
            raise InputError(f"{mpath}: missing key {key!r}")
    if not isinstance(manifest["format"], str):
        raise InputError(f"{mpath}: format: expected a string, got {manifest['format']!r}")
    _need_int(f"{mpath}: num_samples", manifest["num_samples"], 0)
    _need_int(f"{mpath}: chunk_tokens", manifest["chunk_tokens"], 1)
    for key in ("num_tokens", "num_rows"):
        if key in manifest:
            _need_int(f"{mpath}: {key}", manifest[key], 0)
    vocab = manifest.get("vocab_size")
    if vocab is not None:
        _need_int(f"{mpath}: vocab_size", vocab, 1)
    dtype = manifest.get("dtype", "uint16")
    if dtype not in TOKEN_DTYPES:
        raise InputError(
            f"{mpath}: dtype: expected one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}"
        )
    if "tokens_field" in manifest and not isinstance(manifest["tokens_field"], str):
        raise InputError(f"{mpath}: tokens_field: expected a string")
    if manifest.get("loss_mask") not in (None, False, "trained_spans"):
        raise InputError(
            f'{mpath}: loss_mask: expected "trained_spans" or none, got {manifest["loss_mask"]!r}'
        )
    for key in ("bos_id", "eos_id"):  # a special token's id, or none
        v = manifest.get(key)
        if v is not None and not (_is_int(v) and 0 <= v <= _INT_MAX):
            raise InputError(
                f"{mpath}: {key}: expected a token id (an integer >= 0) or null, got {v!r}"
            )
    digest = manifest.get(INDEX_CHECKSUM_KEY)
    if digest is not None and not (isinstance(digest, str) and _HEX16.match(digest)):
        raise InputError(f"{mpath}: {INDEX_CHECKSUM_KEY}: expected 16 hex digits, got {digest!r}")
    fp = manifest.get(FINGERPRINT_KEY)
    if fp is not None and not (isinstance(fp, str) and _HEX32.match(fp)):
        raise InputError(f"{mpath}: {FINGERPRINT_KEY}: expected 32 hex digits, got {fp!r}")
    shards = manifest["shards"]
    if not isinstance(shards, list):
        raise InputError(f"{mpath}: shards: expected a list, got {type(shards).__name__}")
    seen: set[str] = set()
    for i, s in enumerate(shards):
        where = f"{mpath}: shards[{i}]"
        if not isinstance(s, dict):
            raise InputError(f"{where}: expected an object, got {s!r}")
        if "name" not in s or "rows" not in s:
            raise InputError(f"{where}: missing key {'name' if 'name' not in s else 'rows'!r}")
        problem = shard_name_problem(s["name"])
        if problem:
            raise InputError(f"{where}.name: {problem}")
        if s["name"] in seen:
            raise InputError(f"{where}.name: {s['name']!r} is listed twice")
        seen.add(s["name"])
        _need_int(f"{where}.rows", s["rows"], 0)
        if "bytes" in s:
            _need_int(f"{where}.bytes", s["bytes"], 0)
        h = s.get("xxh3_64", "")
        if h and not (isinstance(h, str) and _HEX16.match(h)):
            raise InputError(f"{where}.xxh3_64: expected 16 hex digits, got {h!r}")
    rows = sum(s["rows"] for s in shards)
    if "num_rows" in manifest and manifest["num_rows"] != rows:
        raise InputError(
            f"{mpath}: num_rows is {manifest['num_rows']}, the shards hold {rows} rows"
        )
    if fp is not None and fp != dataset_fingerprint(manifest):
        raise InputError(
            f"{mpath}: {FINGERPRINT_KEY} {fp} does not match the checksums it lists (they give "
            f"{dataset_fingerprint(manifest)}): its checksums were changed after it was written"
        )


def expected_row_lengths(num_tokens: np.ndarray, num_rows: np.ndarray, chunk: int) -> np.ndarray:
    """Tokens of every storage row, in global row order: row j of a sample of L tokens holds
    min(C, L - j*C) (an empty sample has one empty row)."""
    num_rows = np.asarray(num_rows, np.int64)
    total = int(num_rows.sum())
    start = np.zeros(len(num_rows) + 1, np.int64)
    np.cumsum(num_rows, out=start[1:])
    sample = np.repeat(np.arange(len(num_rows)), num_rows)
    j = np.arange(total, dtype=np.int64) - start[sample]
    return np.clip(np.asarray(num_tokens, np.int64)[sample] - j * chunk, 0, chunk)


def check_index(
    columns: Mapping[str, np.ndarray], manifest: Mapping[str, Any], ipath: str
) -> list[str]:
    """Problems of index.parquet's columns against the manifest (empty: consistent). Vectorized;
    each problem names the first bad row of its kind."""
    out: list[str] = []
    n = int(manifest["num_samples"])
    sid, tok = columns["sample_id"], columns["num_tokens"]
    shard, first, nrows = columns["shard"], columns["first_row"], columns["num_rows"]
    if len(tok) != n:
        return [f"{ipath}: {len(tok)} rows but manifest.json num_samples is {n}"]
    chunk = int(manifest["chunk_tokens"])
    shard_rows = np.array([s["rows"] for s in manifest["shards"]], np.int64)

    def first_bad(mask: np.ndarray, what: Callable[[int], str]) -> None:
        bad = np.flatnonzero(mask)
        if bad.size:
            i = int(bad[0])
            out.append(f"{ipath}: row {i} (sample {i}): {what(i)}")

    first_bad(sid != np.arange(n), lambda i: f"sample_id {int(sid[i])}, expected {i}")
    first_bad(tok < 0, lambda i: f"num_tokens {int(tok[i])} < 0")
    want_rows = np.maximum(1, -(-np.maximum(tok, 0) // chunk))
    first_bad(
        nrows != want_rows,
        lambda i: (
            f"num_rows {int(nrows[i])}, but {int(tok[i])} tokens in chunks of {chunk} "
            f"take {int(want_rows[i])}"
        ),
    )
    bad_shard = (shard < 0) | (shard >= len(shard_rows))
    first_bad(bad_shard, lambda i: f"shard {int(shard[i])} is not in manifest.json's shards")
    if out:
        return out
    first_bad(
        (first < 0) | (first >= shard_rows[shard]),
        lambda i: (
            f"first_row {int(first[i])} is outside shard {int(shard[i])} "
            f"({int(shard_rows[shard[i]])} rows)"
        ),
    )
    if out:
        return out
    offsets = np.concatenate([[0], np.cumsum(shard_rows)])
    glob = offsets[shard] + first
    want = np.concatenate([[0], np.cumsum(nrows.astype(np.int64))])
    first_bad(
        glob != want[:-1],
        lambda i: (
            f"its rows start at global row {int(glob[i])}, but the samples before it end "
            f"at row {int(want[i])} (shard/first_row disagree with the shards)"
        ),
    )
    if not out and int(want[-1]) != int(offsets[-1]):
        out.append(
            f"{ipath}: the samples take {int(want[-1])} storage rows, the shards in "
            f"manifest.json hold {int(offsets[-1])}"
        )
    return out


def check_shard_file(path: str, entry: Mapping[str, Any], hash_bytes: bool = True) -> None:
    """InputError naming `path` if it is missing, of another size than the manifest's `bytes`, or
    (with `hash_bytes`) its XXH3-64 differs from `xxh3_64`. Entries without them are not checked."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise InputError(f"{path}: shard listed in manifest.json is missing") from None
    want = entry.get("bytes")
    if want is not None and size != want:
        what = "truncated" if size < want else "longer than written"
        raise InputError(f"{path}: {size} bytes, manifest.json says {want} ({what})", VERIFY_ADVICE)
    digest = entry.get("xxh3_64")
    if hash_bytes and digest:
        got = checksum_file(path)
        if got != digest:
            raise InputError(
                f"{path}: XXH3-64 checksum {got} differs from manifest.json's {digest} "
                "(the shard is corrupt or was changed after it was written)"
            )
