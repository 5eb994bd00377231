"""`mixlen train`'s TOML config: one dataclass per section, validation, `--set` overrides.

Unknown sections or keys and bad values raise `ConfigError` naming `section.key`. Every field has
a default except `[data] path`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from datapipe.errors import ConfigError, MixlenError
from datapipe.planners import POLICIES as PLANNER_POLICIES
from datapipe.planners import PlannerConfig
from datapipe.stream import OVERSIZE_POLICIES

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

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
    "apply_overrides",
    "load_config",
    "to_toml",
]

DTYPES = ("float32", "float64", "bfloat16")
POLICIES = (*PLANNER_POLICIES, "single")  # single: one process, whole samples (the reference)


@dataclass
class ModelSection:
    """`[model]`: a named config (trainer.model.MODEL_CONFIGS), optionally with fields replaced."""

    name: str = "debug"
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None

    def validate(self) -> None:
        from trainer.model import MODEL_CONFIGS, get_config

        if self.name not in MODEL_CONFIGS:
            raise ConfigError(f"model.name: unknown {self.name!r} (known: {sorted(MODEL_CONFIGS)})")
        for key, value in self.overrides().items():
            _positive(f"model.{key}", value)
        try:
            get_config(self.name, **self.overrides())
        except ValueError as exc:  # shape constraints between fields (heads, head dim)
            keys = ", ".join(f"model.{k}" for k in self.overrides()) or "model.name"
            raise ConfigError(f"{keys}: {exc}") from None

    def overrides(self) -> dict[str, int]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "name" and getattr(self, f.name) is not None
        }


@dataclass
class DataConfig:
    """`[data]`: the preprocessed dataset and the held-out set.

    Held-out set: `val_path` (another preprocessed dataset), else, if `val_fraction` > 0, the
    samples whose id hashes (splitmix64 of id ^ seed) below that fraction are held out of
    training. At most `val_tokens` tokens of it are evaluated (a fixed prefix by sample id).
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

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("data.path: required (a directory written by `mixlen preprocess`)")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction: must be in [0, 1), got {self.val_fraction}")
        _positive("data.val_tokens", self.val_tokens)
        _positive("data.prefetch_depth", self.prefetch_depth)
        _nonneg("data.seed", self.seed)
        _nonneg("data.lookahead", self.lookahead)
        _choice("data.oversize", self.oversize, OVERSIZE_POLICIES)


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

    def validate(self) -> None:
        _positive("train.steps", self.steps)
        _positive("train.global_batch_tokens", self.global_batch_tokens)
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


@dataclass
class ParallelConfig:
    """`[parallel]`: the planner. `cost` is a cost file (`mixlen calibrate`) or a preset name
    (datapipe.cost.preset); `max_context` fixes the static mesh's CP degree (default: per batch);
    `widen` lets hdp give long samples more ranks than the smallest group (docs/PLAN.md)."""

    policy: str = "hdp"
    capacity: int = 4096
    islands: int = 1
    cost: str = "debug"
    max_context: int | None = None
    widen: bool = False

    def validate(self) -> None:
        _choice("parallel.policy", self.policy, POLICIES)
        _positive("parallel.islands", self.islands)
        if self.islands != 1:
            raise ConfigError(
                f"parallel.islands: {self.islands} islands need CO2 outer sync, which is not "
                "implemented yet; use islands = 1"
            )
        if self.policy == "single" and self.widen:
            raise ConfigError("parallel.widen: the single policy does not plan; set widen = false")
        try:  # the planner's own checks (capacity, max_context, widen only with hdp)
            PlannerConfig(
                policy="hdp" if self.policy == "single" else self.policy,
                num_ranks=1,
                capacity=self.capacity,
                max_context=self.max_context,
                widen=self.widen,
            ).validate()
        except ConfigError as exc:
            raise ConfigError(f"parallel.{exc}") from None
        self.cost_model()

    def cost_model(self):  # -> datapipe.cost.CostModel
        """The planner's cost model: a `mixlen calibrate` file (*.json) or a preset name."""
        from datapipe.cost import load, preset

        try:
            return load(self.cost) if self.cost.endswith(".json") else preset(self.cost)
        except (MixlenError, OSError) as exc:
            raise ConfigError(f"parallel.cost: {exc}") from None


@dataclass
class OffloadConfig:
    """`[offload]`: selective activation offload (ByteScale). Not implemented yet: must be off."""

    enabled: bool = False
    bytes_per_s: float | None = None  # host link bandwidth override for the planner

    def validate(self) -> None:
        if self.bytes_per_s is not None and not self.bytes_per_s > 0:
            raise ConfigError(f"offload.bytes_per_s: must be > 0, got {self.bytes_per_s}")
        if self.enabled:
            raise ConfigError(
                "offload.enabled: selective offload is not implemented yet (it lands in a later "
                "issue); set it to false"
            )


@dataclass
class CO2Config:
    """`[co2]`: outer sync across islands (DESIGN.md). Validated; running it needs islands > 1,
    which is not implemented yet, so `enabled` must stay false."""

    enabled: bool = False
    tau: int = 48
    outer_lr: float = 1.0
    momentum: float = 0.9
    staleness_lambda: float = 0.0
    clip: str = "none"
    clip_value: float = 1.0
    overlap: bool = True
    nesterov: bool = False
    baseline: str = "co2"

    def validate(self) -> None:
        _positive("co2.tau", self.tau)
        if not self.outer_lr > 0:
            raise ConfigError(f"co2.outer_lr: must be > 0, got {self.outer_lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"co2.momentum: must be in [0, 1), got {self.momentum}")
        _nonneg("co2.staleness_lambda", self.staleness_lambda)
        _choice("co2.clip", self.clip, ("none", "value", "norm"))
        if not self.clip_value > 0:
            raise ConfigError(f"co2.clip_value: must be > 0, got {self.clip_value}")
        _choice("co2.baseline", self.baseline, ("co2", "sync", "diloco"))
        if self.enabled:
            raise ConfigError(
                "co2.enabled: CO2 outer sync is not implemented yet (only one island, "
                "[parallel] islands = 1, is supported); set it to false"
            )


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

    def validate(self) -> None:
        _positive("metrics.console_interval", self.console_interval)


@dataclass
class TrainerConfig:
    """The whole `mixlen train` config."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    co2: CO2Config = field(default_factory=CO2Config)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


# Settings a resumed run may change: how long it runs and where it logs. Everything else (model,
# data order, optimisation, parallelism) must match the checkpoint's run.
RESUME_MAY_CHANGE = frozenset(
    {"train.steps", "train.stop_after", "train.eval_interval", "train.device"}
    | {"data.path", "data.cache_dir", "data.prefetch_depth"}
)
RESUME_FREE_SECTIONS = frozenset({"checkpoint", "metrics"})


def resume_conflicts(saved: dict[str, dict[str, Any]], cfg: TrainerConfig) -> list[str]:
    """`section.key: saved -> now` for every run-defining setting that differs from `saved` (the
    checkpoint's `to_dict()`)."""
    out = []
    for section, values in cfg.to_dict().items():
        if section in RESUME_FREE_SECTIONS:
            continue
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


def _parse_value(text: str) -> Any:
    """A --set value: a TOML value (1e-3, true, "x", [1, 2]) or else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` overrides to a parsed config dict (copied)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not section or not name:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        out.setdefault(section, {})
        if not isinstance(out[section], dict):
            raise ConfigError(f"--set {item!r}: {section} is not a section")
        out[section][name] = _parse_value(value.strip())
    return out


def load_config(
    path: str | os.PathLike | None, overrides: list[str] | None = None
) -> TrainerConfig:
    """Read a TOML file (None: defaults only), apply overrides, validate. Relative paths in
    `[data]`, `[checkpoint]`, `[metrics]` and a `.json` cost stay relative to the working dir."""
    d: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                d = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read config ({exc.strerror})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    return from_dict(apply_overrides(d, overrides or []))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


def to_toml(cfg: TrainerConfig) -> str:
    """The resolved config as TOML (keys left at None are shown as comments)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            lines.append(f"# {k} = (unset)" if v is None else f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)
