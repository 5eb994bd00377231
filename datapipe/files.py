"""Small file helpers shared by the tools: writes that never leave a half-written file, and reads
that never block on a FIFO, never read a device without end and never load more than a bound.

`read_bounded_text(path, limit, what)` is the way to read a config, manifest or metadata file:
only a regular file (a symlink is followed to one) of at most `limit` bytes is read; anything
else is refused with an InputError naming the file before a byte is read.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from typing import BinaryIO

from datapipe.errors import InputError

# a full disk, a quota, a file size limit: the user's to fix (each caller adds what else is)
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

CONFIG_FILE_LIMIT = 16 << 20  # config and manifest files: refused above this size
METADATA_FILE_LIMIT = 64 << 20  # other tools' dataset metadata (MDS index.json): the same

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def is_inside(child: str, parent: str) -> bool:
    """Is the path `child` the folder `parent` or under it (both already resolved: realpath)?"""
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


class NotRegularFile(InputError):
    """A path that is not a regular file (a FIFO, socket, device, directory, symlink loop or
    broken symlink); `reason` says which, without the path."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def file_kind(mode: int) -> str:
    """'a regular file', 'a FIFO (named pipe)', 'a character device', ... for an st_mode."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def not_regular_reason(path: str | os.PathLike) -> str | None:
    """Why `path` is not a regular file to read (None: it is one, after following symlinks):
    a symlink loop, a broken symlink, or the kind of file it is. FileNotFoundError when
    nothing is there at all."""
    path = os.fspath(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink loop (too many levels of symbolic links); only regular files are read"
        if exc.errno == errno.ENOENT and os.path.islink(path):
            return f"a broken symlink (to {os.readlink(path)!r}, which does not exist)"
        raise
    if stat.S_ISREG(mode):
        return None
    return f"{file_kind(mode)}, not a regular file; only regular files are read"


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """Open a regular file for reading in binary mode; NotRegularFile for anything else, checked
    on the open descriptor (a FIFO is opened non-blocking, so this never waits for a writer).
    FileNotFoundError and other OSErrors propagate."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a loop; a socket cannot be opened
            reason = not_regular_reason(path)
            if reason:
                raise NotRegularFile(path, reason) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(
                path, f"{file_kind(mode)}, not a regular file; only regular files are read"
            )
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded_bytes(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The bytes of regular file `path`, refused (InputError naming the file and `what` it is)
    when it is not a regular file or holds more than `limit` bytes. FileNotFoundError
    propagates (callers say what was expected there); other OSErrors become InputError."""
    path = os.fspath(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(limit + 1) if size <= limit else b""
    except NotRegularFile as exc:
        raise InputError(f"{path}: {what} is {exc.reason}") from None
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise InputError(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    if size > limit or len(data) > limit:
        got = f"{max(size, len(data)):,} bytes" if size > limit else f"over {limit:,} bytes"
        raise InputError(
            f"{path}: {what} is {got}, over the {limit:,}-byte limit; refused before reading"
        )
    return data


def read_bounded_text(path: str | os.PathLike, limit: int, what: str) -> str:
    """`read_bounded_bytes` decoded as UTF-8 (InputError naming the file and offset if not)."""
    data = read_bounded_bytes(path, limit, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{os.fspath(path)}: {what} is not valid UTF-8 (byte 0x{data[exc.start]:02x} at "
            f"offset {exc.start})"
        ) from None


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


BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"


def host_tag() -> str:
    """This host's name, PID namespace and boot as a file name's part: a pid means something only
    in one PID namespace of one running kernel (containers of one node may share its name but not
    their pids; two machines may share a name, and every Linux's first PID namespace has the same
    inode, so the kernel's boot id tells them apart)."""
    import socket

    parts = ["".join(c if c.isalnum() else "_" for c in socket.gethostname())]
    with contextlib.suppress(OSError):
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    with contextlib.suppress(OSError, UnicodeDecodeError):
        with open(BOOT_ID_FILE) as f:
            boot = "".join(c for c in f.read(64) if c.isalnum())[:12]
        if boot:
            parts.append(boot)
    return "_".join(parts)


def dead_pid_paths(parent: str, tag: str, anywhere: bool = False) -> list[str]:
    """The paths in `parent` whose name holds `tag` + PID (at its start, or `anywhere` in it),
    the PID ending the name or followed by "-" or ".", for a PID not running on this host (this
    process's own is running)."""
    import re

    out = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(parent):
            head, found, rest = name.partition(tag)
            pid = re.match(r"\d+(?=$|[-.])", rest) if found and (anywhere or not head) else None
            if pid and not pid_alive(int(pid.group())):
                out.append(os.path.join(parent, name))
    return out


def remove_dead_pid_dirs(parent: str, prefix: str) -> list[str]:
    """Remove the folders in `parent` named `prefix` + PID (+ "-..."), for a PID that is not
    running; `prefix` names this host (host_tag), so another host's are never touched. Returns
    the paths removed."""
    import shutil

    removed = []
    for path in dead_pid_paths(parent, prefix):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):  # not another user's
            removed.append(path)
    return removed


def pid_alive(pid: int) -> bool:
    """Is process `pid` running on this host (one of another user's counts as running)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def open_lock_file(path: str, mode: int = os.O_RDONLY) -> int | None:
    """A lock file opened with `mode`, made if missing (0644); else read-only where it exists
    (a folder or file of another user's, a read-only file system); else None (the caller goes
    unguarded). Never through a symlink, never blocking (a FIFO), and only a regular file."""
    flags = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, mode | os.O_CREAT | flags, 0o644)
    except OSError:
        try:
            fd = os.open(path, os.O_RDONLY | flags)
        except OSError:
            return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def take_flock(fd: int, holder: str) -> str | None:
    """Take an exclusive flock on `fd` without waiting and write `holder` (who has it) into the
    file: None; or, when another process has it, what that one wrote ("?" if nothing). OSError
    where the file system has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 128, 0).decode("utf-8", "replace").strip() or "?"
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode(), 0)
    return None
