"""`mixlen index DIR`: build index.parquet + manifest.json for an MDS dataset written elsewhere.

Each MDS row is taken as one whole sample (no storage chunks); its length is the size of the token
column, read once with mosaicml-streaming's own shard reader.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from functools import partial

import numpy as np

from datapipe import __version__
from datapipe.errors import InputError
from datapipe.files import METADATA_FILE_LIMIT, read_bounded_text
from datapipe.formats.mds import UNSAFE_ENCODINGS
from datapipe.index import INDEX_FILE, MANIFEST_FILE, write_index
from datapipe.integrity import (
    FINGERPRINT_KEY,
    INDEX_CHECKSUM_KEY,
    TOKEN_DTYPES,
    checksum_file,
    dataset_fingerprint,
    shard_name_problem,
)


def _read_mds_index(root: str) -> dict:
    path = os.path.join(root, "index.json")
    try:
        text = read_bounded_text(path, METADATA_FILE_LIMIT, "MDS index.json")
    except FileNotFoundError:
        raise InputError(f"{path}: not found; {root} is not an MDS dataset") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise InputError(f"{path}: expected an MDS index (a JSON object)")
    if obj.get("version") != 2 or not isinstance(obj.get("shards"), list):
        raise InputError(f"{path}: expected an MDS index (version 2 with a 'shards' list)")
    for si, sh in enumerate(obj["shards"]):
        for col, enc in zip(sh.get("column_names", []), sh.get("column_encodings", [])):
            if str(enc).split(":")[0] in UNSAFE_ENCODINGS:
                raise InputError(
                    f"{path}: shard {si} column {col!r} has encoding {enc!r}, which would "
                    "unpickle data; mixlen never reads pickled columns"
                )
        name = sh.get("raw_data", {}).get("basename") if isinstance(sh, dict) else None
        problem = shard_name_problem(name)
        if problem:
            raise InputError(f"{path}: shard {si} raw_data.basename: {problem}")
    return obj


def index_mds(
    root: str, tokens_field: str = "tokens", overwrite: bool = False, progress: bool | None = None
) -> dict:
    """Read every row's token column once, write index.parquet and manifest.json; return the
    manifest. `progress`: a bar over rows (None: only on a terminal)."""
    from datapipe.progress import progress as progress_bar

    obj = _read_mds_index(root)
    if os.path.exists(os.path.join(root, MANIFEST_FILE)) and not overwrite:
        raise InputError(
            f"{root}: already has {MANIFEST_FILE}; pass --overwrite to rebuild the index"
        )
    lengths: list[int] = []
    shard_of: list[int] = []
    row_in_shard: list[int] = []
    shards = []
    dtype: np.dtype | None = None
    max_token = -1
    total_rows = sum(int(sh.get("samples", 0)) for sh in obj["shards"])
    bar = progress_bar(total_rows, "index", "row", progress)
    for si, sh in enumerate(obj["shards"]):
        if sh.get("format") != "mds":
            raise InputError(
                f"{root}/index.json: shard {si} has format {sh.get('format')!r}, expected 'mds'"
            )
        if tokens_field not in sh.get("column_names", []):
            raise InputError(
                f"{root}/index.json: no column {tokens_field!r} (columns: {', '.join(sh.get('column_names', []))});"
                " pass --tokens-field"
            )
        if sh.get("compression"):
            raise InputError(
                f"{root}: shard {si} is compressed ({sh['compression']}); decompress it first"
            )
        for toks in _shard_rows(root, sh, tokens_field):
            dtype = toks.dtype if dtype is None else np.promote_types(dtype, toks.dtype)
            if toks.size:
                max_token = max(max_token, int(toks.max()))
            lengths.append(int(toks.size))
            shard_of.append(si)
        row_in_shard.extend(range(sh["samples"]))
        bar.update(sh["samples"])
        name = sh["raw_data"]["basename"]
        path = os.path.join(root, name)
        shards.append(
            {
                "name": name,
                "rows": sh["samples"],
                "samples": sh["samples"],
                "first_sample": len(lengths) - sh["samples"],
                "bytes": os.path.getsize(path),
                "xxh3_64": checksum_file(path),
            }
        )
    bar.close()
    if not lengths:
        raise InputError(f"{root}: the MDS dataset holds no rows; nothing to index")
    if dtype is not None and dtype.name not in TOKEN_DTYPES:
        raise InputError(
            f"{root}: column {tokens_field!r} holds {dtype.name} token ids; mixlen reads "
            f"{', '.join(TOKEN_DTYPES)} (rewrite the column in one of them)"
        )
    num_tokens = np.asarray(lengths, dtype=np.int64)
    manifest_of = partial(_manifest, num_tokens, shards, dtype, max_token, tokens_field)
    return _write_index(root, num_tokens, shard_of, row_in_shard, manifest_of)


def _write_index(
    root: str,
    num_tokens: np.ndarray,
    shard_of: list[int],
    row_in_shard: list[int],
    manifest_of: Callable[[str], dict],
) -> dict:
    """index.parquet and manifest.json (`manifest_of(index path)`) under temporary names, then
    renamed over the old ones; a failed write (a full disk) leaves the old ones and no
    temporaries."""
    tmp_index = os.path.join(root, f"{INDEX_FILE}.tmp-{os.getpid()}")
    tmp_manifest = os.path.join(root, f"{MANIFEST_FILE}.tmp-{os.getpid()}")
    try:
        write_index(
            tmp_index,
            num_tokens,
            np.asarray(shard_of, dtype=np.int32),
            np.asarray(row_in_shard, dtype=np.int64),
            np.ones(len(num_tokens), dtype=np.int32),
            ["" for _ in range(len(num_tokens))],
        )
        manifest = manifest_of(tmp_index)
        with open(tmp_manifest, "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(tmp_index, os.path.join(root, INDEX_FILE))
        os.replace(tmp_manifest, os.path.join(root, MANIFEST_FILE))
    finally:
        for tmp in (tmp_index, tmp_manifest):
            if os.path.exists(tmp):
                os.remove(tmp)
    return manifest


def _shard_rows(root: str, sh: dict, tokens_field: str) -> Iterator[np.ndarray]:
    """Each row's token column of one MDS shard (its index.json entry `sh`), checked: readable,
    a 1-D integer array, no negative id."""
    from streaming.base.format import reader_from_json

    reader = reader_from_json(root, None, sh)
    where = f"{root}/{sh['raw_data']['basename']}"
    for r in range(sh["samples"]):
        try:
            toks = np.asarray(reader.get_item(r)[tokens_field])
        except (OSError, EOFError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise InputError(
                f"{where} row {r}: cannot be read ({type(exc).__name__}: {exc}); the shard is "
                "truncated or corrupt"
            ) from None
        if toks.ndim != 1 or toks.dtype.kind not in "iu":
            raise InputError(f"{where} row {r}: column {tokens_field!r} is not a 1-D integer array")
        if toks.size and toks.dtype.kind == "i" and int(toks.min()) < 0:
            k = int(np.argmax(toks < 0))
            raise InputError(
                f"{where} row {r}: column {tokens_field!r} holds token id {int(toks[k])} at "
                f"position {k}; token ids are never negative"
            )
        yield toks


def _manifest(
    num_tokens: np.ndarray,
    shards: list[dict],
    dtype: np.dtype | None,
    max_token: int,
    tokens_field: str,
    index_path: str,
) -> dict:
    """manifest.json of an MDS dataset indexed here (docs/FORMAT.md: every row a sample)."""
    manifest = {
        "mixlen_version": __version__,
        "format": "mds",
        "tokenizer": {"kind": "unknown"},
        "vocab_size": max_token + 1 if max_token >= 0 else None,
        "dtype": (dtype or np.dtype(np.uint16)).name,
        "bos_id": None,
        "eos_id": None,
        "tokens_field": tokens_field,
        "rows_are_samples": True,
        "chunk_tokens": max(1, int(num_tokens.max()) if len(num_tokens) else 1),
        "max_len": None,
        "num_samples": len(num_tokens),
        "num_tokens": int(num_tokens.sum()),
        "num_rows": len(num_tokens),
        "counts": {"documents": len(num_tokens)},
        "shards": shards,
        INDEX_CHECKSUM_KEY: checksum_file(index_path),
        "args": {"command": "index", "tokens_field": tokens_field},
    }
    manifest[FINGERPRINT_KEY] = dataset_fingerprint(manifest)
    return manifest
