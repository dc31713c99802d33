"""What the scale benchmarks share: a process that holds regions, and a median timer."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

# argv: SHM_DIR ENGINE_ID...; maps each region through the core, says "ready", holds them
# until its stdin closes
HOLDER = """
import sys
from vllm_offload_cli.core.region import SharedOffloadRegion
rs = [SharedOffloadRegion(e, 4, None, 4096, 4096, shm_dir=sys.argv[1]) for e in sys.argv[2:]]
print("ready", flush=True)
sys.stdin.read()
"""


def median_time(fn: Callable[[], object], repeat: int) -> float:
    """Median wall seconds of `repeat` calls."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
