"""A test-only hook that stops a process at a named point of a multi-step operation.

Crash tests must kill `create` at exact points (after the manifest is written,
after `ftruncate`, half-way through pre-fault). With the environment variable
`VLLM_OFFLOAD_TEST_PAUSE_AT` set to a point's name, the process stops itself
there with SIGSTOP; the test sees it stopped (state `T` in /proc/PID/stat) and
kills it. Unset (always, outside tests) it costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

PAUSE_ENV = "VLLM_OFFLOAD_TEST_PAUSE_AT"


def pause_at(point: str) -> None:
    """Stop this process here when the test hook names `point`; else do nothing."""
    if os.environ.get(PAUSE_ENV) == point:
        os.kill(os.getpid(), signal.SIGSTOP)
