"""Which files a run reads: inputs and directories expanded by `--glob` / `--exclude`, in a fixed
order. Only regular files are read (a symlink is followed to one) and `datasets` save_to_disk
folders; everything else that is named or matched (a FIFO, socket, device, a symlink loop or a
broken symlink, a symlink to a directory inside an input directory) is `special`: skipped, counted
and named (with `--strict` the run stops at the first one). Nothing here opens a file."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from datapipe.errors import InputError
from datapipe.files import not_regular_reason
from datapipe.ingest import hf_export

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.zstd")


@dataclass
class Inputs:
    """The files to read, in order, and the special entries skipped: (path, why)."""

    files: list[Path] = field(default_factory=list)
    special: list[tuple[str, str]] = field(default_factory=list)


def input_kind(path: Path) -> str:
    """'hf' (a `datasets` save_to_disk folder), else 'jsonl', 'parquet' or 'text' from the name."""
    if path.is_dir():
        return "hf"
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def glob_regex(pattern: str) -> re.Pattern:
    """Compile a glob over relative POSIX paths: `*`, `?` and `[...]` stay inside one component,
    `**` spans any number of directories (zero included)."""
    out = []
    parts = pattern.strip("/").split("/")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            out.append(".*" if last else "(?:[^/]+/)*")
            continue
        out.append(_component(part))
        if not last:
            out.append("/")
    return re.compile("".join(out) + r"\Z")


def _component(part: str) -> str:
    rx, i = [], 0
    while i < len(part):
        c = part[i]
        if c == "*":
            rx.append("[^/]*")
        elif c == "?":
            rx.append("[^/]")
        elif c == "[":
            j = part.find("]", i + 1)
            if j < 0:
                rx.append(re.escape(c))
            else:
                body = part[i + 1 : j]
                neg = body.startswith("!")
                body = (body[1:] if neg else body).replace("\\", "\\\\").replace("^", "\\^")
                rx.append(("[^" if neg else "[") + body + "]")
                i = j
        else:
            rx.append(re.escape(c))
        i += 1
    return "".join(rx)


def _entry_problem(path: str) -> str | None:
    """Why a file found inside an input directory is not read (None: a regular file)."""
    try:
        return not_regular_reason(path)
    except OSError as exc:  # vanished or unreadable since the listing
        return f"cannot be read ({exc.strerror or exc})"


def _walk(top: Path, include: list[re.Pattern], exclude: list[re.Pattern], out: Inputs) -> None:
    """Add the files under `top` matching an include pattern and no exclude pattern to `out`
    (special ones to `out.special`); excluded directories are not entered, symlinked ones are
    not followed."""
    found: list[str] = []
    special: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        rel_dir = os.path.relpath(dirpath, top)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
        if rel_dir and hf_export.is_saved_dataset(dirpath):  # one input, not its files
            dirnames[:] = []
            if any(x.match(rel_dir[:-1]) for x in include):
                found.append(rel_dir[:-1])
            continue
        hf_export.check_not_dataset_dict(dirpath)
        kept = []
        for d in dirnames:
            rel = rel_dir + d
            if any(x.match(rel) or x.match(rel + "/") for x in exclude):
                continue
            if os.path.islink(os.path.join(dirpath, d)):  # os.walk would not enter it
                if any(x.match(rel) for x in include):
                    special[rel] = (
                        "a symlink to a directory (not followed inside an input "
                        "directory; give its target as an input)"
                    )
                continue
            kept.append(d)
        dirnames[:] = kept
        for name in filenames:
            rel = rel_dir + name
            if any(x.match(rel) for x in include) and not any(x.match(rel) for x in exclude):
                problem = _entry_problem(os.path.join(dirpath, name))
                if problem:
                    special[rel] = problem
                else:
                    found.append(rel)
    out.files.extend(top / r for r in sorted(found))
    out.special.extend((str(top / r), special[r]) for r in sorted(special))


def scan_inputs(inputs: list[str], globs: list[str], excludes: tuple[str, ...] = ()) -> Inputs:
    """Expand files and directories into an ordered, de-duplicated file list. Inside a directory,
    files are kept when their relative path matches a glob and no exclude (`**` spans
    directories; a directory matching an exclude, or `pattern/*`, is skipped whole). A `datasets`
    save_to_disk folder is one input (given directly, or found inside a directory). An input
    that does not exist is an InputError; special files are listed apart (module docstring)."""
    include = [glob_regex(g) for g in globs]
    exclude = [glob_regex(x) for x in excludes]
    exclude += [glob_regex(x[: -len(s)]) for x in excludes for s in ("/*", "/**") if x.endswith(s)]
    out = Inputs()
    seen: set[str] = set()
    for item in inputs:
        p = Path(item)
        found = Inputs()
        if p.is_dir() and hf_export.is_saved_dataset(p):
            found.files.append(p)
        elif p.is_dir():
            _walk(p, include, exclude, found)
        elif p.exists() or p.is_symlink():
            problem = _entry_problem(item)
            if problem:
                found.special.append((item, problem))
            else:
                found.files.append(p)
        else:
            raise InputError(f"{item}: input not found")
        for f in found.files:
            key = os.path.normpath(os.path.abspath(f))
            if key not in seen:
                seen.add(key)
                out.files.append(f)
        for where, why in found.special:
            key = os.path.normpath(os.path.abspath(where))
            if key not in seen:
                seen.add(key)
                out.special.append((where, why))
    return out


def find_inputs(inputs: list[str], globs: list[str], excludes: tuple[str, ...] = ()) -> list[Path]:
    """The regular input files of `scan_inputs` (special entries left out)."""
    return scan_inputs(inputs, globs, excludes).files
