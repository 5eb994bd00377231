"""The planner's activation-memory model (datapipe.plan.memory.activation_memory, the line
`mixlen plan --model` prints) against torch's own MemTracker: the real Llama-3.2-1B-shaped model's
forward and backward on the meta device, attention through torch's CUDA flash kernel's meta
function, the chunked loss, each activation_checkpoint mode through the trainer's
ActivationManager (benchmarks/estimate_memory.py; nothing is computed, so a 1B model takes
seconds on a CPU); the largest micro-batch a device holds, and `mixlen train`'s warning on a
GPU when `parallel.capacity` would not fit."""

from __future__ import annotations

import functools
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT

from datapipe.plan.memory import (
    CHECKPOINTS,
    H100_BYTES,
    H200_BYTES,
    activation_memory,
    largest_capacity,
    micro_batch_bytes,
    model_state_bytes,
    outer_state_bytes,
)
from datapipe.shapes import MODEL_CONFIGS
from trainer.config.job import TrainerConfig, from_dict
from trainer.offload.manager import ActivationPolicy
from trainer.trainer import Trainer, memory_warning

sys.path.insert(0, str(ROOT / "benchmarks"))

from estimate_memory import planned, tracked_peak  # noqa: E402


def _ratio(model: str, tokens: int, mode: str) -> tuple[float, dict[str, int]]:
    got = tracked_peak(model, tokens, mode, documents=3)
    assert got["Gradient"] == 0  # each .grad is moved out once accumulated, as in training
    return planned(model, tokens, mode) / got["microbatch"], got


def test_planned_activations_bound_torchs_tracked_peak() -> None:
    """The `small` shape (8 layers, dim 512) per activation_checkpoint mode (and every:3, blocks 0,
    3 and 6 checkpointed) at 2,048 positions in 3 documents, and Llama-3.2-1B under full checkpointing, where the loss over its 128,256
    vocabulary is most of the peak: never below the tracked peak by more than 3%, nor above it by
    more than 30% (the planner adds the loss's bytes to the recomputed block's, which the tracker
    sees alive one after the other). Without checkpointing, 2,048 more positions add what the
    planner says they add, within 5% (linear memory: nothing in T x T)."""
    peaks = {}
    for mode in (*CHECKPOINTS, "every:3"):
        ratio, peaks[mode] = _ratio("small", 2048, mode)
        assert 0.97 <= ratio <= 1.3, (mode, ratio, peaks[mode])
    assert (
        peaks["full"]["microbatch"] < peaks["every:3"]["microbatch"] < peaks["none"]["microbatch"]
    )
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


def _config(capacity: int, **sections: dict) -> TrainerConfig:
    base = {"model": {"name": "llama3.2-1b"}, "train": {"dtype": "bfloat16"},
            "parallel": {"capacity": capacity, "cost": "llama3.2-1b"}, "data": {"path": "/no"}}  # fmt: skip
    for key, more in sections.items():
        base[key] = {**base.get(key, {}), **more}
    return from_dict(base)


def _rt(ranks: int = 1, tp: int = 1, islands: int = 1) -> SimpleNamespace:
    return SimpleNamespace(tp=tp, islands=islands, comm=SimpleNamespace(size=ranks))


def _need(msg: str, what: str = "needs about") -> float:
    return float(re.search(what + r" ([\d.]+) GB", msg).group(1))


def test_a_run_that_would_not_fit_its_gpu_is_warned_naming_the_settings() -> None:
    """`mixlen train` on a GPU (trainer.memory_warning with the device's total bytes): Llama-3.2-1B
    at capacity 65,536 without checkpointing on one H100 is warned, naming the keys and the
    largest capacity that fits 95% of the device less 1 GiB (the last that does)."""
    msg = memory_warning(_config(65536), _rt(), H100_BYTES)
    assert msg is not None
    assert 'parallel.capacity = 65536 with train.activation_checkpoint = "none"' in msg
    fit = int(re.search(r"At most ([\d,]+) positions fit", msg).group(1).replace(",", ""))
    shape = MODEL_CONFIGS["llama3.2-1b"]
    state = model_state_bytes(shape.num_params(), 1, 0).total
    usable = 0.95 * H100_BYTES - 2**30
    assert (
        state + micro_batch_bytes(shape, fit) <= usable < state + micro_batch_bytes(shape, fit + 1)
    )
    assert "selective" in msg and "offload.enabled = true" in msg
    assert memory_warning(_config(fit), _rt(), H100_BYTES) is None  # the last that fits
    assert memory_warning(_config(fit + 1), _rt(), H100_BYTES) is not None
    assert memory_warning(_config(32768), _rt(), H200_BYTES) is None


def test_the_warning_counts_the_runs_own_state() -> None:
    """The ranks and ZeRO level (8 ranks at the default ZeRO 1: 9.3 GB of model state, 32K
    positions fit an H100; at ZeRO 0, 22.2 GB, they do not), the compute dtype (float32 needs
    more), CO2's outer state across islands, a model state with no room left; nothing at tp 2
    or with offload (not modelled)."""
    assert memory_warning(_config(32768), _rt(8), H100_BYTES) is None
    zero0 = memory_warning(_config(32768, parallel={"zero": 0}), _rt(8), H100_BYTES)
    assert zero0 is not None and "model state 22.2 GB" in zero0
    bf16 = memory_warning(_config(65536), _rt(), H100_BYTES)
    f32 = memory_warning(_config(65536, train={"dtype": "float32"}), _rt(), H100_BYTES)
    micro = "the largest micro-batch"  # float32 activations: most of them twice the bytes
    assert _need(f32, micro) > 1.8 * _need(bf16, micro) and "model state 19.8 GB" in f32
    co2 = _config(65536, parallel={"islands": 2}, co2={"mode": "co2"})
    numel = MODEL_CONFIGS["llama3.2-1b"].num_params()
    outer = outer_state_bytes(numel, 1) / 1e9  # 4 float32 copies of the model: 19.8 GB
    assert abs(_need(memory_warning(co2, _rt(islands=2), H100_BYTES)) - _need(bf16) - outer) < 0.1
    assert "leaving no room" in memory_warning(_config(65536), _rt(), 20 << 30)
    assert memory_warning(_config(65536), _rt(tp=2), H100_BYTES) is None
    assert memory_warning(_config(65536, offload={"enabled": True}), _rt(), H100_BYTES) is None


def test_the_trainer_logs_the_warning_and_never_fails_on_it(monkeypatch) -> None:
    """Trainer._warn_memory (what a CUDA rank 0 runs at start) with torch.cuda.mem_get_info
    answering an H100's total: the warning is logged; if the estimate fails (a driver error
    here), it is logged at debug level and the run goes on."""
    import trainer.trainer as module

    logged: list[tuple[str, str]] = []
    log = SimpleNamespace(**{k: functools.partial(lambda k, m: logged.append((k, m)), k)
                             for k in ("debug", "warning")})  # fmt: skip
    monkeypatch.setattr(module, "get_logger", lambda: log)
    trainer = SimpleNamespace(cfg=_config(65536), rt=_rt())
    trainer.rt.device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, H100_BYTES))
    Trainer._warn_memory(trainer)
    assert len(logged) == 1 and logged[0][0] == "warning" and "capacity = 65536" in logged[0][1]
    logged.clear()

    def broken(device=None):  # noqa: ANN001, ANN202
        raise RuntimeError("CUDA driver version is insufficient")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    Trainer._warn_memory(trainer)
    assert logged == [("debug", "memory estimate skipped: RuntimeError: CUDA driver version is "
                       "insufficient")]  # fmt: skip
