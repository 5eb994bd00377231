"""Model-state memory per rank: the slice arithmetic and the byte formula, without torch.

One definition of how the flat parameter vector is cut into per-rank slices (`slice_length`,
`slice_bounds`: `trainer.parallel.slices.FlatLayout` uses them), and of how many bytes a rank holds for
weights, master weights, AdamW moments and gradient buffers under `[parallel] zero = 0 | 1 | 2`
(`model_state_bytes`), and for CO2's outer state (`outer_state_bytes`). The trainer's metrics,
`mixlen plan` and `mixlen simulate` (`preset_memory`) report these figures, so this module imports
nothing heavier than the standard library. `mixlen plan` also reports a micro-batch's activations
by checkpointing mode and the chunked loss's bytes (`activation_memory`, from the shape's terms in
datapipe.shapes), and the largest micro-batch a device holds beside the model state
(`micro_batch_bytes`, `largest_capacity`; `mixlen train` warns on a GPU when its
`parallel.capacity` would not fit: `capacity_warning`).

What each level keeps, for P parameters on N ranks of an island, slice length S (P/N rounded up
to the alignment), compute dtype c and accumulation dtype a (float64 for float64, else float32):

| buffer  | zero 0                  | zero 1            | zero 2                                  |
| ------- | ----------------------- | ----------------- | --------------------------------------- |
| weights | N*S*c (padded flat)     | N*S*c             | N*S*c                                   |
| master  | N*S*a if c != a, else 0 | own*a if c != a   | own*a if c != a                         |
| moments | 2*P*a                   | 2*own*a           | 2*own*a                                 |
| grads   | N*S*a                   | N*S*a             | own*a between steps; up to P*a in a step |

`own` is the rank's real slice length (<= S; the last slices may be shorter or empty). With
float32/float64 compute the flat weights are the master weights (no copy).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from datapipe.shapes import ModelConfig

__all__ = [
    "CHECKPOINTS",
    "DEVICE_BYTES",
    "DTYPE_BYTES",
    "H100_BYTES",
    "H200_BYTES",
    "ModelStateBytes",
    "accum_dtype_name",
    "activation_memory",
    "capacity_fit",
    "capacity_warning",
    "format_activation_memory",
    "format_capacity_fit",
    "format_preset_memory",
    "largest_capacity",
    "micro_batch_bytes",
    "model_state_bytes",
    "outer_state_bytes",
    "preset_memory",
    "slice_bounds",
    "slice_length",
    "usable_bytes",
    "zero_level",
]

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def accum_dtype_name(compute: str) -> str:
    """Dtype of master weights, moments and gradient accumulation for a compute dtype (the rule of
    `trainer.attention.local.accum_dtype`, by name)."""
    return "float64" if compute == "float64" else "float32"


def slice_length(numel: int, ranks: int, align: int) -> int:
    """Padded length S of every slice: ceil(numel / ranks) rounded up to a multiple of `align`."""
    assert ranks >= 1 and align >= 1 and numel >= 0
    per = -(-numel // ranks)
    return -(-per // align) * align


def slice_bounds(numel: int, ranks: int, align: int, rank: int) -> tuple[int, int]:
    """[start, end) of `rank`'s slice of the flat vector: [rank*S, (rank+1)*S) clipped to numel
    (the last slices may be shorter, or empty when the model is tiny)."""
    s = slice_length(numel, ranks, align)
    return min(rank * s, numel), min((rank + 1) * s, numel)


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes one rank holds for the model state (activations not included)."""

    weights: int  # compute-dtype weights (replicated, padded flat buffer)
    master: int  # accumulation-dtype master weights (0 when the weights are the master)
    moments: int  # AdamW exp_avg + exp_avg_sq
    grads: int  # gradient buffers held between steps
    grads_peak: int  # gradient buffers at most during a step

    @property
    def optimizer(self) -> int:
        """Optimizer state: master weights and moments."""
        return self.master + self.moments

    @property
    def total(self) -> int:
        """Peak model-state bytes (weights, optimizer state, gradients at their peak)."""
        return self.weights + self.master + self.moments + self.grads_peak

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "optimizer": self.optimizer, "total": self.total}


def model_state_bytes(
    numel: int,
    ranks: int,
    zero: int,
    compute: str = "bfloat16",
    align: int = 64,
    rank: int = 0,
) -> ModelStateBytes:
    """Model-state bytes of `rank` (rank 0 holds the largest slice) for `numel` trainable
    parameters on an island of `ranks` ranks with ZeRO level `zero` and compute dtype `compute`
    (a name of DTYPE_BYTES). Equal to what `trainer.parallel.zero.ZeroOptimizer` allocates."""
    if zero not in (0, 1, 2):
        raise ValueError(f"zero must be 0, 1 or 2, got {zero!r}")
    c = DTYPE_BYTES[compute]
    a = DTYPE_BYTES[accum_dtype_name(compute)]
    padded = ranks * slice_length(numel, ranks, align)
    start, end = slice_bounds(numel, ranks, align, rank)
    own = end - start if zero > 0 else numel
    separate_master = c != a
    if zero == 0:
        master = padded * a if separate_master else 0
    else:
        master = own * a if separate_master else 0
    grads = padded * a if zero < 2 else own * a
    grads_peak = padded * a if zero < 2 else numel * a
    return ModelStateBytes(
        weights=padded * c,
        master=master,
        moments=2 * own * a,
        grads=grads,
        grads_peak=grads_peak,
    )


def outer_state_bytes(numel: int, ranks: int, compute: str = "bfloat16", align: int = 64) -> int:
    """CO2 outer-state bytes of rank 0 of an island: its slice of the anchor, outer momentum,
    previous average D_prev and the in-flight buffer, in the accumulation dtype (about 4/N of the
    model)."""
    start, end = slice_bounds(numel, ranks, align, 0)
    return 4 * (end - start) * DTYPE_BYTES[accum_dtype_name(compute)]


def preset_memory(
    model: str, ranks: int, compute: str = "bfloat16", tp: int = 1
) -> dict[str, dict[str, int]]:
    """Model-state bytes per process of the named shape (datapipe.shapes; a cost preset's
    `name@device` suffix is ignored) on an island of `ranks` HDP ranks of `tp` tensor-parallel
    processes each (ZeRO shards each process's TP share over the HDP ranks of its TP index), by
    ZeRO level ("zero0" is the replicated optimizer); {} for a name that is not a model shape (a
    cost file). ValueError when the shape cannot be split over `tp`."""
    from datapipe.shapes import MODEL_CONFIGS

    shape = MODEL_CONFIGS.get(model.split("@")[0])
    if shape is None:
        return {}
    n = shape.tp_params(tp)
    return {f"zero{z}": model_state_bytes(n, ranks, z, compute).as_dict() for z in (0, 1, 2)}


# devices' memory as torch.cuda.mem_get_info reports their total (bytes)
H100_BYTES = 81_559 << 20  # an "80 GB" H100
H200_BYTES = 143_771 << 20  # a "141 GB" H200
DEVICE_BYTES = H100_BYTES  # the device the tables compare with


def usable_bytes(total: int) -> int:
    """What the memory estimates may fill of a device of `total` bytes: 95% less 1 GiB (the CUDA
    context, the caching allocator's fragmentation, kernels' workspaces are not modelled)."""
    return int(total * 0.95) - (1 << 30)


CHECKPOINTS = ("none", "selective", "full")  # train.activation_checkpoint's whole-model modes


def activation_memory(model: str, capacity: int, compute: str = "bfloat16") -> dict[str, int]:
    """Bytes one rank (tp 1) holds beside its model state for a micro-batch of `capacity`
    positions of the named shape: what all its blocks keep from forward to backward under each
    `train.activation_checkpoint` mode ("kept_none", "kept_selective", "kept_full":
    `ModelConfig.saved_bytes_per_token_layer` x layers), one block's activations while its
    backward recomputes it ("recompute", under selective or full), what a block's backward
    allocates at its peak ("backward", every mode: `ModelConfig.backward_bytes_per_token`) and
    the chunked loss's (`ModelConfig.loss_bytes`); {} for a name that is not a model shape."""
    from datapipe.shapes import MODEL_CONFIGS

    shape = MODEL_CONFIGS.get(model.split("@")[0])
    if shape is None:
        return {}
    c = DTYPE_BYTES[compute]
    out = {
        f"kept_{m}": int(shape.saved_bytes_per_token_layer(c, m) * shape.n_layers * capacity)
        for m in CHECKPOINTS
    }
    out["recompute"] = int(shape.act_bytes_per_token_layer(c) * capacity)
    out["backward"] = int(shape.backward_bytes_per_token(c) * capacity)
    out["loss"] = int(shape.loss_bytes(capacity, c))
    return out


def format_activation_memory(
    model: str, capacity: int, compute: str = "bfloat16", tp: int = 1
) -> str:
    """One line for `mixlen plan` ('' when `model` is no shape)."""
    b = activation_memory(model, capacity, compute)
    if not b:
        return ""
    if tp > 1:
        return f"activations per process at tp {tp}: not modelled (tp 1 only)"
    gb = {k: v / 1e9 for k, v in b.items()}
    return (
        f"activations per rank at C={capacity} positions ({model.split('@')[0]}, {compute}, GB): "
        f"kept by the blocks {gb['kept_none']:.1f} with activation_checkpoint none, "
        f"{gb['kept_selective']:.1f} selective, {gb['kept_full']:.1f} full (these two add up to "
        f"{gb['recompute']:.1f} for the block being recomputed); a block's backward "
        f"{gb['backward']:.1f}; the loss {gb['loss']:.1f}"
    )


def micro_batch_bytes(
    shape: ModelConfig, capacity: int, checkpoint: str = "none", compute: str = "bfloat16"
) -> int:
    """Peak bytes one rank (tp 1, no offload) holds beside its model state for a micro-batch of
    `capacity` positions under `train.activation_checkpoint` = `checkpoint` ("none",
    "selective", "full" or "every:K"): what the blocks keep, one block recomputed (when any
    is), a block's backward, the chunked loss (the sum `activation_memory` reports)."""
    c = DTYPE_BYTES[compute]
    layers = shape.n_layers
    if checkpoint.startswith("every:"):
        k = int(checkpoint.split(":", 1)[1])
        full = -(-layers // k)  # blocks 0, K, 2K, ...
        kept = full * shape.saved_bytes_per_token_layer(c, "full")
        kept += (layers - full) * shape.saved_bytes_per_token_layer(c, "none")
    else:
        kept = layers * shape.saved_bytes_per_token_layer(c, checkpoint)
    recompute = shape.act_bytes_per_token_layer(c) if checkpoint != "none" else 0.0
    per_token = kept + recompute + shape.backward_bytes_per_token(c)
    return int(per_token * capacity + shape.loss_bytes(capacity, c))


def largest_capacity(
    shape: ModelConfig, budget: int, checkpoint: str = "none", compute: str = "bfloat16"
) -> int:
    """The most positions whose `micro_batch_bytes` stay within `budget` bytes (0: none)."""
    lo, hi = 0, 1
    while micro_batch_bytes(shape, hi, checkpoint, compute) <= budget and hi < 1 << 40:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # micro_batch_bytes rises with the positions
        mid = (lo + hi) // 2
        lo, hi = (
            (mid, hi) if micro_batch_bytes(shape, mid, checkpoint, compute) <= budget else (lo, mid)
        )
    return lo


def zero_level(zero: int | None, ranks: int) -> int:
    """The ZeRO level an island of `ranks` ranks trains with: `[parallel] zero`, or by default 1
    with more than one rank, else 0."""
    if zero is not None:
        return zero
    return 1 if ranks > 1 else 0


def format_capacity_fit(
    model: str,
    ranks: int,
    compute: str = "bfloat16",
    device_bytes: int = DEVICE_BYTES,
    zero: int | None = None,
) -> str:
    """One line for `mixlen plan`: the largest --capacity a rank of `device_bytes` holds with
    each checkpointing mode beside the model state at ZeRO `zero` (default: the trainer's, 1 with
    more than one rank); '' when `model` is no shape."""
    fits = capacity_fit(model, ranks, compute, device_bytes, zero)
    if not fits:
        return ""
    zero = zero_level(zero, ranks)
    modes = ", ".join(f"{n:,} {m}" for m, n in fits.items())
    return (
        f"largest --capacity in {device_bytes / 1e9:.1f} GB (usable {usable_bytes(device_bytes) / 1e9:.1f}) "
        f"beside zero {zero}'s model state (tp 1, no offload): {modes}"
    )


def capacity_fit(
    model: str,
    ranks: int,
    compute: str = "bfloat16",
    device_bytes: int = DEVICE_BYTES,
    zero: int | None = None,
) -> dict[str, int]:
    """{checkpointing mode: the largest capacity that fits `usable_bytes(device_bytes)` beside
    the model state}; {} when `model` is no shape."""
    from datapipe.shapes import MODEL_CONFIGS

    shape = MODEL_CONFIGS.get(model.split("@")[0])
    if shape is None:
        return {}
    zero = zero_level(zero, ranks)
    state = model_state_bytes(shape.num_params(), ranks, zero, compute).total
    room = usable_bytes(device_bytes) - state
    return {m: largest_capacity(shape, room, m, compute) for m in CHECKPOINTS}


def capacity_warning(
    shape: ModelConfig,
    capacity: int,
    checkpoint: str,
    compute: str,
    state: int,
    device_bytes: int,
    keys: tuple[str, str] = ("parallel.capacity", "train.activation_checkpoint"),
) -> str | None:
    """A warning when `state` model-state bytes plus a micro-batch of `capacity` positions
    (`micro_batch_bytes`) exceed `usable_bytes(device_bytes)`, naming the settings (`keys`:
    capacity, checkpointing) and what would fit; None when it fits."""
    usable = usable_bytes(device_bytes)
    need = state + micro_batch_bytes(shape, capacity, checkpoint, compute)
    if need <= usable:
        return None
    where = (
        f"about {usable / 1e9:.1f} GB usable of this device's {device_bytes / 1e9:.1f} GB (the "
        "CUDA context, fragmentation and workspaces aside)"
    )
    advice = "shard it over more ranks (parallel.zero, --nproc) or tensor parallelism"
    if micro_batch_bytes(shape, 1, "full", compute) > usable - state:
        return (
            f"the model state needs about {state / 1e9:.1f} GB a rank, leaving no room for a "
            f"micro-batch in {where}: {advice}"
        )
    room = usable - state
    other = ", ".join(
        f"{largest_capacity(shape, room, m, compute):,} with {m}"
        for m in CHECKPOINTS
        if m != checkpoint
    )
    return (
        f'{keys[0]} = {capacity} with {keys[1]} = "{checkpoint}" needs about {need / 1e9:.1f} GB '
        f"a rank (model state {state / 1e9:.1f} GB + the largest micro-batch "
        f"{(need - state) / 1e9:.1f} GB), more than {where}: it may run out of memory. At most "
        f"{largest_capacity(shape, room, checkpoint, compute):,} positions fit as configured "
        f"({other}); or set offload.enabled = true"
    )


def format_preset_memory(model: str, ranks: int, compute: str = "bfloat16", tp: int = 1) -> str:
    """One line per ZeRO level for `mixlen plan` / `simulate` ('' when `model` is no shape)."""
    table = preset_memory(model, ranks, compute, tp)
    if not table:
        return ""
    name = model.split("@")[0]
    who = f"process (tp {tp} per rank)" if tp > 1 else "rank"
    lines = [
        f"model state per {who} ({name}, {compute} compute, {ranks} ranks per island, GB; "
        f"activations not included):"
    ]
    for level, b in table.items():
        fits = "fits" if b["total"] <= usable_bytes(DEVICE_BYTES) else "over"
        lines.append(
            f"  zero {level[-1]}: weights {b['weights'] / 1e9:.1f}  master {b['master'] / 1e9:.1f}"
            f"  moments {b['moments'] / 1e9:.1f}  grads {b['grads'] / 1e9:.1f}"
            f" (peak {b['grads_peak'] / 1e9:.1f})  total {b['total'] / 1e9:.1f}"
            f"  ({fits} an 80 GB H100)"
        )
    return "\n".join(lines)
