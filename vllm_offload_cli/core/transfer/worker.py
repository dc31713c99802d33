"""CopyWorker: moves KV blocks between device tensors and one worker's slot of a region;
every job is reported once by `get_finished()`, in submission order per direction."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm_offload_cli.core.base.errors import InvalidInputError, OperationFailedError
from vllm_offload_cli.core.base.extras import COPY, import_torch, require
from vllm_offload_cli.core.base.units import is_int
from vllm_offload_cli.core.transfer import pinning
from vllm_offload_cli.core.transfer.copies import TensorPair, as_words, copy_job, word_width
from vllm_offload_cli.core.transfer.jobs import CopyJob, Direction, make_job
from vllm_offload_cli.core.transfer.lanes import ResultSink, StreamLane, ThreadLane, TransferResult

if TYPE_CHECKING:
    from concurrent.futures import Executor

    import torch
    from torch import Tensor

    from vllm_offload_cli.core.region.shared_region import SharedOffloadRegion

logger = logging.getLogger(__name__)

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
        self._pin_state: pinning.PinState | None = None
        self._region: SharedOffloadRegion | None = region
        self._lock = threading.Lock()
        self._closed = False
        self._sink = ResultSink()
        self._pairs = [self._pair(dev, reg) for dev, reg in zip(rows, self.region_views,
                                                                strict=True)]
        if self.device.type == "cuda" and pin:
            self._pin(region)
        self._lanes: dict[Direction, ThreadLane | StreamLane] = {
            d: ThreadLane(d, self._copy, self._sink, self.bytes_per_block)
            if self.device.type == "cpu"
            else StreamLane(d, self._copy, self._sink, self.bytes_per_block, self.device)
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

    def _pair(self, dev: torch.Tensor, reg: torch.Tensor) -> TensorPair:
        width = word_width(dev, reg)
        return TensorPair(device=as_words(dev, width), region=as_words(reg, width),
                          row_bytes=dev.shape[1], one_device=dev.device == reg.device)

    def _copy(self, job: CopyJob, helper: Executor | None) -> str:
        return copy_job(self._pairs, job, non_blocking=self.device.type == "cuda",
                        helper=helper)

    def _pin(self, region: SharedOffloadRegion) -> None:
        if not region.is_pinned:  # else another worker of this process pinned it: enough
            storage = self.region_views[0].untyped_storage()
            state = pinning.pin(storage.data_ptr(), storage.nbytes(),
                                region.geometry.row_stride, device_index=self.device.index)
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
            if self._sink.known(job_id):
                raise InvalidInputError(f"job id {job_id} is still in flight or its result "
                                        "was not collected yet", code="duplicate_job_id")
            self._sink.expect(job_id)
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
        if region is not None:
            region.remove_close_callback(self.shutdown)
        if self._pin_state is not None:
            for problem in pinning.unpin(self._pin_state):
                logger.warning("%s", problem)
            self._pin_state = None
            if region is not None:
                region.is_pinned = False

    def __enter__(self) -> CopyWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (f"CopyWorker(device={self.device}, tensors={len(self.row_bytes)}, "
                f"bytes_per_block={self.bytes_per_block}, pinned={self.pinned})")
