"""How much `verify-rank-layout` costs, against baselines measured in the same run.

Live mode: checking a region (manifest, mincore, per-slot residency) against
one plain mincore pass over the same file (`residency.resident_bytes`), the
least any residency measurement must do. Plan mode: planning a large layout
(every collision check) against computing the slots alone.

Usage: python benchmarks/bench_verify_rank_layout.py [--size-mib N] [--repeat N]
Regions live in a private directory under /dev/shm, removed afterwards.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

from vllm_offload_cli.core.host import residency
from vllm_offload_cli.core.layout.check import check_region
from vllm_offload_cli.core.layout.plan import plan_layout
from vllm_offload_cli.core.region import SharedOffloadRegion
from vllm_offload_cli.core.region.geometry import default_row_stride
from vllm_offload_cli.core.region.ranks import DEVICE_MODULO, WorkerPlace


def best_and_median(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def bench_live(shm_dir: str, size_mib: int, world: int, page: int, repeat: int) -> None:
    stride = default_row_stride(world, page)
    blocks = max(1, size_mib * 1024 * 1024 // stride)
    engine_id = f"bench-w{world}-p{page}"
    # rank 0 pre-faults only its own slot: the rest stays a hole, as on a half-started engine
    region = SharedOffloadRegion(engine_id, blocks, 0, stride, page, shm_dir=shm_dir,
                                 world_size=world, rank_source="logical", device_index=0,
                                 preflight=False)
    try:
        fd = os.open(region.mmap_path, os.O_RDONLY)
        try:
            base_best, base_med = best_and_median(lambda: residency.resident_bytes(fd), repeat)
        finally:
            os.close(fd)
        check_best, check_med = best_and_median(
            lambda: check_region(shm_dir, engine_id), repeat)
        check = check_region(shm_dir, engine_id)
        codes = sorted({p.code for p in check.problems})
        size = blocks * stride
        print(f"live  {size / 2**20:7.1f} MiB  W={world:<2} cpu_page_size={page:<6} "
              f"rows={blocks:<6} | mincore baseline {base_med * 1e3:8.2f} ms (best "
              f"{base_best * 1e3:.2f}) | verify {check_med * 1e3:8.2f} ms (best "
              f"{check_best * 1e3:.2f}) | ratio {check_med / base_med:5.2f}x | "
              f"{size / check_med / 1e9:6.1f} GB/s checked | problems {codes}")
    finally:
        region.cleanup()


def bench_plan(world: int, dp: int, repeat: int) -> None:
    def slots_only() -> list[int]:
        return [DEVICE_MODULO.slot(WorkerPlace(w, k * world + w, world))
                for k in range(dp) for w in range(world)]

    base_best, base_med = best_and_median(slots_only, repeat)
    plan_best, plan_med = best_and_median(lambda: plan_layout(world, DEVICE_MODULO,
                                                              dp_size=dp), repeat)
    print(f"plan  {world * dp:6d} workers (W={world}, D={dp}) | slots only "
          f"{base_med * 1e3:7.2f} ms (best {base_best * 1e3:.2f}) | full plan "
          f"{plan_med * 1e3:7.2f} ms (best {plan_best * 1e3:.2f}) | ratio "
          f"{plan_med / base_med:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    if not 1 <= args.size_mib <= 256:
        parser.error("--size-mib must be between 1 and 256")
    shm_dir = tempfile.mkdtemp(prefix="vllm-offload-bench-", dir="/dev/shm")
    try:
        for world, page in ((8, 64 * 1024), (8, 6000), (2, 2 * 1024 * 1024)):
            bench_live(shm_dir, args.size_mib, world, page, args.repeat)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    for world, dp in ((8, 8), (8, 1024), (8, 8192)):
        bench_plan(world, dp, args.repeat)


if __name__ == "__main__":
    main()
