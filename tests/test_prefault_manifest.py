"""Pre-fault ranges and fallback; manifest updates from many processes at once."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

from vllm_offload_cli.core.host import residency
from vllm_offload_cli.core.region import SharedOffloadRegion
from vllm_offload_cli.core.region import manifest as manifest_io
from vllm_offload_cli.core.region.geometry import PAGESIZE, Geometry
from vllm_offload_cli.core.region.prefault import _touch, populate, slot_ranges


def test_slot_ranges_match_vllms_per_row_loop() -> None:
    g = Geometry.for_workers(num_blocks=5, world_size=3, cpu_page_size=3000)
    for rank in range(3):
        expected = set()
        for b in range(5):  # vLLM's loop, computed independently
            raw = b * g.row_stride + rank * 3000
            start = raw // PAGESIZE * PAGESIZE
            expected |= set(range(start // PAGESIZE, -(-(raw + 3000) // PAGESIZE)))
        got = set()
        for start, length in slot_ranges(g, rank):
            got |= set(range(start // PAGESIZE, -(-(start + length) // PAGESIZE)))
        assert got == expected, rank


def test_adjacent_ranges_merge_into_one_call() -> None:
    g = Geometry.for_workers(num_blocks=100, world_size=1, cpu_page_size=2 * PAGESIZE)
    assert slot_ranges(g, 0) == [(0, 100 * 2 * PAGESIZE)]
    assert slot_ranges(g, None) == [(0, g.size_bytes)]
    two = Geometry.for_workers(num_blocks=100, world_size=2, cpu_page_size=PAGESIZE)
    assert len(slot_ranges(two, 1)) == 100


def test_threads_populate_exactly_the_ranges(shm_dir: Path) -> None:
    path = shm_dir / "f"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 64 * PAGESIZE)
        mm = mmap.mmap(fd, 64 * PAGESIZE)
        ranges = [(i * 2 * PAGESIZE, PAGESIZE) for i in range(32)]
        stats = populate(mm, ranges, threads=4)
        assert stats.method == "madvise" and stats.bytes == 32 * PAGESIZE
        assert residency.page_map(fd) == b"\x01\x00" * 32
        mm.close()
    finally:
        os.close(fd)


def test_touch_fallback_keeps_existing_bytes(shm_dir: Path) -> None:
    path = shm_dir / "f"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 8 * PAGESIZE)
        mm = mmap.mmap(fd, 8 * PAGESIZE)
        mm[PAGESIZE * 3] = 42  # a peer's data
        _touch(mm, 2 * PAGESIZE, 4 * PAGESIZE)
        assert mm[PAGESIZE * 3] == 42
        assert residency.page_map(fd) == b"\x00\x00\x01\x01\x01\x01\x00\x00"
        mm.close()
    finally:
        os.close(fd)


def _attach_worker(shm_dir: str, rank: int, start: Any, done: Any) -> None:
    start.wait()
    region = SharedOffloadRegion("many", 4, rank, 8 * PAGESIZE, PAGESIZE, shm_dir=shm_dir,
                                 world_size=8)
    done.wait()  # keep the region until every worker is in the manifest
    done.wait()
    region.cleanup()


def test_concurrent_attachments_are_all_recorded(shm_dir: Path) -> None:
    ctx = mp.get_context("fork")
    start, done = ctx.Barrier(8), ctx.Barrier(9)
    procs = [ctx.Process(target=_attach_worker, args=(str(shm_dir), r, start, done))
             for r in range(8)]
    for p in procs:
        p.start()
    done.wait()
    m = manifest_io.read(str(shm_dir / "vllm_offload_many.manifest.json"))
    assert sorted(a.rank for a in m.attachments) == list(range(8))
    assert {a.pid for a in m.attachments} == {p.pid for p in procs}
    done.wait()
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert os.listdir(shm_dir) == []
