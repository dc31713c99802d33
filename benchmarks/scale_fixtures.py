"""What the scale benchmarks share: a process that holds regions, and a median timer."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
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


def explain(name: str, process: float, in_process: float, python: float, imports: float,
            target_ms: float) -> str:
    """Where a command's process time goes beyond its in-process work, and the verdict.

    process = interpreter start (`python -c pass`) + imports of what the command
    loads (measured as `python -c 'import ...'`, less the interpreter) + the
    in-process work + the rest (option parsing, JSON encoding, process exit).
    """
    imp = imports - python
    rest = process - python - imp - in_process
    verdict = "ok" if process * 1000 <= target_ms else "MISSED"
    return (f"{name}: {process * 1000:.0f} ms as a process (target <= {target_ms:.0f} ms: "
            f"{verdict}) = {python * 1000:.0f} ms interpreter start + {imp * 1000:.0f} ms "
            f"imports + {in_process * 1000:.0f} ms the work in-process + {rest * 1000:.0f} ms "
            "the rest (parsing options, JSON out, exit)")


def stop_all(procs: list[subprocess.Popen[bytes]] | list[subprocess.Popen[str]],
             shm: str | os.PathLike[str]) -> None:
    """Kill the holder processes, reap them, and remove the scratch directory."""
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()
    shutil.rmtree(shm, ignore_errors=True)
