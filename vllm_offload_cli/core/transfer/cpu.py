"""The CPU copy path: vectorised gather/scatter between device rows and region rows.

It is real (CI runs it, and it stands in for the engine's copies where there
is no GPU) and asynchronous like CUDA: each direction has its own thread and
FIFO queue, and torch's kernels release the GIL while they copy.

Method. torch has no CPU operation that copies rows with both a source and a
destination index list, so each job is copied one of four ways, picked per
tensor by a cost model counted in bytes (one Python-level torch call costs
about as much as copying OP_COST_BYTES):

* slices  - one slice copy per run where source and destination both advance
            by one (a fully contiguous job is one copy);
* gather  - one `index_select(out=...)` per run of consecutive destinations:
            rows are fetched by index straight into the destination slice;
* scatter - one `index_copy_` per run of consecutive sources;
* staged  - both sides scattered: gather a bounded chunk into a staging buffer,
            then scatter it (two passes over the bytes, two calls per chunk).

Parallelism. A job of a few big calls runs on its direction thread, each call
split over torch's threads. A job of many calls (scattered blocks) would start
one parallel region per call, which is slow from a background thread (see
core.openmp); its calls are dealt instead, in order, into one share per copy
thread of a small pool whose threads run torch single-threaded.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from vllm_offload_cli.core.base.torch_import import import_torch
from vllm_offload_cli.core.transfer.openmp import single_threaded_torch
from vllm_offload_cli.core.transfer.plan import Direction, TransferPlan
from vllm_offload_cli.core.transfer.result import ResultSink, TransferResult
from vllm_offload_cli.core.transfer.views import copy_many

if TYPE_CHECKING:
    import torch
    from torch import Tensor

logger = logging.getLogger(__name__)

# What one extra torch call costs, in bytes a core copies in the same time
# (Python and dispatch, ~5 us), and what one more row of a batched row copy
# costs (a view, a C++ loop step and a cold row's page walks: measured ~6 us
# more than streaming the same 64 KiB)
OP_COST_BYTES = 64 * 1024
ROW_COST_BYTES = 64 * 1024
STAGE_BYTES = 4 * 1024 * 1024  # rows gathered per staging chunk, in bytes
# torch splits one call over its threads from 32768 elements (16-byte words:
# 512 KiB); index_select does so per row, one parallel region per row
PARALLEL_ROW_BYTES = 32768 * 16
MAX_COPY_THREADS = 16
_SCATTER_FACTOR = 1.1  # index_copy_ is a little slower per byte than index_select
METHODS = ("slices", "gather", "scatter", "staged")


def choose_method(plan: TransferPlan, row_bytes: int) -> str:
    """The cheapest way to copy `plan` for rows of `row_bytes` (ties: earliest in METHODS).

    Costs are bytes copied plus OP_COST_BYTES per torch call (ROW_COST_BYTES per
    row of a batched row copy); the staged path copies every byte twice.
    """
    if plan.joint_run_count <= 1:
        return "slices"  # one copy: nothing is cheaper
    total = plan.num_blocks * row_bytes
    k = OP_COST_BYTES
    if row_bytes >= PARALLEL_ROW_BYTES:  # gathered as batched single rows
        gather = total + plan.num_blocks * ROW_COST_BYTES
    else:
        singles = int((plan.run_lengths("dst") == 1).sum()) if plan.dst_run_count > 1 else 0
        gather = total + singles * ROW_COST_BYTES + (plan.dst_run_count - singles) * k
    costs: dict[str, float] = {
        "slices": total + plan.joint_run_count * k,
        "gather": gather,
        "staged": 2 * total + 2 * math.ceil(total / STAGE_BYTES) * k,
    }
    if _SCATTER_FACTOR * total + k < min(costs.values()):  # only then is sorting worth it
        costs["scatter"] = _SCATTER_FACTOR * total + plan.src_run_count * k
    return min((m for m in METHODS if m in costs), key=lambda m: costs[m])


class Staging:
    """A reusable scratch buffer for the two-pass path (one per copy thread)."""

    def __init__(self) -> None:
        self._buf: Tensor | None = None

    def rows(self, count: int, like: Tensor) -> Tensor:
        torch = import_torch()
        need = count * like.shape[1] * like.element_size()
        if self._buf is None or self._buf.numel() < need:
            self._buf = torch.empty(max(need, 16), dtype=torch.int8)
        view: Tensor = self._buf[:need].view(like.dtype).view(count, like.shape[1])
        return view


@dataclass(frozen=True)
class RowPair:
    """One KV tensor: its device rows and region rows, as words of the same width."""

    device: torch.Tensor
    region: torch.Tensor
    row_bytes: int

    def sides(self, direction: Direction) -> tuple[torch.Tensor, torch.Tensor]:
        """(source, destination) of a copy in `direction`."""
        if direction is Direction.STORE:
            return self.device, self.region
        return self.region, self.device


# -- units of work ---------------------------------------------------------------------

ROW_BATCH_BYTES = 8 * 1024 * 1024  # rows per torch._foreach_copy_ call, in bytes


class Unit(NamedTuple):
    """Part of a job: `work(staging)` copies `nbytes`. `pooled` units (many small
    copies) run best on the single-threaded copy threads, others as one big call."""

    nbytes: int
    work: Callable[[Staging], None]
    pooled: bool = False


def _copy(dst: Tensor, src: Tensor, staging: Staging) -> None:
    dst.copy_(src)


def _gather(src: Tensor, idx: Tensor, out: Tensor, staging: Staging) -> None:
    import_torch().index_select(src, 0, idx, out=out)


def _scatter(dst: Tensor, idx: Tensor, src: Tensor, staging: Staging) -> None:
    dst.index_copy_(0, idx, src)


def _staged(src: Tensor, src_idx: Tensor, dst: Tensor, dst_idx: Tensor,
            staging: Staging) -> None:
    rows = staging.rows(src_idx.numel(), src)
    import_torch().index_select(src, 0, src_idx, out=rows)
    dst.index_copy_(0, dst_idx, rows)


def _rows(dst: Tensor, dst_ids: list[int], src: Tensor, src_ids: list[int],
          staging: Staging) -> None:
    """Single-row copies, a batch per C++ call; row views are made here, on the copy
    thread, so making one batch overlaps another thread's copying."""
    step = max(1, ROW_BATCH_BYTES // max(1, src.shape[1] * src.element_size()))
    for a in range(0, len(dst_ids), step):
        copy_many([dst[i] for i in dst_ids[a:a + step]], [src[i] for i in src_ids[a:a + step]])


def units(pair: RowPair, plan: TransferPlan, method: str, shares: int = 1) -> list[Unit]:
    """The work that copies `plan` for one tensor by `method`: one call per run, and
    single rows batched into `shares` units."""
    src, dst = pair.sides(plan.direction)
    row = pair.row_bytes
    out: list[Unit] = []
    if plan.num_blocks == 0:
        return out
    part = functools.partial
    if method == "slices":
        for run in plan.joint_runs():
            d, s, n = run.dst, run.src, run.length
            out.append(Unit(n * row, part(_copy, dst[d:d + n], src[s:s + n])))
    elif method == "gather":
        spans = plan.dst_spans()
        firsts = plan.dst[[s.start for s in spans]].tolist()
        sources = plan.src.tolist()
        row_dst: list[int] = []
        row_src: list[int] = []
        for span, first in zip(spans, firsts, strict=True):
            n = span.stop - span.start
            if n == 1 or row >= PARALLEL_ROW_BYTES:
                # one row, or rows so big that index_select would start a parallel
                # region per row: plain row copies, batched below
                row_dst += range(first, first + n)
                row_src += sources[span.start:span.stop]
                continue
            out.append(Unit(n * row, part(_gather, src, plan.src[span.start:span.stop],
                                          dst[first:first + n])))
        per = -(-len(row_dst) // max(1, shares)) if row_dst else 1
        for a in range(0, len(row_dst), per):
            ids = row_dst[a:a + per]
            out.append(Unit(len(ids) * row, part(_rows, dst, ids, src, row_src[a:a + per]),
                            pooled=True))
    elif method == "scatter":
        targets = plan.dst_by_src
        spans = plan.src_spans()
        firsts = plan.src_sorted[[s.start for s in spans]].tolist()
        for span, first in zip(spans, firsts, strict=True):
            n = span.stop - span.start
            out.append(Unit(n * row, part(_scatter, dst, targets[span.start:span.stop],
                                          src[first:first + n])))
    elif method == "staged":
        chunk = max(1, STAGE_BYTES // row)
        for a in range(0, plan.num_blocks, chunk):
            n = min(chunk, plan.num_blocks - a)
            out.append(Unit(n * row, part(_staged, src, plan.src[a:a + n], dst,
                                          plan.dst[a:a + n])))
    else:
        raise ValueError(f"unknown copy method {method!r}")
    return out


def copy_rows(pair: RowPair, plan: TransferPlan, method: str, staging: Staging) -> None:
    """dst[plan.dst[i]] = src[plan.src[i]] for every pair of blocks, on this thread."""
    for unit in units(pair, plan, method):
        unit.work(staging)


def deal(work: Sequence[Unit], shares: int) -> list[list[Unit]]:
    """Cut `work` into at most `shares` consecutive groups of about equal bytes."""
    total = sum(u.nbytes for u in work)
    if shares <= 1 or len(work) <= 1 or total == 0:
        return [list(work)] if work else []
    target = total / shares
    groups: list[list[Unit]] = [[]]
    size = 0
    for unit in work:
        if size >= target * len(groups) and len(groups) < shares:
            groups.append([])
        groups[-1].append(unit)
        size += unit.nbytes
    return groups


_STOP = object()


class CpuBackend:
    """One thread and one FIFO queue per direction; a job is split over the copy threads."""

    def __init__(self, pairs: Sequence[RowPair], sink: ResultSink,
                 job_bytes: Callable[[TransferPlan], int],
                 threads: int | None = None) -> None:
        torch = import_torch()
        self._pairs = list(pairs)
        self._sink = sink
        self._job_bytes = job_bytes
        self.threads = max(1, min(MAX_COPY_THREADS, threads or torch.get_num_threads()))
        self._local = threading.local()
        self._pool = (ThreadPoolExecutor(self.threads, thread_name_prefix="vllm-offload-copy",
                                         initializer=single_threaded_torch)
                      if self.threads > 1 else None)
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
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pairs = []

    def _staging(self) -> Staging:
        staging: Staging | None = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = Staging()
        return staging

    def _run_share(self, share: list[Unit]) -> None:
        staging = self._staging()
        for unit in share:
            unit.work(staging)

    def _serve(self, direction: Direction) -> None:
        q = self._queues[direction]
        while True:
            item = q.get()
            if item is _STOP:
                return
            assert isinstance(item, TransferPlan)
            self._sink.add(self._run(item))

    def _copy(self, plan: TransferPlan) -> str:
        used: list[str] = []
        work: list[Unit] = []
        for pair in self._pairs:
            method = choose_method(plan, pair.row_bytes)
            work += units(pair, plan, method, self.threads)
            if method not in used:
                used.append(method)
        if self._pool is None or (len(work) <= self.threads
                                  and not any(u.pooled for u in work)):
            self._run_share(work)  # a few big calls: torch's own threads split each one
            return "+".join(used)
        futures: list[Future[None]] = [self._pool.submit(self._run_share, s)
                                       for s in deal(work, self.threads)]
        errors = [f.exception() for f in futures]  # wait for all: none may outlive the job
        first_error = next((e for e in errors if e is not None), None)
        if first_error is not None:
            raise first_error
        return "+".join(used)

    def _run(self, plan: TransferPlan) -> TransferResult:
        nbytes = self._job_bytes(plan)
        if self._cancel.is_set():
            return TransferResult(plan.job_id, plan.direction, False, nbytes, 0.0,
                                  plan.num_blocks, error="cancelled: the copy worker shut "
                                  "down before this job started")
        start = time.perf_counter()
        try:
            method = self._copy(plan)
        except Exception as exc:  # reported as a failed job, never dropped
            logger.warning("%s job %d failed: %s", plan.direction.value, plan.job_id, exc)
            return TransferResult(plan.job_id, plan.direction, False, nbytes,
                                  time.perf_counter() - start, plan.num_blocks,
                                  error=f"{type(exc).__name__}: {exc}")
        return TransferResult(plan.job_id, plan.direction, True, nbytes,
                              time.perf_counter() - start, plan.num_blocks, method=method)
