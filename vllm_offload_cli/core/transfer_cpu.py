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
# torch runs an operation on all its threads only from 32768 elements (16-byte
# words: 512 KiB); a smaller call runs on one thread, at 1/threads of the speed
PARALLEL_BYTES = 32768 * 16
_SCATTER_FACTOR = 1.1  # index_copy_ is a little slower per byte than index_select
METHODS = ("slices", "gather", "scatter", "staged")


def _calls_cost(plan: TransferPlan, kind: str, count: int, row_bytes: int,
                threads: int) -> float:
    """Cost in bytes of one call per run of `kind`: overhead plus bytes at their speed."""
    if count == 1:
        total = plan.num_blocks * row_bytes
        return OP_COST_BYTES + total * (threads if total < PARALLEL_BYTES else 1)
    lengths = plan.run_lengths(kind)
    short = lengths * row_bytes < PARALLEL_BYTES
    weighted = int((lengths * (1 + short * (threads - 1))).sum())
    return count * OP_COST_BYTES + weighted * row_bytes


def choose_method(plan: TransferPlan, row_bytes: int, threads: int | None = None) -> str:
    """The cheapest way to copy `plan` for rows of `row_bytes` (ties: earliest in METHODS).

    Costs are counted in bytes copied at full (all-threads) speed: each Python-level
    call adds OP_COST_BYTES, and a call too small to go parallel moves its bytes at
    single-thread speed. The staged path moves every byte twice, in big parallel calls.
    """
    if plan.joint_run_count <= 1:
        return "slices"  # one copy: nothing is cheaper
    t = max(1, threads if threads is not None else import_torch().get_num_threads())
    total = plan.num_blocks * row_bytes
    costs: dict[str, float] = {
        "slices": _calls_cost(plan, "joint", plan.joint_run_count, row_bytes, t),
        "gather": _calls_cost(plan, "dst", plan.dst_run_count, row_bytes, t),
        "staged": 2 * total + 2 * math.ceil(total / STAGE_BYTES) * OP_COST_BYTES,
    }
    if _SCATTER_FACTOR * total + OP_COST_BYTES < min(costs.values()):
        # only now is sorting by source worth its price
        costs["scatter"] = _SCATTER_FACTOR * _calls_cost(plan, "src", plan.src_run_count,
                                                         row_bytes, t)
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
    """One KV tensor: its device rows and region rows, as words of the same width.

    Words also keep small copies on one thread: torch splits an operation over
    its threads by element count (32768 and up), and a fork/join per block
    costs more than the block when other processes hold the cores (measured:
    a 64 KiB int8 row copy took 400 us on two threads of a busy host, 13 us
    on one). Long runs and many-row index operations are still parallel.
    """

    device: torch.Tensor
    region: torch.Tensor
    row_bytes: int

    def sides(self, direction: Direction) -> tuple[torch.Tensor, torch.Tensor]:
        """(source, destination) of a copy in `direction`."""
        if direction is Direction.STORE:
            return self.device, self.region
        return self.region, self.device


def copy_rows(pair: RowPair, plan: TransferPlan, method: str, staging: Staging) -> None:
    """dst[plan.dst[i]] = src[plan.src[i]] for every pair of blocks, by `method`."""
    torch = import_torch()
    if plan.num_blocks == 0:
        return
    src, dst = pair.sides(plan.direction)
    if method == "slices":
        for run in plan.joint_runs():
            dst[run.dst:run.dst + run.length].copy_(src[run.src:run.src + run.length])
    elif method == "gather":
        spans = plan.dst_spans()
        firsts = plan.dst[[s.start for s in spans]].tolist()
        sources = plan.src.tolist()
        for span, first in zip(spans, firsts, strict=True):
            length = span.stop - span.start
            if length == 1:  # one row: a plain copy is the cheapest call
                dst[first].copy_(src[sources[span.start]])
                continue
            torch.index_select(src, 0, plan.src[span.start:span.stop],
                               out=dst[first:first + length])
    elif method == "scatter":
        targets = plan.dst_by_src
        spans = plan.src_spans()
        firsts = plan.src_sorted[[s.start for s in spans]].tolist()
        for span, first in zip(spans, firsts, strict=True):
            length = span.stop - span.start
            dst.index_copy_(0, targets[span.start:span.stop], src[first:first + length])
    elif method == "staged":
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
