"""The CPU copy path: vectorised gather/scatter between device rows and region rows.

It is real (CI runs it, and it stands in for the engine's copies where there
is no GPU) and asynchronous like CUDA: each direction has its own thread and
FIFO queue, and torch's copy kernels release the GIL while they run.

torch has no CPU operation that copies rows with both a source and a
destination index list, so each job is copied one of four ways, picked per
tensor by a cost model counted in bytes (one Python-level torch call costs
about as much as copying OP_COST_BYTES):

* slices  - one slice copy per run where source and destination both advance
            by one (a fully contiguous job is one copy);
* gather  - one `index_select(out=...)` per run of consecutive destinations:
            rows are fetched by index straight into the destination slice;
* scatter - one `index_copy_` per run of consecutive sources;
* staged  - both sides scattered: gather a bounded chunk into a staging buffer,
            then scatter it (two passes over the bytes, but two calls per chunk).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_offload_cli.core.torch_import import import_torch
from vllm_offload_cli.core.transfer_plan import Direction, TransferPlan
from vllm_offload_cli.core.transfer_result import ResultSink, TransferResult

if TYPE_CHECKING:
    import torch
    from torch import Tensor

logger = logging.getLogger(__name__)

OP_COST_BYTES = 48 * 1024  # bytes a CPU copies in the time one torch call costs from Python
STAGE_BYTES = 4 * 1024 * 1024  # staging chunk of the two-pass path, per direction
_SCATTER_FACTOR = 1.1  # index_copy_ is a little slower per byte than index_select
METHODS = ("slices", "gather", "scatter", "staged")


def choose_method(plan: TransferPlan, row_bytes: int) -> str:
    """The cheapest way to copy `plan` for rows of `row_bytes` (ties: earliest in METHODS)."""
    total = plan.num_blocks * row_bytes
    k = OP_COST_BYTES
    if plan.joint_run_count <= 1:
        return "slices"  # one copy: nothing is cheaper
    costs: dict[str, float] = {
        "slices": total + plan.joint_run_count * k,
        "gather": total + plan.dst_run_count * k,
        "staged": 2 * total + 2 * math.ceil(total / STAGE_BYTES) * k,
    }
    best = min(costs.values())
    if _SCATTER_FACTOR * total + k < best:  # only then is sorting by source worth it
        costs["scatter"] = _SCATTER_FACTOR * total + plan.src_run_count * k
    return min((m for m in METHODS if m in costs), key=lambda m: costs[m])


class Staging:
    """A reusable scratch buffer for the two-pass path (one per direction thread)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def rows(self, count: int, like: torch.Tensor) -> torch.Tensor:
        torch = import_torch()
        need = count * like.shape[1] * like.element_size()
        if self._buf is None or self._buf.numel() < need:
            self._buf = torch.empty(max(need, 16), dtype=torch.int8)
        view: Tensor = self._buf[:need].view(like.dtype).view(count, like.shape[1])
        return view


@dataclass(frozen=True)
class RowPair:
    """One KV tensor: its device rows and region rows, as int8 and as wider words.

    Slice copies use the int8 views: torch parallelises a copy over threads by
    element count, so more elements per row means more threads per row.
    Indexed kernels use the word views: they move one element per step.
    """

    device: torch.Tensor
    region: torch.Tensor
    device_words: torch.Tensor
    region_words: torch.Tensor

    @property
    def row_bytes(self) -> int:
        return int(self.device.shape[1])

    def sides(self, direction: Direction, words: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(source, destination) of a copy in `direction`."""
        dev, reg = (self.device_words, self.region_words) if words else (self.device, self.region)
        return (dev, reg) if direction is Direction.STORE else (reg, dev)


def copy_rows(pair: RowPair, plan: TransferPlan, method: str, staging: Staging) -> None:
    """dst[plan.dst[i]] = src[plan.src[i]] for every pair of blocks, by `method`."""
    torch = import_torch()
    if plan.num_blocks == 0:
        return
    if method == "slices":
        src, dst = pair.sides(plan.direction, words=False)
        for run in plan.joint_runs():
            dst[run.dst:run.dst + run.length].copy_(src[run.src:run.src + run.length])
    elif method == "gather":
        src, dst = pair.sides(plan.direction, words=True)
        src_b, dst_b = pair.sides(plan.direction, words=False)
        spans = plan.dst_spans()
        firsts = plan.dst[[s.start for s in spans]].tolist()
        sources = plan.src.tolist()
        for span, first in zip(spans, firsts, strict=True):
            length = span.stop - span.start
            if length == 1:  # one row: a plain copy, parallel within the row
                dst_b[first].copy_(src_b[sources[span.start]])
                continue
            torch.index_select(src, 0, plan.src[span.start:span.stop],
                               out=dst[first:first + length])
    elif method == "scatter":
        src, dst = pair.sides(plan.direction, words=True)
        targets = plan.dst_by_src
        spans = plan.src_spans()
        firsts = plan.src_sorted[[s.start for s in spans]].tolist()
        for span, first in zip(spans, firsts, strict=True):
            length = span.stop - span.start
            dst.index_copy_(0, targets[span.start:span.stop], src[first:first + length])
    elif method == "staged":
        src, dst = pair.sides(plan.direction, words=True)
        chunk = max(1, STAGE_BYTES // pair.row_bytes)
        for start in range(0, plan.num_blocks, chunk):
            stop = min(start + chunk, plan.num_blocks)
            rows = staging.rows(stop - start, src)
            torch.index_select(src, 0, plan.src[start:stop], out=rows)
            dst.index_copy_(0, plan.dst[start:stop], rows)
    else:
        raise ValueError(f"unknown copy method {method!r}")


def copy_plan(pairs: Sequence[RowPair], plan: TransferPlan, staging: Staging) -> str:
    """Copy every tensor of a job; returns the method(s) used."""
    used: list[str] = []
    for pair in pairs:
        method = choose_method(plan, pair.row_bytes)
        copy_rows(pair, plan, method, staging)
        if method not in used:
            used.append(method)
    return "+".join(used)


_STOP = object()


class CpuBackend:
    """One thread and one FIFO queue per direction; results go to the sink."""

    def __init__(self, pairs: Sequence[RowPair], sink: ResultSink,
                 job_bytes: Callable[[TransferPlan], int]) -> None:
        self._pairs = list(pairs)
        self._sink = sink
        self._job_bytes = job_bytes
        self._cancel = threading.Event()
        self._queues: dict[Direction, queue.SimpleQueue[object]] = {}
        self._threads: dict[Direction, threading.Thread] = {}
        for direction in Direction:
            self._queues[direction] = queue.SimpleQueue()
            thread = threading.Thread(target=self._serve, args=(direction,), daemon=True,
                                      name=f"vllm-offload-{direction.value}")
            self._threads[direction] = thread
            thread.start()

    def submit(self, plan: TransferPlan) -> None:
        self._queues[plan.direction].put(plan)

    def poll(self) -> None:
        """Nothing to do: the threads report as they finish."""

    def wait(self, job_ids: set[int], timeout: float | None) -> bool:
        return self._sink.wait(job_ids, timeout)

    def close(self, cancel_pending: bool) -> None:
        """Finish (or cancel) what is queued, then stop the threads."""
        if cancel_pending:
            self._cancel.set()
        for direction in Direction:
            self._queues[direction].put(_STOP)
        for thread in self._threads.values():
            thread.join()
        self._pairs = []

    def _serve(self, direction: Direction) -> None:
        staging = Staging()
        q = self._queues[direction]
        while True:
            item = q.get()
            if item is _STOP:
                return
            assert isinstance(item, TransferPlan)
            self._sink.add(self._run(item, staging))

    def _run(self, plan: TransferPlan, staging: Staging) -> TransferResult:
        nbytes = self._job_bytes(plan)
        if self._cancel.is_set():
            return TransferResult(plan.job_id, plan.direction, False, nbytes, 0.0,
                                  plan.num_blocks, error="cancelled: the copy worker shut "
                                  "down before this job started")
        start = time.perf_counter()
        try:
            method = copy_plan(self._pairs, plan, staging)
        except Exception as exc:  # reported as a failed job, never dropped
            logger.warning("%s job %d failed: %s", plan.direction.value, plan.job_id, exc)
            return TransferResult(plan.job_id, plan.direction, False, nbytes,
                                  time.perf_counter() - start, plan.num_blocks,
                                  error=f"{type(exc).__name__}: {exc}")
        return TransferResult(plan.job_id, plan.direction, True, nbytes,
                              time.perf_counter() - start, plan.num_blocks, method=method)
