"""The CUDA lane's bookkeeping (ordering, waiting, failures), with only the GPU faked.

Streams and events are the one part that cannot exist without a GPU, so they
are replaced by fakes whose completion the test controls; the copies are the
CUDA path's own (copy_job over a pair whose sides are on two devices), run for
real on CPU tensors. The real thing: test_transfer_cuda.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_offload_cli.core.base.extras import import_torch
from vllm_offload_cli.core.transfer.copies import Direction, TensorPair, copy_job, make_job
from vllm_offload_cli.core.transfer.worker import ResultSink, StreamLane

torch = import_torch()


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.recorded_on: Any = None
        self.ready = False

    def record(self, stream: Any = None) -> None:
        self.recorded_on = stream
        stream.events.append(self)

    def query(self) -> bool:
        return self.ready

    def synchronize(self) -> None:
        events = self.recorded_on.events  # as on a GPU, those recorded before it finish first
        for event in events[:events.index(self) + 1]:
            event.ready = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return 2.5  # milliseconds


class FakeStream:
    def __init__(self, device: Any = None) -> None:
        self.waited_for: list[Any] = []
        self.events: list[FakeEvent] = []

    def wait_stream(self, other: Any) -> None:
        self.waited_for.append(other)

    def synchronize(self) -> None:
        for event in self.events:
            event.ready = True


class Lanes:
    """A StreamLane per direction over one tensor pair, as CopyWorker builds them on CUDA."""

    def __init__(self) -> None:
        self.device_rows = torch.arange(16 * 64, dtype=torch.int64).remainder(127).to(
            torch.int8).view(16, 64)
        self.host = torch.zeros(32, 64, dtype=torch.int8)
        self.sink = ResultSink(64)
        pairs = [TensorPair(device=self.device_rows, region=self.host, row_bytes=64,
                            one_device=False)]

        def copy(job: Any, helper: Any) -> str:
            assert helper is None  # a stream lane issues on the caller's thread only
            return copy_job(pairs, job, non_blocking=True)

        self.lanes = {d: StreamLane(d, copy, self.sink, torch.device("cpu")) for d in Direction}

    def submit(self, job: int, src: list[int], dst: list[int],
               direction: Direction = Direction.STORE) -> None:
        self.sink.expect(job)
        self.lanes[direction].submit(make_job(job, direction, src, dst, device_blocks=16,
                                              region_blocks=32))

    def end_event(self, direction: Direction, index: int) -> FakeEvent:
        stream: FakeStream = self.lanes[direction].stream
        return stream.events[2 * index + 1]  # start, end, start, ...

    def poll(self) -> None:
        for lane in self.lanes.values():
            lane.poll()


@pytest.fixture
def lanes(monkeypatch: pytest.MonkeyPatch) -> Iterator[Lanes]:
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute-stream")
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    yield Lanes()


def test_jobs_are_reported_in_submission_order_whatever_finishes_first(lanes: Lanes) -> None:
    for job in (1, 2, 3):
        lanes.submit(job, [job], [job + 10])
    stream: FakeStream = lanes.lanes[Direction.STORE].stream
    assert stream.waited_for == ["compute-stream"] * 3  # each after the caller's kernels
    lanes.end_event(Direction.STORE, 2).ready = True  # job 3 "finishes" first
    lanes.poll()
    assert lanes.sink.take() == []
    lanes.end_event(Direction.STORE, 0).ready = True
    lanes.poll()
    assert [r.job_id for r in lanes.sink.take()] == [1]
    lanes.end_event(Direction.STORE, 1).ready = True
    lanes.poll()
    results = lanes.sink.take()
    assert [r.job_id for r in results] == [2, 3]
    assert all(r.success and r.seconds == pytest.approx(0.0025) for r in results)
    assert results[0].method == "slice" and results[0].bytes == 64
    assert torch.equal(lanes.host[12], lanes.device_rows[2])
    assert torch.equal(lanes.host[13], lanes.device_rows[3])


def test_scattered_jobs_are_one_copy_per_block_on_the_stream(lanes: Lanes) -> None:
    lanes.submit(1, [3, 9, 4], [30, 2, 17])
    lanes.submit(2, [30, 2], [0, 1], Direction.LOAD)
    lanes.end_event(Direction.STORE, 0).ready = True
    lanes.end_event(Direction.LOAD, 0).ready = True
    lanes.poll()
    assert [r.method for r in lanes.sink.take()] == ["batched", "batched"]
    assert torch.equal(lanes.host[[30, 2, 17]], lanes.device_rows[[3, 9, 4]])
    assert torch.equal(lanes.device_rows[0], lanes.device_rows[3])


def test_directions_do_not_wait_for_each_other(lanes: Lanes) -> None:
    lanes.submit(1, [0], [0])
    lanes.submit(2, [0], [0], Direction.LOAD)
    lanes.end_event(Direction.LOAD, 0).ready = True
    lanes.poll()
    assert [(r.job_id, r.direction) for r in lanes.sink.take()] == [(2, Direction.LOAD)]


def test_wait_blocks_until_the_jobs_event_completes(lanes: Lanes) -> None:
    lanes.submit(1, [0], [0])
    lanes.submit(2, [1], [1])
    store = lanes.lanes[Direction.STORE]
    assert not store.wait({2}, timeout=0.01)
    assert store.wait({2}, timeout=None)  # synchronizes up to job 2's end event
    assert [r.job_id for r in lanes.sink.take()] == [1, 2]


def test_a_failing_copy_is_a_failed_result_in_its_place(lanes: Lanes) -> None:
    lanes.submit(1, [0], [0])
    storage = lanes.device_rows.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)  # the device memory is gone under the worker
    lanes.submit(2, [1], [1])
    storage.resize_(nbytes)
    lanes.submit(3, [2], [2])
    lanes.lanes[Direction.STORE].close(cancel=False)  # synchronizes, reports everything
    results = lanes.sink.take()
    assert [r.job_id for r in results] == [1, 2, 3]
    assert [r.success for r in results] == [True, False, True]
    assert results[1].error and results[1].bytes == 64
