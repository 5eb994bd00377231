"""numba's `njit` for mixlen's kernels, with two changes to its on-disk cache (`cache=True`):

- A kernel's cache is kept for the sources of every kernel module of the package, not for its
  own file's alone: a kernel holds the compiled code of the kernels it calls, from any file, so
  numba's own rule ran a kernel with the old code of a callee edited in another file (a planted
  bug went unseen by a test run on a warm cache). Editing one kernel module recompiles them all.
- A cache that cannot be written (a full disk, a quota, a read-only folder) is warned of once
  per process and the kernel runs, compiled in memory as without a cache (before: the command
  stopped).

Kernel modules are the package's files that import `njit` from here."""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import sys
from typing import Any

from numba import njit
from numba.core import caching

from datapipe.files import FULL_ERRNOS

__all__ = ["njit"]

IMPORT_LINE = "from datapipe.jit import njit"
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
# the user's disk to fix, not a bug
_DISK_ERRNOS = FULL_ERRNOS | {errno.EROFS, errno.EACCES}  # a read-only cache folder too
_warned = False


@functools.cache
def _kernel_modules(package: str) -> tuple[str, ...]:
    """The files under `package` that import njit from here, sorted."""
    found = []
    for folder, _, names in os.walk(package):
        for name in names:
            path = os.path.join(folder, name)
            if name.endswith(".py"):
                try:
                    with open(path, encoding="utf-8") as f:
                        if IMPORT_LINE in f.read():
                            found.append(path)
                except (OSError, UnicodeDecodeError):
                    continue
    return tuple(sorted(found))


@functools.cache
def _file_digest(path: str, mtime: float, size: int) -> bytes:
    """SHA-256 of a file's content (memoized by its mtime and size, as numba's own is)."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).digest()


def _kernels_digest(package: str) -> bytes:
    """One digest of every kernel module's content."""
    digest = hashlib.sha256()
    for path in _kernel_modules(package):
        try:
            st = os.stat(path)
            content = _file_digest(path, st.st_mtime, st.st_size)
        except OSError:
            content = b"gone"
        digest.update(os.path.relpath(path, package).encode() + b"\0" + content)
    return digest.digest()


def _source_stamp(self: Any) -> Any:
    """numba's stamp of a function's source, and for one of this package, every kernel
    module's digest beside it."""
    stamp = _get_source_stamp(self)
    path = os.path.abspath(getattr(self, "_py_file", "") or "")
    if path.startswith(_PACKAGE + os.sep):
        return (stamp, _kernels_digest(_PACKAGE))
    return stamp


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


# numba's internals as of 0.59-0.68; a numba without them keeps its own rules (no patch)
_Locator = getattr(caching, "_SourceFileBackedLocatorMixin", None)
_save_overload = getattr(getattr(caching, "Cache", None), "save_overload", None)
_get_source_stamp = getattr(_Locator, "get_source_stamp", None)
_patchable = _save_overload is not None and _get_source_stamp is not None
if _patchable and getattr(_save_overload, "__name__", "") != _save_or_warn.__name__:
    caching.Cache.save_overload = _save_or_warn  # type: ignore[method-assign]  # once a process
    _Locator.get_source_stamp = _source_stamp  # type: ignore[method-assign,union-attr]
