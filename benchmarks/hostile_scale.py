"""What 20 processes of one user with ~20,000 descriptors and 30,000 mappings each cost
root's `inspect`, `gc` and one engine claim.

The attack from issue 24: any user can open and map files on /dev/shm, and
every command walks every process's descriptors and mappings. Memory stays
small: each attacker maps one 4 KiB file 30,000 times (separate mappings:
same offset, so the kernel cannot merge them) and dups one descriptor of it
19,900 times (RLIMIT_NOFILE raised in the child up to the hard limit). The attacker file lives in
the benchmark's shm directory, so no device filter can skip it.

Times, median of --repeat runs, in this process:
  discover   the inventory `inspect --json` builds (no residency)
  gc-dry     collect(dry_run=True) over STALE stale regions (3 batches of 64)
  gc         collect(): the same, removing them (recreated before each run)
  claim      startup_lock + claim() of an engine_id with a stale leftover
Also prints how many /proc passes (processes.pids() calls) each made.
Usage: python benchmarks/hostile_scale.py [--repeat N] [--procs 20] [--fds 20000]
       [--maps 30000]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable

from vllm_offload_cli.core.host.discovery import discover
from vllm_offload_cli.core.reclaim.collector import collect
from vllm_offload_cli.core.reclaim.report import GcOptions
from vllm_offload_cli.core.system import processes
from vllm_offload_cli.engine.claim import claim, startup_lock

STALE = 130
SIZE = 8192

# libc mmap, not mmap.mmap: Python's mmap keeps a dup of the descriptor per mapping
ATTACKER = """
import ctypes, os, resource, sys
path, fds, maps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
want = fds + 50 if hard == resource.RLIM_INFINITY else min(fds + 50, hard)
resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
fds = min(fds, want - 50)
fd = os.open(path, os.O_RDONLY)
held = [os.dup(fd) for _ in range(fds - 1)]
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
for _ in range(maps):
    if libc.mmap(None, 4096, 1, 1, fd, 0) in (None, ctypes.c_void_p(-1).value):
        sys.exit("mmap: " + os.strerror(ctypes.get_errno()))
print("ready", flush=True)
sys.stdin.read()
"""


def stale_files(shm_dir: str, prefix: str, count: int) -> None:
    for i in range(count):
        fd = os.open(os.path.join(shm_dir, f"vllm_offload_{prefix}{i}.mmap"),
                     os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, SIZE)
        os.close(fd)


class _Counter:
    """Counts /proc passes: calls of processes.pids()."""

    def __init__(self) -> None:
        self.calls = 0
        self.real = processes.pids

    def __call__(self) -> list[int]:
        self.calls += 1
        return self.real()


def timed(fn: Callable[[], object], repeat: int, before: Callable[[], None] | None = None
          ) -> tuple[float, int]:
    import time

    times, passes = [], 0
    counter = _Counter()
    processes.pids = counter  # type: ignore[assignment]
    try:
        for _ in range(repeat):
            if before is not None:
                before()
            counter.calls = 0
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            passes = counter.calls
    finally:
        processes.pids = counter.real  # type: ignore[assignment]
    times.sort()
    return times[len(times) // 2], passes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--procs", type=int, default=20)
    ap.add_argument("--fds", type=int, default=19900)  # a 20,000 hard limit is common
    ap.add_argument("--maps", type=int, default=30000)
    args = ap.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < args.fds + 50:
        sys.exit(f"RLIMIT_NOFILE hard limit {hard} is below --fds {args.fds} + 50")
    shm = tempfile.mkdtemp(prefix="vllm-offload-hostile-", dir="/dev/shm")
    attackers: list[subprocess.Popen[str]] = []
    try:
        junk = os.path.join(shm, "junk")
        with open(junk, "wb") as f:
            f.write(b"\0" * 4096)
        for _ in range(args.procs):
            p = subprocess.Popen([sys.executable, "-c", ATTACKER, junk, str(args.fds),
                                  str(args.maps)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
            attackers.append(p)
        for p in attackers:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                sys.exit("an attacker process failed to start")

        def fresh() -> None:
            stale_files(shm, "stale", STALE)

        def fresh_one() -> None:
            stale_files(shm, "claimed", 1)

        def one_claim() -> None:
            with startup_lock(shm, timeout=60):
                claim("claimed0", shm_dir=shm, token=None)

        fresh()
        rows = [
            ("discover", *timed(lambda: discover(shm, measure_residency=False), args.repeat)),
            ("gc-dry", *timed(lambda: collect(shm, GcOptions(dry_run=True, min_age=0)),
                              args.repeat)),
            ("gc", *timed(lambda: collect(shm, GcOptions(min_age=0)), args.repeat, before=fresh)),
            ("claim", *timed(one_claim, args.repeat, before=fresh_one)),
        ]
        print(f"{args.procs} processes x {args.fds} descriptors and {args.maps} mappings; "
              f"{STALE} stale regions")
        for name, seconds, passes in rows:
            print(f"{name:10s} {seconds:8.2f} s   /proc passes: {passes}")
    finally:
        for p in attackers:
            p.kill()
            p.wait()
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
