"""Train the small byte-level BPE tokenizer kept as a test asset (tests/assets/bpe-stdlib.json).

Usage: .venv/bin/python benchmarks/make_bpe.py [--vocab 4096] [--out tests/assets/bpe-stdlib.json]
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--out", default="tests/assets/bpe-stdlib.json")
    args = ap.parse_args()
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in root.glob("*.py"))  # top-level stdlib modules only
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    tok.save(args.out)
    print(f"trained on {len(files)} files, vocab {tok.get_vocab_size()}, saved {args.out}")


if __name__ == "__main__":
    main()
