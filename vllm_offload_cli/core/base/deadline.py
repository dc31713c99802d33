"""One overall deadline per command, and waits that end by themselves. The work calls
`check()` where it can stop cleanly, so what was done is still reported; nothing is
interrupted from outside: every open of an untrusted name is non-blocking and every wait on
another process a bounded `poll_until`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from vllm_offload_cli.core.base.errors import OperationFailedError

T = TypeVar("T")

# gc's and inspect's --timeout: far above their cost on a busy host, far below
# a cron interval's worth of stalled collections.
DEFAULT_TIMEOUT = 300.0


class DeadlineExpiredError(OperationFailedError):
    """The command's --timeout passed before its work was done."""

    code = "timeout"


_active: tuple[float, float] | None = None  # (monotonic end, seconds) of the deadline


def expired() -> bool:
    return _active is not None and time.monotonic() >= _active[0]


def check(doing: str) -> None:
    """Raise DeadlineExpiredError once the active deadline has passed."""
    if _active is not None and time.monotonic() >= _active[0]:
        raise DeadlineExpiredError(f"--timeout {_active[1]:g} s expired while {doing}; stopped")


@contextmanager
def within(seconds: float | None) -> Iterator[None]:
    """Run the block under a deadline of `seconds` (None: none; an outer one wins)."""
    global _active
    if seconds is None or _active is not None:
        yield
        return
    _active = (time.monotonic() + seconds, seconds)
    try:
        yield
    finally:
        _active = None


def poll_until(attempt: Callable[[], T | None], timeout: float,
               backoff: tuple[float, float] = (0.001, 0.05)) -> T | None:
    """`attempt()`'s first result that is not None, or None after `timeout` seconds; it
    runs at least once, pausing backoff[0] doubled up to backoff[1] between tries."""
    end = time.monotonic() + timeout
    delay, longest = backoff
    while True:
        if (result := attempt()) is not None:
            return result
        if (left := end - time.monotonic()) <= 0:
            return None
        time.sleep(min(delay, left))
        delay = min(delay * 2, longest)
