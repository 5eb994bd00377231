"""The `mixlen` command line: a thin dispatcher over one module per subcommand.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and is imported
only when its subcommand runs, so `mixlen profile` never pays for torch or the streaming library.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import sys
from collections.abc import Callable

from datapipe.errors import MixlenError, PeerError
from datapipe.files import FULL_ERRNOS

# a full disk, a quota, a file size limit, a read-only file system: the user's to fix, named
DISK_ERRNOS = FULL_ERRNOS | {errno.EROFS}

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "preprocess": ("tools.cmd_preprocess", "tokenize corpora into length-indexed shards"),
    "index": ("tools.cmd_index", "build index.parquet for an MDS dataset written elsewhere"),
    "profile": ("tools.cmd_profile", "length statistics of a preprocessed dataset"),
    "verify": ("tools.cmd_verify", "check a dataset's shards, rows and index against its manifest"),
    "plan": ("tools.cmd_plan", "plan steps and print a balance report per policy"),
    "simulate": ("tools.cmd_simulate", "predict step times at scale on synthetic lengths"),
    "calibrate": ("tools.cmd_calibrate", "fit the cost model by timing the real model"),
    "train": ("tools.cmd_train", "train a model from a TOML config"),
    "export": ("tools.cmd_export", "write a training checkpoint as a Hugging Face model folder"),
    "eval": ("tools.cmd_eval", "loss by position and passkey retrieval of a model on a dataset"),
}


MAX_NPROC = 1 << 16  # --nproc of train, eval, calibrate
MAX_ISLAND = (1 << 16) - 1  # export --island: parallel.islands is at most 2^16


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi]; argparse's error names the flag (exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text[:40]!r}") from None
        if not lo <= value <= hi:
            shown = f"a {len(str(value))}-digit integer" if abs(value) > 1 << 64 else f"{value:,}"
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo:,}, {hi:,}], got {shown}")
        return value

    return parse


def build_parser(argv_command: str | None = None) -> argparse.ArgumentParser:
    """Build the top-level parser; only the named subcommand's module is imported."""
    parser = argparse.ArgumentParser(prog="mixlen", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        # no prefixes of flags: `simulate --offload` would be taken as --offload-gbps
        sp = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        if name == argv_command:
            importlib.import_module(module).add_arguments(sp)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script: runs `argv` (default: the command line) and returns
    the exit code; a torchrun rank running its own command line (argv None) leaves at once with
    it, skipping the interpreter's finalization where gloo can abort (a multi-node launch runs
    `torchrun ... --no-python mixlen train ...`)."""
    try:
        code = run_command(argv)
    except KeyboardInterrupt:  # Ctrl-C while the command's modules load
        print("mixlen: interrupted", file=sys.stderr)
        code = 130
    if argv is None:
        from tools.launch import under_torchrun

        if under_torchrun():
            from trainer.parallel.procexit import exit_now

            exit_now(code)
    return code


def run_command(argv: list[str] | None = None) -> int:
    """Run one `mixlen` command line (default: this process's); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    if command is not None:
        try:
            importlib.import_module(COMMANDS[command][0])
        except ModuleNotFoundError as exc:
            if exc.name == COMMANDS[command][0]:
                print(f"mixlen: '{command}' is not available in this version", file=sys.stderr)
                return 2
            raise
    parser = build_parser(command)
    args = parser.parse_args(argv)
    args.argv = argv  # the command line as given (a command that re-launches itself reuses it)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)
    except PeerError:  # another rank printed the error
        return 2
    except MixlenError as exc:
        print(f"mixlen {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as exc:
        print(f"mixlen {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno not in DISK_ERRNOS:
            raise
        where = f" {exc.filename}:" if exc.filename else ""
        print(f"mixlen {args.command}: error: cannot write{where} {exc.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mixlen {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
