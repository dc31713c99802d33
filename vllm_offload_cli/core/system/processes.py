"""Processes: identity and state from /proc/PID/stat, the rest through psutil.

A pid alone is not an identity (pids are reused); the pair (pid, start time
in clock ticks since boot) is, and its state is part of it: a zombie has
exited. It holds no mapping, no descriptor and no lock, and finishes nothing
it was creating, whatever its /proc/PID/stat still says.

The start time is kept in clock ticks, the unit /proc/PID/stat and the
manifests written by earlier releases use; both come from one read of it
(procfs.stat_identity). psutil answers name, owner, environment and affinity.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

from vllm_offload_cli.core.system import procfs

_EXITED = frozenset("ZXx")  # zombie, dead


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except (psutil.Error, ValueError):
        return None


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
        """True when this exact process still runs: not gone, not reused, not a zombie."""
        now = procfs.stat_identity(self.pid)
        if now is None:
            return False
        state, ticks = now
        if self.start_ticks is not None and ticks != self.start_ticks:
            return False
        return state not in _EXITED


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None if it is gone."""
    now = procfs.stat_identity(pid)
    return None if now is None else now[1]


def comm(pid: int) -> str | None:
    """The process's name (comm); None if it is gone or hidden."""
    proc = _process(pid)
    try:
        return None if proc is None else proc.name()
    except psutil.Error:
        return None


def named_pids(pids: Sequence[int], most: int = 3) -> str:
    """'pid 1 (python), pid 2 (?)': the first `most`; empty when there are none."""
    return ", ".join(f"pid {p} ({comm(p) or '?'})" for p in pids[:most])


def pids() -> list[int]:
    """Every pid this /proc shows, in ascending order."""
    return sorted(psutil.pids())


def environ(pid: int) -> dict[str, str] | None:
    """The environment the process was exec'd with; None if it cannot be read."""
    proc = _process(pid)
    try:
        return None if proc is None else proc.environ()
    except (psutil.Error, OSError):
        return None


def allowed_cpus(pid: int) -> frozenset[int] | None:
    """The CPUs the process may run on; None if it is gone or cannot be asked."""
    proc = _process(pid)
    try:
        return None if proc is None else frozenset(proc.cpu_affinity() or ())
    except (psutil.Error, OSError):
        return None


def hostname() -> str:
    return socket.gethostname()
