"""Is a file open anywhere else? Asked of the kernel, not of /proc.

A write lease (F_SETLEASE, F_WRLCK) is granted only when the caller's descriptor is
the file's sole open description (a mapping or a descriptor parked in a socket keeps
one), so it proves that no process, in any PID namespace, has the file open or mapped;
a /proc scan sees only what it may inspect. Only the owner or CAP_LEASE gets one,
else the answer is "cannot tell". A lease break signals SIGURG (F_SETSIG), whose
default is to ignore it, instead of the fatal SIGIO; leases are held for moments.
"""

from __future__ import annotations

import errno
import fcntl
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from vllm_offload_cli.core.base.deadline import poll_until

# A refused lease is retried this long: another gc's or inspect's probe holds its
# descriptor for microseconds, a real user for as long as it lives.
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
    """Hold write leases on every fd for the block; the verdict is True only if every
    file is open nowhere else. Open each file once, read-only, and nowhere else while in
    the block: our own second open would wait on our own lease."""
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
    """Under a granted lease: False once another process started to open the file (a
    pending break reports the lease's target type, not F_WRLCK)."""
    try:
        return fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_WRLCK
    except OSError:
        return False


def probe(fd: int, *, retry: float = _RETRY_SECONDS) -> OpenersVerdict:
    """One probe, lease released at once: for readers that change nothing."""
    with sole_opener([fd], retry=retry) as verdict:
        return verdict
