"""`mixlen train`'s config: the tree of every component's Config, one TOML section each.

Each section is declared once, by the component that uses it: `[model]` trainer.model.config,
`[data]` trainer.data (with the stream's and the fetch's settings inline), `[train]` here,
`[parallel]` trainer.parallel.config (with the planner's settings inline), `[offload]`
trainer.offload.config, `[checkpoint]` trainer.checkpoint.config, `[metrics]` trainer.metrics,
`[co2]` trainer.islands.config. A field's default, bounds, help text and resume rule are in its
`setting()` (datapipe.settings); errors name `section.key` from the field's place in this tree.
Reading the TOML file and `--set` overrides: trainer.config.toml; what a resume may change:
trainer.config.resume.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from datapipe.errors import ConfigError
from datapipe.plan.cost import CostModel
from datapipe.plan.loss import LOSS_NORMALIZATIONS
from datapipe.settings import Names, check, from_mapping, setting, values
from trainer.checkpoint.config import CheckpointConfig
from trainer.data import DataConfig, PlannerSpec, TrainData, check_special_ids
from trainer.islands.config import CO2Config
from trainer.metrics import MetricsConfig
from trainer.model.config import DTYPES, ModelSection, pretrained_of
from trainer.offload.config import SELECTIVE, SELECTIVE_OFFLOAD, OffloadConfig, checkpoint_every
from trainer.parallel.config import ParallelConfig

__all__ = ["TrainConfig", "TrainerConfig", "from_dict"]


@dataclass
class TrainConfig:
    """`[train]`: optimisation."""

    steps: int = setting(100, help="optimizer steps of the run", lo=1, free_on_resume=True)
    global_batch_tokens: int = setting(
        65536, help="tokens per optimizer step, per island", lo=1, hi=1 << 40
    )
    lr: float = setting(1e-3, help="peak learning rate")
    min_lr_ratio: float = setting(0.1, help="the cosine schedule ends at lr x this", lo=0.0, hi=1.0)
    schedule: str = setting(
        "cosine", help="after warmup: cosine or constant", choices=("cosine", "constant")
    )
    warmup: int = setting(10, help="steps of linear warmup", lo=0)
    grad_clip: float = setting(1.0, help="clip the gradient's global norm to this (0: off)", lo=0.0)
    weight_decay: float = setting(0.1, help="AdamW's decoupled weight decay", lo=0.0)
    beta1: float = setting(0.9, help="AdamW's beta1, in [0, 1)", lo=0.0)
    beta2: float = setting(0.95, help="AdamW's beta2, in [0, 1)", lo=0.0)
    seed: int = setting(0, help="seed of the weights' initialisation", lo=0, hi=(1 << 63) - 1)
    dtype: str = setting("float32", help="compute dtype", choices=DTYPES)
    eval_interval: int = setting(
        0,
        help="evaluate the held-out set every this many steps (0: never)",
        lo=0,
        free_on_resume=True,
    )
    device: str = setting(
        "auto", help="auto (CUDA when available), cpu or cuda", choices=("auto", "cpu", "cuda"),
        free_on_resume=True,
    )  # fmt: skip
    stop_after: int = setting(
        0,
        help="end this invocation after this step, checkpointed (0: run to steps)",
        lo=0,
        free_on_resume=True,
    )
    activation_checkpoint: str = setting(
        "none",
        help='recompute blocks\' forward in backward: "none", "full", "every:K" (blocks 0, K, '
        '2K, ...) or "selective" (every block keeps its matmul and attention outputs and '
        "recomputes its pointwise ops; not with offload)",
        free_on_resume=True,
    )
    compile: bool = setting(
        False,
        help="torch.compile each block as one graph with dynamic shapes, local attention a "
        "registered operator inside it (a ring micro-batch: the segments around its attention), "
        "and the loss's arithmetic on each chunk of logits; "
        "refused with parallel.tp > 1 (DTensor blocks run uncompiled); on an H200 the blocks "
        "compiled ran 7-12% faster with a quarter less memory (the loss's chunks not yet "
        "measured there), the first step compiling (docs/gpu.md)",
        free_on_resume=True,
    )
    loss_normalization: str = setting(
        "token",
        help='the loss of a step: "token" (its token losses over its labelled positions) or '
        '"sequence" (each sample\'s mean over its own labelled positions, averaged over the '
        "step's samples: LongAlign's rule for instruction data with a loss mask)",
        choices=LOSS_NORMALIZATIONS,
    )

    def validate(self, names: Names) -> None:
        if not self.lr > 0:
            raise ConfigError(f"{names('lr')}: must be > 0, got {self.lr}")
        for key in ("beta1", "beta2"):
            if not getattr(self, key) < 1.0:
                raise ConfigError(f"{names(key)}: must be in [0, 1), got {getattr(self, key)}")
        checkpoint_every(self.activation_checkpoint, names("activation_checkpoint"))


def _section(cls: type) -> Any:
    return field(default_factory=cls)


@dataclass
class TrainerConfig:
    """The whole `mixlen train` config: one field per TOML section."""

    model: ModelSection = _section(ModelSection)
    data: DataConfig = _section(DataConfig)
    train: TrainConfig = _section(TrainConfig)
    parallel: ParallelConfig = _section(ParallelConfig)
    offload: OffloadConfig = _section(OffloadConfig)
    checkpoint: CheckpointConfig = _section(CheckpointConfig)
    metrics: MetricsConfig = _section(MetricsConfig)
    co2: CO2Config = _section(CO2Config)

    def section_of(self, part: Any) -> str:
        """The TOML section holding `part` (a section, or a config inline in one)."""
        for f in dataclasses.fields(self):
            sec = getattr(self, f.name)
            if sec is part or any(getattr(sec, g.name) is part for g in dataclasses.fields(sec)):
                return f.name
        raise KeyError(part)

    def names(self, part: Any) -> Names:
        """How the keys of `part` (a section or a config inline in one) are written."""
        return Names(self.section_of(part))

    def key(self, part: Any, name: str) -> str:
        """`section.key` of field `name` of `part`."""
        return self.names(part)(name)

    def validate(self, names: Names | None = None) -> None:
        """Every section's keys, then the rules between sections. ConfigError names the key."""
        for f in dataclasses.fields(self):
            check(getattr(self, f.name), Names(f.name))
        self._validate_offload()
        self._validate_compare()
        self._validate_tp()
        if self.train.stop_after and not self.checkpoint.dir:
            raise ConfigError(
                f"{self.key(self.train, 'stop_after')} = {self.train.stop_after} ends the run "
                f"checkpointed, but {self.key(self.checkpoint, 'dir')} is not set: the run would "
                "stop with nothing to continue from; set a checkpoint directory"
            )

    def _validate_tp(self) -> None:
        """Tensor parallelism needs a shape it can split."""
        problem = self.model.shape().tp_problem(self.parallel.tp) if self.parallel.tp > 1 else ""
        if problem:
            raise ConfigError(f"{self.key(self.parallel, 'tp')}: {problem}")
        if self.train.compile and self.train.activation_checkpoint == SELECTIVE:
            raise ConfigError(
                f"{self.key(self.train, 'compile')}: not with "
                f'{self.key(self.train, "activation_checkpoint")} = "selective" (torch.compile '
                "refuses to compile under selective checkpointing's dispatch mode); turn one "
                "of them off"
            )
        if self.train.compile and self.parallel.tp > 1:
            raise ConfigError(
                f"{self.key(self.train, 'compile')}: not with {self.key(self.parallel, 'tp')} = "
                f"{self.parallel.tp} (DTensor blocks run uncompiled); set it to false"
            )

    def _validate_offload(self) -> None:
        """A planned offload needs a policy that offloads and the model's layer count in the cost
        model (Eq. 3's capacity depends on it)."""
        if self.offload.enabled and self.train.activation_checkpoint == SELECTIVE:
            raise ConfigError(SELECTIVE_OFFLOAD)
        if not self.offload.planned:
            return
        policy, off = self.parallel.planner.policy, self.names(self.offload)
        if policy not in ("hdp", "naive-hdp"):
            raise ConfigError(
                f"{off('enabled')}: the {policy} policy never offloads "
                f"({self.key(self.parallel.planner, 'policy')}); use hdp or naive-hdp, or set "
                f"{off('force_ratio')}"
            )
        layers, planned = self.model.shape().n_layers, self.parallel.cost_model().num_layers
        if layers != planned:
            raise ConfigError(
                f"{self.key(self.parallel, 'cost')}: its num_layers is {planned} but the model has "
                f"{layers} ({self.key(self.model, 'n_layers')}); offload plans Eq. 3 with the "
                "model's layer count: make a cost file for this model (`mixlen calibrate "
                "CONFIG.toml`) or use the preset of its shape"
            )

    def _validate_compare(self) -> None:
        """Compare mode reports the cost model's predicted times beside the measured ones: refused
        with a cost file timed on a model whose work per position differs (another vocabulary,
        width, depth or dtype), whose predictions are that model's, not this one's."""
        if not self.metrics.compare or not self.parallel.cost.endswith(".json"):
            return
        differ = self.parallel.timed_cost_differences(self.model.shape(), self.train.dtype)
        if differ:
            raise ConfigError(
                f"{self.key(self.metrics, 'compare')}: {self.key(self.parallel, 'cost')} "
                f"{self.parallel.cost} was timed on another model ({'; '.join(differ)}), so the "
                "comparison's predicted times would be that model's: time this one with "
                "`mixlen calibrate CONFIG.toml` (or --vocab-size with --model)"
            )

    def cost_model(self) -> CostModel:
        """The planner's cost model (`parallel.cost`), with `offload.host_bytes_per_s` if set."""
        cost = self.parallel.cost_model()
        if self.offload.host_bytes_per_s is not None:
            cost = cost.with_offload_bandwidth(self.offload.host_bytes_per_s)
        return cost

    def planner_spec(self, num_ranks: int) -> PlannerSpec:
        """The island's planner: `[parallel]`'s settings and cost model, planned with offload when
        `offload.planned`."""
        names = self.names(self.parallel).using(
            num_ranks="the number of ranks (--nproc)", offload=self.key(self.offload, "enabled")
        )
        planner = self.parallel.planner
        return PlannerSpec(planner, self.cost_model(), num_ranks, self.offload.planned, names)

    def train_data(
        self,
        rank: int,
        num_ranks: int,
        stack: ExitStack,
        island: int = 0,
        validation: bool = True,
    ) -> TrainData:
        """The run's data as rank `rank` of island `island` (of `parallel.islands`) of
        `num_ranks` ranks sees it; `validation`: plan and fetch the held-out set."""
        names = self.names(self.data).using(
            global_batch_tokens=self.key(self.train, "global_batch_tokens"),
            num_islands=self.key(self.parallel, "islands"),
            island=self.key(self.parallel, "islands"),
            steps=self.key(self.train, "steps"),
        )
        data = TrainData(
            self.data,
            self.planner_spec(num_ranks),
            global_batch_tokens=self.train.global_batch_tokens,
            vocab_size=self.model.shape().vocab_size,
            rank=rank,
            stack=stack,
            names=names,
            eval_interval=self.train.eval_interval if validation else 0,
            island=island,
            islands=self.parallel.islands,
        )
        if self.model.pretrained:
            pre = pretrained_of(self.model)
            first = self.data.mix_sources()[0].path  # a mixture's sources share one tokenizer
            check_special_ids(data.fetcher.index.manifest, pre.config, first, pre.path)
        where = self.data.path or f"{self.key(self.data, 'sources')} (the longest unit)"
        self.model.check_context([data.longest], where)  # a mixture's: its longest piece
        return data

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """{section: {key: value}} as the keys are written (inline keys in their section)."""
        out: dict[str, dict[str, Any]] = {}
        for f in dataclasses.fields(self):
            out[f.name] = {
                k.split(".", 1)[1]: v
                for k, v in values(getattr(self, f.name), Names(f.name)).items()
            }
        return out


def from_dict(d: dict[str, Any]) -> TrainerConfig:
    """Build and validate a config from parsed TOML."""
    cfg = from_mapping(TrainerConfig, d)
    cfg.validate()
    return cfg
