"""What became of a transfer, and the one place results wait to be collected.

Every submitted job ends as exactly one TransferResult, success or failure:
copy paths report into a ResultSink, and the worker's get_finished() drains it.
A result is never dropped, so a caller that counts its jobs can rely on it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from vllm_offload_cli.core.transfer.jobs import Direction


@dataclass(frozen=True, kw_only=True)
class TransferResult:
    """One finished job. `bytes` is the job's size; `success` says whether all of it moved."""

    job_id: int
    direction: Direction
    success: bool
    bytes: int
    seconds: float
    blocks: int = 0
    method: str = ""  # how it was copied (e.g. "gather", "copy-engine"), for diagnostics
    error: str | None = None

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.success and self.seconds > 0 else 0.0


class ResultSink:
    """Thread-safe store of results: filled by copy paths, drained by the caller."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._in_flight: set[int] = set()
        self._ready: list[TransferResult] = []

    def expect(self, job_id: int) -> None:
        with self._cond:
            self._in_flight.add(job_id)

    def known(self, job_id: int) -> bool:
        """In flight, or finished but not yet collected."""
        with self._cond:
            return job_id in self._in_flight or any(r.job_id == job_id for r in self._ready)

    def add(self, result: TransferResult) -> None:
        with self._cond:
            self._in_flight.discard(result.job_id)
            self._ready.append(result)
            self._cond.notify_all()

    def take(self) -> list[TransferResult]:
        with self._cond:
            ready, self._ready = self._ready, []
            return ready

    def wait(self, job_ids: Iterable[int], timeout: float | None) -> bool:
        """Block until none of `job_ids` is in flight; False on timeout."""
        wanted = set(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while wanted & self._in_flight:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True
