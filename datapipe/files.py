"""Small file helpers shared by the tools: writes that never leave a half-written file."""

from __future__ import annotations

import os


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to a temporary file next to `path`, then rename it into place."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
