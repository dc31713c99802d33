"""Lanes: where one direction's jobs run, in order (a later job to the same block wins),
each ending as exactly one TransferResult; a failed job does not stop its lane. A
StreamLane queues after the caller's current stream: a store never reads blocks that
queued kernels still write.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_offload_cli.core.base.deadline import poll_until
from vllm_offload_cli.core.base.extras import import_torch
from vllm_offload_cli.core.transfer.jobs import CopyJob, Direction

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

Copier = Callable[[CopyJob, Executor | None], str]  # copies a job; returns the rules used
CANCELLED = "cancelled: the copy worker shut down before this job started"


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
    """Thread-safe store of results: filled by the lanes, drained by get_finished()."""

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
        with self._cond:
            return self._cond.wait_for(lambda: not wanted & self._in_flight, timeout)


def _result(job: CopyJob, block_bytes: int, seconds: float, method: str,
            error: BaseException | str | None) -> TransferResult:
    if isinstance(error, BaseException):
        logger.warning("%s job %d failed: %s", job.direction.value, job.job_id, error)
        error = f"{type(error).__name__}: {error}"
    return TransferResult(job_id=job.job_id, direction=job.direction, success=error is None,
                          bytes=job.num_blocks * block_bytes,
                          seconds=seconds if error is None else 0.0,
                          blocks=job.num_blocks, method=method if error is None else "",
                          error=error)


class ThreadLane:
    """One direction of CPU copies: one thread copies the jobs in order, with a helper
    thread for half of a batched call."""

    def __init__(self, direction: Direction, copy: Copier, sink: ResultSink,
                 block_bytes: int) -> None:
        self._copy = copy
        self._sink = sink
        self._block_bytes = block_bytes
        self._cancel = False
        name = f"vllm-offload-{direction.value}"
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._helper = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-helper")

    def submit(self, job: CopyJob) -> None:
        self._thread.submit(self._run, job)

    def poll(self) -> None:
        """Nothing to do: the thread reports as it finishes."""

    def wait(self, job_ids: set[int], timeout: float | None) -> bool:
        return self._sink.wait(job_ids, timeout)

    def close(self, cancel: bool) -> None:
        """Finish what is queued (`cancel`: report what has not started as cancelled)."""
        self._cancel = self._cancel or cancel
        self._thread.shutdown()
        self._helper.shutdown()

    def _run(self, job: CopyJob) -> None:
        if self._cancel:
            self._sink.add(_result(job, self._block_bytes, 0.0, "", CANCELLED))
            return
        start = time.perf_counter()
        try:
            method, error = self._copy(job, self._helper), None
        except Exception as exc:  # reported as the job's result; the lane carries on
            method, error = "", exc
        self._sink.add(_result(job, self._block_bytes, time.perf_counter() - start, method,
                               error))


@dataclass(eq=False, kw_only=True)
class _Queued:
    job: CopyJob
    start: Any = None  # torch.cuda.Event
    end: Any = None
    method: str = ""
    error: str | None = None


class StreamLane:
    """One direction of CUDA copies: queued on the lane's stream, completed by events."""

    def __init__(self, direction: Direction, copy: Copier, sink: ResultSink,
                 block_bytes: int, device: torch.device) -> None:
        torch = import_torch()
        self._copy = copy
        self._sink = sink
        self._block_bytes = block_bytes
        self._device = device
        self._lock = threading.Lock()
        self.stream = torch.cuda.Stream(device=device)
        self._queued: deque[_Queued] = deque()

    def submit(self, job: CopyJob) -> None:
        torch = import_torch()
        entry = _Queued(job=job)
        stream = self.stream
        with torch.cuda.device(self._device):
            try:
                stream.wait_stream(torch.cuda.current_stream(self._device))
                entry.start = torch.cuda.Event(enable_timing=True)
                entry.end = torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    entry.start.record(stream)
                    entry.method = self._copy(job, None)
            except Exception as exc:  # reported in order as a failed job, never dropped
                entry.error = f"{type(exc).__name__}: {exc}"
                logger.warning("%s job %d failed: %s", job.direction.value, job.job_id, exc)
            finally:
                try:
                    if entry.end is not None:
                        entry.end.record(stream)
                except Exception:
                    entry.end = None
        with self._lock:
            self._queued.append(entry)

    def poll(self) -> None:
        """Report every job whose end event has completed, in submission order."""
        with self._lock:
            while self._queued:
                head = self._queued[0]
                if head.end is not None:  # failed jobs too: nothing may still run
                    try:
                        if not head.end.query():
                            return
                    except Exception as exc:  # a sticky CUDA error: this job failed
                        head.error = head.error or f"{type(exc).__name__}: {exc}"
                        head.end = None
                self._queued.popleft()
                self._sink.add(self._done(head))

    def _done(self, entry: _Queued) -> TransferResult:
        seconds = 0.0
        if entry.error is None:
            with contextlib.suppress(Exception):
                seconds = entry.start.elapsed_time(entry.end) / 1e3
        return _result(entry.job, self._block_bytes, seconds, entry.method, entry.error)

    def wait(self, job_ids: set[int], timeout: float | None) -> bool:
        def done() -> bool | None:
            self.poll()
            with self._lock:
                ahead = list(self._queued)
            last = max((i for i, e in enumerate(ahead) if e.job.job_id in job_ids), default=-1)
            if last < 0:
                return True
            if timeout is None:
                for entry in ahead[:last + 1]:  # on one stream the last would do
                    if entry.end is not None:
                        with contextlib.suppress(Exception):  # an error is a failed job
                            entry.end.synchronize()
            return None
        return poll_until(done, math.inf if timeout is None else timeout,
                          backoff=(0.0002, 0.0002)) is not None

    def close(self, cancel: bool) -> None:
        """Queued GPU work cannot be recalled: wait for it, then report it."""
        try:
            self.stream.synchronize()
        except Exception as exc:
            logger.warning("synchronising a copy stream: %s", exc)
        self.poll()
        with self._lock:  # anything still queued failed to complete
            while self._queued:
                entry = self._queued.popleft()
                entry.error = entry.error or "did not complete before shutdown"
                self._sink.add(self._done(entry))
