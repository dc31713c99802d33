"""flock helpers: a LOCK_SH held for life makes "can anyone take LOCK_EX?" a liveness test
that needs no process scan, cannot be fooled by pid reuse, and ends even with SIGKILL."""

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


def lock_waiting(fd: int, operation: int, *, timeout: float,
                 timed_out: Callable[[], Exception]) -> None:
    """flock(fd, operation) polled, not blocking in the kernel; `timed_out()` at `timeout`."""
    if poll_until(lambda: try_lock(fd, operation) or None, timeout) is None:
        raise timed_out()


def lock_shared(fd: int, *, timeout: float, path: str = "") -> None:
    """Take LOCK_SH, waiting out a brief exclusive holder such as a gc probe."""
    lock_waiting(fd, fcntl.LOCK_SH, timeout=timeout, timed_out=lambda: RegionTimeoutError(
        f"{path} stayed exclusively locked for {timeout:.0f} s; "
        "is a garbage collection stuck on it?", path=path))
