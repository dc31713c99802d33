"""What the engine hook adds to a start-up: W ranks opening one region, with and without it.

Both runs start W real processes at once against the same geometry in a
fresh private shm directory, in the same run:
  plain   SharedOffloadRegion straight away (the core as vLLM would use it)
  hook    open_region(): start-up lock, claim (discovery of the name), open, slot check
  stale   the hook again, after a SIGKILLed engine left its region: one rank reclaims it
Reported: wall time until every rank has its region (median of --repeat), no pre-fault
(vLLM does that after the hook). The hook serialises ranks, so its cost grows with W.
Usage: python benchmarks/engine_startup.py [--world-size 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PAGE = 64 * 1024
BLOCKS = 64

RANK = f"""
import os, sys, time
from vllm_offload_cli.core.region import SharedOffloadRegion
from vllm_offload_cli.engine import RegionRequest, open_region
mode, shm, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
stride = world * {PAGE}
if mode == "plain":
    r = SharedOffloadRegion("bench", {BLOCKS}, rank, stride, {PAGE}, shm_dir=shm,
                            world_size=world, populate_pages=False)
else:
    r = open_region(RegionRequest("bench", {BLOCKS}, rank, stride, {PAGE}, world),
                    token=os.environ["VLLM_OFFLOAD_ENGINE_TOKEN"], shm_dir=shm).region
print(time.monotonic(), flush=True)
sys.stdin.read()
"""


def start(mode: str, shm: str, world: int, token: str) -> tuple[float, list[subprocess.Popen[str]]]:
    env = {"VLLM_OFFLOAD_ENGINE_TOKEN": token, "PATH": ""}
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, mode, shm, str(k), str(world)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=env) for k in range(world)]
    done = max(float(p.stdout.readline()) for p in procs if p.stdout is not None)
    return done - t0, procs


def stop(procs: list[subprocess.Popen[str]], kill: bool = False) -> None:
    for p in procs:
        if kill:
            p.kill()
        else:
            p.communicate("")
        p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"plain": [], "hook": [], "stale": []}
    for _ in range(args.repeat):
        shm = tempfile.mkdtemp(prefix="vllm-offload-bench-", dir="/dev/shm")
        try:
            for mode in ("plain", "hook"):
                seconds, procs = start(mode, shm, args.world_size, secrets.token_hex(16))
                results[mode].append(seconds)
                stop(procs, kill=mode == "hook")  # the hook run leaves a stale region
            seconds, procs = start("hook", shm, args.world_size, secrets.token_hex(16))
            results["stale"].append(seconds)
            stop(procs)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
    base = statistics.median(results["plain"])
    for mode, values in results.items():
        med = statistics.median(values)
        print(f"{mode:6s} {args.world_size} ranks ready in {med * 1000:7.1f} ms "
              f"(median of {len(values)}; {med / base:4.2f}x plain)")


if __name__ == "__main__":
    main()
