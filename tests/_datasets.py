"""The small dataset the training tests share (tests/_train_worker.py re-exports it)."""

from __future__ import annotations

import json

import numpy as np


def make_dataset(
    out: str, n_docs: int = 120, max_chars: int = 500, seed: int = 0, fmt: str = "mds"
) -> str:
    """A small byte-tokenized dataset of mixed lengths (128-token chunks) in `fmt` (parquet's
    reader never imports the streaming library: 3 s less CPU for each fresh rank process)."""
    from datapipe.ingest.preprocess import PreprocessConfig, preprocess

    rng = np.random.default_rng(seed)
    words = "def class return import for while if else self value data length token".split()
    src = out + ".jsonl"
    with open(src, "w") as f:
        for _ in range(n_docs):
            n = int(
                rng.choice(
                    [rng.integers(5, 60), rng.integers(60, 250), rng.integers(250, max_chars)],
                    p=[0.5, 0.35, 0.15],
                )
            )
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=n // 4 + 1))[:n]}) + "\n")
    preprocess(
        PreprocessConfig(inputs=[src], out=out, chunk_tokens=128, progress=False, format=fmt)
    )
    return out
