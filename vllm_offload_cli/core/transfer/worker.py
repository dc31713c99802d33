"""CopyWorker: moves KV blocks between device tensors and one worker's slot of a region.

Its lanes run each direction's jobs in order (a later job to the same block wins), each
reported once by `get_finished()`; a failed job does not stop its lane. A StreamLane
queues after the caller's current stream: a store never reads blocks that kernels queued
there still write.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from vllm_offload_cli.core.base.deadline import poll_until
from vllm_offload_cli.core.base.errors import InvalidInputError, OperationFailedError
from vllm_offload_cli.core.base.extras import COPY, import_torch, require
from vllm_offload_cli.core.base.units import is_int
from vllm_offload_cli.core.transfer.copies import CopyJob, Direction, TensorPair, copy_job, make_job

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from vllm_offload_cli.core.region.shared_region import SharedOffloadRegion

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

    def __init__(self, block_bytes: int) -> None:
        self._block_bytes = block_bytes
        self._cond = threading.Condition()
        self._in_flight: set[int] = set()
        self._ready: list[TransferResult] = []

    def expect(self, job_id: int) -> bool:
        """Put `job_id` in flight; False if it is, or finished but was not collected yet."""
        with self._cond:
            if job_id in self._in_flight or any(r.job_id == job_id for r in self._ready):
                return False
            self._in_flight.add(job_id)
            return True

    def add(self, job: CopyJob, seconds: float, method: str, error: str | None) -> None:
        """Report `job` finished; failed if `error` says why."""
        result = TransferResult(job_id=job.job_id, direction=job.direction, success=error is None,
                                bytes=job.num_blocks * self._block_bytes,
                                seconds=seconds if error is None else 0.0,
                                blocks=job.num_blocks, method=method if error is None else "",
                                error=error)
        with self._cond:
            self._in_flight.discard(job.job_id)
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


def _failure(job: CopyJob, exc: Exception) -> str:
    """Log a failed job; its error, as a string (a kept exception would keep, through its
    traceback, the tensors of the failed copy and so the region's mapping)."""
    logger.warning("%s job %d failed: %s", job.direction.value, job.job_id, exc)
    return f"{type(exc).__name__}: {exc}"


class ThreadLane:
    """One direction of CPU copies: one thread copies the jobs in order, with a helper
    thread for half of a batched call."""

    def __init__(self, direction: Direction, copy: Copier, sink: ResultSink) -> None:
        self._copy = copy
        self._sink = sink
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
            self._sink.add(job, 0.0, "", CANCELLED)
            return
        start = time.perf_counter()
        try:
            method, error = self._copy(job, self._helper), None
        except Exception as exc:  # reported as the job's result; the lane carries on
            method, error = "", _failure(job, exc)
        self._sink.add(job, time.perf_counter() - start, method, error)


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
                 device: torch.device) -> None:
        torch = import_torch()
        self._copy = copy
        self._sink = sink
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
                entry.error = _failure(job, exc)
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
                        head.error = head.error or _failure(head.job, exc)
                        head.end = None
                self._done(self._queued.popleft())

    def _done(self, entry: _Queued) -> None:
        seconds = 0.0
        if entry.error is None:
            with contextlib.suppress(Exception):
                seconds = entry.start.elapsed_time(entry.end) / 1e3
        self._sink.add(entry.job, seconds, entry.method, entry.error)

    def wait(self, job_ids: set[int], timeout: float | None) -> bool:
        def done() -> bool | None:
            self.poll()
            with self._lock:
                wanted = [e for e in self._queued if e.job.job_id in job_ids]
            if not wanted:
                return True
            if timeout is None and wanted[-1].end is not None:
                # events on one stream complete in order: the last covers all before it
                with contextlib.suppress(Exception):  # an error is a failed job
                    wanted[-1].end.synchronize()
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
                self._done(entry)


LAYOUTS = ("worker", "canonical")


def _refused(message: str) -> InvalidInputError:
    return InvalidInputError(message, code="invalid_tensor")


def byte_rows(tensor: torch.Tensor, *, what: str) -> torch.Tensor:
    """(num_blocks, row_bytes) int8 view of `tensor`, without copying; refuses sparse rows."""
    torch = import_torch()
    if not isinstance(tensor, torch.Tensor):
        raise _refused(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() == 0 or tensor.shape[0] == 0 or tensor.numel() == 0:
        raise _refused(f"{what} must have shape (num_blocks, ...) with at least one block and "
                       f"one element per block, got {tuple(tensor.shape)}")
    n = tensor.shape[0]
    try:
        rows = tensor.view(n, -1)
        if rows.shape[1] > 1 and rows.stride(1) != 1:
            raise RuntimeError("elements inside a block are not adjacent")
        raw: Tensor = rows.view(torch.int8)
    except RuntimeError as exc:
        raise _refused(f"{what}: each block (one row along dim 0) must be one contiguous range "
                       f"of bytes (shape {tuple(tensor.shape)}, strides {tensor.stride()}): "
                       f"{exc}") from exc
    if n > 1 and raw.stride(0) < raw.shape[1]:
        raise _refused(f"{what}: blocks overlap in memory (row stride {raw.stride(0)} bytes < "
                       f"block size {raw.shape[1]} bytes)")
    return raw


# -- Pinning: cudaHostRegister, as vLLM does (row-aligned chunks of at most 64 GiB; on failure,
# pageable with a warning). Each call runs on a short-lived thread: a failed runtime call leaves
# a per-thread "last error" that torch would raise later from an unrelated kernel launch.

MAX_PIN_CHUNK = 64 * 1024**3  # bytes per cudaHostRegister call, as vLLM
CUDA_HOST_REGISTER_DEFAULT = 0
T = TypeVar("T")


def pin_chunks(total: int, row_stride: int, limit: int = MAX_PIN_CHUNK) -> list[tuple[int, int]]:
    """(offset, length) chunks covering [0, total), each <= limit and ending on a row."""
    if total <= 0:
        return []
    step = max(1, limit // row_stride) * row_stride
    return [(offset, min(step, total - offset)) for offset in range(0, total, step)]


@dataclass(frozen=True, kw_only=True)
class PinState:
    """What pinning achieved: the registered chunks, or why there are none."""

    pinned: bool
    ptr: int
    chunks: tuple[tuple[int, int], ...]
    device_index: int | None
    warning: str | None = None


def _code(rc: Any) -> int:
    return int(getattr(rc, "value", rc))


def _describe(cudart: Any, rc: Any) -> str:
    try:
        return f"{cudart.cudaGetErrorString(rc)} (cudaError {_code(rc)})"
    except Exception:  # the description is a nicety: it never costs the warning
        return f"cudaError {_code(rc)}"


def _off_thread(fn: Callable[[Any], T], device_index: int | None, cudart: Any) -> T:
    """fn(runtime) on a short-lived thread, on `device_index` (the real runtime only)."""

    def run() -> T:
        if cudart is not None:
            return fn(cudart)
        torch = import_torch()
        if device_index is not None:
            torch.cuda.set_device(device_index)
        return fn(torch.cuda.cudart())

    with ThreadPoolExecutor(1, thread_name_prefix="vllm-offload-pin") as thread:
        return thread.submit(run).result()


def pin(ptr: int, total: int, row_stride: int, *, device_index: int | None,
        cudart: Any = None, limit: int = MAX_PIN_CHUNK) -> PinState:
    """Register [ptr, ptr+total); on any failure undo what was registered and say why."""

    def register(rt: Any) -> PinState:
        done: list[tuple[int, int]] = []
        for offset, length in pin_chunks(total, row_stride, limit):
            rc = rt.cudaHostRegister(ptr + offset, length, CUDA_HOST_REGISTER_DEFAULT)
            if _code(rc) != 0:
                for d_offset, _ in done:
                    rt.cudaHostUnregister(ptr + d_offset)
                return PinState(pinned=False, ptr=ptr, chunks=(), device_index=device_index,
                                warning=(
                    f"cudaHostRegister of {length} bytes at offset {offset} failed: "
                    f"{_describe(rt, rc)}; copies run from pageable memory, much slower "
                    "(check `ulimit -l` / RLIMIT_MEMLOCK and the container's locked-memory "
                    "limit)"))
            done.append((offset, length))
        return PinState(pinned=True, ptr=ptr, chunks=tuple(done), device_index=device_index)

    return _off_thread(register, device_index, cudart)


def unpin(state: PinState, *, cudart: Any = None) -> list[str]:
    """Unregister every chunk of `state`; returns problems (never raises for one chunk)."""

    def unregister(rt: Any) -> list[str]:
        return [f"cudaHostUnregister at offset {offset}: {_describe(rt, rc)}"
                for offset, _ in state.chunks
                if _code(rc := rt.cudaHostUnregister(state.ptr + offset)) != 0]

    return _off_thread(unregister, state.device_index, cudart)


class CopyWorker:
    """Store (device -> region) and load (region -> device) KV blocks asynchronously.
    `device_tensors`: one per KV tensor, (num_device_blocks, ...), any dtype. Each gets the
    next page of this worker's slot (`layout="worker"`, vLLM's default), of every row
    ("canonical"), or the given `region_views`. On CUDA the region is pinned unless
    `pin=False` (a failure is a warning: `pin_warning`)."""

    def __init__(self, region: SharedOffloadRegion, device_tensors: Sequence[torch.Tensor], *,
                 layout: str = "worker", region_views: Sequence[torch.Tensor] | None = None,
                 pin: bool = True) -> None:
        require(COPY, what="CopyWorker")  # torch and numpy: the `copy` extra
        tensors = list(device_tensors)
        if not tensors:
            raise _refused("a copy worker needs at least one device tensor")
        if layout not in LAYOUTS:
            raise InvalidInputError(f"layout must be one of {', '.join(LAYOUTS)}, "
                                    f"got {layout!r}", code="invalid_layout")
        rows = [byte_rows(t, what=f"device tensor {i}") for i, t in enumerate(tensors)]
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise _refused("all device tensors must live on one device, got "
                           f"{sorted(str(d) for d in devices)}")
        self.device: torch.device = tensors[0].device
        if self.device.type not in ("cpu", "cuda"):
            raise _refused(f"device tensors on {self.device} are not supported (cpu or cuda)")
        counts = {r.shape[0] for r in rows}
        if len(counts) > 1:
            raise _refused("all device tensors must have the same number of blocks (dim 0), "
                           f"got {sorted(counts)}")
        self.num_device_blocks = rows[0].shape[0]
        self.num_region_blocks = region.num_chunks
        self.region_views = self._views(region, rows, layout, region_views)
        self.row_bytes = tuple(r.shape[1] for r in rows)
        self.bytes_per_block = sum(self.row_bytes)
        self.pinned = False
        self.pin_warning: str | None = None
        self._pin_state: PinState | None = None
        self._region: SharedOffloadRegion | None = region
        self._lock = threading.Lock()
        self._closed = False
        self._sink = ResultSink(self.bytes_per_block)
        self._pairs = [TensorPair.of(dev, reg) for dev, reg in zip(rows, self.region_views,
                                                                   strict=True)]
        if self.device.type == "cuda" and pin:
            self._pin(region)
        self._lanes: dict[Direction, ThreadLane | StreamLane] = {
            d: ThreadLane(d, self._copy, self._sink) if self.device.type == "cpu"
            else StreamLane(d, self._copy, self._sink, self.device)
            for d in Direction
        }
        # cleanup() calls this before unmapping: no copy may outlive the mapping
        region.add_close_callback(self.shutdown)

    @staticmethod
    def _views(region: SharedOffloadRegion, rows: list[torch.Tensor], layout: str,
               given: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        torch = import_torch()
        if given is None:
            carve = (region.create_next_worker_view if layout == "worker"
                     else region.create_next_canonical_view)
            return [carve(r.shape[1]) for r in rows]
        views = list(given)
        if len(views) != len(rows):
            raise _refused(f"{len(views)} region views for {len(rows)} device tensors")
        for i, (view, r) in enumerate(zip(views, rows, strict=True)):
            if view.dtype != torch.int8 or tuple(view.shape) != (region.num_chunks, r.shape[1]):
                raise _refused(f"region view {i} must be int8 of shape ({region.num_chunks}, "
                               f"{r.shape[1]}), got {view.dtype} {tuple(view.shape)}")
        return views

    def _copy(self, job: CopyJob, helper: Executor | None) -> str:
        return copy_job(self._pairs, job, non_blocking=self.device.type == "cuda",
                        helper=helper)

    def _pin(self, region: SharedOffloadRegion) -> None:
        if not region.is_pinned:  # else another worker of this process pinned it: enough
            storage = self.region_views[0].untyped_storage()
            state = pin(storage.data_ptr(), storage.nbytes(), region.geometry.row_stride,
                        device_index=self.device.index)
            if not state.pinned:
                self.pin_warning = state.warning
                logger.warning("%s: %s", region.mmap_path, state.warning)
                return
            self._pin_state = state
            region.is_pinned = True
        self.pinned = True

    def submit_store(self, job_id: int, src_blocks: Any, dst_blocks: Any) -> None:
        """Copy device blocks `src_blocks[i]` into region blocks `dst_blocks[i]`."""
        self._submit(job_id, Direction.STORE, src_blocks, dst_blocks)

    def submit_load(self, job_id: int, src_blocks: Any, dst_blocks: Any) -> None:
        """Copy region blocks `src_blocks[i]` into device blocks `dst_blocks[i]`."""
        self._submit(job_id, Direction.LOAD, src_blocks, dst_blocks)

    def _submit(self, job_id: int, direction: Direction, src: Any, dst: Any) -> None:
        if not is_int(job_id):
            raise InvalidInputError(f"job id must be an integer, got {job_id!r}",
                                    code="invalid_job_id")
        job = make_job(job_id, direction, src, dst, device_blocks=self.num_device_blocks,
                       region_blocks=self.num_region_blocks)
        with self._lock:
            if self._closed:
                raise OperationFailedError("the copy worker is shut down; it takes no more jobs")
            if not self._sink.expect(job_id):
                raise InvalidInputError(f"job id {job_id} is still in flight or its result "
                                        "was not collected yet", code="duplicate_job_id")
            self._lanes[direction].submit(job)

    def get_finished(self) -> list[TransferResult]:
        """Results of jobs finished since the last call (each job exactly once)."""
        for lane in self._lanes.values():
            lane.poll()
        return self._sink.take()

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        """Block until the given jobs finished (ids not in flight count as finished); False
        on timeout. Their results still come from the next get_finished()."""
        wanted = set(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        return all(lane.wait(wanted, None if deadline is None
                             else max(0.0, deadline - time.monotonic()))
                   for lane in self._lanes.values())

    def shutdown(self, cancel_pending: bool = False) -> None:
        """Finish (or, on CPU, cancel) queued jobs, release the views and unpin; idempotent.
        Every job still gets its result: cancelled ones are reported failed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for lane in self._lanes.values():
            lane.close(cancel_pending)
        self._pairs = []
        self.region_views = []
        region, self._region = self._region, None
        assert region is not None  # set in __init__, dropped only here, and this runs once
        region.remove_close_callback(self.shutdown)
        if self._pin_state is not None:  # set only once pinned
            for problem in unpin(self._pin_state):
                logger.warning("%s", problem)
            self._pin_state = None
            region.is_pinned = False

    def __enter__(self) -> CopyWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (f"CopyWorker(device={self.device}, tensors={len(self.row_bytes)}, "
                f"bytes_per_block={self.bytes_per_block}, pinned={self.pinned})")
