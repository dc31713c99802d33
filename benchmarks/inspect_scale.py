"""Time `vllm-offload inspect --json` over many regions and many processes.

Sets up, in a private directory on /dev/shm: N small regions (a third held by
real holder processes through the core, a third persistent, a third stale)
plus P idle processes, so the /proc scan has real work. Then it times, in the
same run:
  python-startup   `python -c pass` (the floor for any Python CLI)
  scandir+stat     listing and stat'ing the same directory in-process
  discover()       the core's discovery, in-process
  in-process       what `inspect --json` runs: discover() and the placement observed
  imports          `python -c 'import ...'` of what `inspect --json` loads
  inspect --json   the real CLI as a subprocess (what an operator or cron runs)
and explains the difference between the process and the in-process figure.
Target: inspect --json <= 250 ms (median).
Usage: python benchmarks/inspect_scale.py [--regions 200] [--processes 300] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from scale_fixtures import (  # benchmarks/, beside this script
    HOLDER,
    explain,
    installed_bytecode,
    median_time,
    stop_all,
)

from vllm_offload_cli.core.host.discovery import discover
from vllm_offload_cli.core.host.observed_placement import observe_all
from vllm_offload_cli.core.region import SharedOffloadRegion
from vllm_offload_cli.core.region.geometry import PAGESIZE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regions", type=int, default=200)
    ap.add_argument("--processes", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    bytecode = installed_bytecode()
    shm = tempfile.mkdtemp(prefix="vllm-offload-bench-", dir="/dev/shm")
    procs: list[subprocess.Popen[str]] = []
    try:
        ids = [f"bench{i:04d}_dp{i % 8}" for i in range(args.regions)]
        live, rest = ids[: len(ids) // 3], ids[len(ids) // 3:]
        for i, engine_id in enumerate(rest):
            r = SharedOffloadRegion(engine_id, 4, None, PAGESIZE, PAGESIZE, shm_dir=shm,
                                    persistent=i % 2 == 0)
            r.persistent = True  # leave it behind: persistent or (by manifest) stale
            r.cleanup()
        chunk = 10  # ten live regions per holder process
        for i in range(0, len(live), chunk):
            p = subprocess.Popen([sys.executable, "-c", HOLDER, shm, *live[i:i + chunk]],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            procs.append(p)
        idle = [subprocess.Popen(["sleep", "600"]) for _ in range(args.processes)]
        nproc = sum(1 for e in os.listdir("/proc") if e.isdigit())
        found = discover(shm)
        states = {s: sum(r.state == s for r in found.regions)
                  for s in ("live", "persistent", "stale")}

        def scandir_stat() -> None:
            with os.scandir(shm) as it:
                for entry in it:
                    entry.stat(follow_symlinks=False)

        cli = [sys.executable, "-m", "vllm_offload_cli", "inspect", "--json", "--shm-dir", shm]
        imports = [sys.executable, "-c", "import vllm_offload_cli.cli.app, "
                   "vllm_offload_cli.cli.inspect"]
        for argv in (cli, imports):  # warm-up, not timed: writes the bytecode
            subprocess.run(argv, check=True, capture_output=True)
        rows = [
            ("python-startup", median_time(
                lambda: subprocess.run([sys.executable, "-c", "pass"], check=True),
                args.repeat)),
            ("scandir+stat", median_time(scandir_stat, args.repeat)),
            ("discover()", median_time(lambda: discover(shm), args.repeat)),
            ("in-process", median_time(lambda: observe_all(discover(shm).regions),
                                       args.repeat)),
            ("imports", median_time(lambda: subprocess.run(imports, check=True),
                                    args.repeat)),
            ("inspect --json", median_time(
                lambda: subprocess.run(cli, check=True, capture_output=True), args.repeat)),
        ]
        for p in idle:
            p.kill()
    finally:
        stop_all(procs, shm)
    print(f"{len(found.regions)} regions ({states}), {nproc} processes in /proc, "
          f"{os.cpu_count()} CPUs; median of {args.repeat}; {bytecode}")
    base = rows[0][1]
    for name, t in rows:
        print(f"{name:<16} {t * 1000:8.1f} ms   {t / base:5.2f}x python-startup")
    med = dict(rows)
    print(explain("inspect --json", med["inspect --json"], med["in-process"],
                  med["python-startup"], med["imports"], 250))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
