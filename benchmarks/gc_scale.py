"""How long `gc` takes over 200 regions, against baselines measured in the same run.

Sets up a private directory under /dev/shm with 200 small regions: 120 stale
(20 of them with a `.mmap.1` segment), 40 persistent (made by the core, as
`create` does) and 40 live, held by 4 processes (20 through the core with its
flock, 20 like vLLM: mapped, no lock). Each repetition recreates the stale
ones, then times:

  scandir   os.scandir + lstat of the directory (the least any tool must do)
  discover  the inventory `inspect` builds (no residency scan, like gc)
  gc-dry    collect(dry_run=True): inventory, locks, /proc re-scan, no unlink
  gc        collect(): the same plus removing the 120 stale regions
  cli-gc    `python -m vllm_offload_cli gc --json` as a process (startup included)
  python    `python -c pass`: the interpreter's own startup, for scale
  imports   `python -c 'import ...'` of what `gc --json` loads
plus --processes idle processes, so the /proc scans have real work, and
explains the difference between the process and the in-process figure.
Target: cli-gc <= 200 ms (median).

Prints medians and ratios, then removes everything it made.
Usage: python benchmarks/gc_scale.py [--repeat N] [--processes 300]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from scale_fixtures import explain, installed_bytecode  # benchmarks/, beside this script

from vllm_offload_cli.core.host.discovery import discover
from vllm_offload_cli.core.reclaim.collector import collect
from vllm_offload_cli.core.reclaim.report import GcOptions
from vllm_offload_cli.core.region import SharedOffloadRegion

SLOT, WORLD, BLOCKS = 4096, 2, 2
ROW = SLOT * WORLD
SIZE = ROW * BLOCKS
STALE, PERSISTENT, LIVE_CORE, LIVE_VLLM, HOLDERS = 120, 40, 20, 20, 4


def stale_files(shm_dir: str) -> None:
    for i in range(STALE):
        names = [f"vllm_offload_stale{i}.mmap"] + ([f"vllm_offload_stale{i}.mmap.1"]
                                                   if i < 20 else [])
        for name in names:
            fd = os.open(os.path.join(shm_dir, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, SIZE)
            os.close(fd)


def hold(shm_dir: str, core_ids: list[str], vllm_ids: list[str], ready: int) -> None:
    """A holder process: keeps its regions until SIGTERM."""
    regions = [SharedOffloadRegion(e, BLOCKS, 0, ROW, SLOT, shm_dir=shm_dir, world_size=WORLD,
                                   populate_pages=False) for e in core_ids]
    maps = []
    for e in vllm_ids:
        fd = os.open(os.path.join(shm_dir, f"vllm_offload_{e}.mmap"),
                     os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, SIZE)
        maps.append(mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED))
        os.close(fd)  # like a vLLM worker that keeps only the mapping
    os.write(ready, b"x")
    signal.sigwait({signal.SIGTERM})
    del regions, maps


def start_holders(shm_dir: str) -> list[int]:
    pids = []
    per_core, per_vllm = LIVE_CORE // HOLDERS, LIVE_VLLM // HOLDERS
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        for h in range(HOLDERS):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    hold(shm_dir, [f"core{h}x{i}" for i in range(per_core)],
                         [f"vllm{h}x{i}" for i in range(per_vllm)], w)
                finally:
                    os._exit(0)
            os.close(w)
            os.read(r, 1)
            os.close(r)
            pids.append(pid)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    return pids


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def scandir_stat(shm_dir: str) -> None:
    with os.scandir(shm_dir) as it:
        for entry in it:
            entry.stat(follow_symlinks=False)


def run_cli(*args: str) -> None:
    subprocess.run([sys.executable, *args], check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--processes", type=int, default=300)
    args = parser.parse_args()
    bytecode = installed_bytecode()
    idle: list[subprocess.Popen[bytes]] = []
    shm_dir = tempfile.mkdtemp(prefix="vllm-offload-bench-", dir="/dev/shm")
    holders: list[int] = []
    try:
        for i in range(PERSISTENT):
            SharedOffloadRegion(f"pre{i}", BLOCKS, None, ROW, SLOT, shm_dir=shm_dir,
                                world_size=WORLD, create_only=True, persistent=True,
                                populate_pages=False).cleanup()
        holders = start_holders(shm_dir)
        idle = [subprocess.Popen(["sleep", "600"]) for _ in range(args.processes)]
        samples: dict[str, list[float]] = {k: [] for k in
                                           ("scandir", "discover", "gc-dry", "gc", "cli-gc",
                                            "python", "imports")}
        run_cli("-m", "vllm_offload_cli", "gc", "--help")  # warm-up: writes the bytecode
        for _ in range(args.repeat):
            stale_files(shm_dir)
            discover(shm_dir, measure_residency=False)  # warm: new files cost the first pass
            samples["scandir"].append(timed(lambda: scandir_stat(shm_dir)))
            samples["discover"].append(timed(lambda: discover(shm_dir,
                                                              measure_residency=False)))
            samples["gc-dry"].append(
                timed(lambda: collect(shm_dir, GcOptions(min_age=0, dry_run=True))))
            report = None

            def gc() -> None:
                nonlocal report
                report = collect(shm_dir, GcOptions(min_age=0))
            samples["gc"].append(timed(gc))
            assert report is not None and len(report.removed) == STALE, report
            assert len(report.kept) == PERSISTENT + LIVE_CORE + LIVE_VLLM
            stale_files(shm_dir)
            discover(shm_dir, measure_residency=False)
            samples["cli-gc"].append(timed(lambda: run_cli(
                "-m", "vllm_offload_cli", "gc", "--shm-dir", shm_dir, "--min-age", "0",
                "--json", "-q")))
            samples["python"].append(timed(lambda: run_cli("-c", "pass")))
            samples["imports"].append(timed(lambda: run_cli(
                "-c", "import vllm_offload_cli.cli.app, vllm_offload_cli.cli.gc, "
                "vllm_offload_cli.core.reclaim.collector")))
        procs = sum(1 for p in os.listdir("/proc") if p.isdigit())
        med = {k: statistics.median(v) for k, v in samples.items()}
        print(f"gc over {STALE + PERSISTENT + LIVE_CORE + LIVE_VLLM} regions ({STALE} stale, "
              f"{PERSISTENT} persistent, {LIVE_CORE + LIVE_VLLM} live), {procs} processes, "
              f"median of {args.repeat} runs, {os.cpu_count()} CPUs; {bytecode}")
        for name, value in med.items():
            print(f"  {name:<9} {value * 1000:9.2f} ms")
        print(f"  gc / scandir      {med['gc'] / med['scandir']:8.1f}x")
        print(f"  gc / discover     {med['gc'] / med['discover']:8.2f}x")
        print(f"  gc-dry / discover {med['gc-dry'] / med['discover']:8.2f}x")
        print(explain("gc --json", med["cli-gc"], med["gc"], med["python"], med["imports"],
                      200))
        print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        for p in idle:
            p.kill()
            p.wait()
        for pid in holders:
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)
        shutil.rmtree(shm_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
