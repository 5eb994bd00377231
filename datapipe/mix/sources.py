"""A mixture's sources from their indexes: each dataset's manifest and lengths, checked to be
distinct datasets with one tokenizer, and turned into the stream's `MixSource`s. Imports no numba
until a stream is built (`mixlen profile` reads mixtures too)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from datapipe.errors import ConfigError
from datapipe.index import dataset_fingerprint, is_remote, read_index, resolve_dataset
from datapipe.mix.config import SourceConfig, check_mixture
from datapipe.settings import Names

if TYPE_CHECKING:
    from datapipe.mix.stream import MixSource

__all__ = [
    "LoadedSource",
    "TOKENIZER_KEYS",
    "check_local_folder",
    "load_sources",
    "mix_sources",
    "path_key",
]

# what makes two datasets' token ids mean the same thing
TOKENIZER_KEYS = ("vocab_size", "bos_id", "eos_id", "dtype")


class LoadedSource(NamedTuple):
    """One source's config, name, local directory (`cache` for a remote one's copy), manifest,
    sample lengths, dataset fingerprint and its key in errors (`data.sources[1]`, `data.path`)."""

    config: SourceConfig
    name: str
    local: str
    cache: str | None
    manifest: dict
    lengths: np.ndarray
    fingerprint: str
    key: str


def path_key(key: str) -> str:
    """The key of a source's path: `data.sources[1].path`, or `data.path` itself."""
    return f"{key}.path" if key.endswith("]") else key


def check_local_folder(path: str, key: str) -> None:
    """ConfigError naming `key` when a local source path is a file or missing (a relative path
    is read from the current folder, as `mixlen train` reads a config's paths); URIs pass."""
    path = str(path)
    if is_remote(path):
        return
    local = path[len("file://") :] if path.startswith("file://") else path
    if os.path.isdir(local):
        return
    where = "" if os.path.isabs(local) else f" (relative to the current folder {os.getcwd()})"
    if os.path.exists(local):
        raise ConfigError(
            f"{key}: {path!r}{where} is a file, not a dataset directory (a directory written by "
            "`mixlen preprocess`, holding manifest.json and index.parquet)"
        )
    raise ConfigError(f"{key}: dataset directory {path!r} not found{where}")


def tokenizer_differences(a: dict, b: dict) -> str:
    """How two manifests' tokenizations differ (`key a vs b; ...`), '' when their ids mean the
    same."""
    ia, ib = _tokenizer_identity(a), _tokenizer_identity(b)
    return "; ".join(f"{k} {ia[k]!r} vs {ib[k]!r}" for k in ia if ia[k] != ib[k])


def _tokenizer_identity(manifest: dict) -> dict:
    """What makes two datasets' token ids mean the same: the tokenizer (not its file's path)
    and the ids and vocabulary recorded beside it."""
    tok = dict(manifest.get("tokenizer") or {})
    tok.pop("path", None)  # the same tokenizer file may sit elsewhere
    ident = {k: manifest.get(k) for k in TOKENIZER_KEYS}
    ident["tokenizer"] = tok
    return ident


def load_sources(
    configs: list[SourceConfig],
    names: Names,
    cache_dir: str | None = None,
    keys: list[str] | None = None,
) -> list[LoadedSource]:
    """Read every source's index (a remote one's into `cache_dir`/NAME). ConfigError naming the
    sources (`keys`, default `data.sources[i]`) for: a source with no samples, the same dataset
    twice, or another tokenizer."""
    source_names = check_mixture(configs, [], names)
    keys = keys or [f"{names('sources')}[{i}]" for i in range(len(configs))]
    out: list[LoadedSource] = []
    for i, (cfg, name) in enumerate(zip(configs, source_names)):
        key = path_key(keys[i])
        cache = os.path.join(cache_dir, name) if cache_dir else None
        check_local_folder(cfg.path, key)
        local, _ = resolve_dataset(cfg.path, cache, key)
        index = read_index(local)
        lengths = np.asarray(index.num_tokens, np.int64)
        if not (lengths > 0).any():
            raise ConfigError(f"{key}: dataset {cfg.path!r} ({name}) has no samples")
        out.append(
            LoadedSource(
                cfg, name, local, cache, index.manifest, lengths,
                dataset_fingerprint(index.manifest), keys[i],
            )
        )  # fmt: skip
    for i, a in enumerate(out):
        for b in out[:i]:
            src_a, src_b = a.key, b.key
            if a.fingerprint == b.fingerprint:
                raise ConfigError(
                    f"{path_key(src_a)}: {a.config.path!r} ({a.name}) is the same dataset as "
                    f"{src_b} {b.config.path!r} ({b.name}) (fingerprint {a.fingerprint}); "
                    "give it once, with the weight you want"
                )
            what = tokenizer_differences(a.manifest, b.manifest)
            if what:
                raise ConfigError(
                    f"{path_key(src_a)}: {a.name} was tokenized differently from {src_b} {b.name} "
                    f"({what} in their manifest.json); every source of a mixture must share one "
                    "tokenizer (preprocess them with the same --tokenizer)"
                )
    return out


def mix_sources(
    loaded: list[LoadedSource], held_out: list[np.ndarray] | None = None
) -> list[MixSource]:
    """The stream's view of each source: every sample but the held-out (`held_out[i]`: a bool
    mask, True = held out) and the empty ones."""
    from datapipe.mix.stream import MixSource  # numba: not for `mixlen profile`

    out = []
    for i, src in enumerate(loaded):
        keep = src.lengths > 0
        if held_out is not None:
            keep &= ~held_out[i]
        out.append(
            MixSource(
                src.name,
                src.lengths,
                np.flatnonzero(keep).astype(np.int64),
                tuple(src.config.boosts()),
                int(src.config.max_epochs),
                src.key,
                src.fingerprint,
            )
        )
    return out
