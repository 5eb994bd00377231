"""TorchTitan 0.2.2 on the benchmark's model shape, for benchmarks/bench_gpu.py's `torchtitan`
part: one process, one GPU, TorchTitan's own trainer (its Llama 3 model with `varlen` attention
and block-causal masks over packed documents, torch.compile of each block, fused AdamW, float32
weights under bfloat16 autocast as it trains on one GPU), timed step by step.

    python benchmarks/torchtitan_bench.py --out DIR --seq-len 32768             # a CUDA machine
    python benchmarks/torchtitan_bench.py --out DIR --seq-len 512 --dry-run     # any machine

Why 0.2.2 and not 0.3: TorchTitan 0.3.0 imports `torch.distributed.fsdp.DataParallelMeshDims`,
which torch 2.11 (the GPU image's) does not have; 0.2.2 imports and builds with it. Neither is
on the image: benchmarks/torchtitan_wheels.sh downloads the wheels it lacks into .whl/ (carried
to the device, installed by benchmarks/gpu_run.sh).

Its inputs are made here, offline: a word-level tokenizer whose every word is one token (so a
document of n - 2 words is n tokens with its begin and end markers), and documents whose lengths
are drawn from the demo corpus's (benchmarks/stdlib_lengths.npy), as bench_gpu draws them; its
dataset cuts their concatenation into windows of `seq_len`, and the varlen masks follow the
end markers. The model's shape is mixlen's (datapipe.shapes), with TorchTitan's untied output
layer. `--dry-run` does everything but train (no GPU needed): the job config, the model on the
meta device (its parameter count against mixlen's shape), and one window of TorchTitan's
dataset (its documents end where the end markers say).

Prints one JSON line (also DIR/torchtitan-<seq_len>.json): step seconds (median after the
warm-up), tokens/s, peak GiB, the first step's seconds (compilation), documents per window.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FLAVOR = "mixlen_shape"  # the model flavor registered in TorchTitan's llama3 table
DATASET = "mixlen_docs"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def model_args(shape: Any) -> dict[str, Any]:
    """TorchTitan llama3 TransformerModelArgs keywords for mixlen's shape: its SwiGLU width
    comes out as `shape.ffn_dim` (TorchTitan rounds int(8 dim / 3) x multiplier up to a
    multiple of `multiple_of`)."""
    hidden = int(2 * 4 * shape.dim / 3)
    return {
        "dim": shape.dim,
        "n_layers": shape.n_layers,
        "n_heads": shape.n_heads,
        "n_kv_heads": shape.n_kv_heads,
        "vocab_size": shape.vocab_size,
        "multiple_of": shape.ffn_dim,
        "ffn_dim_multiplier": None if hidden <= shape.ffn_dim else shape.ffn_dim / hidden,
        "norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,
        "attn_type": "varlen",
        "attn_mask_type": "block_causal",
    }


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json (`w0` ... one token each, split on spaces) with begin and end
    markers TorchTitan adds to every document, and its tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {BOS: 0, EOS: 1, "<unk>": 2}
    words.update({f"w{i}": i + 3 for i in range(vocab_size - 3)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def document_lengths(tokens: int, layout: str, divisor: int = 1, seed: int = 7) -> list[int]:
    """Token counts (markers included) of the documents filling `tokens` positions and a few
    windows more: the demo corpus's lengths (/ `divisor`, at least 3), or documents of exactly
    one window (`layout` "one document": its markers and n - 2 words)."""
    if layout == "one document":
        return [tokens + 1] * 64  # a window is seq_len + 1 tokens (inputs and shifted labels)
    pool = np.maximum(np.load(ROOT / "benchmarks" / "stdlib_lengths.npy") // divisor, 3)
    rng = np.random.default_rng(seed)
    return [int(n) for n in rng.choice(pool, size=max(64, 40 * tokens // int(pool.mean())))]


def write_documents(path: Path, lengths: list[int], vocab_size: int, seed: int = 0) -> None:
    """One JSON line {"text": ...} per document: n - 2 random words for a document of n tokens."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for n in lengths:
            ids = rng.integers(0, vocab_size - 3, n - 2)
            f.write(json.dumps({"text": " ".join(f"w{i}" for i in ids)}) + "\n")


def register(shape: Any) -> None:
    """Adds the shape as a llama3 flavor and the documents as a dataset to TorchTitan's tables."""
    from datasets import load_dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS
    from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

    llama3_args[FLAVOR] = TransformerModelArgs(**model_args(shape))
    DATASETS[DATASET] = DatasetConfig(
        path="",
        loader=lambda path: load_dataset("json", data_files=path, split="train"),
        sample_processor=lambda sample: sample["text"],
    )


def job_args(out: Path, seq_len: int, steps: int, compile_blocks: bool) -> list[str]:
    """TorchTitan's command line for the run: one window a step, no checkpoints, no logging
    syncs between the timed steps."""
    args = [
        "--model.name", "llama3", "--model.flavor", FLAVOR,
        "--model.hf_assets_path", str(out / "tokenizer"),
        "--training.dataset", DATASET, "--training.dataset_path", str(out / "documents.jsonl"),
        "--training.seq_len", str(seq_len), "--training.local_batch_size", "1",
        "--training.steps", str(steps), "--training.mixed_precision_param", "bfloat16",
        "--lr_scheduler.warmup_steps", "1", "--activation_checkpoint.mode", "none",
        "--metrics.log_freq", str(10 * steps), "--job.dump_folder", str(out / "titan"),
    ]  # fmt: skip
    if compile_blocks:
        args += ["--compile.enable"]
    return args


def dry_run(shape: Any, config: Any, seq_len: int) -> dict[str, Any]:
    """The job config, the model on the meta device and one window of the dataset, untrained."""
    import torch
    from torchtitan.components.tokenizer import build_hf_tokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset
    from torchtitan.models.llama3 import Transformer, llama3_args

    args = llama3_args[config.model.flavor]
    args.update_from_config(config)
    with torch.device("meta"):
        model = Transformer(args)
    params = sum(p.numel() for p in model.parameters())
    untied = shape.num_params() + (shape.vocab_size * shape.dim if shape.tie_embeddings else 0)
    if params != untied:
        raise RuntimeError(f"TorchTitan's model has {params:,} parameters, the shape {untied:,}")
    tokenizer = build_hf_tokenizer(config)
    data = HuggingFaceTextDataset(DATASET, config.training.dataset_path, tokenizer, seq_len)
    inputs, labels = next(iter(data))
    ids = inputs["input"]
    if ids.shape != (seq_len,) or not torch.equal(labels[:-1], ids[1:]):
        raise RuntimeError(f"a window is {tuple(ids.shape)}, not ({seq_len},) shifted by one")
    return {"params": params, "docs_per_window": int((ids == tokenizer.eos_id).sum()) + 1}


def train(config: Any, seq_len: int, warmup: int) -> dict[str, Any]:
    """TorchTitan's Trainer on this process's GPU, each step timed (device-synchronised)."""
    import torch
    from torchtitan.train import Trainer

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):  # fmt: skip
        os.environ.setdefault(key, value)
    trainer = Trainer(config)
    times: list[float] = []
    step = trainer.train_step

    def timed_step(data_iterator: Any) -> None:
        if len(times) == warmup:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(data_iterator)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)

    trainer.train_step = timed_step
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if len(times) <= warmup:
        raise RuntimeError(f"TorchTitan ran {len(times)} steps, not more than {warmup}")
    secs = float(np.median(times[warmup:]))
    return {
        "step_s": secs, "tokens_per_s": seq_len / secs, "first_step_s": times[0],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "steps_timed": len(times) - warmup,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--layout", default="packed", choices=["packed", "one document"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--length-divisor", type=int, default=1, help="the dry run's short documents")
    p.add_argument("--dry-run", action="store_true", help="build everything, train nothing")
    a = p.parse_args(argv)

    from datapipe.shapes import get_config

    shape = get_config(a.model)
    a.out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(a.out / "tokenizer", shape.vocab_size)
    lengths = document_lengths(a.seq_len, a.layout, a.length_divisor)
    write_documents(a.out / "documents.jsonl", lengths, shape.vocab_size)
    register(shape)
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(job_args(a.out, a.seq_len, a.steps, not a.no_compile))
    if a.dry_run:
        result = dry_run(shape, config, a.seq_len)
    else:
        result = train(config, a.seq_len, a.warmup)
    import torchtitan

    result.update(
        seq_len=a.seq_len, layout=a.layout, compiled=not a.no_compile, dry_run=a.dry_run,
        torchtitan=getattr(torchtitan, "__version__", "?"),
    )  # fmt: skip
    line = json.dumps(result)
    (a.out / f"torchtitan-{a.seq_len}.json").write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
