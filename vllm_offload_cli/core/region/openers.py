"""Is a file open anywhere else? Asked of the kernel, not of /proc.

A /proc scan sees only the processes it may inspect. The kernel itself counts
every open file description of an inode (`i_readcount`, `i_writecount`), and
a write lease (`fcntl(F_SETLEASE, F_WRLCK)`) is granted only when the caller's
own descriptor is the sole one. A mapping keeps its file open after `close`,
and so does a descriptor parked in a unix socket, so a granted lease proves
that no process, in any PID namespace, as any user, visible or not, has the
file open or mapped. A refused lease proves that one does (or that another
gc/inspect is probing it this instant: callers retry briefly).

The kernel grants a lease only to the file's owner or to CAP_LEASE, while
leases are enabled (`fs.leases-enable`); otherwise the answer is "cannot tell".
While we hold a lease, another process's open() of the file waits (up to
`fs.lease-break-time`) and the kernel signals us: SIGIO by default, whose
default action kills. Each leased descriptor is set (F_SETSIG) to signal
SIGURG instead, whose default action is to ignore it, so no process-wide
signal disposition changes, and leases are held only for moments.
"""

from __future__ import annotations

import errno
import fcntl
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from vllm_offload_cli.core.base.deadline import poll_until

# A refused lease is retried this long: another collector's or inspect's probe
# holds its descriptor for microseconds, a real user for as long as it lives.
_RETRY_SECONDS = 0.15


@dataclass(frozen=True)
class OpenersVerdict:
    """The answer for one file: `sole` True (only ours), False (open elsewhere),
    None (cannot tell), with `why` when it cannot tell."""

    sole: bool | None
    why: str = ""


def _try_lease(fd: int, retry: float) -> OpenersVerdict:
    fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)  # a lease break must not kill us

    def attempt() -> OpenersVerdict | None:
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
            return OpenersVerdict(True)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM):
                return OpenersVerdict(None, "not the file's owner and no CAP_LEASE")
            if exc.errno != errno.EAGAIN:
                return OpenersVerdict(None, f"lease refused: {exc.strerror}"
                                      " (fs.leases-enable=0?)")
        return None
    return poll_until(attempt, retry, backoff=(0.005, 0.05)) or OpenersVerdict(False)


def _release(fd: int) -> None:
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    except OSError as exc:
        if exc.errno != errno.EBADF:
            raise


@contextmanager
def sole_opener(fds: list[int], *, retry: float = _RETRY_SECONDS
                ) -> Iterator[OpenersVerdict]:
    """Hold write leases on every fd for the block; yield whether each was granted.

    Each fd must be this process's only open file description of its file
    (open it once, read-only, and open it nowhere else while in the block:
    our own second open would wait on our own lease). The verdict is True only
    if every file is open nowhere else; leases are released on exit.
    """
    taken: list[int] = []
    try:
        verdict = OpenersVerdict(True)
        for fd in fds:
            verdict = _try_lease(fd, retry)
            if verdict.sole is not True:
                break
            taken.append(fd)
        yield verdict
    finally:
        for fd in taken:
            _release(fd)


def still_sole(fd: int) -> bool:
    """Under a granted lease: False once another process started to open the file.

    While a lease break is pending the kernel reports the lease's target type,
    so anything but F_WRLCK means an opener is waiting on us right now.
    """
    try:
        return fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_WRLCK
    except OSError:
        return False


def probe(fd: int, *, retry: float = _RETRY_SECONDS) -> OpenersVerdict:
    """One probe, lease released at once: for readers that change nothing."""
    with sole_opener([fd], retry=retry) as verdict:
        return verdict
