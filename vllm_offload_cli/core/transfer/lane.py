"""A lane: one direction's FIFO of jobs, cut into units, and the copy threads that drain it.

Jobs run one after another (FIFO is about data too: a later job to the same
block must win), each cut into units that whichever of the lane's threads is
free takes next. Threads that start late or run slow simply take fewer units.

Why the threads are the lane's own rather than a pool fed by a dispatcher
thread: the thread that copies a job's last unit reports it and takes the
first unit of the next job at once, and a thread that takes a unit wakes one
idle thread while units are left (a submit pays for one wake-up). With a
dispatcher, each job boundary paid two wake-ups in series, 0.1-0.2 ms each on
a VM, while the cores idled (measured, 2 jobs of 128 MiB in flight on 2 cores:
each thread idled ~1.1 ms per round before, ~0.85 ms after; the 2 jobs took
1-3% less time).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

__all__ = ["Lane"]

logger = logging.getLogger(__name__)

J = TypeVar("J")  # a job, as the owner knows it
C = TypeVar("C")  # what a unit is given: the thread's own scratch state

Work = Sequence[Callable[[C], None]]


class _Open(Generic[J, C]):
    """The job being copied: units handed out in order and counted back in."""

    __slots__ = ("error", "handed", "job", "running", "start", "work")

    def __init__(self, job: J, work: Work[C] | None) -> None:
        self.job = job
        self.work = work  # None: not planned yet (the first thread to look plans it)
        self.handed = 0
        self.running = 0  # units (or the planning) in progress
        self.error: BaseException | None = None
        self.start = time.perf_counter()

    @property
    def done(self) -> bool:
        if self.running or self.work is None:
            return False
        return self.error is not None or self.handed == len(self.work)


class Lane(Generic[J, C]):
    """`threads` threads copy the jobs `put` here, one job at a time, in order.

    `plan(job)` cuts a job that was put without its units (on a lane thread);
    `finish(job, error, seconds)` reports each job exactly once, in order, with
    the first exception of its units or of its planning (None: all copied);
    `cancelled(job)` reports a job that `close(cancel=True)` kept from starting.
    `context()` makes each thread's scratch state, after `setup()` ran on it.
    """

    def __init__(self, name: str, threads: int, *, plan: Callable[[J], Work[C]],
                 finish: Callable[[J, BaseException | None, float], None],
                 cancelled: Callable[[J], None], context: Callable[[], C],
                 setup: Callable[[], object] = lambda: None) -> None:
        self._plan = plan
        self._finish = finish
        self._cancelled = cancelled
        self._context = context
        self._setup = setup
        self._cond = threading.Condition(threading.Lock())
        self._waiting: collections.deque[tuple[J, Work[C] | None]] = collections.deque()
        self._open: _Open[J, C] | None = None
        self._idle = 0  # threads waiting for work: a submit wakes only when there are some
        self._cancel = False
        self._stopping = False
        self._threads = [threading.Thread(target=self._run, daemon=True, name=f"{name}-{i}")
                         for i in range(max(1, threads))]
        for thread in self._threads:
            thread.start()

    def put(self, job: J, work: Work[C] | None) -> None:
        """Queue `job`; `work` is its units, or None for a lane thread to plan it."""
        with self._cond:
            if self._stopping:
                raise RuntimeError("the lane is closed")
            self._waiting.append((job, work))
            if self._idle:
                self._cond.notify()  # one: it wakes the next if there is work to share

    def close(self, cancel: bool) -> None:
        """Finish what is queued (or, with `cancel`, report what has not started as
        cancelled, in order), then stop the threads."""
        with self._cond:
            self._cancel = self._cancel or cancel
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    # -- the threads ---------------------------------------------------------------------

    def _run(self) -> None:
        self._setup()
        context = self._context()
        cond = self._cond
        with cond:
            while True:
                task = self._take()
                if task is None:
                    if self._stopping and self._open is None and not self._waiting:
                        cond.notify_all()  # the others stop too
                        return
                    self._idle += 1
                    cond.wait()
                    self._idle -= 1
                    continue
                job, index = task
                cond.release()
                try:
                    failure = self._do(job, index, context)
                finally:
                    cond.acquire()
                self._returned(job, failure)

    def _take(self) -> tuple[_Open[J, C], int] | None:
        """The next unit to copy (index -1: the job to plan), opening jobs as needed."""
        while True:
            job = self._open
            if job is None:
                if not self._waiting:
                    return None
                job = self._open = _Open(*self._waiting.popleft())
                if self._cancel:
                    self._open = None
                    self._report(self._cancelled, job.job)
                    continue
                if job.done:  # nothing to copy
                    self._close_job(job)
                    continue
            if job.work is None:
                if job.running:  # another thread is planning it
                    return None
                job.running += 1
                return job, -1
            if job.error is not None or job.handed == len(job.work):
                return None  # the rest is being copied: the one that ends it opens the next
            job.handed += 1
            job.running += 1
            if self._idle and job.handed < len(job.work):
                self._cond.notify()  # a chain of wake-ups: the caller pays for one
            return job, job.handed - 1

    def _do(self, job: _Open[J, C], index: int, context: C) -> BaseException | None:
        try:
            if index < 0:
                job.work = list(self._plan(job.job))
            else:
                assert job.work is not None
                job.work[index](context)
        except BaseException as exc:  # reported as the job's result, never lost
            if index < 0:
                job.work = []
            return exc
        return None

    def _returned(self, job: _Open[J, C], failure: BaseException | None) -> None:
        job.running -= 1
        if failure is not None and job.error is None:
            job.error = failure
        if job.done:
            self._close_job(job)

    def _close_job(self, job: _Open[J, C]) -> None:
        self._open = None
        self._report(self._finish, job.job, job.error, time.perf_counter() - job.start)
        # the thread that ended the job opens the next one itself
        if self._stopping:
            self._cond.notify_all()

    @staticmethod
    def _report(callback: Callable[..., None], *args: object) -> None:
        """A report that raises must not kill the thread: the lane would stop with jobs
        queued, and close() would wait for it forever."""
        try:
            callback(*args)
        except Exception:
            logger.exception("reporting a finished job failed")
