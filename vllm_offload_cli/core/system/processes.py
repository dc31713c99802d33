"""Processes: identity from /proc/PID/stat, the rest through psutil. A pid is reused, so
(pid, start time in clock ticks) is the identity; a zombie has exited."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import psutil

from vllm_offload_cli.core.system import procfs

_EXITED = frozenset("ZXx")  # zombie, dead
_T = TypeVar("_T")


def _ask(pid: int, what: Callable[[psutil.Process], _T]) -> _T | None:
    """One psutil answer about `pid`; None if it is gone or cannot be asked."""
    try:
        return what(psutil.Process(pid))
    except (psutil.Error, OSError, ValueError):
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
        return now is not None and now[0] not in _EXITED and self.start_ticks in (None, now[1])


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None if it is gone."""
    now = procfs.stat_identity(pid)
    return None if now is None else now[1]


def comm(pid: int) -> str | None:
    """The process's name (comm); None if it is gone or hidden."""
    return _ask(pid, psutil.Process.name)


def pids() -> list[int]:
    """Every pid this /proc shows, in ascending order."""
    return sorted(psutil.pids())


def environ(pid: int) -> dict[str, str] | None:
    """The environment the process was exec'd with; None if it cannot be read."""
    return _ask(pid, psutil.Process.environ)


def allowed_cpus(pid: int) -> frozenset[int] | None:
    """The CPUs the process may run on; None if it is gone or cannot be asked."""
    return _ask(pid, lambda p: frozenset(p.cpu_affinity() or ()))
