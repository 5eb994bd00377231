"""The generators' state a checkpoint stores (trainer.checkpoint.rng): torch's, numpy's and
Python's, through JSON, put back exactly (the reference: the draws themselves)."""

from __future__ import annotations

import json
import random

import numpy as np
import torch

from trainer.checkpoint.rng import capture_rng, restore_rng, seed_all


def draws() -> tuple:
    """Uniform draws of each generator, then a normal one of Python's and of numpy's."""
    uniform = (torch.rand(7), np.random.rand(7), [random.random() for _ in range(7)])
    return (*uniform, random.gauss(0, 1), np.random.normal())


def test_every_generator_is_restored() -> None:
    """torch, numpy and python generators drawn after a save equal those drawn after a load into
    a process whose generators were moved elsewhere (the reference: the draws themselves)."""
    seed_all(3)  # a normal draw each: Python and numpy keep its pair's second value for the next
    torch.rand(5), np.random.rand(5), random.random(), random.gauss(0, 1), np.random.normal()
    state = json.loads(json.dumps(capture_rng()))  # what a checkpoint stores
    want = draws()
    seed_all(99)
    torch.rand(11), np.random.normal(size=3), random.gauss(0, 1)
    restore_rng(state)
    got = draws()
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2:] == want[2:]


def test_seed_all_seeds_each_generator_as_its_own_seed_call_would() -> None:
    """seed_all(s) draws what torch.manual_seed(s), numpy's seed(s mod 2^32) and random.seed(s)
    draw, for seeds past 2^31 and 2^32 too (no two seeds below 2^32 share numpy's stream)."""
    for seed in (0, 7, 2**31 + 5, 2**32 - 1, 2**40 + 3):
        seed_all(seed)
        got = draws()
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)
        want = draws()
        for a, b in zip(got, want):
            assert np.array_equal(np.asarray(a), np.asarray(b)), seed
