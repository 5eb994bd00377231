"""`mixlen profile DIR`: length statistics from index.parquet (never reads token payloads)."""

from __future__ import annotations

import argparse
import json

from datapipe.errors import InputError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="dataset directory (index.parquet + manifest.json)")
    p.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="report the share in samples longer than C tokens",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="write a length histogram PNG")


def run(args: argparse.Namespace) -> int:
    from datapipe.index import read_lengths, read_manifest
    from datapipe.profile import format_profile, length_profile

    if args.capacity is not None and args.capacity < 1:
        raise InputError(f"--capacity must be >= 1, got {args.capacity}")
    read_manifest(args.dir)
    lengths = read_lengths(args.dir)
    prof = length_profile(lengths, args.capacity)
    if args.plot:
        from datapipe.profile import plot_profile

        plot_profile(prof, lengths, args.plot)
    if args.json:
        print(json.dumps(prof))
    else:
        print(format_profile(prof, title=f"profile of {args.dir}"))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0
