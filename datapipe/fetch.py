"""Data-aware fetch: read exactly one rank's token ranges and pack them into micro-batches.

A plan piece ``(s, a, b)`` means "compute positions a..b-1 of sample s". Its inputs are tokens
[a, b); its labels are tokens [a+1, b+1) of the same sample, so the fetch reads tokens
[a, min(b+1, L)); the last position of a sample has label -100. Every sample thus contributes
L-1 labelled positions however it is split. A dataset with a loss mask (docs/FORMAT.md) stores
each row's trained spans beside its tokens; they are read with the tokens, and a position whose
next token is not trained has label -100 too, so the mask travels as the labels through packing,
ring splits and pieces. The labels each piece gets are checked against the index's
`trained_spans` (datapipe.plan.loss.LossMask), which the loss's denominator is computed from. Tokens are read through the storage rows
(``chunk_tokens`` each, FORMAT.md) that overlap that range, so a rank reads at most its tokens plus
one storage chunk at each end of each piece.

Rows come from the dataset format's reader (datapipe.formats: one module per format, random access
by global row). Remote datasets: ``manifest.json``/``index.parquet`` come through
``datapipe.index.resolve_dataset`` and shards are downloaded on first use into ``cache_dir`` with
mosaicml-streaming's downloader (each remote dataset in its own folder of ``cache_dir``); the
processes of a node may share one: a file appears under its name whole (a temporary name, then a
rename), and a damaged copy is replaced the same way.

Micro-batches are numpy; ``PackedMicroBatch.to_torch()`` converts. Torch and the streaming library
are imported lazily.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from datapipe.errors import VERIFY_ADVICE, InputError
from datapipe.formats import open_reader
from datapipe.formats.base import RowReader
from datapipe.index import DatasetIndex, read_index, resolve_dataset
from datapipe.inuse import ReadersLock
from datapipe.pack_kernel import first_mislabelled, mark_trained, pack_kernel
from datapipe.plan.loss import IGNORE_INDEX
from datapipe.settings import Names, check, setting

MDS_ACCESS = ("reader", "dataset")


# ----------------------------------------------------------------------------- micro-batches


@dataclass
class PackedMicroBatch:
    """One packed micro-batch of one rank; every array is 1-D over its T positions. Token ids keep
    the dataset's dtype (uint16 below 65,536 ids: 2 bytes per position where int64 took 8), labels
    and positions are int32; the model widens them on its device (trainer.model.transformer)."""

    input_ids: np.ndarray  # [T], the token dtype (uint16, uint32; int64 from MemoryFetcher)
    labels: np.ndarray  # int32 [T], IGNORE_INDEX at a sample's last position
    position_ids: np.ndarray  # int32 [T], absolute position within the sample
    cu_seqlens: np.ndarray  # int32 [P+1], piece boundaries for document-masked attention
    pieces: np.ndarray  # int64 [P, 3] (sample_id, token_start, token_end)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_labels(self) -> int:
        """Labelled positions (the loss denominator's share of this micro-batch)."""
        return int(np.count_nonzero(self.labels != IGNORE_INDEX))

    def to_torch(self) -> dict[str, Any]:
        """The arrays as torch tensors (same dtypes), sharing memory."""
        import torch

        return {
            "input_ids": torch.from_numpy(self.input_ids),
            "labels": torch.from_numpy(self.labels),
            "position_ids": torch.from_numpy(self.position_ids),
            "cu_seqlens": torch.from_numpy(self.cu_seqlens),
        }


def as_pieces(pieces: Any) -> np.ndarray:
    """Pieces as a contiguous int64 [P, 3] array."""
    arr = np.asarray(pieces, dtype=np.int64)
    if arr.size == 0:
        return np.zeros((0, 3), np.int64)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"pieces must have shape [P, 3], got {arr.shape}")
    return np.ascontiguousarray(arr)


_ALL_TRAINED = np.zeros(0, np.uint8)


def pack_microbatch(
    pieces: np.ndarray,
    lengths: np.ndarray,
    flat: np.ndarray,
    span_start: np.ndarray,
    trained: np.ndarray | None = None,
) -> PackedMicroBatch:
    """Pack pieces whose tokens [a, min(b+1, L)) sit at ``flat[span_start[i]:]`` (one pass,
    datapipe.pack_kernel); `lengths` is indexed by the pieces' sample ids; `trained` (uint8,
    aligned with `flat`; None: every token) marks the tokens that are targets."""
    pieces = as_pieces(pieces)
    return pack_pieces(pieces, lengths[pieces[:, 0]], flat, span_start, trained)


def pack_pieces(
    pieces: np.ndarray,
    piece_len: np.ndarray,
    flat: np.ndarray,
    span_start: np.ndarray,
    trained: np.ndarray | None = None,
    counts: np.ndarray | None = None,
) -> PackedMicroBatch:
    """`pack_microbatch` with the length of each piece's sample given per piece (a mixture's
    units: a piece of a longer document is a sample of its own, positions from 0); `counts`
    (int64 [P]) receives the labels each piece got."""
    pieces = as_pieces(pieces)
    a, b = (np.ascontiguousarray(pieces[:, i]) for i in (1, 2))
    cu = np.zeros(len(pieces) + 1, np.int64)
    np.cumsum(b - a, out=cu[1:])
    total = int(cu[-1])
    input_ids = np.empty(total, flat.dtype)
    labels = np.full(total, IGNORE_INDEX, np.int32)
    position_ids = np.empty(total, np.int32)
    starts = np.ascontiguousarray(span_start, np.int64)
    sample_len = np.ascontiguousarray(piece_len, np.int64)
    mask = _ALL_TRAINED if trained is None else trained
    got = np.empty(len(pieces), np.int64) if counts is None else counts
    pack_kernel(flat, starts, a, b, sample_len, cu, input_ids, labels, position_ids, mask, got)
    return PackedMicroBatch(input_ids, labels, position_ids, cu.astype(np.int32), pieces)


def rank_pieces(plan: Any, rank: int) -> list[tuple]:
    """A StepPlan's pieces of `rank`, per micro-batch in slot order (what `fetch_step` takes)."""
    return [m.pieces for m in plan.microbatches(rank)]


def rows_of_pieces(
    pieces: np.ndarray, lengths: np.ndarray, global_first_row: np.ndarray, chunk: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(global rows, first chunk j0, row count) of each piece's read range [a, min(b+1, L))."""
    s, a, b = pieces[:, 0], pieces[:, 1], pieces[:, 2]
    return rows_of_ranges(s, a, np.minimum(b + 1, lengths[s]), global_first_row, chunk)


def rows_of_ranges(
    s: np.ndarray, a: np.ndarray, end: np.ndarray, global_first_row: np.ndarray, chunk: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(global rows, first chunk j0, row count) of token ranges [a, end) of samples `s`."""
    j0 = a // chunk
    count = (end - 1) // chunk - j0 + 1
    start = global_first_row[s] + j0
    offs = np.zeros(len(s) + 1, np.int64)
    np.cumsum(count, out=offs[1:])
    rows = np.repeat(start - offs[:-1], count) + np.arange(int(offs[-1]), dtype=np.int64)
    return rows, j0, count


# ----------------------------------------------------------------------------- readers


@dataclass(frozen=True)
class FetchConfig:
    """The fetch's settings (in a training config: `[data]`); the dataset is a `build()`
    argument."""

    prefetch_depth: int = setting(
        1, help="steps fetched ahead in a background thread", lo=1, hi=64, free_on_resume=True
    )
    mds_access: str = setting(
        "reader",
        help="MDS shards read through the library's reader and positional reads (reader) or "
        "StreamingDataset[i] (dataset)",
        choices=MDS_ACCESS,
        free_on_resume=True,
    )
    verify: bool = setting(
        True,
        help="check each shard's XXH3-64 against the manifest when it is first opened",
        free_on_resume=True,
    )

    def build(self, path: str, cache_dir: str | None = None, names: Names | None = None) -> Fetcher:
        """Read the index of the dataset at `path` (a directory or a remote URI; `cache_dir`
        holds a remote dataset's local copy) and open the format's reader."""
        names = names or Names()
        check(self, names)
        local, remote = resolve_dataset(path, cache_dir, names("path"))
        in_use = ReadersLock(local) if remote is None else None  # --overwrite waits for us
        try:
            index = read_index(local)
            reader = open_reader(local, remote, index.manifest, cache_dir, self.mds_access)
        except BaseException:
            if in_use is not None:
                in_use.close()
            raise
        try:
            reader.verify = self.verify
            reader.check_present()  # a missing or truncated local shard stops us here
        except BaseException:
            reader.close()
            if in_use is not None:
                in_use.close()
            raise
        return Fetcher(self, index, reader, in_use)


@dataclass
class Fetcher:
    """Reads pieces' tokens and packs micro-batches; `fetch_step` does one read per step."""

    config: FetchConfig
    index: DatasetIndex
    reader: RowReader
    in_use: ReadersLock | None = None  # a local dataset's readers lock (datapipe.inuse)
    lengths: np.ndarray = field(init=False)
    global_first_row: np.ndarray = field(init=False)
    chunk: int = field(init=False)
    # token ids must be below this (the manifest's vocab_size; the trainer may set the model's)
    vocab_size: int | None = field(init=False)
    vocab_source: str = field(init=False)

    def __post_init__(self) -> None:
        self.lengths = np.asarray(self.index.num_tokens, np.int64)
        self.global_first_row = np.asarray(self.index.global_first_row, np.int64)
        self.chunk = int(self.index.manifest["chunk_tokens"])
        self.vocab_size = self.index.manifest.get("vocab_size")
        self.vocab_source = "manifest.json vocab_size"

    def _check(self, pieces: np.ndarray) -> None:
        s, a, b = pieces[:, 0], pieces[:, 1], pieces[:, 2]
        bad = (s < 0) | (s >= len(self.lengths))
        if bad.any():
            raise ValueError(f"piece {pieces[bad][0].tolist()}: sample id outside the dataset")
        bad = (a < 0) | (b <= a) | (b > self.lengths[s])
        if bad.any():
            p = pieces[bad][0]
            raise ValueError(f"piece {p.tolist()}: needs 0 <= start < end <= {self.lengths[p[0]]}")

    def _check_rows(self, s, j0, count, rows, uniq, row_len) -> None:
        """Storage rows must hold min(C, L - j*C) tokens (FORMAT.md); else the data is corrupt."""
        piece_of = np.repeat(np.arange(len(s)), count)
        offs = np.zeros(len(s) + 1, np.int64)
        np.cumsum(count, out=offs[1:])
        j = np.arange(len(rows), dtype=np.int64) - offs[piece_of] + j0[piece_of]
        want = np.minimum(self.chunk, self.lengths[s[piece_of]] - j * self.chunk)
        got = row_len[np.searchsorted(uniq, rows)]
        bad = np.flatnonzero(got != want)
        if bad.size:
            k = int(bad[0])
            raise InputError(
                f"{self.index.root}: global row {int(rows[k])} (sample {int(s[piece_of[k]])}, "
                f"chunk {int(j[k])}) holds {int(got[k])} tokens, the index implies {int(want[k])}"
            )

    def _out_of_vocab(self, flat: np.ndarray, uniq: np.ndarray, row_off: np.ndarray) -> None:
        """InputError naming the shard, sample and position of the first out-of-vocabulary id
        (negative, or at least the vocabulary size)."""
        bad = flat < 0 if flat.dtype.kind == "i" else np.zeros(flat.shape, bool)
        if self.vocab_size is not None:
            bad |= flat >= self.vocab_size
        k = int(np.argmax(bad))
        i = int(np.searchsorted(row_off, k, side="right") - 1)
        row = int(uniq[i])
        sample = int(np.searchsorted(self.global_first_row, row, side="right") - 1)
        pos = (row - int(self.global_first_row[sample])) * self.chunk + k - int(row_off[i])
        shard = self.reader.shard_names[self.reader.shard_of_row(row)]
        raise InputError(
            f"{self.index.root}/{shard}: sample {sample}, token {pos} has id {int(flat[k])}, "
            f"outside the vocabulary ({self.vocab_source} = {self.vocab_size}, ids from 0); "
            "the data does not match its tokenizer or the model"
        )

    def fetch_step(self, microbatches: Sequence[Any]) -> list[PackedMicroBatch]:
        """Micro-batches for a list of piece arrays ([P, 3] each); rows shared are read once."""
        plist = [as_pieces(p) for p in microbatches]
        allp = np.concatenate(plist) if plist else np.zeros((0, 3), np.int64)
        self._check(allp)
        s, a, b = allp[:, 0], allp[:, 1], allp[:, 2]
        end = np.minimum(b + 1, self.lengths[s])
        flat, span_start, trained = self.read_ranges(s, a, end)
        counts = np.zeros(len(allp), np.int64)
        out, p0 = [], 0
        for p in plist:
            p1 = p0 + len(p)
            part = counts[p0:p1]
            out.append(
                pack_pieces(p, self.lengths[p[:, 0]], flat, span_start[p0:p1], trained, part)
            )
            p0 = p1
        if trained is not None:
            self.check_labels(s, a + 1, end, counts)
        return out

    def check_labels(self, s: np.ndarray, lo: np.ndarray, hi: np.ndarray, got: np.ndarray) -> None:
        """The labels pieces got from the shards' spans (their targets: tokens [lo, hi) of
        samples `s`) must be what index.parquet's trained_spans say; else the data is corrupt.
        One numba pass (first_mislabelled: a whole sample's count is its loss_tokens, which
        read_index checked against its spans; benchmarks/RESULTS.md, "Instruction data: loss
        masks in the fetch")."""
        loss = self.index.loss
        k, want = first_mislabelled(
            loss.loss_tokens, self.lengths, loss.offsets, loss.values, s, lo, hi, got
        )
        if k >= 0:
            raise InputError(
                f"{self.index.root}: sample {int(s[k])}, tokens {int(lo[k])}..{int(hi[k])}: the "
                f"shards' trained spans give {int(got[k])} trained tokens, index.parquet's "
                f"{want}",
                VERIFY_ADVICE,
            )

    def read_ranges(
        self, s: np.ndarray, a: np.ndarray, end: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(flat tokens, where each range starts in them, which of them are trained: uint8, or
        None without a loss mask) of token ranges [a, end) of samples `s` (checked by the
        caller: 0 <= a < end <= L); storage rows shared are read once."""
        s, a, end = (np.asarray(x, np.int64) for x in (s, a, end))
        rows, j0, count = rows_of_ranges(s, a, end, self.global_first_row, self.chunk)
        uniq = np.unique(rows)
        trained = None
        if self.index.loss is not None:
            flat, row_len, spans, span_len = self.reader.read_rows_masked(uniq)
        else:
            flat, row_len = self.reader.read_rows_flat(uniq)
        self._check_rows(s, j0, count, rows, uniq, row_len)
        row_off = np.zeros(len(row_len) + 1, np.int64)
        np.cumsum(row_len, out=row_off[1:])
        if self.index.loss is not None:
            span_off = np.zeros(len(span_len) + 1, np.int64)
            np.cumsum(span_len, out=span_off[1:])
            trained = np.zeros(flat.shape[0], np.uint8)
            mark_trained(row_off, span_off, spans, trained)
        if flat.size and (
            (self.vocab_size is not None and int(flat.max()) >= self.vocab_size)
            or (flat.dtype.kind == "i" and int(flat.min()) < 0)  # a signed column of others
        ):
            self._out_of_vocab(flat, uniq, row_off)
        # a range's rows are consecutive global rows, hence adjacent in `uniq`: its span is
        # contiguous in `flat`, starting inside its first row
        first = np.searchsorted(uniq, self.global_first_row[s] + j0)
        return flat, row_off[first] + a - j0 * self.chunk, trained

    def fetch(self, pieces: Any) -> PackedMicroBatch:
        """One micro-batch."""
        return self.fetch_step([pieces])[0]

    def prefetch(self, steps: Iterable[tuple[Any, Sequence[Any]]]) -> Prefetcher:
        """Background fetch of `(key, microbatch pieces)` steps; see :class:`Prefetcher`."""
        return Prefetcher(self, steps, self.config.prefetch_depth)

    def close(self) -> None:
        self.reader.close()
        if self.in_use is not None:
            self.in_use.close()

    def __enter__(self) -> Fetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class MemoryFetcher:
    """Packs micro-batches from in-memory token arrays (tests, benchmarks); same output as
    `datapipe.fetch.Fetcher.fetch_step`. `trained`: per sample, a boolean array marking its
    trained tokens (None: every token)."""

    def __init__(
        self, tokens: Sequence[np.ndarray], trained: Sequence[np.ndarray] | None = None
    ) -> None:
        self.lengths = np.array([len(t) for t in tokens], dtype=np.int64)
        self.offsets = np.zeros(len(tokens) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        self.flat = (
            np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens])
            if len(tokens)
            else np.zeros(0, np.int64)
        )
        self.trained = None
        if trained is not None:
            self.trained = np.concatenate(
                [np.asarray(m, dtype=np.uint8) for m in trained] or [np.zeros(0, np.uint8)]
            )
            assert self.trained.shape == self.flat.shape

    def fetch_step(self, microbatches: Sequence[object]) -> list[PackedMicroBatch]:
        out = []
        for p in microbatches:
            pieces = as_pieces(p)
            span = self.offsets[pieces[:, 0]] + pieces[:, 1]
            out.append(pack_microbatch(pieces, self.lengths, self.flat, span, self.trained))
        return out


_END = object()


class Prefetcher:
    """Fetches step t+1 (up to `depth` steps ahead) in a thread while step t computes.

    Iterating yields ``(key, list[PackedMicroBatch])``; ``key`` is passed through untouched (e.g. the
    stream state to checkpoint with the step, since the producer runs ahead of the consumer).
    ``last_wait_s``/``total_wait_s`` is the time the consumer spent waiting for data.
    """

    def __init__(
        self, fetcher: Fetcher, steps: Iterable[tuple[Any, Sequence[Any]]], depth: int = 1
    ):
        self.fetcher = fetcher
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self.last_wait_s = 0.0
        self.total_wait_s = 0.0
        self.steps = 0
        self._thread = threading.Thread(target=self._work, args=(iter(steps),), daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, steps: Iterator[tuple[Any, Sequence[Any]]]) -> None:
        try:
            for key, mbs in steps:
                if self._stop.is_set() or not self._put((key, self.fetcher.fetch_step(mbs))):
                    return
            self._put(_END)
        except BaseException as exc:  # handed to the consumer
            self._put(exc)

    def __iter__(self) -> Iterator[tuple[Any, list[PackedMicroBatch]]]:
        return self

    def __next__(self) -> tuple[Any, list[PackedMicroBatch]]:
        t0 = time.perf_counter()
        item = self._q.get()
        self.last_wait_s = time.perf_counter() - t0
        self.total_wait_s += self.last_wait_s
        if item is _END:
            self._q.put(_END)
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        self.steps += 1
        return item

    def close(self) -> None:
        """Stop the worker (it finishes the step it is fetching) and wait for it."""
        self._stop.set()
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=30)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
