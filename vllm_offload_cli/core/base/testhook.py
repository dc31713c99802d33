"""Crash tests stop a process at a named point of a multi-step operation: with
VLLM_OFFLOAD_TEST_PAUSE_AT naming it, the process SIGSTOPs itself there."""

from __future__ import annotations

import os
import signal

PAUSE_ENV = "VLLM_OFFLOAD_TEST_PAUSE_AT"


def pause_at(point: str) -> None:
    """Stop this process here when the test hook names `point`; else do nothing."""
    if os.environ.get(PAUSE_ENV) == point:
        os.kill(os.getpid(), signal.SIGSTOP)
