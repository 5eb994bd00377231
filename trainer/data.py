"""The trainer's data: the dataset's fetch, the train/held-out split, the length-aware stream, the
planner, and the fixed validation set. Every rank builds the same stream and planner from the
index alone; each fetches only its own pieces.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import numpy as np

from datapipe.errors import ConfigError
from datapipe.fetch import Fetcher
from datapipe.plan.planner import Planner
from datapipe.plan.stepplan import StepPlan
from datapipe.stream import GlobalBatch, LengthAwareStream, greedy_boundaries
from trainer.config.job import TrainerConfig
from trainer.parallel.executor import HDPExecutor

__all__ = ["TrainData", "Validation", "held_out_mask", "rank_pieces"]


def held_out_mask(sample_ids: np.ndarray, seed: int, fraction: float) -> np.ndarray:
    """True for held-out samples: splitmix64(id ^ seed) / 2^64 < fraction (stable across runs,
    datasets sizes and ranks)."""
    with np.errstate(over="ignore"):
        z = np.asarray(sample_ids, dtype=np.uint64) ^ np.uint64(seed)
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)) < fraction


def rank_pieces(plan: StepPlan, rank: int) -> list[tuple]:
    """This rank's pieces per micro-batch, in slot order (the fetcher takes them as they are)."""
    return [m.pieces for m in plan.microbatches(rank)]


class Validation:
    """A fixed held-out set, planned once; evaluated forward-only on the island."""

    def __init__(
        self,
        cfg: TrainerConfig,
        rank: int,
        fetcher: Fetcher,
        ids: np.ndarray,
        lengths: np.ndarray,
        planner: Planner,
    ) -> None:
        # a held-out dataset may hold samples no plan of this island can (longer than N * C)
        keep = (lengths > 0) & planner.fits(lengths)
        ids, lengths = ids[keep], lengths[keep]
        n = int(np.searchsorted(np.cumsum(lengths), cfg.data.val_tokens, side="right"))
        n = max(n, min(1, len(ids)))  # at least one sample when there is one
        ids, lengths = ids[:n], lengths[:n]
        bounds = greedy_boundaries(lengths, cfg.train.global_batch_tokens) if len(ids) else [0]
        self.batches = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            plan = planner.plan(lengths[a:b], ids[a:b])
            self.batches.append((plan, fetcher.fetch_step(rank_pieces(plan, rank))))
        self.tokens = int(lengths.sum())

    def run(self, executor: HDPExecutor) -> float:
        """Mean token loss over the held-out set."""
        total, labels = 0.0, 0
        for plan, fetched in self.batches:
            s, n = executor.evaluate(plan, fetched)
            total += s
            labels += n
        return total / max(labels, 1)


class TrainData:
    """Fetch, split, stream and planner of one run (the validation set planned and fetched unless
    `validation` is False); `stack` releases the readers."""

    def __init__(
        self,
        cfg: TrainerConfig,
        rank: int,
        world: int,
        vocab_size: int,
        stack: ExitStack,
        validation: bool = True,
        island: int = 0,
        islands: int = 1,
    ) -> None:
        """`rank` of an island of `world` ranks, island `island` of `islands`."""
        self.rank = rank
        # the training set's fetch; the model must cover its vocabulary
        self.fetcher = cfg.data.fetch_config().build()
        stack.callback(self.fetcher.close)
        manifest_vocab = int(self.fetcher.index.manifest.get("vocab_size") or 0)
        if vocab_size < manifest_vocab:
            raise ConfigError(
                f"model: vocab_size {vocab_size} < the dataset's {manifest_vocab} "
                f"({cfg.data.path}/manifest.json vocab_size)"
            )
        if not manifest_vocab:  # the fetch refuses token ids the model has no embedding for
            self.fetcher.vocab_size, self.fetcher.vocab_source = (
                vocab_size,
                "the model's vocab_size",
            )
        all_lengths = np.asarray(self.fetcher.lengths, dtype=np.int64)
        all_ids = np.arange(all_lengths.shape[0], dtype=np.int64)
        # held-out split: another dataset, or a hash-based fraction of this one
        self.val_fetcher: Fetcher | None = None
        self.val_ids = np.zeros(0, np.int64)
        self.train_ids = all_ids
        if cfg.data.val_path:
            self.val_fetcher = cfg.data.fetch_config(cfg.data.val_path).build()
            stack.callback(self.val_fetcher.close)
            self.val_ids = np.arange(len(self.val_fetcher.lengths), dtype=np.int64)
        elif cfg.data.val_fraction > 0:
            held = held_out_mask(all_ids, cfg.data.seed, cfg.data.val_fraction)
            self.train_ids, self.val_ids = all_ids[~held], all_ids[held]
            self.val_fetcher = self.fetcher
        if self.train_ids.size == 0:
            raise ConfigError("data.val_fraction: leaves no training samples")
        # stream over the training samples, and the island's planner
        self.stream = LengthAwareStream(
            cfg.data.stream_config(cfg.train.global_batch_tokens, island, islands),
            all_lengths[self.train_ids],
        )
        cost = cfg.cost_model()
        self.planner = cfg.planner_config(world, int(all_lengths.max())).build(cost)
        self.planner.check_fits(all_lengths, f"data.path {cfg.data.path}")
        self.validation: Validation | None = None
        if (
            validation
            and cfg.train.eval_interval
            and self.val_fetcher is not None
            and self.val_ids.size
        ):
            val_lengths = np.asarray(self.val_fetcher.lengths)[self.val_ids]
            self.validation = Validation(
                cfg, rank, self.val_fetcher, self.val_ids, val_lengths, self.planner
            )

    def steps(self) -> Iterator[tuple[tuple[GlobalBatch, StepPlan, dict[str, Any]], list]]:
        """Endless ((batch, plan, stream state after it), this rank's pieces) per step."""
        while True:
            b = next(self.stream)
            plan = self.planner.plan(b.lengths, self.train_ids[b.sample_ids])
            yield (b, plan, self.stream.state_dict()), rank_pieces(plan, self.rank)
