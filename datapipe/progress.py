"""Progress bars for the commands that can run longer than a few seconds.

A bar draws on stderr only when stderr is a terminal (counts, rate and ETA, through tqdm); it
stays silent when output goes to a file or pipe, with ``--quiet``, or with ``TQDM_DISABLE=1``.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from typing import Any


def bar_enabled(enabled: bool | None = None) -> bool:
    """Whether a bar draws: `enabled` if given (False for --quiet), else stderr is a terminal and
    TQDM_DISABLE is not set."""
    if enabled is not None:
        return enabled
    if os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes"):
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def progress(
    total: float | None = None,
    desc: str = "",
    unit: str = "it",
    enabled: bool | None = None,
    **kwargs: Any,
):
    """A tqdm bar on stderr (`enabled` None: only on a terminal). Use as a context manager or
    call `.close()`; `.update(n)` advances it."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        dynamic_ncols=True,
        disable=not bar_enabled(enabled),
        **kwargs,
    )


def input_sizes(paths: list) -> dict[str, int]:
    """Bytes on disk of each input (a directory input: the sum of its files)."""
    out: dict[str, int] = {}
    for p in paths:
        p = os.fspath(p)
        try:
            if os.path.isdir(p):
                out[p] = sum(
                    os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs
                )
            else:
                out[p] = os.path.getsize(p)
        except OSError:
            out[p] = 0
    return out


class InputProgress:
    """Bar advances, in bytes on disk, for blocks read in input order (datapipe.ingest.sources
    `Block`s): a text block advances by its files' sizes; a block of a JSON Lines, parquet or
    dataset-folder input by the bytes it read (at most that file's size), and the rest of a file
    is counted once the next file starts. `advance(block)` is called when a block is read,
    `pop()` when its result is written (results come back in block order)."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes
        self.total = sum(sizes.values())
        self._current: str | None = None
        self._left = 0
        self._pending: deque[int] = deque()

    def advance(self, block: Any) -> None:
        step = 0
        files = list(block.items) if block.kind == "text" else [block.path]
        if block.kind == "error":
            if block.path in self.sizes and block.path != self._current:  # a whole file failed
                step = self._left + self.sizes[block.path]
                self._current, self._left = None, 0
            self._pending.append(step)  # else a bad line or an error inside the current file
            return
        if block.kind == "text" or block.path != self._current:
            step += self._left  # the previous file is finished
            self._current, self._left = None, 0
        if block.kind == "text":
            step += sum(self.sizes.get(f, 0) for f in files)
        else:
            if self._current is None:
                self._current, self._left = block.path, self.sizes.get(block.path, 0)
            used = min(int(block.nbytes), self._left)
            self._left -= used
            step += used
        self._pending.append(step)

    def pop(self) -> int:
        """Bytes to advance the bar by for the next finished block."""
        return self._pending.popleft()

    def rest(self) -> int:
        """What is left of the last file once every block is done (its remaining bytes)."""
        left, self._left = self._left, 0
        return left
