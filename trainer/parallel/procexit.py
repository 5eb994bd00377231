"""Leaving a rank's process without interpreter finalization.

A worker that used gloo can abort at interpreter exit: after its Python code is done, gloo's C++
threads may still hold work whose tensors reference Python objects, and tearing them down while
the interpreter finalizes ends in std::terminate ("terminate called without an active exception",
SIGABRT). It was seen here about once in thirty full test runs, in a 2-process calibration and in a
2-rank training run, after every collective had finished. A rank whose work is done therefore runs
the atexit handlers itself (temporary files, shared memory), flushes its streams and leaves with
os._exit, which skips the finalization where the abort happens.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Run the atexit handlers, flush stdout/stderr, then os._exit(code)."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed or broken: nothing left to save
                pass
        os._exit(code)
