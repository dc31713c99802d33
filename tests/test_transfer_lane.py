"""Lane: one direction's FIFO of jobs and the threads that share their units (real threads)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from vllm_offload_cli.core.transfer.lane import Lane

Unit = Callable[[Any], None]


class Log:
    """What a lane reported, and which thread ran which unit, in the order it happened."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, Any, str]] = []  # (what, job/unit, thread name)
        self.results: list[tuple[Any, BaseException | None]] = []
        self.cancelled: list[Any] = []

    def note(self, what: str, item: Any) -> None:
        with self.lock:
            self.events.append((what, item, threading.current_thread().name))

    def finish(self, job: Any, error: BaseException | None, seconds: float) -> None:
        assert seconds >= 0
        with self.lock:
            self.results.append((job, error))
        self.note("finish", job)

    def cancel(self, job: Any) -> None:
        with self.lock:
            self.cancelled.append(job)
            self.results.append((job, None))


@pytest.fixture
def log() -> Log:
    return Log()


def lane(log: Log, threads: int, plan: Callable[[Any], list[Unit]] | None = None) -> Lane[Any, Any]:
    def refuse(job: Any) -> list[Unit]:
        raise AssertionError(f"job {job} was put with its units")

    return Lane("test-lane", threads, plan=plan or refuse, finish=log.finish,
                cancelled=log.cancel, context=dict)


def sleeper(log: Log, job: Any, index: int, seconds: float = 0.0) -> Unit:
    def work(context: Any) -> None:
        assert isinstance(context, dict)  # each thread's own scratch state
        log.note("unit", (job, index))
        time.sleep(seconds)
    return work


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_every_unit_runs_once_and_jobs_end_in_order(log: Log, threads: int) -> None:
    rng = random.Random(threads)
    sizes = [rng.randint(0, 12) for _ in range(40)]  # empty jobs too
    one = lane(log, threads)
    for job, size in enumerate(sizes):
        one.put(job, [sleeper(log, job, i, rng.choice([0, 0.0005, 0.002]))
                      for i in range(size)])
    one.close(cancel=False)
    assert log.results == [(job, None) for job in range(40)]
    ran = [item for what, item, _ in log.events if what == "unit"]
    assert sorted(ran) == [(job, i) for job, size in enumerate(sizes) for i in range(size)]
    # FIFO: no unit of a job runs before the job ahead of it has finished
    finished: set[int] = set()
    for what, item, _ in log.events:
        if what == "finish":
            finished.add(item)
        else:
            assert all(j in finished for j in range(item[0])), f"{item} ran early"


def test_units_are_shared_by_the_threads(log: Log) -> None:
    one = lane(log, 3)
    one.put("big", [sleeper(log, "big", i, 0.01) for i in range(30)])
    one.close(cancel=False)
    assert len({name for what, _, name in log.events if what == "unit"}) == 3


def test_the_thread_that_ends_a_job_starts_the_next(log: Log) -> None:
    """No hand-off at a job boundary: whoever copies a job's last unit copies the first
    unit of the job queued behind it."""
    one = lane(log, 2)
    for job in range(20):
        one.put(job, [sleeper(log, job, i, 0.001 * (i % 2)) for i in range(4)])
    one.close(cancel=False)
    units = [(item, name) for what, item, name in log.events if what == "unit"]
    enders = [name for what, _, name in log.events if what == "finish"]
    for job in range(1, 20):
        first = next(name for item, name in units if item == (job, 0))
        assert first == enders[job - 1]


def test_a_failed_unit_stops_its_job_and_the_lane_carries_on(log: Log) -> None:
    def boom(context: Any) -> None:
        log.note("unit", ("bad", 2))
        raise OSError("disk on fire")

    one = lane(log, 1)
    one.put("bad", [sleeper(log, "bad", 0), sleeper(log, "bad", 1), boom,
                    sleeper(log, "bad", 3), sleeper(log, "bad", 4)])
    one.put("good", [sleeper(log, "good", i) for i in range(3)])
    one.close(cancel=False)
    (bad, error), (good, fine) = log.results
    assert bad == "bad" and isinstance(error, OSError) and "disk on fire" in str(error)
    assert good == "good" and fine is None
    ran = [item for what, item, _ in log.events if what == "unit"]
    assert ran == [("bad", 0), ("bad", 1), ("bad", 2), ("good", 0), ("good", 1), ("good", 2)]


def test_jobs_put_without_units_are_planned_on_a_lane_thread(log: Log) -> None:
    planned_on: list[str] = []

    def plan(job: Any) -> list[Unit]:
        planned_on.append(threading.current_thread().name)
        if job == "unplannable":
            raise RuntimeError("no way to cut this job")
        return [sleeper(log, job, i, 0.002) for i in range(8)]

    one = lane(log, 2, plan)
    one.put("late", None)
    one.put("unplannable", None)
    one.put("early", [sleeper(log, "early", 0)])
    one.close(cancel=False)
    assert [job for job, _ in log.results] == ["late", "unplannable", "early"]
    assert log.results[0][1] is None and log.results[2][1] is None
    assert "no way to cut this job" in str(log.results[1][1])
    assert all(name.startswith("test-lane") for name in planned_on) and len(planned_on) == 2
    late = {name for what, item, name in log.events if what == "unit" and item[0] == "late"}
    assert len(late) == 2  # planned by one thread, copied by both


def test_close_with_cancel_reports_what_has_not_started_in_order(log: Log) -> None:
    started = threading.Event()
    release = threading.Event()

    def blocking(context: Any) -> None:
        started.set()
        assert release.wait(10)

    one = lane(log, 2)
    one.put(0, [blocking])
    for job in range(1, 6):
        one.put(job, [sleeper(log, job, 0)])
    assert started.wait(10)
    closer = threading.Thread(target=one.close, args=(True,))
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive(), "close waits for the job being copied"
    release.set()
    closer.join(10)
    assert not closer.is_alive()
    assert [job for job, _ in log.results] == list(range(6))  # in order, none dropped
    assert log.cancelled == [1, 2, 3, 4, 5]
    assert not [item for what, item, _ in log.events if what == "unit"]
    with pytest.raises(RuntimeError, match="closed"):
        one.put(9, [])


def test_close_without_cancel_finishes_everything(log: Log) -> None:
    one = lane(log, 2)
    for job in range(10):
        one.put(job, [sleeper(log, job, i, 0.001) for i in range(3)])
    one.close(cancel=False)
    assert log.results == [(job, None) for job in range(10)] and not log.cancelled


def test_a_report_that_raises_does_not_stop_the_lane(log: Log,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    def finish(job: Any, error: BaseException | None, seconds: float) -> None:
        if job == 1:
            raise RuntimeError("the sink is gone")
        log.finish(job, error, seconds)

    one = Lane("test-lane", 2, plan=lambda job: [], finish=finish, cancelled=log.cancel,
               context=dict)
    for job in range(4):
        one.put(job, [sleeper(log, job, 0)])
    closer = threading.Thread(target=one.close, args=(False,))
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), "close() returned"
    assert [job for job, _ in log.results] == [0, 2, 3]
    assert "reporting a finished job failed" in caplog.text
