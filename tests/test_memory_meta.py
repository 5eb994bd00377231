"""The planner's activation-memory model (datapipe.plan.memory.activation_memory, the line
`mixlen plan --model` prints) against torch's own MemTracker: the real Llama-3.2-1B-shaped model's
forward and backward on the meta device, attention through torch's CUDA flash kernel's meta
function, the chunked loss, each activation_checkpoint mode through the trainer's
ActivationManager (benchmarks/estimate_memory.py; nothing is computed, so a 1B model takes
seconds on a CPU); the largest micro-batch a device holds, and `mixlen train`'s warning on a
GPU when `parallel.capacity` would not fit."""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import pytest
from conftest import ROOT

from datapipe.plan.memory import (
    CHECKPOINTS,
    activation_memory,
    largest_capacity,
    micro_batch_bytes,
    model_state_bytes,
)
from datapipe.shapes import MODEL_CONFIGS
from trainer.config.job import from_dict
from trainer.offload.manager import ActivationPolicy
from trainer.trainer import memory_warning

sys.path.insert(0, str(ROOT / "benchmarks"))

from estimate_memory import planned, tracked_peak  # noqa: E402


def _ratio(model: str, tokens: int, mode: str) -> tuple[float, dict[str, int]]:
    got = tracked_peak(model, tokens, mode, documents=3)
    assert got["Gradient"] == 0  # each .grad is moved out once accumulated, as in training
    return planned(model, tokens, mode) / got["microbatch"], got


def test_planned_activations_bound_torchs_tracked_peak() -> None:
    """The `small` shape (8 layers, dim 512) per activation_checkpoint mode at 2,048 positions
    in 3 documents, and Llama-3.2-1B under full checkpointing, where the loss over its 128,256
    vocabulary is most of the peak: never below the tracked peak by more than 3%, nor above it by
    more than 30% (the planner adds the loss's bytes to the recomputed block's, which the tracker
    sees alive one after the other). Without checkpointing, 2,048 more positions add what the
    planner says they add, within 5% (linear memory: nothing in T x T)."""
    peaks = {}
    for mode in CHECKPOINTS:
        ratio, peaks[mode] = _ratio("small", 2048, mode)
        assert 0.97 <= ratio <= 1.3, (mode, ratio, peaks[mode])
    assert peaks["full"]["microbatch"] < peaks["selective"]["microbatch"]
    assert peaks["selective"]["microbatch"] < peaks["none"]["microbatch"]
    more = tracked_peak("small", 4096, "none")["microbatch"] - peaks["none"]["microbatch"]
    want = planned("small", 4096, "none") - planned("small", 2048, "none")
    assert abs(more / want - 1) < 0.05, (more, want)
    ratio, got = _ratio("llama3.2-1b", 2048, "full")
    assert got["Parameter"] > 2e9  # the bf16 weights of 1.24 B parameters, tracked apart
    assert 0.97 <= ratio <= 1.3, (ratio, got)


@pytest.mark.parametrize("name", ["debug", "small", "llama3.2-1b"])
@pytest.mark.parametrize("mode", ["none", "selective", "full", "every:3"])
def test_largest_capacity_is_the_last_that_fits(name: str, mode: str) -> None:
    """`micro_batch_bytes` against the sum of `activation_memory`'s terms, every:K built from the
    ActivationPolicy's own list of checkpointed blocks; `largest_capacity` against a scan."""
    shape = MODEL_CONFIGS[name]
    n = 4096
    a = activation_memory(name, n)
    if mode.startswith("every:"):
        marks = ActivationPolicy(mode).checkpointed(shape.n_layers)
        kept = sum(shape.saved_bytes_per_token_layer(2, "full" if m else "none") for m in marks)
        want = int(kept * n) + a["recompute"] + a["backward"] + a["loss"]
        assert abs(micro_batch_bytes(shape, n, mode) - want) <= 4
    else:
        want = a[f"kept_{mode}"] + (a["recompute"] if mode != "none" else 0)
        assert abs(micro_batch_bytes(shape, n, mode) - (want + a["backward"] + a["loss"])) <= 4
    for budget in (0, micro_batch_bytes(shape, 1, mode) - 1, micro_batch_bytes(shape, 777, mode)):
        edge = largest_capacity(shape, budget, mode)
        fits = [c for c in range(0, 800) if micro_batch_bytes(shape, c, mode) <= budget]
        assert edge == (max(fits) if fits else 0)
    big = 141 * 10**9
    edge = largest_capacity(shape, big, mode)
    assert micro_batch_bytes(shape, edge, mode) <= big < micro_batch_bytes(shape, edge + 1, mode)


def test_a_run_that_would_not_fit_its_gpu_is_warned_naming_the_settings() -> None:
    """`mixlen train` on a GPU (trainer.memory_warning with the device's bytes): Llama-3.2-1B at
    capacity 65,536 without checkpointing on one 80 GB rank is warned, naming the keys and the
    largest capacity that fits (the last that does); 32,768 on 141 GB, offload, or tp 2 are not."""

    def cfg(capacity: int, offload: bool = False):  # noqa: ANN202
        return from_dict({"model": {"name": "llama3.2-1b"}, "train": {"dtype": "bfloat16"},
                          "parallel": {"capacity": capacity, "cost": "llama3.2-1b"},
                          "offload": {"enabled": offload},
                          "data": {"path": "/nowhere"}})  # fmt: skip

    one = SimpleNamespace(tp=1, comm=SimpleNamespace(size=1))
    msg = memory_warning(cfg(65536), one, 80 * 10**9)
    assert msg is not None
    assert 'parallel.capacity = 65536 with train.activation_checkpoint = "none"' in msg
    fit = int(re.search(r"At most ([\d,]+) positions fit", msg).group(1).replace(",", ""))
    state = model_state_bytes(MODEL_CONFIGS["llama3.2-1b"].num_params(), 1, 0).total
    shape = MODEL_CONFIGS["llama3.2-1b"]
    assert state + micro_batch_bytes(shape, fit) <= 80 * 10**9
    assert state + micro_batch_bytes(shape, fit + 1) > 80 * 10**9
    assert "selective" in msg and "offload.enabled = true" in msg
    assert memory_warning(cfg(32768), one, 141 * 10**9) is None
    assert memory_warning(cfg(65536), SimpleNamespace(tp=2, comm=one.comm), 80 * 10**9) is None
    assert "model state alone" in memory_warning(cfg(65536), one, 10 * 10**9)
    assert memory_warning(cfg(65536, offload=True), one, 80 * 10**9) is None
