"""A module of this repository as it was at a git revision, loaded beside today's, so a benchmark
can measure a change's before and after in one run (`--baseline REV` of bench_loss.py and
bench_zero.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import tempfile
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_at(rev: str, path: str) -> ModuleType:
    """`path` (from the repository's root) at git revision `rev`, as a module of its own; it
    imports today's other modules (a revision whose imports have moved fails here)."""
    src = subprocess.run(
        ["git", "-C", ROOT, "show", f"{rev}:{path}"], capture_output=True, text=True, check=True
    ).stdout
    name = f"{os.path.splitext(path)[0].replace('/', '_')}_at_{rev.replace('~', '_')}"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    try:
        spec = importlib.util.spec_from_file_location(name, f.name)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        os.unlink(f.name)
    return module
