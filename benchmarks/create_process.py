"""`vllm-offload create` as a process: start-up, and the window in which a kill leaves a
half-made region (from winning O_EXCL to a `ready` manifest).

Each run starts `python -m vllm_offload_cli create` in a private tmpfs directory
and polls (every millisecond) for the region's name, then for its `ready`
manifest; the window is what the crash tests' kills land in. Figures are
medians over --repeat runs, polled, so good to about a millisecond.
Usage: python benchmarks/create_process.py [--size 256MiB] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from vllm_offload_cli.core.region import manifest as manifest_io
from vllm_offload_cli.core.region.naming import manifest_path, region_path


def _ready(shm_dir: Path, engine_id: str) -> bool:
    try:
        return manifest_io.read(str(manifest_path(shm_dir, engine_id))).complete
    except (OSError, manifest_io.ManifestError, LookupError):
        return False


def _poll(condition: Callable[[], bool], proc: subprocess.Popen[bytes]) -> float:
    while not condition():
        if proc.poll() is not None:
            raise RuntimeError(f"create exited with {proc.returncode} before that")
        time.sleep(0.001)
    return time.perf_counter()


def one_run(shm_dir: Path, size: str, engine_id: str) -> tuple[float, float, float]:
    """(start to name, name to ready, start to exit) of one create, in seconds."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_offload_cli", "create", engine_id, "--world-size", "1",
         "--cpu-page-size", "64KiB", "--size", size, "--shm-dir", str(shm_dir), "--json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    named = _poll(region_path(shm_dir, engine_id).exists, proc)
    ready = _poll(lambda: _ready(shm_dir, engine_id), proc)
    _, err = proc.communicate(timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(err.decode())
    done = time.perf_counter()
    for name in os.listdir(shm_dir):
        os.unlink(shm_dir / name)
    return named - t0, ready - named, done - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    shm_dir = Path(tempfile.mkdtemp(prefix="vllm-offload-bench-", dir="/dev/shm"))
    try:
        runs = [one_run(shm_dir, args.size, f"bench{i}") for i in range(args.repeat)]
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    start, window, total = (statistics.median(col) for col in zip(*runs, strict=True))
    print(f"create --size {args.size}, median of {args.repeat}; {os.cpu_count()} CPUs")
    print(f"start-up to O_EXCL   {start:7.3f} s")
    print(f"O_EXCL to ready      {window:7.3f} s")
    print(f"whole process        {total:7.3f} s")


if __name__ == "__main__":
    main()
