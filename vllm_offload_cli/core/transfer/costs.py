"""What each CPU copy method costs here, measured once, and the per-job choice it drives.

The CPU path can copy a job several ways (see transfer.cpu); which is fastest
depends on the machine (call overhead, the C library's memcpy against torch's
copy loop, how the kernel copies for process_vm_readv), so it is measured, not
assumed. A calibration of a few tenths of a second, once per process and on
a copy thread like the ones that do the work, times each primitive on two
shapes of the same bytes (few big pieces, many small ones) and solves

    seconds = calls * per_call + rows * per_row + bytes * per_byte

for its costs. choose_method then prices every method for a job and takes
the cheapest. Buffers are bigger than a core's caches so that per-byte costs
are those of memory, as in a real job.

One pass over the same bytes costs about the same whichever primitive makes it
(single-threaded, 256 KiB .. 2 MiB pieces: within ~15 %), while a short
calibration on a shared host misjudges one primitive's rate by up to 2x. So
the per-byte cost is shared: the median of the primitives' own figures. What
tells the methods apart is what each measures for itself, robustly: its cost
per call, per row and per piece, and how many passes it makes (staged: two).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from vllm_offload_cli.core.base.torch_import import import_torch
from vllm_offload_cli.core.transfer import batch
from vllm_offload_cli.core.transfer.openmp import single_threaded_torch

if TYPE_CHECKING:
    from vllm_offload_cli.core.transfer.plan import TransferPlan

logger = logging.getLogger(__name__)

METHODS = ("slices", "gather", "scatter", "staged", "batched")
STAGE_BYTES = 4 * 1024 * 1024  # rows gathered per staging chunk, in bytes
CALIBRATION_BYTES = 16 * 1024 * 1024  # per buffer: more than a core's caches
_BIG, _SMALL = 256 * 1024, 8 * 1024  # piece sizes of the two shapes
_ROUNDS = 5


@dataclass(frozen=True)
class Cost:
    """Seconds = calls * per_call + rows * per_row + bytes * per_byte (one thread)."""

    per_call: float
    per_row: float
    per_byte: float

    def seconds(self, calls: int, rows: int, nbytes: int) -> float:
        return calls * self.per_call + rows * self.per_row + nbytes * self.per_byte


@dataclass(frozen=True)
class CopyCosts:
    """Measured costs of the primitives; `mechanism` is the batched copy that won, if any."""

    copy: Cost  # Tensor.copy_ of a slice (one call per run of blocks)
    gather: Cost  # index_select(out=) into consecutive rows
    scatter: Cost  # index_copy_ from consecutive rows
    batched: Cost | None  # pieces copied by `mechanism`, one piece per call
    mechanism: str | None
    mechanisms: tuple[str, ...]  # every mechanism that works here
    seconds: float  # what the calibration took

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        for name in ("copy", "gather", "scatter", "batched"):
            cost = doc[name]
            if cost is not None:
                doc[name] = {"per_call_us": round(cost["per_call"] * 1e6, 3),
                             "per_row_us": round(cost["per_row"] * 1e6, 3),
                             "per_byte_ns": round(cost["per_byte"] * 1e9, 5)}
        doc["mechanisms"] = list(self.mechanisms)
        doc["seconds"] = round(self.seconds, 4)
        return doc


_GIL_FREE_PIECES = ("ucontext", "vm-readv")  # one call copies every piece of a chunk


def _turns(cost: Cost, threads: int) -> Cost:
    """`cost` with its calls priced as `threads` threads taking turns at the GIL."""
    return dataclasses.replace(cost, per_call=cost.per_call * threads)


def job_costs(plan: TransferPlan, row_bytes: int, dense: bool, costs: CopyCosts,
              threads: int = 1) -> dict[str, float]:
    """Predicted seconds of each method for one tensor of `plan` (one thread's worth).

    `dense`: rows are adjacent on both sides, so a joint run is one batched piece.
    `threads`: copy threads that share the job. The calibration runs on one thread,
    but every torch call and every piece a Python loop calls holds the GIL for part
    of its time, so threads sharing a job take turns at it: such calls are priced
    `threads` times, while bytes, rows and a context chain's pieces (no GIL between
    them) or process_vm_readv's (one syscall) run side by side. Measured: with a
    one-thread price, a 64 KiB scattered job took one gather per destination run
    and ran at half the speed of memcpy on two threads.
    """
    n = plan.num_blocks
    total = n * row_bytes
    runs = plan.joint_run_count
    if runs <= 1:  # one run is one copy: nothing is cheaper
        return {"slices": costs.copy.seconds(1, 0, total)}
    copy, gather, scatter = (_turns(c, threads) for c in (costs.copy, costs.gather,
                                                           costs.scatter))
    chunks = math.ceil(total / STAGE_BYTES)
    out = {
        "slices": copy.seconds(runs, 0, total),
        "gather": gather.seconds(plan.dst_run_count, n, total),
        "staged": gather.seconds(chunks, n, total) + scatter.seconds(chunks, n, total),
    }
    if costs.batched is not None:
        batched = (costs.batched if costs.mechanism in _GIL_FREE_PIECES
                   else _turns(costs.batched, threads))
        out["batched"] = batched.seconds(runs if dense else n, 0, total)
    scatter_floor = scatter.seconds(1, n, total)
    if scatter_floor < min(out.values()):  # only then is sorting by source worth it
        out["scatter"] = scatter.seconds(plan.src_run_count, n, total)
    return out


def choose_method(plan: TransferPlan, row_bytes: int, dense: bool, costs: CopyCosts,
                  threads: int = 1) -> str:
    """The cheapest method for `plan` on `threads` copy threads (ties: earliest in
    METHODS)."""
    priced = job_costs(plan, row_bytes, dense, costs, threads)
    return min((m for m in METHODS if m in priced), key=lambda m: priced[m])


# -- calibration ---------------------------------------------------------------------------------

def _timings(jobs: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Seconds of each job, robust to load from other processes.

    The jobs take turns, round after round. Each job's time is taken relative to the
    first job of the same round (a burst of load elsewhere scales a whole round, not
    one job), the median of those ratios over the rounds is kept, and it is scaled by
    the first job's least disturbed round (other processes only ever add time).
    """
    for fn in jobs.values():
        fn()  # warm: first touch, caches, lazy set-up
    names = list(jobs)
    rounds: list[dict[str, float]] = []
    for _ in range(_ROUNDS):
        took = {}
        for name in names:
            t0 = time.perf_counter()
            jobs[name]()
            took[name] = max(time.perf_counter() - t0, 1e-9)
        rounds.append(took)
    reference = min(r[names[0]] for r in rounds)
    return {name: reference * statistics.median(r[name] / r[names[0]] for r in rounds)
            for name in names}


def _fit(t_big: float, t_small: float, nbytes: int, big: int, small: int) -> tuple[float, float]:
    """(per piece, per byte) from two timings of the same bytes in `big` and `small` pieces."""
    per_piece = max(0.0, (t_small - t_big) / (small - big))
    per_byte = max(1e-13, (t_big - big * per_piece) / nbytes)
    return per_piece, per_byte


def _measure(mechanisms: tuple[str, ...]) -> CopyCosts:
    torch = import_torch()
    start = time.perf_counter()
    words = CALIBRATION_BYTES // 16
    src = torch.ones(words, dtype=torch.complex128)
    dst = torch.zeros(words, dtype=torch.complex128)
    g = torch.Generator().manual_seed(0)
    shapes = {}
    for piece in (_BIG, _SMALL):
        count = CALIBRATION_BYTES // piece
        shapes[piece] = (src.view(count, -1), dst.view(count, -1),
                         torch.randperm(count, generator=g), torch.randperm(count, generator=g))
    nbytes = CALIBRATION_BYTES
    big, small = CALIBRATION_BYTES // _BIG, CALIBRATION_BYTES // _SMALL

    # each job does all that its method does per job in the worker (views, index
    # slices, address arrays), not only the copying
    def slices(piece: int) -> Callable[[], object]:
        s_rows, d_rows, a, b = shapes[piece]
        return lambda: [d_rows[i:i + 1].copy_(s_rows[j:j + 1])
                        for i, j in zip(a.tolist(), b.tolist(), strict=True)]

    def index_op(name: str, piece: int, one_row_calls: bool = False) -> Callable[[], object]:
        s_rows, d_rows, perm, _ = shapes[piece]
        n = perm.numel()
        step = 1 if one_row_calls else n
        if name == "gather":
            return lambda: [torch.index_select(s_rows, 0, perm[i:i + step],
                                               out=d_rows[i:i + step]) for i in range(0, n, step)]
        return lambda: [d_rows.index_copy_(0, perm[i:i + step], s_rows[i:i + step])
                        for i in range(0, n, step)]

    def pieces(mechanism: str, piece: int) -> Callable[[], object]:
        s_rows, d_rows, a, b = shapes[piece]
        return lambda: batch.copy_pieces(batch.make_pieces(
            batch.row_addresses(d_rows, a), batch.row_addresses(s_rows, b), piece,
            check_overlap=False), mechanism)

    jobs: dict[str, Callable[[], object]] = {"copy big": slices(_BIG),
                                             "copy small": slices(_SMALL)}
    for name in ("gather", "scatter"):
        jobs[f"{name} big"] = index_op(name, _BIG)
        jobs[f"{name} small"] = index_op(name, _SMALL)
        # one call per big row: what a call costs where it matters (scattered big
        # blocks), including a one-row index kernel's slower streaming
        jobs[f"{name} calls"] = index_op(name, _BIG, one_row_calls=True)
    timed = _worth_measuring(mechanisms)
    for mechanism in timed:
        jobs[f"{mechanism} big"] = pieces(mechanism, _BIG)
        jobs[f"{mechanism} small"] = pieces(mechanism, _SMALL)
    t = _timings(jobs)
    per_call, per_byte = _fit(t["copy big"], t["copy small"], nbytes, big, small)
    copy = Cost(per_call, 0.0, per_byte)
    index = {}
    for name in ("gather", "scatter"):
        per_row, per_byte = _fit(t[f"{name} big"], t[f"{name} small"], nbytes, big, small)
        calls = max(0.0, (t[f"{name} calls"] - t[f"{name} big"]) / (big - 1))
        index[name] = Cost(calls, per_row, per_byte)
    batched: dict[str, Cost] = {}
    for mechanism in timed:
        per_piece, per_byte = _fit(t[f"{mechanism} big"], t[f"{mechanism} small"], nbytes,
                                   big, small)
        batched[mechanism] = Cost(per_piece, 0.0, per_byte)
    shared = statistics.median(c.per_byte for c in (copy, *index.values(), *batched.values()))
    copy, gather, scatter = (dataclasses.replace(c, per_byte=shared)
                             for c in (copy, index["gather"], index["scatter"]))
    best: str | None = None
    for mechanism, cost in batched.items():  # a later one must win clearly: 5 %
        price = cost.seconds(big + small, 0, 2 * nbytes)
        if best is None or price < 0.95 * batched[best].seconds(big + small, 0, 2 * nbytes):
            best = mechanism
    chosen = dataclasses.replace(batched[best], per_byte=shared) if best else None
    return CopyCosts(copy, gather, scatter, chosen, best, mechanisms,
                     time.perf_counter() - start)


_LOCK = threading.Lock()


def _worth_measuring(mechanisms: tuple[str, ...]) -> tuple[str, ...]:
    """Time one in-process memcpy path: a context chain (no GIL between pieces), else
    cffi's call, ctypes' memcpy, ctypes.memmove. They move bytes alike and differ in what
    a piece costs on top; a one-thread calibration cannot see the GIL waits that per-piece
    calls add once two copy threads share a job, so the chain, where it works, is the
    one to time."""
    calls = [m for m in _IN_PROCESS if m in mechanisms][:1]
    return tuple(m for m in mechanisms if m in calls or m not in _IN_PROCESS)


_IN_PROCESS = ("ucontext", "cffi", "memcpy", "memmove")


def calibrate() -> CopyCosts:
    """The costs, measured on first call (later calls wait for it, then share it)."""
    with _LOCK:  # one measurement at a time: two would disturb each other
        return _calibrated()


def measured() -> CopyCosts | None:
    """The costs if they were measured already; never measures, never waits."""
    return _calibrated() if _calibrated.cache_info().currsize else None


def forget_calibration() -> None:
    """Measure again on the next call (after the mechanisms changed, e.g. in tests)."""
    with _LOCK:
        _calibrated.cache_clear()


@functools.cache
def _calibrated() -> CopyCosts:
    """Measure on a thread that runs torch single-threaded like the copy threads; a
    failure with a batched mechanism falls back to measuring the torch methods alone."""
    result: list[CopyCosts] = []
    errors: list[BaseException] = []

    def run() -> None:
        single_threaded_torch()
        try:
            result.append(_measure(batch.available_mechanisms()))
        except Exception as exc:  # a mechanism that breaks mid-way: measure without them
            errors.append(exc)
            try:
                result.append(_measure(()))
            except Exception as again:
                errors.append(again)

    thread = threading.Thread(target=run, name="vllm-offload-calibrate", daemon=True)
    thread.start()
    thread.join()
    if errors:
        logger.warning("copy cost calibration: %s", errors[0])
    if not result:
        raise errors[-1]
    return result[0]
