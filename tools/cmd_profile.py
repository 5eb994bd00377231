"""`mixlen profile DIR`: length statistics from index.parquet (never reads token payloads); of a
mixture (`DIR@WEIGHT ...` or `--mix FILE.toml`): each source's, their shares, one histogram."""

from __future__ import annotations

import argparse
import json

from datapipe.errors import InputError


def add_dataset_arguments(p: argparse.ArgumentParser, stages: str = "") -> None:
    """DIR arguments (several, or DIR@WEIGHT, for a mixture) and --mix FILE.toml; `stages` says
    what the command does with a mixture file's stages."""
    p.add_argument(
        "dir",
        metavar="DIR",
        nargs="*",
        help="dataset directory (index.parquet + manifest.json); several, or DIR@WEIGHT, for a "
        "mixture",
    )
    p.add_argument(
        "--mix",
        metavar="FILE.toml",
        default=None,
        help="a mixture: sources = [...] and [[stages]], at the top or under [data] (as in a "
        "training config)" + stages,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_dataset_arguments(p, "; stages are not used here")
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
    from datapipe.mix.report import is_mixture_args

    if not args.dir and not args.mix:
        raise InputError("a dataset directory (DIR), several (DIR@WEIGHT ...), or --mix FILE.toml")
    if is_mixture_args(args.dir, args.mix):
        return _run_mixture(args)
    (path,) = args.dir
    read_manifest(path)
    lengths = read_lengths(path)
    prof = length_profile(lengths, args.capacity)
    if args.plot:
        from datapipe.profile import plot_profile

        plot_profile(prof, lengths, args.plot)
    if args.json:
        print(json.dumps(prof))
    else:
        print(format_profile(prof, title=f"profile of {path}"))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _run_mixture(args: argparse.Namespace) -> int:
    from datapipe.mix.report import (
        format_mixture_profile,
        mixture_profile,
        parse_mixture,
        plot_mixture,
    )
    from datapipe.mix.sources import load_sources
    from datapipe.settings import Names

    sources, _ = parse_mixture(args.dir, args.mix)
    loaded = load_sources(sources, Names(flags=True).using(sources="DIR"))
    prof = mixture_profile(loaded, args.capacity)
    if args.plot:
        plot_mixture(loaded, args.plot, args.capacity)
    if args.json:
        print(json.dumps(prof))
    else:
        print(format_mixture_profile(prof))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0
