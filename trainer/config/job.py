"""`mixlen train`'s config: one dataclass per section and its validation (reading and writing
the TOML file and `--set` overrides: trainer.config.toml).

Unknown sections or keys and bad values raise `ConfigError` naming `section.key`. Every field has
a default except `[data] path`. Settings that belong to a data-layer component are validated once,
by that component's config (`StreamConfig`, `FetchConfig`, `PlannerConfig`), which the sections
build with a map from its field names to the keys written here, so its errors name these keys.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from datapipe.errors import ConfigError, MixlenError
from datapipe.fetch import FetchConfig
from datapipe.plan.cost import CostModel, load, preset
from datapipe.plan.planner import PlannerConfig
from datapipe.shapes import MODEL_CONFIGS, ModelConfig, get_config
from datapipe.stream import StreamConfig
from trainer.islands.config import CO2Config, ranks_per_island

__all__ = [
    "CO2Config",
    "CheckpointConfig",
    "DataConfig",
    "MetricsConfig",
    "ModelSection",
    "OffloadConfig",
    "ParallelConfig",
    "TrainConfig",
    "TrainerConfig",
    "checkpoint_every",
    "ranks_per_island",
]

DTYPES = (
    "float32",
    "float64",
    "bfloat16",
)  # compute dtypes by config name (trainer.model.transformer maps)


@dataclass
class ModelSection:
    """`[model]`: a named shape (datapipe.shapes.MODEL_CONFIGS), optionally with fields replaced."""

    name: str = "debug"
    vocab_size: int | None = None  # e.g. a BPE tokenizer's (the dataset's manifest vocab_size)
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None

    def validate(self) -> None:
        if self.name not in MODEL_CONFIGS:
            raise ConfigError(f"model.name: unknown {self.name!r} (known: {sorted(MODEL_CONFIGS)})")
        for key, value in self.overrides().items():
            _positive(f"model.{key}", value)
        self.shape()

    def overrides(self) -> dict[str, int]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "name" and getattr(self, f.name) is not None
        }

    def shape(self) -> ModelConfig:
        """The model's shape, with the overrides applied."""
        try:
            return get_config(self.name, **self.overrides())
        except ValueError as exc:  # shape constraints between fields (heads, head dim)
            keys = ", ".join(f"model.{k}" for k in self.overrides()) or "model.name"
            raise ConfigError(f"{keys}: {exc}") from None


@dataclass
class DataConfig:
    """`[data]`: the preprocessed dataset and the held-out set.

    Held-out set: `val_path` (another preprocessed dataset), else, if `val_fraction` > 0, the
    samples whose id hashes (splitmix64 of id ^ seed) below that fraction are held out of
    training. At most `val_tokens` tokens of it are evaluated (a fixed prefix by sample id).
    `seed`, `oversize` and `lookahead` are the stream's (datapipe.stream), `cache_dir` and
    `prefetch_depth` the fetch's (datapipe.fetch).
    """

    path: str = ""
    seed: int = 0
    val_path: str | None = None
    val_fraction: float = 0.0
    val_tokens: int = 65536
    oversize: str = "own_step"
    lookahead: int = 64  # first-fit window of the stream's batch fill (0: plain greedy)
    cache_dir: str | None = None
    prefetch_depth: int = 1

    # how the stream's and the fetch's fields are written in this config
    STREAM_KEYS: typing.ClassVar[dict[str, str]] = {
        "path": "data.path",
        "seed": "data.seed",
        "oversize": "data.oversize",
        "lookahead": "data.lookahead",
        "cache_dir": "data.cache_dir",
        "global_batch_tokens": "train.global_batch_tokens",
        "num_islands": "parallel.islands",
        "island": "parallel.islands",
    }
    FETCH_KEYS: typing.ClassVar[dict[str, str]] = {
        "path": "data.path",
        "cache_dir": "data.cache_dir",
        "prefetch_depth": "data.prefetch_depth",
    }

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("data.path: required (a directory written by `mixlen preprocess`)")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction: must be in [0, 1), got {self.val_fraction}")
        _positive("data.val_tokens", self.val_tokens)

    def stream_config(
        self, global_batch_tokens: int, island: int = 0, num_islands: int = 1
    ) -> StreamConfig:
        """The length-aware stream of the training set, as island `island` of `num_islands` sees
        it (batch j of an epoch goes to island j mod num_islands)."""
        return StreamConfig(
            self.path,
            global_batch_tokens,
            seed=self.seed,
            island=island,
            num_islands=num_islands,
            oversize=self.oversize,
            lookahead=self.lookahead,
            cache_dir=self.cache_dir,
            keys=self.STREAM_KEYS,
        )

    def fetch_config(self, path: str | None = None) -> FetchConfig:
        """The fetch of the training set (or of `path`, the held-out dataset)."""
        keys = self.FETCH_KEYS if path is None else {**self.FETCH_KEYS, "path": "data.val_path"}
        return FetchConfig(
            path or self.path, self.cache_dir, prefetch_depth=self.prefetch_depth, keys=keys
        )


@dataclass
class TrainConfig:
    """`[train]`: optimisation. `eval_interval` 0 = no validation; `steps` counts optimizer steps."""

    steps: int = 100
    global_batch_tokens: int = 65536
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    schedule: str = "cosine"
    warmup: int = 10
    grad_clip: float = 1.0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    seed: int = 0
    dtype: str = "float32"
    eval_interval: int = 0
    device: str = "auto"
    stop_after: int = 0  # end this invocation after this step, checkpointed (0: run to `steps`)
    # recompute blocks' forward in backward: "none", "full" (every block) or "every:K" (blocks
    # 0, K, 2K, ...); trainer.offload.manager
    activation_checkpoint: str = "none"

    def validate(self) -> None:
        _positive("train.steps", self.steps)
        if not self.lr > 0:
            raise ConfigError(f"train.lr: must be > 0, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        _choice("train.schedule", self.schedule, ("cosine", "constant"))
        _nonneg("train.warmup", self.warmup)
        _nonneg("train.grad_clip", self.grad_clip)
        _nonneg("train.weight_decay", self.weight_decay)
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"train.{key}: must be in [0, 1), got {getattr(self, key)}")
        _nonneg("train.seed", self.seed)
        _choice("train.dtype", self.dtype, DTYPES)
        _nonneg("train.eval_interval", self.eval_interval)
        _choice("train.device", self.device, ("auto", "cpu", "cuda"))
        _nonneg("train.stop_after", self.stop_after)
        checkpoint_every(self.activation_checkpoint)


def checkpoint_every(spec: str) -> int:
    """`train.activation_checkpoint` as a stride: 0 for "none", 1 for "full", K for "every:K"."""
    if spec == "none":
        return 0
    if spec == "full":
        return 1
    head, _, k = spec.partition(":")
    if head == "every" and k.isdigit() and int(k) >= 1:
        return int(k)
    raise ConfigError(
        f'train.activation_checkpoint: expected "none", "full" or "every:K" (K >= 1), got {spec!r}'
    )


@dataclass
class ParallelConfig:
    """`[parallel]`: the planner (datapipe.plan.planner). `cost` is a cost file (`mixlen
    calibrate`) or a preset name (datapipe.plan.cost.preset); `max_context` fixes the static
    mesh's CP degree (default: the dataset's longest sample); `widen` lets hdp give long samples
    more ranks than the smallest group, or take that static mesh for a batch when it is estimated
    faster (docs/PLAN.md).

    `zero`: 0 every rank keeps the whole optimizer state; 1 each rank of an island keeps its
    slice of the master weights and AdamW moments; 2 also only its slice of the gradient between
    steps (trainer.parallel.zero). Default: 1 when an island has more than one rank, else 0. `islands`:
    the world is `islands` x ranks per island; islands train together as `[co2]` says."""

    policy: str = "hdp"
    capacity: int = 4096
    cost: str = "debug"
    max_context: int | None = None
    widen: bool = False
    zero: int | None = None
    islands: int = 1

    # how the planner's fields are written in this config
    PLANNER_KEYS: typing.ClassVar[dict[str, str]] = {
        "policy": "parallel.policy",
        "capacity": "parallel.capacity",
        "max_context": "parallel.max_context",
        "widen": "parallel.widen",
        "num_ranks": "the number of ranks (--nproc)",
        "offload": "offload.enabled",
    }

    def validate(self) -> None:
        self.planner_config(num_ranks=1, max_len=1, seed=0).validate()
        self.cost_model()
        if self.zero is not None and self.zero not in (0, 1, 2):
            raise ConfigError(f"parallel.zero: must be 0, 1 or 2, got {self.zero!r}")
        _positive("parallel.islands", self.islands)

    def ranks_per_island(self, world: int) -> int:
        """N of a run of `world` ranks (ConfigError unless `islands` divides it)."""
        return ranks_per_island(self.islands, world)

    def zero_level(self, ranks: int) -> int:
        """The ZeRO level of an island of `ranks` ranks (`zero`, default 1 if ranks > 1)."""
        if self.zero is not None:
            return self.zero
        return 1 if ranks > 1 else 0

    def planner_config(
        self, num_ranks: int, max_len: int, seed: int, offload: bool = False
    ) -> PlannerConfig:
        """The planner of an island of `num_ranks` ranks over a dataset whose longest sample
        has `max_len` tokens (the static mesh's default context); `offload`: plan with Eq. 3."""
        return PlannerConfig(
            policy=self.policy,
            num_ranks=num_ranks,
            capacity=self.capacity,
            offload=offload,
            # static's mesh; with widen, hdp also tries that mesh on every batch
            max_context=(self.max_context or max_len)
            if self.policy == "static" or self.widen
            else None,
            widen=self.widen,
            seed=seed,
            keys=self.PLANNER_KEYS,
        )

    def cost_model(self) -> CostModel:
        """The planner's cost model: a `mixlen calibrate` file (*.json) or a preset name."""
        try:
            return load(self.cost) if self.cost.endswith(".json") else preset(self.cost)
        except (MixlenError, OSError) as exc:
            raise ConfigError(f"parallel.cost: {exc}") from None


@dataclass
class OffloadConfig:
    """`[offload]`: selective activation offload (ByteScale Eq. 3, trainer.offload.manager).

    `enabled`: hdp and naive-hdp plan with offload and every micro-batch keeps the first blocks'
    saved activations in host memory as its plan's `offload_ratio` says. `force_ratio` runs every
    micro-batch at that ratio instead, on plans made without offload (tests, experiments).
    `host_bytes_per_s` replaces the cost model's `offload_bytes_per_s` (the host link the planner
    assumes). A rank refuses a plan whose host store would exceed `host_budget_bytes` before the
    step (0: no limit). Saved storages under `min_bytes` stay on the device; `pool_bytes` bounds the
    (pinned, on CUDA) host buffer pool, default twice the budget or 4 GiB without one.
    """

    enabled: bool = False
    force_ratio: float | None = None
    host_bytes_per_s: float | None = None
    host_budget_bytes: int = 0
    min_bytes: int = 4096
    pool_bytes: int | None = None

    DEFAULT_POOL_BYTES: typing.ClassVar[int] = 4 << 30

    def validate(self) -> None:
        if self.force_ratio is not None:
            if not self.enabled:
                raise ConfigError("offload.force_ratio: needs offload.enabled = true")
            if not 0.0 <= self.force_ratio <= 1.0:
                raise ConfigError(f"offload.force_ratio: must be in [0, 1], got {self.force_ratio}")
        if self.host_bytes_per_s is not None and not self.host_bytes_per_s > 0:
            raise ConfigError(f"offload.host_bytes_per_s: must be > 0, got {self.host_bytes_per_s}")
        _nonneg("offload.host_budget_bytes", self.host_budget_bytes)
        _nonneg("offload.min_bytes", self.min_bytes)
        if self.pool_bytes is not None:
            _nonneg("offload.pool_bytes", self.pool_bytes)

    @property
    def planned(self) -> bool:
        """Does the planner plan with offload (enabled, no force_ratio)?"""
        return self.enabled and self.force_ratio is None

    @property
    def pool_bound(self) -> int:
        """Bytes the host buffer pool may own."""
        if self.pool_bytes is not None:
            return self.pool_bytes
        return 2 * self.host_budget_bytes if self.host_budget_bytes else self.DEFAULT_POOL_BYTES

    def ratio(self, planned: float) -> float:
        """The ratio a micro-batch runs with: `force_ratio`, else its plan's."""
        if self.force_ratio is not None:
            return float(self.force_ratio)
        if planned > 0 and not self.enabled:
            raise MixlenError(
                f"the plan offloads activations (offload_ratio {planned:g}) but "
                "offload.enabled = false"
            )
        return float(planned)


@dataclass
class CheckpointConfig:
    """`[checkpoint]`: DCP checkpoints in `dir`/step-NNNNNNNN every `interval` steps (0: only at
    the end; no `dir`: none). `resume` = true resumes from the latest, or give a step directory."""

    dir: str | None = None
    interval: int = 0
    resume: bool | str = False
    keep: int = 2

    def validate(self) -> None:
        _nonneg("checkpoint.interval", self.interval)
        _positive("checkpoint.keep", self.keep)
        if self.resume is True and not self.dir:
            raise ConfigError("checkpoint.resume: needs checkpoint.dir (or a checkpoint path)")


@dataclass
class MetricsConfig:
    """`[metrics]`: metrics.jsonl (+ TensorBoard events if enabled and installed) in `dir`."""

    dir: str = "runs/mixlen"
    tensorboard: bool = False
    progress: bool = True
    console_interval: int = 1
    # another policy run on every `compare_interval`-th step's batch too (no update), reported
    # beside the run's policy at the end (trainer/compare.py); "" = off
    compare: str = ""
    compare_interval: int = 4
    # the comparison's headline clock: "wall" (ranks on their own cores or GPUs) or "cpu" (each
    # micro-batch's thread CPU time replayed in the plan's slot order: more ranks than cores, with
    # a cost file from `mixlen calibrate --clock cpu`); both are recorded
    compare_clock: str = "wall"

    def validate(self) -> None:
        _positive("metrics.console_interval", self.console_interval)
        _positive("metrics.compare_interval", self.compare_interval)
        _choice("metrics.compare_clock", self.compare_clock, ("wall", "cpu"))
        if self.compare:
            _choice("metrics.compare", self.compare, ("static", "hdp", "naive-hdp"))


@dataclass
class TrainerConfig:
    """The whole `mixlen train` config."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    co2: CO2Config = field(default_factory=CO2Config)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        self.data.stream_config(
            self.train.global_batch_tokens, num_islands=self.parallel.islands
        ).validate()
        self.data.fetch_config().validate()
        self._validate_offload()

    def _validate_offload(self) -> None:
        """A planned offload needs a policy that offloads and the model's layer count in the cost
        model (Eq. 3's capacity depends on it)."""
        if not self.offload.planned:
            return
        if self.parallel.policy not in ("hdp", "naive-hdp"):
            raise ConfigError(
                f"offload.enabled: the {self.parallel.policy} policy never offloads "
                "(parallel.policy); use hdp or naive-hdp, or set offload.force_ratio"
            )
        layers, planned = self.model.shape().n_layers, self.parallel.cost_model().num_layers
        if layers != planned:
            raise ConfigError(
                f"parallel.cost: its num_layers is {planned} but the model has {layers} "
                "(model.n_layers); offload plans Eq. 3 with the model's layer count: use a cost "
                "file for this model (`mixlen calibrate`) or the preset of its shape"
            )

    def cost_model(self) -> CostModel:
        """The planner's cost model (`parallel.cost`), with `offload.host_bytes_per_s` if set."""
        cost = self.parallel.cost_model()
        if self.offload.host_bytes_per_s is not None:
            cost = cost.with_offload_bandwidth(self.offload.host_bytes_per_s)
        return cost

    def planner_config(self, num_ranks: int, max_len: int) -> PlannerConfig:
        """The island's planner (`[parallel]`, with offload when `offload.planned`)."""
        return self.parallel.planner_config(
            num_ranks, max_len, self.data.seed, offload=self.offload.planned
        )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


# Settings a resumed run may change: how long it runs, where it logs, and how (not what) a step
# computes: the planner's settings (and the number of ranks) change which rank computes which
# tokens, not the loss or the gradients (docs/ARCHITECTURE.md, "Loss and exactness"); the ZeRO
# level which rank keeps which state; the emulated link only the time. Everything else must match.
RESUME_MAY_CHANGE = frozenset(
    {"train.steps", "train.stop_after", "train.eval_interval", "train.device"}
    | {"data.path", "data.cache_dir", "data.prefetch_depth"}
    # memory only: the same plans and the same gradients
    | {"train.activation_checkpoint", "offload.host_budget_bytes", "offload.min_bytes"}
    | {"offload.pool_bytes"}
    | {"parallel.policy", "parallel.capacity", "parallel.widen", "parallel.cost"}
    | {"parallel.max_context", "parallel.zero", "co2.link_gbps"}
)
RESUME_FREE_SECTIONS = frozenset({"checkpoint", "metrics"})


def resume_conflicts(saved: dict[str, dict[str, Any]], cfg: TrainerConfig) -> list[str]:
    """`section.key: saved -> now` for every run-defining setting that differs from `saved` (the
    checkpoint's `to_dict()`)."""
    out = []
    islands = (saved.get("parallel", {}).get("islands", 1), cfg.parallel.islands)
    for section, values in cfg.to_dict().items():
        if section in RESUME_FREE_SECTIONS or (section == "co2" and islands == (1, 1)):
            continue  # [co2] means nothing to a run of one island
        old = saved.get(section, {})
        for key, value in values.items():
            name = f"{section}.{key}"
            if name not in RESUME_MAY_CHANGE and key in old and old[key] != value:
                out.append(f"{name}: {old[key]!r} -> {value!r}")
    return out


# --- parsing -------------------------------------------------------------------------------------


def _positive(key: str, v: float) -> None:
    if not v >= 1:
        raise ConfigError(f"{key}: must be >= 1, got {v!r}")


def _nonneg(key: str, v: float) -> None:
    if not v >= 0:
        raise ConfigError(f"{key}: must be >= 0, got {v!r}")


def _choice(key: str, v: str, options: tuple[str, ...]) -> None:
    if v not in options:
        raise ConfigError(f"{key}: {v!r} is not one of {', '.join(options)}")


def _allowed(tp: Any) -> tuple[type, ...]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return tuple(t for a in typing.get_args(tp) for t in _allowed(a))
    return (type(None),) if tp is type(None) else (tp,)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    allowed = _allowed(tp)
    if value is None and type(None) in allowed:
        return None
    if isinstance(value, bool):
        if bool in allowed:
            return value
    elif isinstance(value, int) and int in allowed:
        return value
    elif isinstance(value, (int, float)) and float in allowed:
        if not math.isfinite(float(value)):
            raise ConfigError(f"{key}: must be finite, got {value!r}")
        return float(value)
    elif isinstance(value, str) and str in allowed:
        return value
    names = " or ".join("none" if t is type(None) else t.__name__ for t in allowed)
    raise ConfigError(f"{key}: expected {names}, got {type(value).__name__} {value!r}")


def _section(name: str, cls: type, values: Any) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{name}: expected a table [{name}], got {values!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"{name}.{key}: unknown key (known: {', '.join(sorted(known))})")
        kwargs[key] = _coerce(f"{name}.{key}", value, hints[key])
    return cls(**kwargs)


def from_dict(d: dict[str, Any]) -> TrainerConfig:
    """Build and validate a config from parsed TOML."""
    hints = typing.get_type_hints(TrainerConfig)
    unknown = set(d) - set(hints)
    if unknown:
        raise ConfigError(f"{sorted(unknown)[0]}: unknown section (known: {', '.join(hints)})")
    cfg = TrainerConfig(**{k: _section(k, hints[k], v) for k, v in d.items()})
    cfg.validate()
    return cfg
