"""Lanes: where one direction's jobs run, in submission order, and report their results.

Both lanes run the same copy function (transfer.copies); they differ only in
what cannot be shared between devices:

* ThreadLane (CPU tensors): CPU copies are synchronous, so a thread of the lane
  copies its jobs one after another (FIFO is about data too: a later job to the
  same block must win), with one helper thread for half of a batched call.
* StreamLane (CUDA tensors): the copies are queued on the lane's own stream at
  submit, after the caller's current stream (so a store never reads blocks
  that queued kernels still write), and complete by events, polled in order.
  Stores and loads overlap each other and the compute stream.

Every job is reported exactly once, success or failure, in submission order;
a failed job does not stop its lane.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_offload_cli.core.base.deadline import poll_until
from vllm_offload_cli.core.base.torch_import import import_torch
from vllm_offload_cli.core.transfer.jobs import CopyJob, Direction
from vllm_offload_cli.core.transfer.result import ResultSink, TransferResult

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

Copier = Callable[[CopyJob, Executor | None], str]  # copies a job; returns the rules used
CANCELLED = "cancelled: the copy worker shut down before this job started"


def _result(job: CopyJob, nbytes: int, seconds: float, method: str,
            error: BaseException | str | None) -> TransferResult:
    if isinstance(error, BaseException):
        logger.warning("%s job %d failed: %s", job.direction.value, job.job_id, error)
        error = f"{type(error).__name__}: {error}"
    return TransferResult(job_id=job.job_id, direction=job.direction, success=error is None,
                          bytes=nbytes,
                          seconds=seconds if error is None else 0.0, blocks=job.num_blocks,
                          method=method if error is None else "", error=error)


class ThreadLane:
    """One direction of CPU copies: a thread that copies the submitted jobs in order."""

    def __init__(self, direction: Direction, copy: Copier, sink: ResultSink,
                 job_bytes: Callable[[CopyJob], int]) -> None:
        self._copy = copy
        self._sink = sink
        self._job_bytes = job_bytes
        self._cond = threading.Condition()
        self._queue: deque[CopyJob] = deque()
        self._cancel = False
        self._stopping = False
        name = f"vllm-offload-{direction.value}"
        self._helper = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-helper")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: CopyJob) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the lane is closed")
            self._queue.append(job)
            self._cond.notify()

    def poll(self) -> None:
        """Nothing to do: the thread reports as it finishes."""

    def wait(self, job_ids: set[int], timeout: float | None) -> bool:
        return self._sink.wait(job_ids, timeout)

    def close(self, cancel: bool) -> None:
        """Finish what is queued (or, with `cancel`, report what has not started as
        cancelled, in order), then stop the threads."""
        with self._cond:
            self._cancel = self._cancel or cancel
            self._stopping = True
            self._cond.notify()
        self._thread.join()
        self._helper.shutdown()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                cancel = self._cancel
            nbytes = self._job_bytes(job)
            if cancel:
                self._sink.add(_result(job, nbytes, 0.0, "", CANCELLED))
                continue
            start = time.perf_counter()
            try:
                method, error = self._copy(job, self._helper), None
            except Exception as exc:  # reported as the job's result; the lane carries on
                method, error = "", exc
            self._sink.add(_result(job, nbytes, time.perf_counter() - start, method, error))


@dataclass(eq=False, kw_only=True)
class _Queued:
    job: CopyJob
    nbytes: int
    start: Any = None  # torch.cuda.Event
    end: Any = None
    method: str = ""
    error: str | None = None


class StreamLane:
    """One direction of CUDA copies: queued on the lane's stream, completed by events."""

    def __init__(self, direction: Direction, copy: Copier, sink: ResultSink,
                 job_bytes: Callable[[CopyJob], int], device: torch.device) -> None:
        torch = import_torch()
        self._copy = copy
        self._sink = sink
        self._job_bytes = job_bytes
        self._device = device
        self._lock = threading.Lock()
        self.stream = torch.cuda.Stream(device=device)
        self._queued: deque[_Queued] = deque()

    def submit(self, job: CopyJob) -> None:
        torch = import_torch()
        entry = _Queued(job=job, nbytes=self._job_bytes(job))
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
        return _result(entry.job, entry.nbytes, seconds, entry.method, entry.error)

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
