"""`mixlen verify DIR`: check a dataset's shards, rows and index against its manifest."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="local dataset directory (manifest.json + index)")
    p.add_argument(
        "--quiet", action="store_true", help="no progress bar (also off when not a terminal)"
    )


def run(args: argparse.Namespace) -> int:
    from datapipe.verify import verify_dataset

    rep = verify_dataset(args.dir, False if args.quiet else None)
    if rep.ok:
        print(
            f"ok: {rep.root}: {rep.shards} shards "
            f"({rep.bytes:,} bytes, checksums match), {rep.samples:,} samples, {rep.rows:,} rows, "
            f"{rep.tokens:,} tokens agree with index.parquet"
        )
        how = "" if rep.fingerprint_recorded else " (computed: the manifest predates the field)"
        print(f"dataset fingerprint {rep.fingerprint}{how}")
        return 0
    if rep.fingerprint:
        print(f"dataset fingerprint {rep.fingerprint} (not verified)", file=sys.stderr)
    print(f"{args.dir}: {len(rep.problems)} problem(s):", file=sys.stderr)
    for p in rep.problems:
        print(f"  {p}", file=sys.stderr)
    return 1
