"""The CUDA copy path: one stream per direction, events for completion and timing.

Ordering. A job is enqueued on its direction's stream at submit time, after a
`wait_stream` on the caller's current stream, so it never reads (store) or
overwrites (load) blocks that kernels already queued there still use. One
stream per direction makes each direction complete in submission order;
stores and loads overlap each other and the compute stream.

Copies. torch only issues a true asynchronous cudaMemcpyAsync when both sides
of a copy are contiguous; a slice of strided region rows would go through a
pageable temporary. So a job is cut into contiguous pieces:

* copy-engine (default, like vLLM's swap_blocks): one cudaMemcpyAsync per
  piece, issued from C++ in one `torch._foreach_copy_` call per tensor. A
  piece is a whole run of blocks when the region rows of that tensor are
  adjacent (a slot that holds one tensor of a one-worker region), else one
  block; contiguous runs are coalesced, and the Python cost per piece is one
  view (about a microsecond).
* kernel (opt-in): the pinned region is also addressed from the GPU (UVA:
  registered host memory is reachable at its host address on 64-bit Linux
  with devices whose `canUseHostPointerForRegisteredMem` is 1, e.g. H100/H200),
  so a job of any shape is one gather/scatter launch per tensor. It batches
  many small blocks best, but uses SMs rather than copy engines; prove it with
  `benchmarks/gpu_check.sh` before relying on it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_offload_cli.core.base.torch_import import import_torch
from vllm_offload_cli.core.transfer.plan import Direction, TransferPlan
from vllm_offload_cli.core.transfer.result import ResultSink, TransferResult
from vllm_offload_cli.core.transfer.views import copy_many

if TYPE_CHECKING:
    import torch
    from torch import Tensor

logger = logging.getLogger(__name__)

STRATEGIES = ("copy-engine", "kernel")


@dataclass(frozen=True)
class CudaPair:
    """One KV tensor: int8 rows on the GPU and in the region, plus the kernel path's views."""

    device: torch.Tensor
    host: torch.Tensor
    row_bytes: int
    device_words: torch.Tensor | None = None  # word views for the kernel strategy
    mapped_words: torch.Tensor | None = None  # the region rows as seen from the GPU

    @property
    def dense(self) -> bool:
        """Are runs of blocks contiguous on both sides (one memcpy per run)?"""
        return self.host.stride(0) == self.row_bytes and self.device.stride(0) == self.row_bytes


def map_into_device(host_rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The pinned mapping under `host_rows`, as a CUDA tensor with the same layout (no copy).

    torch accepts any pointer that CUDA knows through __cuda_array_interface__,
    and refuses one that is not registered.
    """
    torch = import_torch()
    storage = host_rows.untyped_storage()

    class _Mapped:
        def __init__(self) -> None:
            self.__cuda_array_interface__ = {
                "shape": (storage.nbytes(),), "typestr": "|i1",
                "data": (storage.data_ptr(), False), "version": 2}

    whole = torch.as_tensor(_Mapped(), device=device)
    rows: Tensor = whole.as_strided(host_rows.shape, host_rows.stride(),
                                          host_rows.storage_offset())
    return rows


def engine_copy(pairs: Sequence[CudaPair], plan: TransferPlan) -> None:
    """One copy per contiguous piece (a run when rows are adjacent, else a block).

    Device-agnostic: with CUDA tensors each piece is one cudaMemcpyAsync on the
    current stream; the tests also run it on CPU tensors.
    """
    store = plan.direction is Direction.STORE
    runs = None
    ids: tuple[list[int], list[int]] | None = None
    for pair in pairs:
        src, dst = (pair.device, pair.host) if store else (pair.host, pair.device)
        if pair.dense:
            runs = runs if runs is not None else plan.joint_runs()
            srcs = [src[r.src:r.src + r.length] for r in runs]
            dsts = [dst[r.dst:r.dst + r.length] for r in runs]
        else:
            ids = ids if ids is not None else (plan.src_ids.tolist(), plan.dst_ids.tolist())
            srcs = [src[i] for i in ids[0]]
            dsts = [dst[i] for i in ids[1]]
        copy_many(dsts, srcs, non_blocking=True)


def kernel_copy(pairs: Sequence[CudaPair], plan: TransferPlan, device: torch.device) -> None:
    """One gather/scatter launch per tensor through the device-mapped region.

    Index tensors are moved to `device` once per job; with rows of any shape a
    job costs one or two launches per tensor, however many blocks it has.
    """
    torch = import_torch()
    store = plan.direction is Direction.STORE
    n = plan.num_blocks

    def to_dev(ids: Tensor) -> Tensor:
        moved: Tensor = ids.to(device, non_blocking=True)
        return moved

    first = 0
    if plan.dst_run_count == 1:  # one destination run: gather straight into it
        src_idx, first = to_dev(plan.src), int(plan.dst[0])
    elif plan.src_run_count == 1:  # one source run: scatter straight from it
        dst_idx, first = to_dev(plan.dst_by_src), int(plan.src_sorted[0])
    else:
        src_idx, dst_idx = to_dev(plan.src), to_dev(plan.dst)
    for pair in pairs:
        assert pair.device_words is not None and pair.mapped_words is not None
        src, dst = ((pair.device_words, pair.mapped_words) if store
                    else (pair.mapped_words, pair.device_words))
        if plan.dst_run_count == 1:
            torch.index_select(src, 0, src_idx, out=dst[first:first + n])
        elif plan.src_run_count == 1:
            dst.index_copy_(0, dst_idx, src[first:first + n])
        else:
            dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))


@dataclass(eq=False)
class _Pending:
    plan: TransferPlan
    nbytes: int
    start: Any = None  # torch.cuda.Event
    end: Any = None
    method: str = ""
    error: str | None = None
    done: bool = field(default=False)


class CudaBackend:
    """Enqueue at submit, complete by events; results go to the sink in FIFO order."""

    def __init__(self, pairs: Sequence[CudaPair], sink: ResultSink,
                 job_bytes: Callable[[TransferPlan], int], device: torch.device,
                 strategy: str) -> None:
        torch = import_torch()
        self._pairs = list(pairs)
        self._sink = sink
        self._job_bytes = job_bytes
        self._device = device
        self._strategy = strategy
        self._lock = threading.Lock()
        self._streams = {d: torch.cuda.Stream(device=device) for d in Direction}
        self._pending: dict[Direction, deque[_Pending]] = {d: deque() for d in Direction}

    # -- submitting ----------------------------------------------------------------

    def submit(self, plan: TransferPlan) -> None:
        torch = import_torch()
        entry = _Pending(plan, self._job_bytes(plan))
        stream = self._streams[plan.direction]
        with torch.cuda.device(self._device):
            try:
                stream.wait_stream(torch.cuda.current_stream(self._device))
                entry.start = torch.cuda.Event(enable_timing=True)
                entry.end = torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    entry.start.record(stream)
                    entry.method = self._copy(plan)
            except Exception as exc:  # reported in order as a failed job, never dropped
                logger.warning("%s job %d failed: %s", plan.direction.value, plan.job_id, exc)
                entry.error = f"{type(exc).__name__}: {exc}"
            finally:
                try:
                    if entry.end is not None:
                        entry.end.record(stream)
                except Exception:
                    entry.end = None
        with self._lock:
            self._pending[plan.direction].append(entry)

    def _copy(self, plan: TransferPlan) -> str:
        if plan.num_blocks == 0:
            return "none"
        if self._strategy == "kernel" and all(p.mapped_words is not None for p in self._pairs):
            kernel_copy(self._pairs, plan, self._device)
            return "kernel"
        engine_copy(self._pairs, plan)
        return "copy-engine"

    # -- completing -----------------------------------------------------------------

    def poll(self) -> None:
        """Report every job whose end event has completed, in FIFO order per direction."""
        with self._lock:
            for direction in Direction:
                queue = self._pending[direction]
                while queue:
                    head = queue[0]
                    if head.end is not None:  # failed jobs too: nothing may still run
                        try:
                            if not head.end.query():
                                break
                        except Exception as exc:  # a sticky CUDA error: this job failed
                            head.error = head.error or f"{type(exc).__name__}: {exc}"
                            head.end = None
                    queue.popleft()
                    self._sink.add(self._result(head))

    def _result(self, entry: _Pending) -> TransferResult:
        plan = entry.plan
        if entry.error is not None:
            return TransferResult(plan.job_id, plan.direction, False, entry.nbytes, 0.0,
                                  plan.num_blocks, entry.method, entry.error)
        try:
            seconds = entry.start.elapsed_time(entry.end) / 1e3
        except Exception:
            seconds = 0.0
        return TransferResult(plan.job_id, plan.direction, True, entry.nbytes, seconds,
                              plan.num_blocks, entry.method)

    def wait(self, job_ids: set[int], timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.poll()
            if not job_ids & self._sink.in_flight():
                return True
            if deadline is None:
                for event in self._last_events(job_ids):
                    # an error here is a failed job: poll() reports it
                    with contextlib.suppress(Exception):
                        event.synchronize()
                continue
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0002)

    def _last_events(self, job_ids: set[int]) -> list[Any]:
        """End events of every pending job up to the last wanted one, per direction.

        On one stream the last suffices; the earlier ones make FIFO explicit.
        """
        events = []
        with self._lock:
            for queue in self._pending.values():
                entries = list(queue)
                last = max((i for i, e in enumerate(entries) if e.plan.job_id in job_ids),
                           default=-1)
                events += [e.end for e in entries[:last + 1] if e.end is not None]
        return events

    def close(self, cancel_pending: bool) -> None:
        """Queued GPU work cannot be recalled: wait for it, then report it."""
        for stream in self._streams.values():
            try:
                stream.synchronize()
            except Exception as exc:
                logger.warning("synchronising a copy stream: %s", exc)
        self.poll()
        with self._lock:  # anything still pending failed to complete
            for queue in self._pending.values():
                while queue:
                    entry = queue.popleft()
                    entry.error = entry.error or "did not complete before shutdown"
                    self._sink.add(self._result(entry))
        self._pairs = []
