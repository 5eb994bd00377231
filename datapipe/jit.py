"""numba's `njit` for mixlen's kernels, with its on-disk cache made optional: a cache that
cannot be written (a full disk, a quota, a read-only folder) is warned of once per process and
the kernel runs, compiled in memory as without a cache (before: the command stopped)."""

from __future__ import annotations

import errno
import sys
from typing import Any

from numba import njit
from numba.core import caching

__all__ = ["njit"]

# the user's disk to fix, not a bug
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES})
_warned = False


def _save_or_warn(self: Any, sig: Any, data: Any) -> None:
    """numba's Cache.save_overload, a disk error turned into one warning."""
    global _warned
    try:
        _save_overload(self, sig, data)
    except OSError as exc:
        if exc.errno not in _DISK_ERRNOS:
            raise
        if not _warned:
            _warned = True
            where = getattr(self, "_cache_path", None) or exc.filename or "its folder"
            print(
                f"mixlen: warning: numba's kernel cache in {where} could not be written "
                f"({exc.strerror}): mixlen's kernels are compiled again in every process until "
                "it can be",
                file=sys.stderr,
            )


_save_overload = caching.Cache.save_overload
if getattr(_save_overload, "__name__", "") != _save_or_warn.__name__:  # once per process
    caching.Cache.save_overload = _save_or_warn  # type: ignore[method-assign]
