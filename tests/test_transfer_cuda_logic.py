"""The CUDA backend's bookkeeping (ordering, waiting, failures), with the GPU faked.

Streams and events are the one part that cannot exist without a GPU, so they
are replaced by fakes whose completion the test controls; the copies
themselves run for real, on CPU tensors. The real thing: test_transfer_cuda.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_offload_cli.core.base.torch_import import import_torch
from vllm_offload_cli.core.transfer.cuda import CudaBackend, CudaPair
from vllm_offload_cli.core.transfer.plan import Direction, plan_transfer
from vllm_offload_cli.core.transfer.result import ResultSink

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
        self.ready = True

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


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[CudaBackend, ResultSink, Any]]:
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute-stream")
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    device_rows = torch.arange(16 * 64, dtype=torch.int64).remainder(127).to(torch.int8).view(
        16, 64)
    host = torch.zeros(32, 64, dtype=torch.int8)
    sink = ResultSink()
    b = CudaBackend([CudaPair(device_rows, host, 64)], sink, lambda plan: plan.num_blocks * 64,
                    torch.device("cpu"), "copy-engine")
    yield b, sink, (device_rows, host)


def submit(b: CudaBackend, sink: ResultSink, job: int, src: list[int], dst: list[int],
           direction: Direction = Direction.STORE) -> None:
    sink.expect(job)
    b.submit(plan_transfer(job, direction, src, dst, device_blocks=16, region_blocks=32))


def end_event(b: CudaBackend, direction: Direction, index: int) -> FakeEvent:
    event: FakeEvent = b._streams[direction].events[2 * index + 1]  # start, end, start, ...
    return event


def test_jobs_are_reported_in_submission_order_whatever_finishes_first(backend: Any) -> None:
    b, sink, (device_rows, host) = backend
    for job in (1, 2, 3):
        submit(b, sink, job, [job], [job + 10])
    stream = b._streams[Direction.STORE]
    assert stream.waited_for == ["compute-stream"] * 3  # each after the caller's kernels
    end_event(b, Direction.STORE, 2).ready = True  # job 3 "finishes" first
    b.poll()
    assert sink.take() == []
    end_event(b, Direction.STORE, 0).ready = True
    b.poll()
    assert [r.job_id for r in sink.take()] == [1]
    end_event(b, Direction.STORE, 1).ready = True
    b.poll()
    results = sink.take()
    assert [r.job_id for r in results] == [2, 3]
    assert all(r.success and r.seconds == pytest.approx(0.0025) for r in results)
    assert results[0].method == "copy-engine" and results[0].bytes == 64
    assert torch.equal(host[12], device_rows[2]) and torch.equal(host[13], device_rows[3])


def test_directions_do_not_wait_for_each_other(backend: Any) -> None:
    b, sink, _ = backend
    submit(b, sink, 1, [0], [0])
    submit(b, sink, 2, [0], [0], Direction.LOAD)
    end_event(b, Direction.LOAD, 0).ready = True
    b.poll()
    assert [(r.job_id, r.direction) for r in sink.take()] == [(2, Direction.LOAD)]


def test_wait_blocks_until_the_jobs_event_completes(backend: Any) -> None:
    b, sink, _ = backend
    submit(b, sink, 1, [0], [0])
    submit(b, sink, 2, [1], [1])
    assert not b.wait({2}, timeout=0.01)
    assert b.wait({2}, timeout=None)  # synchronizes up to job 2's end event
    assert [r.job_id for r in sink.take()] == [1, 2]


def test_a_failing_copy_is_a_failed_result_in_its_place(backend: Any) -> None:
    b, sink, (device_rows, _) = backend
    submit(b, sink, 1, [0], [0])
    storage = device_rows.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)  # the device memory is gone under the worker
    submit(b, sink, 2, [1], [1])
    storage.resize_(nbytes)
    submit(b, sink, 3, [2], [2])
    b.close(cancel_pending=False)  # synchronizes the streams, reports everything
    results = sink.take()
    assert [r.job_id for r in results] == [1, 2, 3]
    assert [r.success for r in results] == [True, False, True]
    assert results[1].error and results[1].bytes == 64
