"""The trainer's data: the dataset's fetch, the train/held-out split, the length-aware stream, the
planner, and the fixed held-out set; `TrainData.steps()` hands the trainer one typed `Step` per
optimizer step. Every rank builds the same stream and planner from the index alone; each fetches
only its own pieces (in a background thread, one step ahead).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from datapipe.errors import ConfigError
from datapipe.fetch import FetchConfig, Fetcher, PackedMicroBatch, rank_pieces
from datapipe.index import dataset_fingerprint
from datapipe.mix.config import SourceConfig, StageConfig, check_mixture, source_name
from datapipe.mix.fetch import MixtureFetcher, unit_pieces
from datapipe.mix.sources import load_sources, mix_sources, path_key
from datapipe.mix.stream import MixtureStream
from datapipe.plan.cost import CostModel
from datapipe.plan.planner import Planner, PlannerConfig
from datapipe.plan.stepplan import StepPlan
from datapipe.settings import Names, setting
from datapipe.stream import GlobalBatch, StreamConfig, greedy_boundaries, held_out_mask

if TYPE_CHECKING:
    from trainer.eval.buckets import BucketLosses
    from trainer.parallel.executor import HDPExecutor

__all__ = [
    "DataConfig",
    "PlannerSpec",
    "Step",
    "TrainData",
    "Validation",
    "check_special_ids",
    "held_out_mask",
]


@dataclass
class DataConfig:
    """`[data]`: the preprocessed dataset, its stream and fetch, and the held-out set.

    Held-out set: `val_path` (another preprocessed dataset), else, if `val_fraction` > 0, the
    samples whose id hashes (splitmix64 of id ^ seed) below that fraction are held out of
    training. At most `val_tokens` tokens of it are evaluated (a fixed prefix by sample id)."""

    path: str = setting(
        "",
        help="the dataset: a directory or object-store URI written by `mixlen preprocess` "
        "(this or sources)",
        free_on_resume=True,
    )
    sources: list[SourceConfig] = setting(
        factory=list,
        help="a mixture: [{path = ..., weight = ..., name = ..., max_epochs = ..., length_boost = "
        "{MIN_TOKENS = FACTOR}}, ...], weights as shares of tokens (instead of path); a resume "
        "keeps the datasets, may change the weights",
        free_on_resume=True,
    )
    stages: list[StageConfig] = setting(
        factory=list,
        help="[[data.stages]] tables: start_step and any of weights = {SOURCE = W}, "
        "max_sample_tokens, global_batch_tokens, in force from that step on",
        free_on_resume=True,
    )
    cache_dir: str | None = setting(
        None, help="local copies of remote datasets' files, a folder per URI", free_on_resume=True
    )
    val_path: str | None = setting(None, help="a held-out dataset (another preprocessed one)")
    val_fraction: float = setting(
        0.0, help="else hold out this fraction of the samples (by id hash), in [0, 1)", lo=0.0
    )
    val_tokens: int = setting(65536, help="tokens of the held-out set evaluated", lo=1)
    allow_other_dataset: bool = setting(
        False,
        help="resume on a dataset whose fingerprint differs from the checkpoint's (a re-sharded "
        "copy of the same data)",
        free_on_resume=True,
    )
    stream: StreamConfig = setting(help="", factory=StreamConfig, inline=True)
    fetch: FetchConfig = setting(help="", factory=FetchConfig, inline=True)

    def validate(self, names: Names) -> None:
        if self.path and self.sources:
            raise ConfigError(
                f"{names('path')} and {names('sources')}: give one (a single dataset is "
                f'sources = [{{path = "{self.path}"}}])'
            )
        if not self.path and not self.sources:
            raise ConfigError(
                f"{names('path')}: required (a directory written by `mixlen preprocess`), or "
                f"{names('sources')} for a mixture"
            )
        check_mixture(self.mix_sources(), self.stages, names)
        if self.val_path and self.is_mixture:
            raise ConfigError(
                f"{names('val_path')}: not with {names('sources')} or {names('stages')}; hold "
                f"out part of every source with {names('val_fraction')}"
            )
        if not self.val_fraction < 1.0:
            raise ConfigError(
                f"{names('val_fraction')}: must be in [0, 1), got {self.val_fraction}"
            )

    @property
    def is_mixture(self) -> bool:
        """Read through the mixture stream (sources or stages given)."""
        return bool(self.sources or self.stages)

    def mix_sources(self) -> list[SourceConfig]:
        """`sources`, or `path` as the one source of a mixture."""
        return list(self.sources) or [SourceConfig(path=self.path, name=source_name(self.path))]


class PlannerSpec(NamedTuple):
    """How the run plans an island's steps: the planner's settings, the cost model, the island's
    ranks, whether to plan offload, and the names of those settings as the user wrote them."""

    config: PlannerConfig
    cost: CostModel
    num_ranks: int
    offload: bool
    names: Names

    def build(self, max_len: int, seed: int) -> Planner:
        """The island's planner over a dataset whose longest sample has `max_len` tokens (the
        static mesh's default context; with widen, hdp also tries that mesh)."""
        cfg = self.config
        mesh = cfg.policy == "static" or cfg.widens
        cfg = dataclasses.replace(cfg, max_context=(cfg.max_context or max_len) if mesh else None)
        return cfg.build(self.cost, self.num_ranks, seed, self.offload, self.names)


@dataclass(frozen=True)
class Step:
    """One optimizer step handed to the trainer: the global batch, its plan, the stream's state
    after it (what a checkpoint saved with this step resumes from), this rank's fetched
    micro-batches in slot order, how long the trainer waited for them, and each of the plan's
    samples' labelled positions (from the index: a loss mask's trained tokens, else L - 1)."""

    batch: GlobalBatch
    plan: StepPlan
    stream_state: dict[str, Any]
    microbatches: list[PackedMicroBatch]
    wait_s: float
    loss_tokens: np.ndarray | None = None


def check_special_ids(manifest: dict, config: dict, data: str, model: str) -> None:
    """ConfigError naming the id that differs when the dataset's BOS/EOS are not the model's
    (config.json's bos_token_id / eos_token_id; a list of EOS ids holds any of them)."""
    for ours, theirs in (("bos_id", "bos_token_id"), ("eos_id", "eos_token_id")):
        a, b = manifest.get(ours), config.get(theirs)
        if a is None or b is None or a == b or (isinstance(b, list) and a in b):
            continue
        raise ConfigError(
            f"{data}/manifest.json: {ours} {a}, but {model}/config.json has {theirs} {b}: the "
            f"dataset was tokenized with another tokenizer than the model's (preprocess it with "
            f"--tokenizer-from {model})"
        )


class Validation:
    """A fixed held-out set, planned once; evaluated forward-only on the island."""

    def __init__(
        self,
        rank: int,
        fetcher: Fetcher,
        ids: np.ndarray,
        lengths: np.ndarray,
        planner: Planner,
        max_tokens: int,
        batch_tokens: int,
        units: np.ndarray | None = None,
    ) -> None:
        # a held-out dataset may hold samples no plan of this island can (longer than N * C)
        keep = (lengths > 0) & planner.fits(lengths)
        ids, lengths = ids[keep], lengths[keep]
        n = int(np.searchsorted(np.cumsum(lengths), max_tokens, side="right"))
        n = max(n, min(1, len(ids)))  # at least one sample when there is one
        ids, lengths = ids[:n], lengths[:n]
        if units is not None:  # a mixture's units (source, sample, start): keyed 0..n-1
            units, ids = units[keep][:n], np.arange(n, dtype=np.int64)
        bounds = greedy_boundaries(lengths, batch_tokens) if len(ids) else [0]
        self.batches = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            plan = planner.plan(lengths[a:b], ids[a:b])
            if units is None:
                pieces = rank_pieces(plan, rank)
            else:
                batch = GlobalBatch(-1, 0, ids[a:b], lengths[a:b], units[a:b])
                pieces = unit_pieces(plan, batch, rank)
            self.batches.append((plan, fetcher.fetch_step(pieces)))
        self.tokens = int(lengths.sum())

    def run(self, executor: HDPExecutor, rank: int) -> BucketLosses:
        """The held-out set's token losses, overall and by position and sample-length bucket."""
        from trainer.eval.run import evaluate_samples

        return evaluate_samples(executor, self.batches, rank)


class MixValidation:
    """A mixture's held-out sets, one per source, evaluated separately; `run` returns the pooled
    losses and keeps each source's mean loss in `by_source`."""

    def __init__(self, parts: dict[str, Validation]) -> None:
        self.parts = parts
        self.tokens = sum(v.tokens for v in parts.values())
        self.by_source: dict[str, float] = {}

    def run(self, executor: HDPExecutor, rank: int) -> BucketLosses:
        """Every source's held-out losses, pooled (token-weighted) into one BucketLosses."""
        from trainer.eval.buckets import BucketLosses

        pooled = BucketLosses()
        self.by_source = {}
        for name, val in self.parts.items():
            b = val.run(executor, rank)
            self.by_source[name] = b.loss
            pooled = pooled.merged(b)
        return pooled


class TrainData:
    """Fetch, split, stream and planner of one run (the held-out set planned and fetched when
    `eval_interval` > 0); `stack` releases the readers. `rank` is this process's rank in island
    `island` of `islands`; `names` spells `[data]`'s keys and the runtime values the stream
    receives (`global_batch_tokens`, `num_islands`) as the user wrote them. With `data.sources`
    or `data.stages` the batches come from the mixture stream (datapipe.mix)."""

    def __init__(
        self,
        cfg: DataConfig,
        planner: PlannerSpec,
        *,
        global_batch_tokens: int,
        vocab_size: int,
        rank: int,
        stack: ExitStack,
        names: Names,
        eval_interval: int = 0,
        island: int = 0,
        islands: int = 1,
    ) -> None:
        self.rank = rank
        self.planner_spec = planner
        self._prefetch: Any = None
        self._stack = stack
        self.mixture = cfg.is_mixture
        self.source_names: tuple[str, ...] = ()
        self.validation: Validation | MixValidation | None = None
        self.notice: str | None = None  # what the trainer logs at start (no held-out sample)
        if self.mixture:
            self._open_mixture(
                cfg, planner, global_batch_tokens, vocab_size, stack, names, eval_interval,
                island, islands,
            )  # fmt: skip
            return
        # the training set's fetch; the model must cover its vocabulary
        self.fetcher = cfg.fetch.build(cfg.path, cfg.cache_dir, names)
        stack.callback(self.fetcher.close)
        self.fingerprint = dataset_fingerprint(self.fetcher.index.manifest)
        self._check_vocab(self.fetcher, cfg.path, vocab_size)
        all_lengths = np.asarray(self.fetcher.lengths, dtype=np.int64)
        all_ids = np.arange(all_lengths.shape[0], dtype=np.int64)
        # held-out split: another dataset, or a hash-based fraction of this one
        self.val_fetcher: Fetcher | None = None
        self.val_ids = np.zeros(0, np.int64)
        self.train_ids = all_ids
        if cfg.val_path:
            self.val_fetcher = cfg.fetch.build(
                cfg.val_path, cfg.cache_dir, names.using(path=names("val_path"))
            )
            stack.callback(self.val_fetcher.close)
            self._check_vocab(self.val_fetcher, cfg.val_path, vocab_size)
            _check_same_tokenizer(self.fetcher, self.val_fetcher, names)
            self.val_ids = np.arange(len(self.val_fetcher.lengths), dtype=np.int64)
        elif cfg.val_fraction > 0:
            held = held_out_mask(all_ids, cfg.stream.seed, cfg.val_fraction)
            self.train_ids, self.val_ids = all_ids[~held], all_ids[held]
            self.val_fetcher = self.fetcher
        if self.train_ids.size == 0:
            raise ConfigError(f"{names('val_fraction')}: leaves no training samples")
        if eval_interval and not cfg.val_path and cfg.val_fraction > 0 and not self.val_ids.size:
            self.notice = (
                f"{names('val_fraction')} = {cfg.val_fraction} holds out none of the "
                f"{all_ids.size:,} samples of {cfg.path}: no validation runs (no val_loss); "
                f"raise it or set {names('val_path')}"
            )
        # stream over the training samples, and the island's planner
        self.stream = cfg.stream.build(
            all_lengths[self.train_ids], global_batch_tokens, island, islands, names
        )
        self.longest = max(int(all_lengths.max()), 1)  # the longest sample a plan must hold
        self.planner = planner.build(self.longest, cfg.stream.seed)
        self.planner.check_fits(all_lengths, f"{names('path')} {cfg.path}")
        if eval_interval and self.val_fetcher is not None and self.val_ids.size:
            val_lengths = np.asarray(self.val_fetcher.lengths)[self.val_ids]
            self.validation = Validation(
                rank, self.val_fetcher, self.val_ids, val_lengths, self.planner,
                cfg.val_tokens, global_batch_tokens,
            )  # fmt: skip

    def _open_mixture(
        self,
        cfg: DataConfig,
        planner: PlannerSpec,
        global_batch_tokens: int,
        vocab_size: int,
        stack: ExitStack,
        names: Names,
        eval_interval: int,
        island: int,
        islands: int,
    ) -> None:
        """The mixture's sources, fetch, held-out sets, stream and planner."""
        srcs = cfg.mix_sources()
        keys = [f"{names('sources')}[{i}]" for i in range(len(srcs))]
        loaded = load_sources(srcs, names, cfg.cache_dir, keys if cfg.sources else [names("path")])
        self.source_names = tuple(s.name for s in loaded)
        fetchers = []
        for src in loaded:
            f = cfg.fetch.build(src.config.path, src.cache, names.using(path=path_key(src.key)))
            stack.callback(f.close)
            fetchers.append(f)
        self.fetcher = MixtureFetcher(fetchers)
        h = hashlib.blake2b(digest_size=16)
        for src in loaded:
            h.update(f"{src.name}={src.fingerprint};".encode())
        self.fingerprint = loaded[0].fingerprint if len(loaded) == 1 else h.hexdigest()
        for f, src in zip(fetchers, loaded):
            manifest_vocab = int(src.manifest.get("vocab_size") or 0)
            if vocab_size < manifest_vocab:
                raise ConfigError(
                    f"model: vocab_size {vocab_size} < the dataset's {manifest_vocab} "
                    f"({src.config.path}/manifest.json vocab_size): the model has no embedding "
                    "for some of its token ids"
                )
            if not manifest_vocab:
                f.vocab_size, f.vocab_source = vocab_size, "the model's vocab_size"
        # each source's held-out samples (by id hash, as for one dataset)
        held = [
            held_out_mask(np.arange(s.lengths.shape[0]), cfg.stream.seed, cfg.val_fraction)
            for s in loaded
        ]
        mix = mix_sources(loaded, held)
        for src, m in zip(loaded, mix):
            if m.ids.size == 0:
                raise ConfigError(
                    f"{names('val_fraction')}: leaves source {src.name!r} no training samples"
                )
        quiet = None if self.rank == 0 else (lambda _: None)  # a source running out: said once
        self.stream = MixtureStream(
            cfg.stream, mix, srcs, cfg.stages, global_batch_tokens, island, islands, names, quiet
        )
        self.longest = self.stream.longest_unit()
        self.planner = planner.build(self.longest, cfg.stream.seed)
        what = (
            f"{names('sources')} (the longest unit; {names('stages')}' max_sample_tokens cuts it)"
        )
        self.planner.check_fits(np.array([self.longest]), what)
        if eval_interval and cfg.val_fraction > 0:
            self.validation = self._mix_validation(cfg, loaded, held, global_batch_tokens)

    def _mix_validation(
        self, cfg: DataConfig, loaded: list, held: list[np.ndarray], batch_tokens: int
    ) -> MixValidation | None:
        """Each source's held-out samples, whole where a plan holds them, else cut into units of
        the longest unit a stage forms (as training saw them); sources with none left out."""
        parts = {}
        for s, (src, mask) in enumerate(zip(loaded, held)):
            ids = np.flatnonzero(mask & (src.lengths > 0)).astype(np.int64)
            n = src.lengths[ids]
            cut = np.where(self.planner.fits(n), n, min(self.longest, int(n.max(initial=1))))
            pieces = -(-n // cut)  # units per sample
            sid, size = np.repeat(ids, pieces), np.repeat(cut, pieces)
            first = np.repeat(np.cumsum(pieces) - pieces, pieces)
            start = (np.arange(sid.shape[0]) - first) * size
            length = np.minimum(size, src.lengths[sid] - start)
            units = np.stack([np.full_like(sid, s), sid, start], axis=1)
            val = Validation(
                self.rank, self.fetcher, np.arange(sid.shape[0]), length, self.planner,
                cfg.val_tokens, batch_tokens, units,
            )  # fmt: skip
            if val.tokens:
                parts[src.name] = val
        return MixValidation(parts) if parts else None

    @staticmethod
    def _check_vocab(fetcher: Fetcher, path: str, vocab_size: int) -> None:
        """ConfigError when the model has no embedding for some of the dataset's token ids."""
        manifest_vocab = int(fetcher.index.manifest.get("vocab_size") or 0)
        if vocab_size < manifest_vocab:
            raise ConfigError(
                f"model: vocab_size {vocab_size} < the dataset's {manifest_vocab} "
                f"({path}/manifest.json vocab_size): the model has no embedding for some of "
                "its token ids"
            )
        if not manifest_vocab:  # the fetch refuses token ids the model has no embedding for
            fetcher.vocab_size = vocab_size
            fetcher.vocab_source = "the model's vocab_size"

    def plans(self) -> Iterator[tuple[GlobalBatch, StepPlan, dict[str, Any]]]:
        """Endless (batch, plan, stream state after it) per step, from lengths alone."""
        while True:
            b = next(self.stream)
            ids = b.sample_ids if self.mixture else self.train_ids[b.sample_ids]
            plan = self.planner.plan(b.lengths, ids)
            yield b, plan, self.stream.state_dict()

    def pieces(self, plan: StepPlan, batch: GlobalBatch) -> list:
        """This rank's pieces of `batch`'s `plan`, as the fetch takes them."""
        if self.mixture:
            return unit_pieces(plan, batch, self.rank)
        return rank_pieces(plan, self.rank)

    def check_supply(self, last_step: int) -> None:
        """A mixture whose sources run out (max_epochs) before step `last_step`: DataExhausted
        now, before training (datapipe.mix.stream.MixtureStream.check_supply)."""
        if self.mixture:
            self.stream.check_supply(last_step)

    def loss_tokens(self, batch: GlobalBatch) -> np.ndarray:
        """Each sample's (a mixture's: unit's) labelled positions in `batch`, in batch order,
        from the index alone (datapipe.plan.loss.LossMask): a loss mask's trained tokens after
        the first token of the sample or unit, else L - 1."""
        if not self.mixture:
            return self.fetcher.index.loss_tokens[self.train_ids[batch.sample_ids]]
        assert batch.units is not None
        out = np.zeros(batch.lengths.shape[0], np.int64)
        for s, f in enumerate(self.fetcher.fetchers):
            k = np.flatnonzero(batch.units[:, 0] == s)
            if k.size:
                u = batch.units[k]
                out[k] = f.index.loss_mask.unit_tokens(u[:, 1], u[:, 2], batch.lengths[k])
        return out

    def tokens_by_source(self, batch: GlobalBatch) -> dict[str, int]:
        """A mixture batch's tokens per source ({} for one dataset)."""
        return self.stream.tokens_by_source(batch) if self.mixture else {}

    def steps(self) -> Iterator[Step]:
        """Endless Steps, this rank's micro-batches fetched one step ahead in the background."""
        planned = ((item, self.pieces(item[1], item[0])) for item in self.plans())
        prefetch = self.fetcher.prefetch(planned)
        self._stack.callback(prefetch.close)
        for (batch, plan, state), fetched in prefetch:
            lt = self.loss_tokens(batch)
            yield Step(batch, plan, state, fetched, prefetch.last_wait_s, lt)


def _check_same_tokenizer(train: Fetcher, val: Fetcher, names: Names) -> None:
    """ConfigError naming data.val_path when it was tokenized otherwise than data.path (its loss
    would measure another encoding)."""
    from datapipe.mix.sources import tokenizer_differences

    what = tokenizer_differences(val.index.manifest, train.index.manifest)
    if what:
        raise ConfigError(
            f"{names('val_path')}: tokenized differently from {names('path')} ({what} in their "
            "manifest.json); preprocess both with the same --tokenizer"
        )
