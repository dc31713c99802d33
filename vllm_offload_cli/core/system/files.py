"""A file's identity as the kernel gives it: device and inode."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass


@dataclass(frozen=True)
class FileId:
    """A file's identity: same device and inode means the same bytes, whatever the name."""

    dev: int
    ino: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileId:
        return cls(st.st_dev, st.st_ino)


# Flags for opening an object another user may control: a FIFO or device put
# behind the name (or behind /proc/PID/fd/N) cannot block the open or become
# our terminal, and a symlink is not followed.
UNTRUSTED_OPEN_FLAGS = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC


def _regular(st: os.stat_result, expect: FileId | None) -> bool:
    return stat.S_ISREG(st.st_mode) and (expect is None or FileId.of(st) == expect)


def open_regular(path: str, expect: FileId | None = None) -> int | None:
    """A descriptor of `path` if it is a regular file (with identity `expect`); else None.
    Judged on the descriptor, so a name swapped since the caller's scan is caught."""
    try:
        fd = os.open(path, os.O_RDONLY | UNTRUSTED_OPEN_FLAGS)
    except OSError:
        return None
    try:
        if _regular(os.fstat(fd), expect):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def stat_proc_link(path: str, expect: FileId | None = None) -> os.stat_result | None:
    """stat of the regular file behind a /proc magic link (`/proc/PID/fd/N`,
    `/proc/PID/map_files/A-B`); None if it is anything else. Opens nothing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st if _regular(st, expect) else None


def open_proc_link(path: str, expect: FileId | None = None) -> int | None:
    """A descriptor of the regular file behind a /proc magic link; else None. Resolved
    with O_PATH (nothing behind it opens or blocks), judged, then reopened through our
    own /proc/self/fd: the file opened is the inode judged, whatever happens meanwhile."""
    try:
        pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not _regular(os.fstat(pfd), expect):
            return None
        return os.open(f"/proc/self/fd/{pfd}",
                       os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    finally:
        os.close(pfd)
