"""`mixlen preprocess INPUT... --out DIR`: tokenize corpora into length-indexed shards."""

from __future__ import annotations

import argparse
import re
import sys

from datapipe.errors import InputError
from datapipe.ingest.config import MAX_CHUNK_TOKENS, MAX_WORKERS
from datapipe.settings import MAX_INT
from tools.cli import int_in

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
# the summary's outcome counts, after `documents` (the manifest's `counts`, docs/FORMAT.md)
_SUMMARY = ("empty", "blank", "bad", "special", "split", "truncated", "dropped", "short")


def parse_size(text: str, flag: str = "--shard-size") -> int:
    """Bytes from '64MiB', '500kb', '1048576' (errors name `flag`)."""
    m = _SIZE.match(text)
    if not m:
        raise InputError(f"{flag} {text!r}: expected a size like 64MiB, 500MB or 1048576")
    unit = (m.group(2) or "").lower()
    base = 1024 if "i" in unit else 1000
    mult = base ** "bkmgt".index(unit[0]) if unit and unit[0] != "b" else 1
    return int(float(m.group(1)) * mult)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="JSON Lines (.jsonl[.gz|.zst]), parquet, text files, Hugging Face save_to_disk "
        "folders, or directories holding them",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="output dataset directory, or an object store prefix (s3://bucket/prefix, gs://, "
        "oci://, ...: written locally, then uploaded, manifest last)",
    )
    p.add_argument(
        "--format",
        default="mds",
        choices=["mds", "wds", "parquet"],
        help="shard format (default mds)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="Hugging Face tokenizer.json (default: UTF-8 bytes)",
    )
    p.add_argument(
        "--tokenizer-from",
        default=None,
        metavar="DIR",
        help="a saved tokenizer folder (tokenizer.json; BOS/EOS from special_tokens_map.json, else "
        "tokenizer_config.json)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template for conversation rows (`messages`, or `prompt`/`completion` "
        "message lists); default: the --tokenizer-from folder's chat_template.jinja or "
        "tokenizer_config.json chat_template",
    )
    p.add_argument(
        "--text-field",
        default="text",
        help="text field of JSON Lines / parquet inputs (default text); rows with `messages`, or "
        "`prompt` and `completion`, are instruction data with a loss mask "
        "(docs/instruction-data.md)",
    )
    p.add_argument(
        "--glob",
        action="append",
        dest="globs",
        metavar="PATTERN",
        help="file pattern inside directories (repeatable; default **/*)",
    )
    p.add_argument(
        "--exclude",
        action="append",
        dest="excludes",
        metavar="PATTERN",
        help="skip files matching this pattern inside directories (repeatable)",
    )
    _add_limits(p)
    _add_engine(p)
    p.add_argument(
        "--strict",
        action="store_true",
        help="stop at the first bad input, special file or document losing characters to the "
        "tokenizer, instead of skipping it",
    )
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
    p.add_argument("--shard-size", default="64MiB", help="shard size limit (default 64MiB)")
    p.add_argument(
        "--quiet",
        "--no-progress",
        action="store_true",
        help="no progress bar (also off when stderr is not a terminal)",
    )


def _add_limits(p: argparse.ArgumentParser) -> None:
    """Sizes: storage chunks, sample and document limits."""
    p.add_argument(
        "--chunk-tokens",
        type=int_in(1, MAX_CHUNK_TOKENS),
        default=65536,
        help="storage chunk: max tokens per shard row (default 65536)",
    )
    p.add_argument(
        "--max-len",
        type=int_in(1, MAX_INT),
        default=None,
        help="longest sample in tokens (default: no limit)",
    )
    p.add_argument(
        "--long-docs",
        default="split",
        choices=["split", "truncate", "drop"],
        help="what to do with documents over --max-len or --max-doc-bytes (default split)",
    )
    p.add_argument(
        "--max-doc-bytes",
        default="256MiB",
        metavar="SIZE",
        help="largest document read whole (default 256MiB); a longer text file is split into "
        "pieces of at most SIZE, truncated or dropped (--long-docs), a longer JSON line is bad; "
        "peak memory is about --workers x 5 x SIZE + --shard-size over start-up with the bytes "
        "tokenizer; a tokenizer.json that cannot be given a document in pieces takes 160-175x SIZE "
        "(docs/preprocess.md)",
    )
    p.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        metavar="N",
        help="drop samples shorter than N tokens (BOS/EOS included), counted as short "
        "(default 0: keep all)",
    )


def _add_engine(p: argparse.ArgumentParser) -> None:
    """Where the work runs: processes, Ray, a staging directory for an object-store --out."""
    from datapipe.ingest.engines import ENGINES

    p.add_argument(
        "--workers",
        type=int_in(1, MAX_WORKERS),
        default=1,
        help="tokenizer processes (default 1); with --engine ray: CPUs of the local Ray runtime",
    )
    p.add_argument(
        "--engine",
        default="local",
        choices=sorted(ENGINES),
        help="local processes (default) or Ray Data tasks (pip install 'mixlen[ray]')",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="--engine ray: join this Ray cluster (default: start a local runtime)",
    )
    p.add_argument(
        "--staging",
        default=None,
        metavar="DIR",
        help="object store --out: local directory to write in before the upload (default: temp)",
    )


def run(args: argparse.Namespace) -> int:
    from datapipe.ingest.preprocess import PreprocessConfig, preprocess

    cfg = PreprocessConfig(
        inputs=args.inputs,
        out=args.out,
        format=args.format,
        tokenizer=args.tokenizer,
        tokenizer_from=args.tokenizer_from,
        chat_template=args.chat_template,
        text_field=args.text_field,
        globs=args.globs or ["**/*"],
        excludes=args.excludes or [],
        chunk_tokens=args.chunk_tokens,
        max_len=args.max_len,
        long_docs=args.long_docs,
        max_doc_bytes=parse_size(args.max_doc_bytes, "--max-doc-bytes"),
        min_tokens=args.min_tokens,
        workers=args.workers,
        strict=args.strict,
        overwrite=args.overwrite,
        shard_bytes=parse_size(args.shard_size),
        progress=False if args.quiet else None,
        engine=args.engine,
        ray_address=args.ray_address,
        staging=args.staging,
    )
    res = preprocess(cfg)
    m, c = res.manifest, res.manifest["counts"]
    mb = res.input_bytes / 1e6
    print(
        f"wrote {m['num_samples']:,} samples, {m['num_tokens']:,} tokens in {len(m['shards'])} "
        f"{m['format']} shards to {res.out} | documents {c['documents']:,}: "
        + ", ".join(f"{k} {c.get(k, 0):,}" for k in _SUMMARY)
        + (f", no_target {c['no_target']:,}" if c.get("no_target") else "")
        + (
            f" | loss mask: {m['num_loss_tokens']:,} trained tokens "
            f"({m['num_loss_tokens'] / max(m['num_tokens'], 1):.1%} of tokens)"
            if m.get("loss_mask")
            else ""
        )
        + (
            f" | unknown_chars {c['unknown_chars']:,} in {c['unknown_docs']:,} documents"
            if c["unknown_chars"]
            else ""
        )
        + f" | {mb:.1f} MB in {res.seconds:.1f} s ({mb / max(res.seconds, 1e-9):.1f} MB/s)"
    )
    for kind, count, what in (
        ("bad", "bad", "bad inputs"),
        ("special", "special", "special files"),
        ("unknown", "unknown_docs", "documents with unknown characters"),
    ):
        more = c[count] - len(res.reported[kind])
        if more > 0:
            print(f"({more:,} more {what} not shown)", file=sys.stderr)
    return 0
