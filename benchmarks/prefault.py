"""Pre-fault throughput: `create`'s populate against vLLM's per-row madvise loop.

Both fault in the same bytes of a fresh tmpfs file in the same run:
  vllm-loop   what every vLLM worker does: mmap.madvise(MADV_POPULATE_WRITE) once per
              row for its own slot, all ranks one after another (the whole file)
  create      vllm_offload_cli's populate() as `vllm-offload create` runs it: ranges
              merged (one call for a whole file), cut into 16 MiB pieces, N threads
Usage: python benchmarks/prefault.py [--size 256MiB] [--cpu-page-size 16KiB]
       [--world-size 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

from vllm_offload_cli.core.base.units import parse_size
from vllm_offload_cli.core.region.geometry import PAGESIZE, Geometry
from vllm_offload_cli.core.region.prefault import populate, slot_ranges

MADV_POPULATE_WRITE = 23


def vllm_loop(mm: mmap.mmap, g: Geometry) -> None:
    world = g.world_size or 1
    for rank in range(world):
        offset = rank * g.cpu_page_size
        for block in range(g.num_blocks):
            raw = block * g.row_stride + offset
            aligned = raw // PAGESIZE * PAGESIZE
            mm.madvise(MADV_POPULATE_WRITE, aligned, raw + g.cpu_page_size - aligned)


def timed(directory: str, g: Geometry, body: Callable[[mmap.mmap], None]) -> float:
    path = os.path.join(directory, "bench.mmap")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, g.size_bytes)
        mm = mmap.mmap(fd, g.size_bytes)
        t0 = time.perf_counter()
        body(mm)
        elapsed = time.perf_counter() - t0
        assert os.fstat(fd).st_blocks * 512 >= g.size_bytes, "not fully populated"
        mm.close()
        return elapsed
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--cpu-page-size", default="16KiB")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    page = parse_size(args.cpu_page_size)
    probe = Geometry.for_workers(num_blocks=1, world_size=args.world_size, cpu_page_size=page)
    g = Geometry.for_workers(num_blocks=parse_size(args.size) // probe.row_stride,
                             world_size=args.world_size, cpu_page_size=page)
    directory = tempfile.mkdtemp(prefix="vllm-offload-bench-", dir="/dev/shm")
    cases: dict[str, Callable[[mmap.mmap], None]] = {
        "vllm-loop": lambda mm: vllm_loop(mm, g),
        "create t=1": lambda mm: populate(mm, slot_ranges(g, None), threads=1) and None,
    }
    for threads in sorted({2, os.cpu_count() or 1}):
        cases[f"create t={threads}"] = (
            lambda mm, t=threads: populate(mm, slot_ranges(g, None), threads=t) and None)
    results: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for _ in range(args.repeat):  # interleaved, so drift hits every case alike
            for name, body in cases.items():
                results[name].append(timed(directory, g, body))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    base = statistics.median(results["vllm-loop"])
    print(f"region {g.size_bytes / 2**20:.0f} MiB: {g.num_blocks} rows x {g.row_stride} B, "
          f"{g.world_size} slots of {g.cpu_page_size} B; {os.cpu_count()} CPUs; "
          f"median of {args.repeat}")
    print(f"{'method':<12} {'seconds':>8} {'GB/s':>7} {'vs vllm-loop':>13}")
    for name, times in results.items():
        t = statistics.median(times)
        print(f"{name:<12} {t:8.3f} {g.size_bytes / t / 1e9:7.2f} {base / t:12.2f}x")


if __name__ == "__main__":
    main()
