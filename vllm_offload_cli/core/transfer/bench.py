"""The measurement behind `vllm-offload benchmark`: copy workers against a plain memcpy."""

from __future__ import annotations

import functools
import math
import os
import platform
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_offload_cli.core.base import errors
from vllm_offload_cli.core.base.extras import import_torch
from vllm_offload_cli.core.base.problems import jsonable
from vllm_offload_cli.core.region.geometry import default_row_stride
from vllm_offload_cli.core.region.shared_region import SharedOffloadRegion
from vllm_offload_cli.core.transfer.worker import CopyWorker

if TYPE_CHECKING:
    from torch import Tensor

KiB, MiB = 1024, 1024 * 1024
DEFAULT_BLOCK_SIZES = (16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB)
DEFAULT_SIZE = 256 * MiB
# bigger than a last-level cache: worker and baseline both measure memory, not cache
AUTO_TRANSFER_BYTES = 128 * MiB
# one run on both sides; random device blocks into consecutive region blocks (vLLM's
# store into fresh offload blocks) and back; random blocks on both sides
PATTERNS = ("contiguous", "device-scattered", "scattered")
PIPELINE_DEPTH = 2  # jobs in flight per timed round, and copies per baseline round
DEFAULT_REPEAT = 11  # rounds per figure: enough for a steady median on a busy host
# The targets: CPU store/load against memcpy for blocks >= 64 KiB
TARGET_RATIOS = {"contiguous": 0.9, "device-scattered": 0.8, "scattered": 0.75}
TARGET_MIN_BLOCK = 64 * KiB

Progress = Callable[[int, int], None]


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    shm_dir: str
    device: str  # "cpu" or "cuda", resolved
    size_bytes: int = DEFAULT_SIZE
    block_sizes: tuple[int, ...] = DEFAULT_BLOCK_SIZES
    world_size: int = 1
    blocks_per_transfer: int | None = None  # None: about AUTO_TRANSFER_BYTES per job
    repeat: int = DEFAULT_REPEAT
    patterns: tuple[str, ...] = PATTERNS
    populate_threads: int = 1
    seed: int = 0
    huge_pages: bool = False  # also compare normal and huge pages (largest block size)


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """One direction of one row: the worker and the memcpy baseline, measured interleaved."""

    gbps: float  # best round, first submit to last completion
    median_gbps: float
    worker_gbps: float  # median of the worker's own copy timing (no submit or hand-off)
    memcpy_gbps: float  # best round of the baseline
    memcpy_median_gbps: float
    method: str  # the copy rules the worker used (transfer.copies)
    ratio: float = 0.0  # median over rounds of (worker / baseline) in the same round


@dataclass(frozen=True, kw_only=True)
class PrefaultFigure:
    block_bytes: int
    bytes: int
    seconds: float
    gbps: float
    method: str
    threads: int


@dataclass(frozen=True, kw_only=True)
class BenchRow:
    block_bytes: int
    pattern: str
    mode: str  # "cpu", "pinned" or "pageable"
    blocks_per_transfer: int
    transfer_bytes: int
    store: Throughput
    load: Throughput
    verified: bool


@dataclass(frozen=True, kw_only=True)
class HugePageRun:
    """Pre-fault and contiguous copies of one scratch region, normal or huge pages."""

    huge_page_bytes: int | None  # what the kernel mapped with PMD pages
    prefault_gbps: float
    store_gbps: float
    load_gbps: float


@dataclass(frozen=True, kw_only=True)
class HugePageComparison:
    """Normal against huge pages in the same run; ratios are huge / normal."""

    available: bool
    reason: str
    block_bytes: int
    normal: HugePageRun | None = None
    huge: HugePageRun | None = None

    @property
    def ratios(self) -> dict[str, float] | None:
        if self.normal is None or self.huge is None:
            return None
        pairs = {k: (getattr(self.huge, f"{k}_gbps"), getattr(self.normal, f"{k}_gbps"))
                 for k in ("prefault", "store", "load")}
        return {k: round(a / b, 3) if b > 0 else 0.0 for k, (a, b) in pairs.items()}


@dataclass(frozen=True, kw_only=True)
class BenchReport:
    engine_id: str
    shm_dir: str
    device: str
    device_name: str
    torch_version: str
    torch_threads: int
    size_bytes: int
    world_size: int
    repeat: int
    patterns: tuple[str, ...]
    prefault: tuple[PrefaultFigure, ...]
    rows: tuple[BenchRow, ...]
    pinned: bool | None  # None on CPU: nothing to pin
    pin_warning: str | None
    removed: bool
    omp_wait_policy: str | None = None  # what torch's OpenMP team did between copies
    target: dict[str, Any] = field(default_factory=dict)
    huge_pages: HugePageComparison | None = None

    def to_dict(self) -> dict[str, Any]:
        """Every field, ratios rounded, and the huge-page ratios."""
        doc: dict[str, Any] = jsonable(self)
        for row in doc["rows"]:
            for way in ("store", "load"):
                row[way]["ratio"] = round(row[way]["ratio"], 3)
        if self.huge_pages is not None:
            doc["huge_pages"]["ratio"] = self.huge_pages.ratios
        return doc


def resolve_device(requested: str) -> str:
    """auto (cuda when torch sees a GPU, else cpu), cpu or cuda; cuda without a GPU is an
    error (exit 5)."""
    torch = import_torch()
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        build = torch.version.cuda
        why = (f"this torch {torch.__version__} is a CPU-only build" if build is None
               else f"torch {torch.__version__} (CUDA {build}) finds no usable GPU")
        raise errors.DeviceUnavailableError(
            f"--device cuda: no CUDA device is available ({why}); run with --device cpu, or "
            "on a host with an NVIDIA GPU and a CUDA build of torch", code="no_device")
    return requested


def _rates(nbytes: int, seconds: Sequence[float]) -> tuple[float, float]:
    """(best, median) GB/s."""
    rates = [nbytes / s / 1e9 for s in seconds if s > 0]
    return (max(rates), statistics.median(rates)) if rates else (0.0, 0.0)


class _Baseline:
    """A plain copy between two contiguous buffers: on CPU the memory a contiguous job
    moves (the device tensor's first bytes, the mapping's last), on CUDA pinned <-> GPU."""

    def __init__(self, device: str, nbytes: int, device_rows: Tensor,
                 region_view: Tensor) -> None:
        torch = import_torch()
        self.nbytes = nbytes
        self.cuda = device == "cuda"
        if self.cuda:
            self.host = torch.full((nbytes,), 1, dtype=torch.int8, pin_memory=True)
            self.dev = torch.full((nbytes,), 2, dtype=torch.int8, device="cuda")
        else:
            mapping = region_view.untyped_storage().nbytes()
            self.host = region_view.as_strided((nbytes,), (1,), mapping - nbytes)
            self.dev = device_rows.view(-1)[:nbytes]

    def batch(self, store: bool, count: int) -> float:
        """Seconds for `count` copies back to back: device -> host for a store, host ->
        device for a load; on the host's clock, as the worker's jobs are timed."""
        dst, src = (self.host, self.dev) if store else (self.dev, self.host)
        sync = import_torch().cuda.synchronize if self.cuda else (lambda: None)
        sync()  # nothing queued before is timed
        t0 = time.perf_counter()
        for _ in range(count):
            dst.copy_(src, non_blocking=self.cuda)
        sync()
        return time.perf_counter() - t0


class _Bench:
    def __init__(self, config: BenchConfig, progress: Progress | None) -> None:
        self.config = config
        self.torch = import_torch()
        self.progress = progress
        self.done = 0
        self.engine_id = f"bench-{os.getpid()}-{secrets.token_hex(4)}"
        self.generator = self.torch.Generator().manual_seed(config.seed)
        self.modes = ("cpu",) if config.device == "cpu" else ("pinned", "pageable")
        self.total = self.plan_total()  # also validates every size before any region exists
        self.pinned: bool | None = None
        self.pin_warning: str | None = None
        self.removed = True
        self._ids: Iterator[int] = iter(range(1, 1 << 62))

    def shape(self, block: int) -> tuple[int, int, int]:
        """(row_stride, num_blocks, blocks per transfer) for one block size."""
        c = self.config
        row_stride = default_row_stride(c.world_size, block)
        num_blocks = c.size_bytes // row_stride
        if num_blocks < 2:
            raise errors.InvalidInputError(
                f"--size {c.size_bytes} holds {num_blocks} row(s) of {row_stride} bytes "
                f"(block {block} x world size {c.world_size}); it needs at least 2",
                code="invalid_size")
        n = c.blocks_per_transfer
        if n is None:
            n = max(1, min(num_blocks // 2, AUTO_TRANSFER_BYTES // block))
        elif n > num_blocks:
            raise errors.InvalidInputError(
                f"--blocks-per-transfer {n} exceeds the {num_blocks} blocks of {block} bytes "
                f"that --size {c.size_bytes} holds; raise --size or lower it",
                code="invalid_size")
        return row_stride, num_blocks, n

    def plan_total(self) -> int:
        """Bytes the worker will move in all: the progress bar's total."""
        c = self.config
        jobs = ((c.repeat + 1) * PIPELINE_DEPTH + 1) * 2  # per direction, both directions
        total = sum(len(self.modes) * len(c.patterns) * jobs * self.shape(block)[2] * block
                    for block in c.block_sizes)
        if c.huge_pages:  # normal and huge: one contiguous row each
            block = max(c.block_sizes)
            total += 2 * jobs * self.shape(block)[2] * block
        return total

    def ids(self, pattern: str, n: int, num_blocks: int) -> tuple[Tensor, Tensor]:
        """(device block ids, region block ids) of one job."""
        torch = self.torch
        tail = torch.arange(num_blocks - n, num_blocks)
        if pattern == "contiguous":
            return torch.arange(n), tail
        scattered_device = torch.randperm(num_blocks, generator=self.generator)[:n]
        if pattern == "device-scattered":
            return scattered_device, tail
        return scattered_device, torch.randperm(num_blocks, generator=self.generator)[:n]

    def jobs(self, worker: CopyWorker, store: bool, src: Tensor, dst: Tensor,
             count: int = 1) -> tuple[float, list[float], str]:
        """Submit `count` identical jobs back to back and wait for all: (seconds from the
        first submit to the last completion, each job's own copy seconds, method)."""
        ids = [next(self._ids) for _ in range(count)]
        submit = worker.submit_store if store else worker.submit_load
        t0 = time.perf_counter()
        for job_id in ids:
            submit(job_id, src, dst)
        worker.wait(ids)
        wall = time.perf_counter() - t0
        results = worker.get_finished()
        failed = [r for r in results if not r.success]
        if failed or len(results) != count:
            detail = failed[0].error if failed else f"{len(results)} results for {count} jobs"
            raise errors.OperationFailedError(f"benchmark job failed: {detail}")
        self.done += sum(r.bytes for r in results)
        if self.progress is not None:
            self.progress(self.done, self.total)
        return wall, [r.seconds for r in results], results[-1].method

    def direction(self, worker: CopyWorker, baseline: _Baseline, store: bool, src: Tensor,
                  dst: Tensor) -> Throughput:
        """Rounds of: one plain copy, PIPELINE_DEPTH jobs in flight, one plain copy (their
        baseline, so a burst of load elsewhere on the host weighs on both alike); the ratio
        is the median of the rounds' worker/baseline ratios."""
        depth = PIPELINE_DEPTH
        self.jobs(worker, store, src, dst, depth)  # warm-up, both of them
        baseline.batch(store, depth)
        walls, inner, copies, method = [], [], [], ""
        for _ in range(self.config.repeat):
            before = baseline.batch(store, depth // 2)
            wall, seconds, method = self.jobs(worker, store, src, dst, depth)
            copies.append(before + baseline.batch(store, depth - depth // 2))
            walls.append(wall)
            inner += seconds
        nbytes = baseline.nbytes
        best, median = _rates(nbytes * depth, walls)
        memcpy_best, memcpy_median = _rates(nbytes * depth, copies)
        paired = [c / w for c, w in zip(copies, walls, strict=True) if w > 0 and c > 0]
        return Throughput(gbps=best, median_gbps=median, worker_gbps=_rates(nbytes, inner)[1],
                          memcpy_gbps=memcpy_best, memcpy_median_gbps=memcpy_median,
                          method=method, ratio=statistics.median(paired) if paired else 0.0)

    def verify(self, worker: CopyWorker, view: Tensor, device_rows: Tensor, dev_ids: Tensor,
               reg_ids: Tensor) -> bool:
        """Store fresh bytes, compare the region; scramble the device, load, compare."""
        torch = self.torch
        fresh = torch.randint(-128, 128, (dev_ids.numel(), device_rows.shape[1]),
                              dtype=torch.int8, generator=self.generator)
        device_rows[dev_ids] = fresh.to(device_rows.device)
        self.jobs(worker, True, dev_ids, reg_ids)
        stored = bool(torch.equal(view[reg_ids], fresh))
        device_rows[dev_ids] = 0
        self.jobs(worker, False, reg_ids, dev_ids)
        loaded = bool(torch.equal(device_rows[dev_ids].cpu(), fresh))
        if not (stored and loaded):
            raise errors.OperationFailedError(
                f"benchmark self-check failed: the {'load' if stored else 'store'} did not "
                "copy the bytes it was given; this is a bug, please report it")
        return True

    def region(self, block: int, huge_pages: str | None = None) -> SharedOffloadRegion:
        """A scratch region; `huge_pages` (never or always) names the huge-page one."""
        c = self.config
        row_stride, num_blocks, _ = self.shape(block)
        name = self.engine_id if huge_pages is None else f"{self.engine_id}-thp"
        return SharedOffloadRegion(name, num_blocks, 0, row_stride, block, shm_dir=c.shm_dir,
                                   world_size=c.world_size, populate_threads=c.populate_threads,
                                   huge_pages=huge_pages or "never")

    def on_region(self, block: int, modes: Sequence[str], patterns: Sequence[str],
                  huge_pages: str | None = None) -> tuple[SharedOffloadRegion, list[BenchRow]]:
        """Measure `patterns` in each of `modes` on a scratch region, removed whatever
        happens; returns it (for its pre-fault figures) and the rows."""
        c = self.config
        _, num_blocks, n = self.shape(block)
        rows: list[BenchRow] = []
        worker: CopyWorker | None = None
        region = self.region(block, huge_pages)
        try:
            device_rows = self.torch.full((num_blocks, block), 0x5A, dtype=self.torch.int8,
                                          device=c.device)
            view = region.create_next_worker_view(block)
            baseline = _Baseline(c.device, n * block, device_rows, view)
            for mode in modes:
                worker = CopyWorker(region, [device_rows], region_views=[view],
                                    pin=mode == "pinned")
                if mode == "pinned" and huge_pages is None:
                    self.pinned, self.pin_warning = worker.pinned, worker.pin_warning
                for pattern in patterns:
                    dev_ids, reg_ids = self.ids(pattern, n, num_blocks)
                    store = self.direction(worker, baseline, True, dev_ids, reg_ids)
                    load = self.direction(worker, baseline, False, reg_ids, dev_ids)
                    verified = self.verify(worker, view, device_rows, dev_ids, reg_ids)
                    rows.append(BenchRow(block_bytes=block, pattern=pattern, mode=mode,
                                         blocks_per_transfer=n, transfer_bytes=n * block,
                                         store=store, load=load, verified=verified))
                worker.shutdown()
        finally:
            if worker is not None:  # a no-op after a clean shutdown
                worker.shutdown(cancel_pending=True)
            self.drop(region)
        return region, rows

    def drop(self, region: SharedOffloadRegion) -> None:
        region.cleanup()
        gone = not (Path(region.mmap_path).exists() or Path(region.manifest_path).exists())
        self.removed = self.removed and gone

    def huge_pages(self, block: int) -> HugePageComparison:
        """The same pre-fault and contiguous store/load, normal pages then huge pages."""
        from vllm_offload_cli.core.region.page_policy import thp_support

        support = thp_support(self.config.shm_dir)
        if not support.allowed:
            return HugePageComparison(available=False, reason=support.reason, block_bytes=block)
        # pre-fault is one short call: alternate fresh regions `repeat` times, keep the best
        best = {"never": 0.0, "always": 0.0}
        for _ in range(self.config.repeat):
            for mode in best:
                region = self.region(block, mode)
                try:
                    stats = region.populate_stats
                    best[mode] = max(best[mode], 0.0 if stats is None else stats.gbps)
                finally:
                    self.drop(region)
        runs = []
        for mode, prefault_gbps in best.items():
            region, (row,) = self.on_region(block, self.modes[:1], ("contiguous",), mode)
            runs.append(HugePageRun(huge_page_bytes=region.huge_page_bytes,
                                    prefault_gbps=prefault_gbps, store_gbps=row.store.gbps,
                                    load_gbps=row.load.gbps))
        return HugePageComparison(available=True, reason=support.reason, block_bytes=block,
                                  normal=runs[0], huge=runs[1])


@functools.cache
def passive_openmp() -> str | None:
    """Make torch's OpenMP team sleep, not spin, between parallel regions if torch is not
    loaded yet (spinning threads would take a core from the copy worker's); the policy
    in force, None where torch was loaded first. Set by the benchmark only."""
    if "torch" in sys.modules:
        return None
    return os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def run_benchmark(config: BenchConfig, *, progress: Progress | None = None) -> BenchReport:
    """Measure every block size of `config`; the scratch region never outlives the call."""
    wait_policy = passive_openmp()
    if config.repeat < 1:
        raise errors.InvalidInputError("repeat must be at least 1", code="invalid_repeat")
    if not config.block_sizes:
        raise errors.InvalidInputError("give at least one block size", code="invalid_size")
    if unknown := [p for p in config.patterns if p not in PATTERNS]:
        raise errors.InvalidInputError(f"unknown pattern {unknown[0]!r}; choose from "
                                       f"{', '.join(PATTERNS)}", code="invalid_pattern")
    bench = _Bench(config, progress)
    rows: list[BenchRow] = []
    prefault: list[PrefaultFigure] = []
    for block in config.block_sizes:
        region, measured = bench.on_region(block, bench.modes, config.patterns)
        rows += measured
        if (stats := region.populate_stats) is not None:
            prefault.append(PrefaultFigure(block_bytes=block, gbps=stats.gbps, **asdict(stats)))
    huge = bench.huge_pages(max(config.block_sizes)) if config.huge_pages else None
    torch = bench.torch
    cpu = f"{platform.processor() or platform.machine() or 'CPU'} ({os.cpu_count()} CPUs)"
    return BenchReport(
        engine_id=bench.engine_id, shm_dir=config.shm_dir, device=config.device,
        device_name=cpu if config.device == "cpu"
        else str(torch.cuda.get_device_name(torch.cuda.current_device())),
        torch_version=str(torch.__version__),
        torch_threads=torch.get_num_threads(), size_bytes=config.size_bytes,
        world_size=config.world_size, repeat=config.repeat, patterns=config.patterns,
        prefault=tuple(prefault), rows=tuple(rows), pinned=bench.pinned,
        pin_warning=bench.pin_warning, removed=bench.removed, omp_wait_policy=wait_policy,
        target=target_summary(rows), huge_pages=huge)


def target_summary(rows: Sequence[BenchRow]) -> dict[str, Any]:
    """Does the CPU path meet TARGET_RATIOS to memcpy for blocks >= 64 KiB, per pattern?"""
    worst: dict[str, float] = {}
    for r in rows:
        if r.block_bytes >= TARGET_MIN_BLOCK and r.mode == "cpu":
            worst[r.pattern] = min(worst.get(r.pattern, math.inf), r.store.ratio, r.load.ratio)
    if not worst:
        return {}
    return {"min_block_bytes": TARGET_MIN_BLOCK,
            "patterns": {p: {"ratio": TARGET_RATIOS[p], "min_ratio": round(v, 3),
                             "met": v >= TARGET_RATIOS[p]} for p, v in worst.items()}}
