"""Length-aware stream of global batches: sample ids and lengths from the index, never tokens.

Fill rule (per island, per epoch):

1. The epoch's order is a permutation of all sample ids drawn from
   ``Generator(PCG64(SeedSequence([seed, epoch])))``: the same bits in every process.
2. Global batches are filled along that order over the *whole* dataset, first fit with a bounded
   look-ahead (``lookahead`` = W, default 64): a batch first takes the samples deferred by earlier
   batches (oldest first, each if it still fits), then consecutive samples while their token sum
   stays <= ``global_batch_tokens``; when the next one does not fit, the following W - D samples
   (D = samples already deferred) are scanned and each that fits the room left joins the batch,
   the others are deferred to the next batches. The oldest deferred sample always opens the next
   batch, so a sample waits at most W batches and the epoch still holds every sample once. A
   batch of only zero-length samples is folded into its neighbour: no step is empty.
   ``lookahead = 0`` is the plain greedy fill (the first sample that does not fit closes the
   batch). Cost: one searchsorted per batch plus O(W) per batch, independent of batch size.
3. A sample longer than ``global_batch_tokens`` is, with ``oversize="own_step"``, a batch on its own
   (a step with more tokens than the budget); with ``oversize="error"`` the stream refuses to start.
   Never a silent drop.
4. Islands: batch j of the epoch goes to island ``j % num_islands``. The last ``B mod num_islands``
   batches of an epoch (B = batches in the epoch) are *skipped for that epoch* so that every island
   runs the same number of steps; their samples appear again in the next epoch's shuffle. With one
   island nothing is skipped: every sample is in exactly one batch per epoch.

Every process computes the same sequence from (index, config) alone, without communication.
This module imports numpy and pyarrow (through ``datapipe.index``) only; the streaming library is
imported lazily, and only for remote datasets, to download ``manifest.json`` and ``index.parquet``.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from datapipe.errors import ConfigError

STATE_VERSION = 2
DEFAULT_LOOKAHEAD = 64
OVERSIZE_POLICIES = ("own_step", "error")
METADATA_FILES = ("manifest.json", "index.parquet")


# ----------------------------------------------------------------------------- remote datasets


def is_remote(path: str) -> bool:
    """True for a URI with a scheme (s3://, gs://, oci://, hf://, ...); False for a local path."""
    scheme = urllib.parse.urlparse(str(path)).scheme
    return scheme not in ("", "file") and len(scheme) > 1  # len>1: not a Windows drive letter


def default_cache_dir(remote: str) -> str:
    """Local cache directory for a remote dataset: stable per URI, under the temp directory."""
    digest = hashlib.sha1(remote.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), "mixlen-cache", digest)


def download(remote_file: str, local_file: str) -> None:
    """Fetch one file with mosaicml-streaming's downloader (no-op when already cached)."""
    from streaming.base.storage import CloudDownloader  # lazy: only remote datasets need it

    if not os.path.exists(local_file):
        CloudDownloader.direct_download(remote_file, local_file)


def resolve_dataset(path: str, cache_dir: str | None = None) -> tuple[str, str | None]:
    """(local directory holding manifest.json + index.parquet, remote root or None).

    A remote dataset's two metadata files are downloaded into ``cache_dir`` (default: a directory
    derived from the URI); its shards are fetched later, on demand, by the fetch.
    """
    path = str(path)
    if not is_remote(path):
        if path.startswith("file://"):
            path = urllib.parse.urlparse(path).path
        if not os.path.isdir(path):
            raise ConfigError(f"stream.path: dataset directory {path!r} not found")
        return path, None
    local = cache_dir or default_cache_dir(path)
    os.makedirs(local, exist_ok=True)
    for name in METADATA_FILES:
        download(path.rstrip("/") + "/" + name, os.path.join(local, name))
    return local, path


def load_index(local_dir: str) -> Any:
    """The dataset index (``datapipe.index.DatasetIndex``) of a local directory."""
    from datapipe.index import read_index

    return read_index(local_dir)


# ----------------------------------------------------------------------------- batch formation


def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's permutation of sample ids (int64), identical in every process."""
    gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return gen.permutation(num_samples).astype(np.int64, copy=False)


def greedy_boundaries(lengths: np.ndarray, budget: int) -> np.ndarray:
    """Batch boundaries (int64, B+1 offsets from 0 to n) of the greedy fill of `lengths` in order.

    A batch holds consecutive samples while their sum stays <= budget; a sample that does not fit
    closes the batch. A sample longer than the budget alone forms a batch.
    """
    n = int(lengths.shape[0])
    csum = np.cumsum(lengths, dtype=np.int64)
    bounds = [0]
    start, base = 0, 0
    while start < n:
        end = int(np.searchsorted(csum, base + budget, side="right"))
        if end <= start:  # the sample at `start` alone exceeds the budget: its own batch
            end = start + 1
        bounds.append(end)
        base = int(csum[end - 1])
        start = end
    return np.asarray(bounds, dtype=np.int64)


def lookahead_fill(
    lengths: np.ndarray, budget: int, lookahead: int
) -> tuple[np.ndarray, np.ndarray]:
    """First-fit fill of `lengths` (in order) with a look-ahead window (module docstring, rule 2).

    Returns (positions, bounds): batch b holds ``positions[bounds[b]:bounds[b + 1]]``, positions
    into `lengths`; every position appears exactly once. ``lookahead = 0`` is the greedy fill.
    Batches of zero tokens are folded into a neighbour (merge_empty_batches).
    """
    n = int(lengths.shape[0])
    if lookahead <= 0 or n == 0:
        bounds = merge_empty_batches(lengths, greedy_boundaries(lengths, budget))
        return np.arange(n, dtype=np.int64), bounds
    lens = lengths.tolist()
    csum = np.cumsum(lengths, dtype=np.int64)
    chunks: list[np.ndarray] = []
    bounds = [0]
    deferred: list[int] = []  # positions, oldest first
    p = 0  # next position of the run not yet taken or deferred
    while p < n or deferred:
        room = budget
        head: list[int] = []  # deferred samples taken
        keep: list[int] = []
        for q in deferred:
            if lens[q] <= room or not head:  # the oldest always opens the batch
                head.append(q)
                room -= lens[q]
            else:
                keep.append(q)
        deferred = keep
        run_start = run_end = p
        tail: list[int] = []  # samples taken from the look-ahead window
        if room >= 0 and p < n:
            base = int(csum[p - 1]) if p else 0
            end = int(np.searchsorted(csum, base + room, side="right"))
            if end == p and not head:  # an oversize sample: a batch on its own
                end = p + 1
            run_end = end
            if end > p:
                room -= int(csum[end - 1]) - base
                p = end
            stop = min(n, p + lookahead - len(deferred))
            while room > 0 and p < stop:
                if lens[p] <= room:
                    tail.append(p)
                    room -= lens[p]
                else:
                    deferred.append(p)
                p += 1
        batch = np.concatenate(
            [np.asarray(head, np.int64), np.arange(run_start, run_end), np.asarray(tail, np.int64)]
        )
        chunks.append(batch)
        bounds.append(bounds[-1] + batch.shape[0])
    positions = np.concatenate(chunks).astype(np.int64, copy=False)
    assert positions.shape[0] == n
    return positions, merge_empty_batches(lengths[positions], np.asarray(bounds, dtype=np.int64))


def merge_empty_batches(lengths: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Fold batches of zero tokens (only zero-length samples) into the batch before them (the
    first non-empty one for leading ones), so no step is empty unless every sample is."""
    if bounds.shape[0] < 3:
        return bounds
    tokens = np.add.reduceat(lengths, bounds[:-1])
    empty = tokens == 0
    if not empty.any() or empty.all():
        return bounds
    first = int(np.argmax(~empty))
    drop = np.flatnonzero(empty)  # batch j > first merges into j - 1: drop its start bounds[j]
    drop = np.where(drop < first, drop + 1, drop)  # leading ones merge forward: drop their ends
    keep = np.ones(bounds.shape[0], dtype=bool)
    keep[drop] = False
    return bounds[keep]


@dataclass(frozen=True)
class GlobalBatch:
    """One optimizer step of one island: which samples, how long. ``step`` counts island steps."""

    step: int
    epoch: int
    sample_ids: np.ndarray  # int64
    lengths: np.ndarray  # int64

    @property
    def num_tokens(self) -> int:
        """Tokens in the batch."""
        return int(self.lengths.sum())

    def digest(self) -> bytes:
        """16-byte digest of (step, epoch, ids, lengths), for cross-rank agreement checks."""
        h = hashlib.blake2b(digest_size=16)
        h.update(np.asarray([self.step, self.epoch], dtype="<i8").tobytes())
        h.update(np.ascontiguousarray(self.sample_ids, dtype="<i8").tobytes())
        h.update(np.ascontiguousarray(self.lengths, dtype="<i8").tobytes())
        return h.digest()


@dataclass
class StreamConfig:
    """Configuration of a :class:`LengthAwareStream`."""

    path: str  # dataset directory, or a remote URI that mosaicml-streaming can download from
    global_batch_tokens: int  # per island
    seed: int = 0
    island: int = 0
    num_islands: int = 1
    oversize: str = "own_step"  # sample longer than global_batch_tokens: "own_step" | "error"
    lookahead: int = DEFAULT_LOOKAHEAD  # first-fit window of the batch fill (0: plain greedy)
    cache_dir: str | None = None  # local copy of a remote dataset's metadata

    def validate(self) -> None:
        """Raise ConfigError naming the first bad key."""
        if int(self.global_batch_tokens) < 1:
            raise ConfigError(
                f"stream.global_batch_tokens must be >= 1, got {self.global_batch_tokens}"
            )
        if int(self.seed) < 0:
            raise ConfigError(f"stream.seed must be >= 0, got {self.seed}")
        if int(self.num_islands) < 1:
            raise ConfigError(f"stream.num_islands must be >= 1, got {self.num_islands}")
        if not 0 <= int(self.island) < int(self.num_islands):
            raise ConfigError(
                f"stream.island must be in [0, {self.num_islands}), got {self.island}"
            )
        if int(self.lookahead) < 0:
            raise ConfigError(f"stream.lookahead must be >= 0, got {self.lookahead}")
        if self.oversize not in OVERSIZE_POLICIES:
            raise ConfigError(
                f"stream.oversize must be one of {OVERSIZE_POLICIES}, got {self.oversize!r}"
            )

    def build(self) -> LengthAwareStream:
        """Read the dataset's index (downloading it first if remote) and return the stream."""
        self.validate()
        local, _ = resolve_dataset(self.path, self.cache_dir)
        index = load_index(local)
        return LengthAwareStream(self, np.asarray(index.num_tokens, dtype=np.int64))


class LengthAwareStream:
    """Endless iterator of :class:`GlobalBatch` for one island; resumable via state_dict()."""

    def __init__(self, config: StreamConfig, lengths: np.ndarray) -> None:
        config.validate()
        self.config = config
        self.lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        self.budget = int(config.global_batch_tokens)
        self.num_islands = int(config.num_islands)
        self.island = int(config.island)
        if self.lengths.size == 0:
            raise ConfigError(f"stream.path: dataset {config.path!r} has no samples")
        if config.oversize == "error":
            longest = int(self.lengths.argmax())
            if int(self.lengths[longest]) > self.budget:
                raise ConfigError(
                    f"stream.global_batch_tokens={self.budget} is smaller than sample {longest} "
                    f"({int(self.lengths[longest])} tokens); raise it or set "
                    f"stream.oversize='own_step'"
                )
        self._digest: str | None = None
        self._plan: tuple[int, np.ndarray, np.ndarray] | None = None
        self.epoch = 0
        self.batch_in_epoch = 0  # island-local position of the next batch in the epoch
        self.step = 0

    # --- epoch plan
    def _epoch_plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(order, boundaries) of the epoch's global batches over all islands (cached)."""
        if self._plan is None or self._plan[0] != epoch:
            order = epoch_order(self.lengths.shape[0], int(self.config.seed), epoch)
            pos, bounds = lookahead_fill(
                self.lengths[order], self.budget, int(self.config.lookahead)
            )
            order = order[pos]
            self._plan = (epoch, order, bounds)
        return self._plan[1], self._plan[2]

    def steps_in_epoch(self, epoch: int) -> int:
        """Batches each island runs in `epoch` (the same for all islands)."""
        _, bounds = self._epoch_plan(epoch)
        steps = (bounds.shape[0] - 1) // self.num_islands
        if steps == 0:
            raise ConfigError(
                f"stream.num_islands={self.num_islands}: the dataset makes only "
                f"{bounds.shape[0] - 1} global batches of {self.budget} tokens per epoch; "
                f"lower stream.global_batch_tokens or the number of islands"
            )
        return steps

    def skipped_samples(self, epoch: int) -> np.ndarray:
        """Sample ids skipped in `epoch` by the island remainder policy (empty with one island)."""
        order, bounds = self._epoch_plan(epoch)
        used = self.steps_in_epoch(epoch) * self.num_islands
        return order[bounds[used] :]

    def batch(self, epoch: int, k: int, island: int | None = None) -> GlobalBatch:
        """The k-th batch of `island` (default: this stream's) in `epoch`; its step is not set."""
        isl = self.island if island is None else int(island)
        order, bounds = self._epoch_plan(epoch)
        j = k * self.num_islands + isl
        ids = order[bounds[j] : bounds[j + 1]]
        return GlobalBatch(step=-1, epoch=epoch, sample_ids=ids, lengths=self.lengths[ids])

    # --- iteration
    def __iter__(self) -> Iterator[GlobalBatch]:
        return self

    def __next__(self) -> GlobalBatch:
        while self.batch_in_epoch >= self.steps_in_epoch(self.epoch):
            self.epoch += 1
            self.batch_in_epoch = 0
        b = self.batch(self.epoch, self.batch_in_epoch)
        out = GlobalBatch(self.step, b.epoch, b.sample_ids, b.lengths)
        self.batch_in_epoch += 1
        self.step += 1
        return out

    # --- resume
    def lengths_digest(self) -> str:
        """Hex digest of the length column, to refuse resuming on a different dataset."""
        if self._digest is None:
            self._digest = hashlib.blake2b(self.lengths.tobytes(), digest_size=16).hexdigest()
        return self._digest

    def state_dict(self) -> dict[str, Any]:
        """Position of the stream plus what it depends on (plain ints and strings)."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "step": self.step,
            "seed": int(self.config.seed),
            "global_batch_tokens": self.budget,
            "lookahead": int(self.config.lookahead),
            "island": self.island,
            "num_islands": self.num_islands,
            "num_samples": int(self.lengths.shape[0]),
            "lengths_digest": self.lengths_digest(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was saved; ConfigError if it belongs to another setup."""
        if state.get("version") == 1 and "lookahead" not in state:
            # saved before the look-ahead fill existed: its batches are the greedy fill's
            state = {**state, "version": STATE_VERSION, "lookahead": 0}
        mine = self.state_dict()
        for key in (
            "version",
            "seed",
            "global_batch_tokens",
            "lookahead",
            "island",
            "num_islands",
            "num_samples",
            "lengths_digest",
        ):
            if key not in state:
                raise ConfigError(f"stream state: missing key {key!r}")
            if state[key] != mine[key]:
                raise ConfigError(
                    f"stream state: {key}={state[key]!r} was saved, but this stream has "
                    f"{key}={mine[key]!r}" + (" (set it to match)" if key == "lookahead" else "")
                )
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
        self.step = int(state["step"])
