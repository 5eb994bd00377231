"""`mixlen profile DIR`: length statistics from index.parquet (never reads token payloads); of a
mixture (`DIR@WEIGHT ...` or `--mix FILE.toml`): each source's, their shares, one histogram."""

from __future__ import annotations

import argparse
import json
import os

from datapipe.errors import ConfigError, InputError


def add_dataset_arguments(p: argparse.ArgumentParser, stages: str = "") -> None:
    """DIR arguments (several, or DIR@WEIGHT, for a mixture) and --mix FILE.toml; `stages` says
    what the command does with a mixture file's stages."""
    p.add_argument(
        "dir",
        metavar="DIR",
        nargs="*",
        help="dataset directory (index.parquet + manifest.json); several, or [NAME=]DIR[@WEIGHT] "
        "(NAME: its name in reports, default the folder's last part; WEIGHT: its token share, "
        "default 1), for a mixture",
    )
    p.add_argument(
        "--mix",
        metavar="FILE.toml",
        default=None,
        help="a mixture: sources = [...] and [[stages]], at the top or under [data] (as in a "
        "training config, whose other [data] keys are checked as training checks them); "
        "relative paths are read from the current folder, as `mixlen train` reads them" + stages,
    )


def check_outputs(args: argparse.Namespace, flags: tuple[str, ...]) -> None:
    """Before any work: each output file flag names a file in an existing folder (ConfigError
    naming the flag and the path as given)."""
    for flag in flags:
        path = getattr(args, flag[2:].replace("-", "_"), None)
        if not path:
            continue
        folder = os.path.dirname(path)
        if os.path.isdir(path):
            raise ConfigError(f"{flag} {path}: is a folder; give a file path")
        if folder and not os.path.isdir(folder):
            what = "is not a folder" if os.path.exists(folder) else "does not exist"
            raise ConfigError(f"{flag} {path}: its folder {folder!r} {what} (create it first)")


def check_outside(args: argparse.Namespace, flags: tuple[str, ...], folders: list[str]) -> None:
    """ConfigError naming the flag for an output file inside a dataset folder the command reads
    (it would overwrite or add to the dataset)."""
    from datapipe.files import is_inside
    from datapipe.index import is_remote

    roots = [os.path.realpath(f) for f in folders if not is_remote(f)]
    for flag in flags:
        path = getattr(args, flag[2:].replace("-", "_"), None)
        real = os.path.realpath(path) if path else None
        for root in roots if real else ():
            if is_inside(real, root):
                raise ConfigError(
                    f"{flag} {path}: inside the dataset folder {root}, which this command reads; "
                    "write it elsewhere"
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
    from datapipe.index import read_lengths, read_loss_tokens, read_manifest
    from datapipe.profile import format_profile, length_profile

    if args.capacity is not None and args.capacity < 1:
        raise InputError(f"--capacity must be >= 1, got {args.capacity}")
    check_outputs(args, ("--plot",))
    from datapipe.mix.report import is_mixture_args

    if not args.dir and not args.mix:
        raise InputError("a dataset directory (DIR), several (DIR@WEIGHT ...), or --mix FILE.toml")
    if is_mixture_args(args.dir, args.mix):
        return _run_mixture(args)
    (path,) = args.dir
    manifest = read_manifest(path)
    check_outside(args, ("--plot",), [path])
    lengths = read_lengths(path)
    prof = length_profile(lengths, args.capacity, read_loss_tokens(path, manifest, lengths))
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
        load_mixture,
        mixture_profile,
        plot_mixture,
        read_mixture,
    )
    from trainer.data import DataConfig

    mix = read_mixture(args.dir, args.mix, DataConfig)
    loaded = load_mixture(mix, mix.names)
    check_outside(args, ("--plot",), [s.local for s in loaded])
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
