"""flock helpers: a shared lock proves a region's user is alive.

A process holding LOCK_SH for its whole life makes "can anyone take LOCK_EX?"
a definitive liveness test that needs no process scan and cannot be fooled
by pid reuse; the kernel drops the lock when the process dies, even by SIGKILL.
"""

from __future__ import annotations

import errno
import fcntl
from collections.abc import Callable

from vllm_offload_cli.core.base.deadline import poll_until
from vllm_offload_cli.core.base.errors import RegionTimeoutError


def try_lock(fd: int, operation: int = fcntl.LOCK_EX) -> bool:
    """flock(fd, operation) without waiting; False when another holder is in the way."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def try_lock_exclusive(fd: int) -> bool:
    """Take LOCK_EX without waiting; False when any other holder exists."""
    return try_lock(fd, fcntl.LOCK_EX)


def lock_waiting(fd: int, operation: int, *, timeout: float,
                 timed_out: Callable[[], Exception]) -> None:
    """flock(fd, operation) polled with back-off rather than blocking in the kernel,
    so the wait can end at `timeout`: then `timed_out()` is raised."""
    if poll_until(lambda: try_lock(fd, operation) or None, timeout) is None:
        raise timed_out()


def lock_shared(fd: int, *, timeout: float, path: str = "") -> None:
    """Take LOCK_SH, waiting out a brief exclusive holder such as a gc probe."""
    lock_waiting(fd, fcntl.LOCK_SH, timeout=timeout, timed_out=lambda: RegionTimeoutError(
        f"{path} stayed exclusively locked for {timeout:.0f} s; "
        "is a garbage collection stuck on it?", path=path))
