"""What the engine hook adds to a start-up: W ranks opening one region, with and without it.

Both runs start W real processes at once against the same geometry in a
fresh private shm directory, in the same run:
  plain   SharedOffloadRegion straight away (the core as vLLM would use it)
  hook    open_region(): start-up lock, claim (discovery of the name), open, slot check
  stale   the hook again, after a SIGKILLed engine left its region: one rank reclaims it
Reported: wall time until every rank has its region (median of --repeat), no pre-fault
(vLLM does that after the hook). The hook serialises ranks, so its cost grows with W.

With --hostile-procs P, P processes of another user (nobody, when run as root) each
hold --hostile-files unlinked region-named files in the shm directory throughout
(issue 30's attack on start-up), and the claim's look at its name is timed too, in
this process: `discover(engine_ids=[id])` (what each rank's claim did before: a walk
of every process) against `discover_engine` (what it does now); and the look
`engine.claim.make_room` takes at this user's regions when a new one does not fit.
Usage: python benchmarks/engine_startup.py [--world-size 8] [--repeat 3]
       [--hostile-procs 20 --hostile-files 19900]
"""

from __future__ import annotations

import argparse
import os
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
from vllm_offload_cli.engine.region_hold import RegionRequest, open_region
mode, shm, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
stride = world * {PAGE}
if mode == "plain":
    r = SharedOffloadRegion("bench", {BLOCKS}, rank, stride, {PAGE}, shm_dir=shm,
                            world_size=world, populate_pages=False)
else:
    r = open_region(RegionRequest(engine_id="bench", num_blocks={BLOCKS}, rank=rank,
                                  row_stride=stride, cpu_page_size={PAGE}, world_size=world),
                    token=os.environ["VLLM_OFFLOAD_ENGINE_TOKEN"], shm_dir=shm).region
print(time.monotonic(), flush=True)
sys.stdin.read()
"""


# argv: DIR COUNT; creates COUNT region-named files, unlinks each, keeps it open
HOSTILE = """
import os, resource, sys
d, n = sys.argv[1], int(sys.argv[2])
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 50 if hard < 0 else min(n + 50, hard), hard))
held = []
for i in range(n):
    path = os.path.join(d, f"vllm_offload_atk{os.getpid()}x{i}.mmap")
    held.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    os.unlink(path)
print("ready", flush=True)
sys.stdin.read()
"""


def hostile(shm: str, procs: int, files: int) -> list[subprocess.Popen[str]]:
    """`procs` processes of nobody (when we are root) holding `files` unlinked files each."""
    os.chmod(shm, 0o1777)  # like /dev/shm: anyone may make names in it
    drop = (["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
            if os.geteuid() == 0 else [])
    started = [subprocess.Popen([*drop, sys.executable, "-S", "-c", HOSTILE, shm, str(files)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for _ in range(procs)]
    for p in started:
        if p.stdout is None or p.stdout.readline().strip() != "ready":
            sys.exit("a hostile process failed to start")
    return started


def looks(shm: str, repeat: int) -> None:
    """The claim's look at its name, and make_room's at this user's regions (when a
    region does not fit): before (a walk of every process) and now."""
    from vllm_offload_cli.core.host import visibility
    from vllm_offload_cli.core.host.discovery import discover, discover_engine

    me = os.geteuid()
    for name, look in (
            ("claim's look before", lambda: discover(shm, engine_ids=["bench"],
                                                     measure_residency=False)),
            ("claim's look now", lambda: discover_engine(shm, "bench")),
            ("room's look before", lambda: discover(shm, measure_residency=False)),
            ("room's look now", lambda: discover(shm, measure_residency=False,
                                                 judge_uids=[me],
                                                 only=visibility.MayOpen(me, 0o600)))):
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            look()
            times.append(time.perf_counter() - t0)
        print(f"{name:20s} {statistics.median(times) * 1000:9.1f} ms (median of {repeat})")


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
    parser.add_argument("--hostile-procs", type=int, default=0)
    parser.add_argument("--hostile-files", type=int, default=19900)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"plain": [], "hook": [], "stale": []}
    for _ in range(args.repeat):
        shm = tempfile.mkdtemp(prefix="vllm-offload-bench-", dir="/dev/shm")
        attackers = hostile(shm, args.hostile_procs, args.hostile_files)
        try:
            if attackers and not results["plain"]:
                print(f"{len(attackers)} processes of another user hold "
                      f"{args.hostile_files} unlinked region-named files each")
                looks(shm, args.repeat)
            for mode in ("plain", "hook"):
                seconds, procs = start(mode, shm, args.world_size, secrets.token_hex(16))
                results[mode].append(seconds)
                stop(procs, kill=mode == "hook")  # the hook run leaves a stale region
            seconds, procs = start("hook", shm, args.world_size, secrets.token_hex(16))
            results["stale"].append(seconds)
            stop(procs)
        finally:
            for p in attackers:
                p.kill()
                p.wait()
            shutil.rmtree(shm, ignore_errors=True)
    base = statistics.median(results["plain"])
    for mode, values in results.items():
        med = statistics.median(values)
        print(f"{mode:6s} {args.world_size} ranks ready in {med * 1000:7.1f} ms "
              f"(median of {len(values)}; {med / base:4.2f}x plain)")


if __name__ == "__main__":
    main()
