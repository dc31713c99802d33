"""One overall deadline per command, so nobody can make `gc` or `inspect` run forever.

Work checks it where it can stop cleanly (between processes of a /proc scan,
between regions), so what was done is still reported. An alarm a little
after the deadline is the backstop for a wait nobody has thought of: it
raises `DeadlineExpiredError` inside whatever blocks, except inside a `shielded()`
block (a removal in progress), which then ends first.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from vllm_offload_cli.core.base.errors import OperationFailedError

# gc's and inspect's --timeout: far above their cost on a busy host, far below
# a cron interval's worth of stalled collections.
DEFAULT_TIMEOUT = 300.0

# How long after the deadline the alarm interrupts a wait that checks nothing.
_BACKSTOP_SECONDS = 2.0


class DeadlineExpiredError(OperationFailedError):
    """The command's --timeout passed before its work was done."""

    code = "timeout"


class _State:
    def __init__(self) -> None:
        self.at: float | None = None
        self.seconds = 0.0
        self.shield = 0
        self.pending = False


_state = _State()


def expired() -> bool:
    return _state.at is not None and time.monotonic() >= _state.at


def check(doing: str = "") -> None:
    """Raise DeadlineExpiredError once the active deadline has passed."""
    if expired():
        raise _expired(doing)


def _expired(doing: str) -> DeadlineExpiredError:
    what = f" while {doing}" if doing else ""
    return DeadlineExpiredError(f"--timeout {_state.seconds:g} s expired{what}; stopped")


def _alarm(signum: int, frame: FrameType | None) -> None:
    if _state.shield:
        _state.pending = True
        return
    raise _expired("waiting")


@contextmanager
def within(seconds: float | None) -> Iterator[None]:
    """Run the block under a deadline of `seconds` (None: none)."""
    if seconds is None or _state.at is not None:
        yield
        return
    _state.at, _state.seconds = time.monotonic() + seconds, seconds
    main = threading.current_thread() is threading.main_thread()
    old = None
    if main:
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds + _BACKSTOP_SECONDS)
    try:
        yield
    finally:
        if main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old if old is not None else signal.SIG_DFL)
        _state.at, _state.pending = None, False


@contextmanager
def shielded() -> Iterator[None]:
    """A step the backstop must not cut in half (unlinking one region's files)."""
    _state.shield += 1
    try:
        yield
    finally:
        _state.shield -= 1
    if not _state.shield and _state.pending:
        _state.pending = False
        raise _expired("removing")
