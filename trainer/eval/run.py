"""Long-context evaluation on an island: held-out samples and passkey cases planned by the run's
planner and run forward-only by the HDP executor (long samples on rings, so a sample longer than
one rank holds is evaluated on several), every labelled position's loss summed into position and
sample-length buckets (trainer.eval.buckets), every passkey case scored (trainer.eval.passkey).
Collective: every rank of the island calls these with the same arguments."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from datapipe.fetch import MemoryFetcher, rank_pieces
from datapipe.plan.planner import Planner
from datapipe.stream import greedy_boundaries
from trainer.eval.buckets import BucketLosses
from trainer.eval.passkey import PasskeyCase
from trainer.parallel.executor import HDPExecutor

__all__ = ["evaluate_passkey", "evaluate_samples", "fetched", "planned_batches"]


def fetched(plans: Iterable[Any], fetch_step: Any, rank: int) -> Iterator[tuple[Any, Any]]:
    """(plan, this rank's micro-batches) for each plan, read as they are needed."""
    for plan in plans:
        yield plan, fetch_step(rank_pieces(plan, rank))


def planned_batches(
    planner: Planner, ids: np.ndarray, lengths: np.ndarray, batch_tokens: int
) -> list:
    """Plans of the samples in order, in batches of at most `batch_tokens` tokens (a longer
    sample alone); samples no plan of the island can hold are an error naming them."""
    keep = lengths > 0
    ids, lengths = ids[keep], lengths[keep]
    planner.check_fits(lengths, "the evaluated samples")
    bounds = greedy_boundaries(lengths, batch_tokens) if len(ids) else [0]
    return [planner.plan(lengths[a:b], ids[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def evaluate_samples(
    executor: HDPExecutor, batches: Iterable[tuple[Any, Sequence[Any]]], rank: int
) -> BucketLosses:
    """The bucketed losses of every sample of `batches` ((plan, this rank's fetched
    micro-batches) pairs), summed over the island."""
    buckets = BucketLosses()
    for plan, fetched in batches:
        parts = executor.token_losses(plan, fetched)
        buckets.add(parts, dict(zip(plan.sample_ids.tolist(), plan.lengths.tolist())))
        if rank == 0:
            buckets.count_samples(plan.lengths[plan.lengths > 0])
    buckets.reduce(executor.comm)
    return buckets


def evaluate_passkey(
    executor: HDPExecutor,
    planner: Planner,
    cases: Sequence[PasskeyCase],
    batch_tokens: int,
    rank: int,
) -> list[dict[str, Any]]:
    """Each case's answer: {length (tokens), requested length, depth, key, correct (every answer
    token's greedy prediction right), answer_loss (mean over the answer tokens)}."""
    fetcher = MemoryFetcher([c.tokens for c in cases])
    ids = np.arange(len(cases), dtype=np.int64)
    start = np.array([c.answer_start for c in cases], dtype=np.int64)
    n = np.array([c.answer_len for c in cases], dtype=np.int64)
    sums = np.zeros((len(cases), 3))  # loss sum, answer positions seen, of them right
    for plan in planned_batches(planner, ids, fetcher.lengths, batch_tokens):
        for t in executor.token_losses(plan, fetcher.fetch_step(rank_pieces(plan, rank))):
            # position p predicts token p + 1: the answer's tokens are predicted at [s - 1, s + n - 1)
            first = start[t.sample] - 1
            hit = (t.position >= first) & (t.position < first + n[t.sample])
            np.add.at(sums[:, 0], t.sample[hit], t.loss[hit])
            np.add.at(sums[:, 1], t.sample[hit], 1.0)
            np.add.at(sums[:, 2], t.sample[hit], t.correct[hit].astype(np.float64))
    total = torch.from_numpy(sums)
    executor.comm.all_reduce(total)
    sums = total.numpy()
    return [
        {
            "length": int(c.tokens.size),
            "requested_length": c.length,
            "depth": c.depth,
            "key": c.key,
            "correct": bool(sums[i, 2] == c.answer_len),
            "answer_loss": float(sums[i, 0] / max(sums[i, 1], 1.0)),
        }
        for i, c in enumerate(cases)
    ]
