"""One overall deadline per command, so nobody can make `gc` or `inspect` run forever.

Work checks it where it can stop cleanly (between processes of a /proc scan,
between regions), so what was done is still reported. A signal a little
after the deadline is the backstop for a wait nobody has thought of: it
raises `DeadlineExpiredError` inside whatever blocks, except inside a `shielded()`
block (a removal in progress), which then ends first.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

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
        self.previous: Callable[[int, FrameType | None], Any] | int | None = None


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
    if not expired() or _state.at is None:
        previous = _state.previous
        if callable(previous):  # someone else's alarm (a test runner's timeout)
            previous(signum, frame)
        return
    if _state.shield:
        _state.pending = True
        return
    raise _expired("waiting")


@contextmanager
def within(seconds: float | None) -> Iterator[None]:
    """Run the block under a deadline of `seconds` (None: none).

    The backstop is a timer thread that signals the main thread (SIGALRM by
    pthread_kill: the process's interval timer, which others may use, is
    left alone); a SIGALRM before the deadline goes to the handler there was.
    """
    if seconds is None or _state.at is not None:
        yield
        return
    _state.at, _state.seconds = time.monotonic() + seconds, seconds
    main = threading.current_thread() is threading.main_thread()
    timer = None
    if main:
        _state.previous = signal.signal(signal.SIGALRM, _alarm)
        ident = threading.get_ident()
        timer = threading.Timer(seconds + _BACKSTOP_SECONDS,
                                lambda: signal.pthread_kill(ident, signal.SIGALRM))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
            signal.signal(signal.SIGALRM, _state.previous
                          if _state.previous is not None else signal.SIG_DFL)
        _state.at, _state.pending, _state.previous = None, False, None


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
