"""`mixlen export CKPT_DIR --hf OUT_DIR [--dtype bfloat16]`: a training checkpoint (a
`step-NNNNNNNN` directory, or a checkpoint.dir: its newest complete one; saved under any number
of ranks and ZeRO level) as a Hugging Face `save_pretrained` folder that transformers'
`AutoModelForCausalLM.from_pretrained` loads: config.json with the run's RoPE settings and
context, sharded safetensors with their index, and the tokenizer files when the run had them,
written into a temporary folder and renamed into place.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from datapipe.errors import ConfigError, InputError
from datapipe.plan.setup import MAX_CONTEXT
from tools.cli import MAX_ISLAND, int_in

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",  # transformers >= 4.50 saves the chat template beside the tokenizer
    "chat_template.json",
    "generation_config.json",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CKPT_DIR", help="a step directory or a checkpoint.dir")
    p.add_argument("--hf", required=True, metavar="OUT_DIR", help="the folder to write")
    p.add_argument(
        "--dtype", default=None, choices=("float32", "bfloat16", "float16"), help="stored dtype"
    )
    p.add_argument(
        "--island",
        type=int_in(0, MAX_ISLAND),
        default=0,
        help="with co2/diloco islands: whose weights",
    )
    p.add_argument(
        "--max-position-embeddings",
        type=int_in(1, MAX_CONTEXT),
        default=None,
        help="the context config.json declares (default: model.max_position_embeddings, the "
        "pretrained model's, or a single-dataset run's longest sample; under dynamic RoPE "
        "scaling its original context, where transformers starts stretching)",
    )
    p.add_argument(
        "--shard-size",
        type=int_in(1 << 20, 1 << 40),
        default=2_000_000_000,
        help="bytes per shard (1 MiB to 1 TiB)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")


def _dataset_manifest(run: dict) -> dict:
    """The manifest of the run's dataset (a mixture's first source's: its sources share one
    tokenizer), or {} where it is not here to read."""
    data = run.get("data", {})
    sources = data.get("sources") or [{}]
    path = data.get("path") or (sources[0] or {}).get("path")
    try:
        from datapipe.index import read_manifest

        return read_manifest(path) if path else {}
    except (InputError, OSError):
        return {}


def _run_settings(run: dict) -> dict[str, dict[str, Any]]:
    """mixlen.json: the run's held-out split (data.val_fraction and seed), so that mixlen eval of
    the folder scores the samples the run held out, not a default fraction's."""
    data = run.get("data", {})
    return {"data": {"val_fraction": data.get("val_fraction"), "seed": data.get("seed")}}


def _token_ids(run: dict) -> dict[str, int | None]:
    """A model trained from scratch: the dataset's BOS and EOS ids, as config.json's (null where
    unknown: transformers would otherwise take its own defaults, 1 and 2)."""
    manifest = _dataset_manifest(run)
    return {"bos_token_id": manifest.get("bos_id"), "eos_token_id": manifest.get("eos_id")}


def _tokenizer_files(run: dict, model_dir: str | None) -> list[str | tuple[str, str]]:
    """The tokenizer files of the pretrained folder, else the dataset's (its --tokenizer-from
    folder's, or its --tokenizer file as tokenizer.json, the name transformers loads)."""
    if model_dir:
        return [
            os.path.join(model_dir, n)
            for n in TOKENIZER_FILES
            if os.path.isfile(os.path.join(model_dir, n))
        ]
    tok = _dataset_manifest(run).get("tokenizer", {})
    if tok.get("kind") == "hf-dir" and tok.get("path"):
        return _tokenizer_files(run, tok["path"])
    if tok.get("kind") == "hf" and tok.get("path") and os.path.isfile(tok["path"]):
        return [(tok["path"], "tokenizer.json")]
    return []


def _context(args, shape, run: dict) -> int:
    if args.max_position_embeddings:
        return args.max_position_embeddings
    if shape.max_position_embeddings:
        return int(shape.max_position_embeddings)
    section = run.get("data", {})
    data = section.get("path")
    if not data and section.get("sources"):
        raise ConfigError(
            "--max-position-embeddings: needed (the model declares no context, and a mixture "
            "run's (data.sources) is not measured from its datasets)"
        )
    try:
        from datapipe.index import read_lengths

        return int(read_lengths(data).max())
    except (InputError, OSError, TypeError, ValueError):
        raise ConfigError(
            "--max-position-embeddings: needed (the model declares no context and the run's "
            "dataset is not here to measure)"
        ) from None


def _check_output(args: argparse.Namespace, inputs: list[str], noun: str = "checkpoint") -> None:
    """InputError naming --hf if it lies under a file, is or holds the current directory, or is,
    holds or sits inside one of `inputs` (what the export reads: --overwrite would delete it)."""
    from pathlib import Path

    from datapipe.ingest.output import check_out_path

    out = Path(args.hf).absolute()
    check_out_path(out, args.hf, inputs, "--hf", noun, "--overwrite would delete it")


def run(args: argparse.Namespace) -> int:
    import torch

    from datapipe.settings import from_mapping
    from trainer.checkpoint.weights import check_weights, read_checkpoint
    from trainer.config.job import TrainerConfig
    from trainer.model.config import pretrained_of
    from trainer.model.export import export_hf

    _check_output(args, [args.checkpoint])  # before anything is read
    if os.path.lexists(args.hf) and not args.overwrite:
        raise InputError(f"--hf {args.hf}: already exists (pass --overwrite to replace it)")
    seen: dict = {}

    def settings(step: str, run: dict) -> None:
        """What the run's settings imply, checked before the weights are read."""
        _check_output(args, [step])
        seen["cfg"] = cfg = from_mapping(TrainerConfig, run["config"])
        seen["pre"] = pre = pretrained_of(cfg.model)
        if pre is not None:
            _check_output(args, [pre.path], "pretrained folder")
        seen["shape"] = cfg.model.shape()

    ckpt = read_checkpoint(args.checkpoint, args.island, settings)
    run_cfg, pre, shape = ckpt.run["config"], seen["pre"], seen["shape"]
    source = "model.name" if pre is None else f"{os.path.join(pre.path, 'config.json')}"
    check_weights(ckpt.weights, shape, ckpt.step, source)
    files = export_hf(
        ckpt.weights,
        shape,
        pre.family if pre is not None else "LlamaForCausalLM",
        args.hf,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        tokenizer_files=_tokenizer_files(run_cfg, pre.path if pre is not None else None),
        max_position_embeddings=_context(args, shape, run_cfg),
        base_config=pre.config if pre is not None else _token_ids(run_cfg),
        shard_bytes=args.shard_size,
        overwrite=args.overwrite,
        run_settings=_run_settings(run_cfg),
    )
    print(f"wrote {args.hf}: {', '.join(sorted(files))} (from {ckpt.step})")
    return 0
