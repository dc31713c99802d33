"""Small, race-tolerant reads of /proc for one process.

A pid alone is not an identity (pids are reused); the pair (pid, start time
in clock ticks since boot) is. Every reader returns None for a process that
vanished or denies access, as psutil's scripts do.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessRef:
    """A process as recorded in a manifest: pid plus start time makes it unique."""

    pid: int
    start_ticks: int | None

    @classmethod
    def current(cls) -> ProcessRef:
        pid = os.getpid()
        return cls(pid, start_ticks(pid))

    def alive(self) -> bool:
        """True when this exact process still runs (not a later one with the same pid)."""
        now = start_ticks(self.pid)
        if now is None:
            return False
        return self.start_ticks is None or now == self.start_ticks


def start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm may contain spaces and parentheses: fields resume after the last ')'
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return int(fields[19])  # field 22 overall: starttime
    except (IndexError, ValueError):
        return None


def comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().rstrip(b"\n").decode("utf-8", "replace")
    except OSError:
        return None


def hostname() -> str:
    return socket.gethostname()
