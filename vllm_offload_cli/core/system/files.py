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

    The type and identity are checked on the descriptor, so a name swapped
    between a caller's scan and this open is caught, and the open itself can
    neither block nor follow a link.
    """
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
