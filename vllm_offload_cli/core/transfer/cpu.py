"""The CPU copy path: block copies between device rows and region rows, on copy threads.

It is real (CI runs it, and it stands in for the engine's copies where there
is no GPU) and asynchronous like CUDA: each direction is a lane (transfer.lane),
a FIFO of jobs with its own copy threads.

Method. Each job is copied one of five ways, picked per tensor by measured
costs (transfer.costs: a short calibration, once per process):

* slices  - one slice copy per run where source and destination both advance
            by one (a fully contiguous job is one copy);
* gather  - one `index_select(out=...)` per run of consecutive destinations;
* scatter - one `index_copy_` per run of consecutive sources;
* staged  - gather a bounded chunk into a staging buffer, then scatter it;
* batched - every run or block one piece of a batched copy (transfer.batch: a
            chain of memcpy calls run by one swapcontext, memcpy per piece
            through cffi or ctypes, or process_vm_readv; the GIL released): one
            pass over the bytes however both sides are scattered.

Parallelism. Every job is cut into units that shrink from a third of what is
left to 256 KiB (unit_cuts), which the lane's threads take as they free up,
each running torch single-threaded: a parallel region started from a
background thread is slow (see core.openmp), few big units mean few trips
through the GIL, and small last ones keep both cores streaming to the end of
a job, contiguous or scattered.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_offload_cli.core.base.torch_import import import_torch
from vllm_offload_cli.core.transfer import batch
from vllm_offload_cli.core.transfer.costs import (
    METHODS,
    STAGE_BYTES,
    CopyCosts,
    calibrate,
    measured,
)
from vllm_offload_cli.core.transfer.costs import choose_method as _choose
from vllm_offload_cli.core.transfer.lane import Lane
from vllm_offload_cli.core.transfer.openmp import single_threaded_torch
from vllm_offload_cli.core.transfer.plan import Direction, TransferPlan
from vllm_offload_cli.core.transfer.result import ResultSink, TransferResult

if TYPE_CHECKING:
    import torch
    from torch import Tensor

__all__ = ["METHODS", "CpuBackend", "RowPair", "Staging", "choose_method",
           "copy_rows", "units"]

logger = logging.getLogger(__name__)

MAX_COPY_THREADS = 16
SMALLEST_UNIT_BYTES = 256 * 1024  # per tensor: the last units of a job (see unit_cuts)


def choose_method(plan: TransferPlan, pair: RowPair, costs: CopyCosts | None = None,
                  threads: int = 1) -> str:
    """The cheapest method for one tensor of `plan` on `threads` copy threads; calibrates
    on first need."""
    if plan.joint_run_count <= 1:
        return "slices"  # one copy: nothing is cheaper, and nothing to measure
    return _choose(plan, pair.row_bytes, pair.dense, costs or calibrate(), threads)


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

    @property
    def dense(self) -> bool:
        """Are consecutive rows adjacent on both sides (a run of blocks is one piece)?"""
        return all(t.stride(0) * t.element_size() == self.row_bytes
                   for t in (self.device, self.region))


# -- units of work ---------------------------------------------------------------------


UnitWork = Callable[[Staging], None]  # copies one part of a job, given the thread's scratch


def _copy_run(dst: Tensor, src: Tensor, d: int, s: int, n: int, staging: Staging) -> None:
    dst[d:d + n].copy_(src[s:s + n])


def _gather(src: Tensor, idx: Tensor, out: Tensor, staging: Staging) -> None:
    import_torch().index_select(src, 0, idx, out=out)


def _scatter(dst: Tensor, idx: Tensor, src: Tensor, staging: Staging) -> None:
    dst.index_copy_(0, idx, src)


def _staged(src: Tensor, src_idx: Tensor, dst: Tensor, dst_idx: Tensor,
            staging: Staging) -> None:
    rows = staging.rows(src_idx.numel(), src)
    import_torch().index_select(src, 0, src_idx, out=rows)
    dst.index_copy_(0, dst_idx, rows)


def _batched(chunk: batch.Chunk, mechanism: str, staging: Staging) -> None:
    batch.copy_chunk(chunk, mechanism)


@functools.lru_cache(maxsize=64)
def unit_cuts(n: int, threads: int, smallest: int) -> tuple[int, ...]:
    """Positions in (0, n) where a job of `n` rows is cut for `threads` copy threads.

    Guided scheduling: each unit is about the rows still left / (threads + 1), never
    under `smallest` rows. Big units first mean few trips back to Python (each needs
    the GIL, which the engine's own thread may hold for milliseconds); small units
    last mean the threads finish within a small unit of each other. Against 16 equal
    units per thread: 13 units instead of 32 for a 128 MiB job on 2 threads, and a
    tail of one 256 KiB unit instead of one 4 MiB unit (measured: threads finished
    0.4-0.6 ms apart on 64 KiB scattered blocks). Cached: an engine submits jobs of
    a few sizes, and the loop costs tens of microseconds with the caches cold.
    """
    cuts: list[int] = []
    if threads <= 1:
        return ()
    done = 0
    while True:
        done += max(smallest, 1, -(-(n - done) // (threads + 1)))
        if done >= n:
            return tuple(cuts)
        cuts.append(done)


def _split(start: int, stop: int, cuts: Sequence[int]) -> list[tuple[int, int]]:
    """[start, stop) cut at the positions of `cuts` (ascending) that fall inside it."""
    inner = cuts[bisect.bisect_right(cuts, start):bisect.bisect_left(cuts, stop)]
    return list(itertools.pairwise([start, *inner, stop]))


def pieces_of(pair: RowPair, plan: TransferPlan) -> batch.Pieces:
    """The job as batched-copy pieces: one per joint run where rows are dense, else one
    per block. Destinations are distinct rows (the plan checked that) of tensors that
    cannot alias (a device tensor and a mapping), so overlap is not searched again."""
    import numpy as np

    src, dst = pair.sides(plan.direction)
    if pair.dense and plan.joint_run_count < plan.num_blocks:
        starts = plan.run_starts("joint")
        lengths = plan.run_lengths("joint") * pair.row_bytes
        return batch.make_pieces(batch.row_addresses(dst, plan.dst_ids[starts]),
                                 batch.row_addresses(src, plan.src_ids[starts]),
                                 lengths, check_overlap=False)
    return batch.make_pieces(batch.row_addresses(dst, plan.dst_ids),
                             batch.row_addresses(src, plan.src_ids),
                             np.full(plan.num_blocks, pair.row_bytes, dtype=np.int64),
                             check_overlap=False)


def units(pair: RowPair, plan: TransferPlan, method: str, threads: int = 1,
          mechanism: str | None = None, smallest: int = SMALLEST_UNIT_BYTES) -> list[UnitWork]:
    """The work that copies `plan` for one tensor by `method` on `threads` copy threads:
    one call per run, runs cut where `unit_cuts` says (positions in the method's order)."""
    src, dst = pair.sides(plan.direction)
    row = pair.row_bytes
    n = plan.num_blocks
    out: list[UnitWork] = []
    if n == 0:
        return out
    cuts = unit_cuts(n, threads, max(1, smallest // row))
    part = functools.partial
    if method == "slices":
        at = 0
        for run in plan.joint_runs():
            # views are cut by the copy thread that takes the unit: planning, on the
            # submit path, stays a few list operations however long the run
            for a, b in _split(at, at + run.length, cuts):
                out.append(part(_copy_run, dst, src, run.dst + a - at, run.src + a - at,
                                b - a))
            at += run.length
    elif method == "gather":
        for span, first in zip(plan.dst_spans(), plan.dst_run_firsts(), strict=True):
            for a, b in _split(span.start, span.stop, cuts):
                d = first + a - span.start
                out.append(part(_gather, src, plan.src[a:b], dst[d:d + b - a]))
    elif method == "scatter":
        targets = plan.dst_by_src
        for span, first in zip(plan.src_spans(), plan.src_run_firsts(), strict=True):
            for a, b in _split(span.start, span.stop, cuts):
                s = first + a - span.start
                out.append(part(_scatter, dst, targets[a:b], src[s:s + b - a]))
    elif method == "staged":
        stage = max(1, STAGE_BYTES // row)
        bounds = sorted({*cuts, *range(stage, n, stage)})
        for a, b in _split(0, n, bounds):
            out.append(part(_staged, src, plan.src[a:b], dst, plan.dst[a:b]))
    elif method == "batched":
        chosen = mechanism or next(iter(batch.available_mechanisms()), None)
        if chosen is None:
            raise RuntimeError("no batched copy mechanism works here")
        for chunk in pieces_of(pair, plan).chunks_at([c * row for c in cuts]):
            out.append(part(_batched, chunk, chosen))
    else:
        raise ValueError(f"unknown copy method {method!r}")
    return out


def copy_rows(pair: RowPair, plan: TransferPlan, method: str, staging: Staging,
              mechanism: str | None = None, threads: int = 1,
              smallest: int = SMALLEST_UNIT_BYTES) -> None:
    """dst[plan.dst[i]] = src[plan.src[i]] for every pair of blocks, on this thread (cut
    into the units `threads` copy threads would share)."""
    for unit in units(pair, plan, method, threads, mechanism, smallest):
        unit(staging)


class Job:
    """A job in a lane: its plan, and how it was copied once planned."""

    __slots__ = ("methods", "plan")

    def __init__(self, plan: TransferPlan, methods: str = "") -> None:
        self.plan = plan
        self.methods = methods  # what the result reports, e.g. "batched:cffi"


class CpuBackend:
    """One lane per direction (transfer.lane): a FIFO of jobs and `threads` copy threads
    that share each job's units."""

    def __init__(self, pairs: Sequence[RowPair], sink: ResultSink,
                 job_bytes: Callable[[TransferPlan], int],
                 threads: int | None = None, costs: CopyCosts | None = None) -> None:
        torch = import_torch()
        self._costs = costs  # None: measured once per process, by the first job with a choice
        self._pairs = list(pairs)
        self._sink = sink
        self._job_bytes = job_bytes
        self.threads = max(1, min(MAX_COPY_THREADS, threads or torch.get_num_threads()))
        self._lanes = {
            direction: Lane[Job, Staging](
                f"vllm-offload-{direction.value}", self.threads, plan=self._plan_late,
                finish=self._finish, cancelled=self._cancelled, context=Staging,
                setup=single_threaded_torch)
            for direction in Direction}

    def submit(self, plan: TransferPlan) -> None:
        job, work = self._prepare_early(plan)
        self._lanes[plan.direction].put(job, work)

    def _prepare_early(self, plan: TransferPlan) -> tuple[Job, list[UnitWork] | None]:
        """Cut the job into units now, on the caller's thread, so that a job queued behind
        another starts copying the moment that one ends (planning costs a few hundred
        microseconds, several times more on a copy thread whose caches the last job just
        flushed). Left to a copy thread while the costs are not measured yet (the first
        job measures them, ~0.3 s, which a submit must not wait for) and when planning
        fails (the copy thread plans again and reports the failure as the job's result)."""
        job = Job(plan)
        known = self._costs or measured()
        if known is None and plan.joint_run_count > 1:  # one run needs no costs
            return job, None
        try:
            return job, self._prepare(job, known)
        except Exception as exc:
            logger.debug("job %d: planning deferred to the copy thread: %s", plan.job_id, exc)
            return job, None

    def _plan_late(self, job: Job) -> list[UnitWork]:
        return self._prepare(job, self._costs)

    def _prepare(self, job: Job, known: CopyCosts | None) -> list[UnitWork]:
        used: list[str] = []
        work: list[UnitWork] = []
        for pair in self._pairs:
            method = choose_method(job.plan, pair, known, self.threads)
            mechanism = None
            if method == "batched":
                mechanism = (known or calibrate()).mechanism
                method = f"batched:{mechanism}"
            work += units(pair, job.plan, method.partition(":")[0], self.threads, mechanism)
            if method not in used:
                used.append(method)
        job.methods = "+".join(used)
        return work

    def poll(self) -> None:
        """Nothing to do: the threads report as they finish."""

    def wait(self, job_ids: set[int], timeout: float | None) -> bool:
        return self._sink.wait(job_ids, timeout)

    def close(self, cancel_pending: bool) -> None:
        """Finish (or cancel) what is queued, then stop the threads."""
        for lane in self._lanes.values():
            lane.close(cancel_pending)
        self._pairs = []

    # -- what the lanes report ----------------------------------------------------------

    def _finish(self, job: Job, error: BaseException | None, seconds: float) -> None:
        plan = job.plan
        if error is not None:  # reported as a failed job, never dropped
            logger.warning("%s job %d failed: %s", plan.direction.value, plan.job_id, error)
        self._sink.add(TransferResult(
            plan.job_id, plan.direction, error is None, self._job_bytes(plan), seconds,
            plan.num_blocks, method=job.methods if error is None else "",
            error=None if error is None else f"{type(error).__name__}: {error}"))

    def _cancelled(self, job: Job) -> None:
        plan = job.plan
        self._sink.add(TransferResult(plan.job_id, plan.direction, False,
                                      self._job_bytes(plan), 0.0, plan.num_blocks,
                                      error="cancelled: the copy worker shut down before "
                                      "this job started"))
