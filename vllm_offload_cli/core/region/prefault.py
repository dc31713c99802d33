"""Pre-faulting: allocate a region's tmpfs pages up front, where failure is clear: vLLM's
page ranges (one MADV_POPULATE_WRITE per row), merged where they touch, optionally spread
over threads (ctypes drops the GIL; the kernel faults in parallel)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from vllm_offload_cli.core.base.errors import InsufficientSpaceError, OperationFailedError
from vllm_offload_cli.core.base.testhook import pause_at
from vllm_offload_cli.core.region.geometry import PAGESIZE, Geometry, round_up
from vllm_offload_cli.core.system import libc

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
_CHUNK = 16 * 1024 * 1024  # unit of work for threads and progress reports


@dataclass(frozen=True, kw_only=True)
class PopulateStats:
    bytes: int
    seconds: float
    method: str  # "madvise" or "touch"
    threads: int

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def slot_ranges(geometry: Geometry, rank: int | None) -> list[tuple[int, int]]:
    """Page-aligned (offset, length) ranges covering one rank's slots (rank-less: the whole
    file), merged where adjacent; as vLLM's, the start rounds down, the kernel rounds up."""
    if rank is None:
        return [(0, geometry.size_bytes)]
    slot = geometry.slot(rank)
    spans: list[list[int]] = []  # [start, end]
    for block in range(geometry.num_blocks):
        raw = block * geometry.row_stride + slot.start
        start, end = raw - raw % PAGESIZE, raw + len(slot)
        if spans and round_up(spans[-1][1], PAGESIZE) >= start:  # its last page reaches ours
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    return [(start, end - start) for start, end in spans]


def _chunks(ranges: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Split ranges into work items of about _CHUNK bytes (large ranges are cut)."""
    items: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    size = 0
    for start, length in ranges:
        while length > _CHUNK:  # cut on page boundaries
            items.append([(start, _CHUNK)])
            start += _CHUNK
            length -= _CHUNK
        current.append((start, length))
        size += length
        if size >= _CHUNK:
            items.append(current)
            current, size = [], 0
    if current:
        items.append(current)
    return items


def _madvise_supported(addr: int) -> bool:
    """Probe with one page the caller is about to populate anyway (never a peer's slot)."""
    try:
        libc.madvise(addr - addr % PAGESIZE, PAGESIZE, libc.MADV_POPULATE_WRITE)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise _populate_error(exc) from exc
    return True


def _populate_error(exc: OSError) -> Exception:
    if exc.errno in (errno.ENOMEM, errno.EFAULT, errno.ENOSPC):
        return InsufficientSpaceError(
            "ran out of memory while pre-faulting the region (tmpfs full or the memory "
            "cgroup limit reached); free space with `vllm-offload gc` or shrink the region",
            code="populate_failed",
        )
    return OperationFailedError(f"pre-fault failed: {exc.strerror}")


def populate(
    mm: mmap.mmap,
    ranges: Sequence[tuple[int, int]],
    *,
    threads: int = 1,
    progress: Progress | None = None,
) -> PopulateStats:
    """Fault in `ranges` of a writable shared mapping; keeps existing bytes."""
    total = sum(length for _, length in ranges)
    anchor = ctypes.c_char.from_buffer(mm)  # pins the mapping while we use its address
    try:
        base = ctypes.addressof(anchor)
        t0 = time.perf_counter()
        if total == 0:
            return PopulateStats(bytes=0, seconds=0.0, method="madvise", threads=threads)
        use_madvise = _madvise_supported(base + ranges[0][0])
        done = 0
        lock = threading.Lock()

        def run(item: list[tuple[int, int]]) -> None:
            nonlocal done
            for start, length in item:
                if use_madvise:
                    try:
                        libc.madvise(base + start, length, libc.MADV_POPULATE_WRITE)
                    except OSError as exc:
                        raise _populate_error(exc) from exc
                else:
                    _touch(mm, start, length)
            with lock:
                done += sum(length for _, length in item)
                if progress is not None:
                    progress(done, total)
                if 2 * done >= total > done:
                    pause_at("mid_prefault")  # the crash tests stop us half-way

        items = _chunks(ranges)
        workers = max(1, min(threads, len(items)))
        if workers == 1:
            for item in items:
                run(item)
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="prefault") as pool:
                for future in [pool.submit(run, item) for item in items]:
                    future.result()
        return PopulateStats(bytes=total, seconds=time.perf_counter() - t0,
                             method="madvise" if use_madvise else "touch", threads=workers)
    finally:
        del anchor


def _touch(mm: mmap.mmap, start: int, length: int) -> None:
    """Without MADV_POPULATE_WRITE: write back one byte per page as read (keeps peers' data)."""
    view = memoryview(mm)
    try:
        first = start - start % PAGESIZE
        for offset in range(first, start + length, PAGESIZE):
            view[offset] = view[offset]
    finally:
        view.release()
