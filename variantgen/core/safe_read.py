"""Reading the cache's small records (manifests, failure records, lock records, pid records)
without trusting what lies at their path.

Anyone who can write to a cache folder can put a FIFO, a link to ``/dev/zero`` or a 4 GiB file
where a manifest belongs. A plain ``read_text()`` then blocks forever (a FIFO with no writer),
reads without end (``/dev/zero``) or fills the memory. Here a record is opened without following
a final symbolic link (``O_NOFOLLOW``) and without waiting for a writer (``O_NONBLOCK``), checked
to be a regular file on the descriptor that was opened (``fstat``: no race between a check and
the open), and read up to a size bound. Anything else is an ``OSError`` saying what was found,
which callers already treat as "unreadable": the entry is damaged, never loaded.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

MAX_RECORD_BYTES = 1 << 20  # a manifest is a few KiB; anything near this was not written by variantgen
_CHUNK = 1 << 20


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike) -> int:
    """A read-only descriptor of ``path`` if it is a regular file that is not a symbolic link;
    OSError naming what it is otherwise. Never blocks (a FIFO is refused, not waited on)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise OSError(errno.ELOOP, "is a symbolic link (not followed)", str(path)) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"is {_kind(mode)}, not a regular file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bounded(path: str | os.PathLike, limit: int = MAX_RECORD_BYTES) -> bytes:
    """The bytes of regular file ``path``, at most ``limit`` of them (OSError if it is larger,
    a link, a FIFO, a device...)."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise OSError(errno.EFBIG, f"is {size} bytes, more than the {limit} a record may hold", str(path))
        parts, total = [], 0
        while True:
            chunk = os.read(fd, min(_CHUNK, limit + 1 - total))
            if not chunk:
                break
            parts.append(chunk)
            total += len(chunk)
            if total > limit:  # grew while read
                raise OSError(errno.EFBIG, f"holds more than the {limit} bytes a record may hold", str(path))
        return b"".join(parts)
    finally:
        os.close(fd)


def read_text_bounded(path: str | os.PathLike, limit: int = MAX_RECORD_BYTES) -> str:
    """``read_bounded`` decoded as UTF-8 (ValueError if it is not)."""
    return read_bounded(path, limit).decode("utf-8")


def lstat_kind(path: Path) -> str | None:
    """None if ``path`` is a regular file (not a link); else what it is ("missing" if absent)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "missing"
    return None if stat.S_ISREG(mode) else _kind(mode)
