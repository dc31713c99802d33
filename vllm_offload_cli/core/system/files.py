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


def open_regular(path: str, expect: FileId | None = None, flags: int = os.O_RDONLY
                 ) -> int | None:
    """A descriptor of `path` if it is a regular file (with identity `expect`); else None.
    Judged on the descriptor, so a name swapped since the caller's scan is caught."""
    try:
        fd = os.open(path, flags | UNTRUSTED_OPEN_FLAGS)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and (expect is None or FileId.of(st) == expect):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _verified_path_fd(path: str, expect: FileId | None) -> tuple[int, os.stat_result] | None:
    """O_PATH descriptor (and fstat) of the regular file behind a /proc magic link:
    O_PATH resolves without opening, so no FIFO or device behind it can block us."""
    try:
        pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(pfd)
    except OSError:
        os.close(pfd)
        return None
    if not stat.S_ISREG(st.st_mode) or (expect is not None and FileId.of(st) != expect):
        os.close(pfd)
        return None
    return pfd, st


def stat_proc_link(path: str, expect: FileId | None = None) -> os.stat_result | None:
    """fstat of the regular file behind a /proc magic link (`/proc/PID/fd/N`,
    `/proc/PID/map_files/A-B`); None if it is anything else. Opens nothing."""
    got = _verified_path_fd(path, expect)
    if got is None:
        return None
    os.close(got[0])
    return got[1]


def open_proc_link(path: str, expect: FileId | None = None, flags: int = os.O_RDONLY
                   ) -> int | None:
    """A descriptor of the regular file behind a /proc magic link; else None.
    Judged on an O_PATH descriptor, then reopened through our own /proc/self/fd:
    the file opened is the inode judged, whatever the other process does meanwhile."""
    got = _verified_path_fd(path, expect)
    if got is None:
        return None
    pfd, _ = got
    try:
        return os.open(f"/proc/self/fd/{pfd}",
                       flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    finally:
        os.close(pfd)
