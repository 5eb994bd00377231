"""`mixlen eval MODEL DATA`: a model (a mixlen checkpoint, or a Hugging Face `save_pretrained`
folder) evaluated on a mixlen dataset's held-out samples by the run's planner and executor on the
island's ranks, with loss and perplexity by position and sample-length bucket, and passkey
retrieval at depths 0-100% in filler up to the model's context. Collective: every rank runs
`run_eval`; rank 0 reports."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from datapipe.errors import ConfigError, InputError
from datapipe.fetch import FetchConfig
from datapipe.index import LOSS_MASK_KEY
from datapipe.ingest.tokenizer import HFTokenizer, Tokenizer, TokenizerSpec
from datapipe.plan.cost import resolve
from datapipe.plan.planner import PlannerConfig
from datapipe.settings import Names, from_mapping
from datapipe.shapes import ModelConfig
from trainer.data import held_out_mask
from trainer.eval.passkey import PasskeyCase, check_lengths, make_cases
from trainer.eval.report import perplexity
from trainer.eval.run import evaluate_passkey, evaluate_samples, fetched, planned_batches
from trainer.model.config import check_model_fits
from trainer.model.families.base import SHAPE_KEYS
from trainer.model.transformer import build, torch_dtype
from trainer.parallel.executor import HDPExecutor
from trainer.parallel.runtime import Runtime

__all__ = ["EvalOptions", "LoadedModel", "load_model", "preflight", "run_eval"]

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class EvalOptions:
    """What `mixlen eval` evaluates, and how (None: the checkpoint's setting, else a default)."""

    model: str
    data: str
    split: str = "val"
    dtype: str = "float32"
    capacity: int | None = None
    policy: str = "hdp"
    cost: str | None = None
    val_fraction: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    passkey: bool = True
    passkey_lengths: list[int] | None = None
    passkey_depths: list[float] = field(default_factory=lambda: list(DEPTHS))
    tokenizer: str | None = None
    passkey_beyond_context: bool = False  # passkey lengths beyond the declared context allowed
    sources: list[tuple[str, str]] = field(default_factory=list)  # a mixture: (name, path)


class LoadedModel(NamedTuple):
    """A model with its weights, its shape, its context (None: unknown), its tokenizer when it
    has one, and the settings of the run that trained it (a mixlen checkpoint's; a folder's
    mixlen.json, the held-out split of the run mixlen export wrote it from; else empty)."""

    model: nn.Module
    shape: ModelConfig
    context: int | None
    tokenizer: Tokenizer | None
    run: dict[str, dict[str, Any]]


def load_model(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    shard: Callable[[nn.Module], nn.Module] | None = None,
) -> LoadedModel:
    """A mixlen checkpoint (a step directory or a checkpoint.dir) or a Hugging Face folder;
    `shard` splits the model (tensor parallelism: each process reads only its shards, a folder's
    tensors slice by slice, a checkpoint's chunks through DCP)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        from trainer.model.pretrained import inspect_pretrained, load_pretrained_weights

        pre = inspect_pretrained(path)
        where = os.path.join(path, "config.json")
        check_model_fits(
            pre.shape, _dtype_name(dtype), str(device), lambda k: f"{where}: {SHAPE_KEYS[k]}"
        )
        model = build(pre.shape, "meta", dtype)
        model = (shard(model) if shard else model).to_empty(device=device)
        load_pretrained_weights(model, pre)
        tok = _folder_tokenizer(path)
        return LoadedModel(model, pre.shape, _context(pre.shape), tok, _folder_run(path))
    from trainer.checkpoint.weights import check_weights, read_checkpoint
    from trainer.config.job import TrainerConfig

    seen: dict[str, Any] = {}

    def settings(step: str, run: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """The run's model: its shape, checked against the memory before the weights are read;
        split (`shard`), the model whose shards the checkpoint's chunks are read into."""
        seen["cfg"] = cfg = from_mapping(TrainerConfig, run["config"])
        seen["shape"] = cfg.model.shape()
        check_model_fits(seen["shape"], _dtype_name(dtype), str(device), cfg.model.key_of)
        if shard is None:
            return None
        seen["model"] = shard(build(seen["shape"], "meta", dtype)).to_empty(device=device)
        return dict(seen["model"].named_parameters())

    ckpt = read_checkpoint(path, 0, settings)
    cfg, shape = seen["cfg"], seen["shape"]
    pre = cfg.model.pretrained
    source = os.path.join(pre, "config.json") if pre else "the run's settings"
    check_weights(ckpt.weights, shape, ckpt.step, source)
    model = seen.get("model")
    if model is None:
        model = build(shape, "meta", dtype).to_empty(device=device)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(ckpt.weights.pop(name).to(dtype))
    return LoadedModel(model, shape, _context(shape), None, ckpt.run["config"])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _context(shape: ModelConfig) -> int | None:
    ctx = getattr(shape, "max_position_embeddings", None)
    return int(ctx) if ctx else None


def _eval_ids(opts: EvalOptions, run: dict, n: int, path: str = "") -> np.ndarray:
    """The evaluated sample ids of dataset `path`: the held-out ones (the run's val_fraction and
    seed, or the options'; a mixture's sources hold out the same way, each its own), or all."""
    ids = np.arange(n, dtype=np.int64)
    if opts.split == "all":
        return ids
    data = run.get("data", {})
    frac = opts.val_fraction if opts.val_fraction is not None else data.get("val_fraction", 0.01)
    seed = opts.seed if opts.seed is not None else data.get("seed", 0)
    if not frac:
        raise InputError(
            f"--split val: {opts.model} trained without a held-out split (data.val_fraction = "
            "0); give --val-fraction, or --split all"
        )
    held = ids[held_out_mask(ids, int(seed), float(frac))]
    if held.size == 0 and not opts.sources:  # a mixture leaves such a source out, as training
        raise InputError(
            f"--split val: the held-out fraction {frac} (seed {seed}) selects none of the {n:,} "
            f"samples of {path or opts.data}; give a larger --val-fraction, or --split all"
        )
    return held


def _folder_run(path: str) -> dict[str, dict[str, Any]]:
    """The held-out split mixlen export recorded in a folder's mixlen.json (its run's
    data.val_fraction and seed, checked as [data]'s own settings); empty without one."""
    import json

    from datapipe.files import read_bounded_text
    from datapipe.settings import check
    from trainer.data import DataConfig
    from trainer.model.pretrained import RUN_FILE

    where = os.path.join(path, RUN_FILE)
    if not os.path.exists(where):
        return {}
    try:
        data = json.loads(read_bounded_text(where, 1 << 20, RUN_FILE))
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = None
    data = data.get("data") if isinstance(data, dict) else None
    if not isinstance(data, dict):
        raise InputError(
            f"{where}: not a JSON object with a 'data' object (mixlen export writes it)"
        )
    names = Names(f"{where}: data")
    cfg = from_mapping(DataConfig, {**data, "path": path}, names)
    check(cfg, names)
    return {"data": {"val_fraction": cfg.val_fraction, "seed": cfg.stream.seed}}


def _folder_tokenizer(path: str) -> Tokenizer | None:
    """A model folder's tokenizer.json, if it has one."""
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return HFTokenizer.from_folder(path)
    return None


def _tokenizer(opts: EvalOptions, model_tok: Tokenizer | None, manifest: dict) -> Tokenizer:
    """The passkey's tokenizer: --tokenizer, the model folder's, or the dataset's."""
    if opts.tokenizer:
        return TokenizerSpec.parse(opts.tokenizer).build()
    if model_tok is not None:
        return model_tok
    spec = manifest.get("tokenizer", {"kind": "bytes"})
    kind, path = spec.get("kind", "bytes"), spec.get("path")
    if kind != "bytes" and not (path and os.path.exists(path)):
        raise InputError(
            f"passkey: the dataset's tokenizer ({kind} {path}) is not on this machine; give "
            "--tokenizer FILE, or --no-passkey"
        )
    return TokenizerSpec(kind, path).build()


def _sharding(rt: Runtime) -> Callable[[nn.Module], nn.Module] | None:
    """The split of a model over the runtime's TP group (None at tp 1)."""
    if rt.tp == 1:
        return None
    from trainer.parallel.tensor import parallelize

    def shard(model: nn.Module) -> nn.Module:
        _check_tp(model.cfg, rt.tp)
        return parallelize(model, rt.tp_mesh)

    return shard


def _check_tp(shape: ModelConfig, tp: int) -> None:
    """ConfigError naming --tp when `shape` cannot be split over `tp` processes."""
    problem = shape.tp_problem(tp) if tp > 1 else None
    if problem:
        raise ConfigError(f"--tp: {problem}")


def _planner(opts: EvalOptions, run: dict[str, Any], world: int) -> tuple[Any, int]:
    """The island's planner (--policy, --capacity or the run's, --cost) and its capacity; a
    planning error names --capacity and --nproc."""
    cap = int(opts.capacity or run.get("parallel", {}).get("capacity") or 8192)
    json_cost = bool(opts.cost and opts.cost.endswith(".json"))
    cost = resolve(None, opts.cost) if json_cost else resolve(opts.cost or "debug", None)
    names = Names(flags=True).using(num_ranks="--nproc")
    return PlannerConfig(policy=opts.policy, capacity=cap).build(cost, world, names=names), cap


def preflight(opts: EvalOptions, nproc: int, tp: int, device: str = "auto") -> None:
    """What the ranks of `mixlen eval --nproc N` would refuse before evaluating, refused here
    once, before torchrun starts them (as `mixlen train` does): the model (a checkpoint's files
    present at their sizes and its run.json; a folder's config.json and weight files), its split
    over --tp, the memory it needs, the passkey lengths, and each dataset's vocabulary and
    evaluated samples fitting the plan of nproc / tp ranks (`device`: --device)."""
    shape, context, run = _inspect_model(opts.model, opts.dtype, device)
    _check_tp(shape, tp)
    world = nproc // tp
    planner, cap = _planner(opts, run, world)
    if opts.passkey:
        _check_passkey_lengths(
            opts.passkey_lengths or [], context, world, cap, opts.passkey_beyond_context
        )
        passkey_lengths, what = _passkey_lengths(opts, context, world * cap)
    for k, (_, path) in enumerate(opts.sources or [("", opts.data)]):
        with ExitStack() as stack:
            fetcher = FetchConfig().build(path)
            stack.callback(fetcher.close)
            _check_vocab(shape, fetcher, path)
            _, lengths = _evaluated(opts, run, np.asarray(fetcher.lengths, np.int64), path)
            planner.check_fits(lengths[lengths > 0], f"{path}: the evaluated samples")
            if opts.passkey and k == 0:  # the first dataset's, as run_eval takes it
                tok = _tokenizer(opts, _folder_tokenizer(opts.model), fetcher.index.manifest)
                check_lengths(tok, passkey_lengths, list(opts.passkey_depths), what=what)


def _inspect_model(
    path: str, dtype: str, device: str
) -> tuple[ModelConfig, int | None, dict[str, Any]]:
    """(shape, context, the run's settings) of a model folder or checkpoint, its weights
    unread: a folder's config.json and safetensors headers, or a checkpoint's files against
    checksums.json (present, at their sizes) and its run.json; the weights' memory on `device`
    checked."""
    if os.path.isfile(os.path.join(path, "config.json")):
        from trainer.model.pretrained import inspect_pretrained

        pre = inspect_pretrained(path)
        where = os.path.join(path, "config.json")
        check_model_fits(pre.shape, dtype, device, lambda k: f"{where}: {SHAPE_KEYS[k]}")
        return pre.shape, _context(pre.shape), {}
    from trainer.checkpoint.files import read_checksums, read_json
    from trainer.checkpoint.save import RUN_FILE
    from trainer.checkpoint.weights import checkpoint_step_dir
    from trainer.config.job import TrainerConfig

    step = checkpoint_step_dir(path)
    try:
        files = read_checksums(step)
    except ValueError as exc:
        raise InputError(f"{step}: {exc}") from None
    for name, want in sorted(files.items()):
        file = os.path.join(step, name)
        got = os.path.getsize(file) if os.path.isfile(file) else None
        if got != want["bytes"]:
            what = "is missing" if got is None else f"has {got} bytes, {want['bytes']} were written"
            raise InputError(f"{step}: {name} {what}")
    try:
        run = read_json(os.path.join(step, RUN_FILE))
    except ValueError as exc:
        raise InputError(f"{step}/{RUN_FILE}: {str(exc).removeprefix(RUN_FILE + ' is ')}") from None
    if not isinstance(run, dict) or not isinstance(run.get("config"), dict):
        raise InputError(f"{step}/{RUN_FILE}: no `config` object (the run's settings)")
    cfg = from_mapping(TrainerConfig, run["config"])
    shape = cfg.model.shape()
    check_model_fits(shape, dtype, device, cfg.model.key_of)
    return shape, _context(shape), run["config"]


def run_eval(opts: EvalOptions, rt: Runtime) -> dict[str, Any]:
    """Evaluate as `opts` says on the runtime's ranks; every rank returns the same result."""
    loaded = load_model(opts.model, torch_dtype(opts.dtype), rt.device, _sharding(rt))
    t0 = time.perf_counter()
    loaded.model.eval()
    planner, cap = _planner(opts, loaded.run, rt.world)
    if opts.passkey:
        lengths = opts.passkey_lengths or []
        _check_passkey_lengths(lengths, loaded.context, rt.world, cap, opts.passkey_beyond_context)
    ex = HDPExecutor(loaded.model, None, rt.comm, device=rt.device)
    out: dict[str, Any] = {"model": opts.model, "data": opts.data, "split": opts.split}
    datasets = opts.sources or [("", opts.data)]
    cases: list[PasskeyCase] = []

    def passkey_cases(manifest: dict) -> None:  # built (or refused) before the evaluation
        tok = _tokenizer(opts, loaded.tokenizer, manifest)
        lengths, what = _passkey_lengths(opts, loaded.context, rt.world * cap)
        cases.extend(make_cases(tok, lengths, list(opts.passkey_depths), what=what))

    parts = [
        _evaluate(
            path,
            opts,
            loaded,
            planner,
            ex,
            rt,
            cap,
            passkey_cases if opts.passkey and k == 0 else None,
        )
        for k, (_, path) in enumerate(datasets)
    ]
    if opts.sources:  # sources whose held-out split is empty are left out (and named)
        out["left_out"] = [name for (name, _), p in zip(datasets, parts) if p is None]
        datasets = [d for d, p in zip(datasets, parts) if p is not None]
        parts = [p for p in parts if p is not None]
        if not parts:
            raise InputError(
                f"--split val: the held-out split selects no sample of any source "
                f"({', '.join(out['left_out'])}); give a larger --val-fraction, or --split all"
            )
    buckets = parts[0].buckets
    for part in parts[1:]:  # a mixture: its sources' held-out sets pooled
        buckets = buckets.merged(part.buckets)
    context = loaded.context
    lengths = np.concatenate([part.lengths for part in parts])
    out.update(
        loss=buckets.loss,
        perplexity=perplexity(buckets.loss),
        tokens=buckets.tokens,
        samples=int((lengths > 0).sum()),
        context=context,
        beyond_context=int((lengths > context).sum()) if context else 0,
        by_position=buckets.by_position(),
        by_length=buckets.by_length(),
    )
    if opts.sources:
        out["by_source"] = {
            name: {
                "data": path,
                "loss": part.buckets.loss,
                "perplexity": perplexity(part.buckets.loss),
                "tokens": part.buckets.tokens,
                "samples": int((part.lengths > 0).sum()),
                "by_position": part.buckets.by_position(),
            }
            for (name, path), part in zip(datasets, parts)
        }
    # on a dataset with a loss mask the loss is over its trained positions only (the fetch's labels)
    out["loss_mask"] = any(bool(part.manifest.get(LOSS_MASK_KEY)) for part in parts)
    out["seconds"] = time.perf_counter() - t0  # the samples' evaluation, after the load
    if opts.passkey:
        out["passkey"] = evaluate_passkey(ex, planner, cases, rt.world * cap, rt.rank)
    return out


class Evaluated(NamedTuple):
    """One dataset's held-out losses, the evaluated samples' lengths and its manifest."""

    buckets: Any
    lengths: np.ndarray
    manifest: dict


def _evaluate(
    path: str, opts: EvalOptions, loaded: LoadedModel, planner: Any, ex: HDPExecutor,
    rt: Runtime, cap: int, opened: Callable[[dict], None] | None = None,
) -> Evaluated | None:  # fmt: skip
    """The held-out samples of the dataset at `path` (--max-tokens: `_evaluated`), evaluated;
    None for a mixture's source with none. `opened` gets its manifest before the evaluation."""
    with ExitStack() as stack:
        fetcher = FetchConfig().build(path)
        stack.callback(fetcher.close)
        _check_vocab(loaded.shape, fetcher, path)
        if opened is not None:
            opened(fetcher.index.manifest)
        stored = np.asarray(fetcher.lengths, dtype=np.int64)
        ids, lengths = _evaluated(opts, loaded.run, stored, path)
        if ids.size == 0:  # a mixture's source with no held-out sample
            return None
        plans = planned_batches(planner, ids, lengths, rt.world * cap)
        buckets = evaluate_samples(ex, fetched(plans, fetcher.fetch_step, rt.rank), rt.rank)
        manifest = fetcher.index.manifest
    if not buckets.tokens:
        raise InputError(
            f"{path}: the {ids.size:,} evaluated samples hold no labelled position (each "
            "has fewer than 2 tokens)"
        )
    return Evaluated(buckets, lengths, manifest)


def _evaluated(
    opts: EvalOptions, run: dict[str, Any], stored: np.ndarray, path: str
) -> tuple[np.ndarray, np.ndarray]:
    """(sample ids, the lengths evaluated) of the dataset at `path` whose samples have `stored`
    lengths: the held-out ones in order; with --max-tokens N, those whose labelled positions
    (n - 1 of a sample of n tokens) fit in N all together, and the first tokens of the next one
    to make exactly N: a prefix of k tokens predicts k labels (its last one the sample's next
    stored token), the same predictions a causal model makes on the whole sample there."""
    ids = _eval_ids(opts, run, stored.size, path)
    lengths = stored[ids]
    if not opts.max_tokens or ids.size == 0:
        return ids, lengths
    reach = np.cumsum(np.maximum(lengths - 1, 0))  # labelled positions through each sample
    first = int(np.searchsorted(reach, opts.max_tokens, side="left"))  # the first to reach N
    if first == ids.size:
        return ids, lengths
    # no sample after the first to reach N (not even an empty one); that one cut to make N
    ids, lengths = ids[: first + 1].copy(), lengths[: first + 1].copy()
    if reach[first] > opts.max_tokens:
        lengths[first] = opts.max_tokens - (int(reach[first - 1]) if first else 0)
    return ids, lengths


def _check_passkey_lengths(
    lengths: list[int], context: int | None, world: int, cap: int, beyond: bool = False
) -> None:
    """ConfigError naming --passkey-lengths for a length beyond the model's declared context
    (unless `beyond`: --passkey-beyond-context) or beyond what the island's ranks hold (checked
    before anything is evaluated)."""
    if context and not beyond and any(n > context for n in lengths):
        n = next(n for n in lengths if n > context)
        raise ConfigError(
            f"--passkey-lengths: {n:,} is longer than the model's context, {context:,} "
            "(its max_position_embeddings); give lengths within it, or --passkey-beyond-context "
            "to measure a model before its context is extended"
        )
    if any(n > world * cap for n in lengths):
        n = next(n for n in lengths if n > world * cap)
        ranks = f"{world} rank{'s' if world > 1 else ''}"
        raise ConfigError(
            f"--passkey-lengths: {n:,} tokens is more than {ranks} of --capacity {cap:,} hold "
            f"({world * cap:,} positions); give shorter lengths, more ranks (--nproc) or a "
            "larger --capacity"
        )


def _check_vocab(shape: ModelConfig, fetcher: Any, data: str) -> None:
    vocab = int(fetcher.index.manifest.get("vocab_size") or 0)
    if vocab > shape.vocab_size:
        raise InputError(
            f"{data}/manifest.json: vocab_size {vocab} is more than the model's {shape.vocab_size}"
        )


def _passkey_lengths(opts: EvalOptions, context: int | None, limit: int) -> tuple[list[int], str]:
    """(the passkey lengths, what to call them in an error): --passkey-lengths, else powers of two
    from 1,024 to the model's context or to what the island holds (`limit` positions)."""
    if opts.passkey_lengths:
        return list(opts.passkey_lengths), "--passkey-lengths"
    top = min(context or limit, limit)
    what = (
        f"the default passkey lengths (up to {top:,}: the model's context, or what the ranks hold)"
    )
    return [1024 << i for i in range(40) if 1024 << i <= top] or [top], what
