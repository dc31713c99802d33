"""Time `vllm-offload fleet inspect` against the node-local inspects it replaces.

Starts a local Ray cluster of N nodes on this machine (ray.cluster_utils), each
with its own private shm dir holding R small regions (a third held by a real
process, a third persistent, a third stale), and times, in the same run:
  local inspect x N     `inspect --json` as a subprocess once per node dir, summed
                        (what an operator does with ssh, minus the ssh)
  fleet inspect         `fleet inspect --json` as a subprocess: Ray import,
                        connect, one pinned task per node, merge
  fleet, connected      the same from a driver already connected to Ray
                        (the tasks and the merge alone)
Then prints the fleet's table once. Needs the ray extra. As root it re-runs itself
in a private network namespace (loopback only), as the tests do: Ray otherwise
gives every node the host's interface address.
Usage: python benchmarks/fleet_inspect.py [--nodes 3] [--regions 30] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import ray
from ray.cluster_utils import Cluster
from scale_fixtures import HOLDER, median_time  # benchmarks/, beside this script

from vllm_offload_cli.cli.fleet import run_fleet
from vllm_offload_cli.core.region import SharedOffloadRegion

NODE = {"num_cpus": 1, "object_store_memory": 80 * 1024 * 1024}
def populate(shm: str, node: int, regions: int, procs: list[subprocess.Popen[str]]) -> None:
    """A third held by a live process, a third persistent (`create`), a third leaked."""
    ids = [f"n{node}r{i:03d}_dp{i % 4}" for i in range(regions)]
    third = len(ids) // 3
    for engine_id in ids[third:2 * third]:
        SharedOffloadRegion(engine_id, 4, None, 4096, 4096, shm_dir=shm,
                            persistent=True).cleanup()
    old = time.time() - 3600
    for engine_id in ids[2 * third:]:
        path = os.path.join(shm, f"vllm_offload_{engine_id}.mmap")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4 * 4096)
        os.close(fd)
        os.utime(path, (old, old))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, shm, *ids[:third]],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    procs.append(proc)


def run(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "vllm_offload_cli", *args], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--regions", type=int, default=30, help="per node")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    dirs = [tempfile.mkdtemp(prefix="vllm-offload-bench-", dir="/dev/shm")
            for _ in range(args.nodes)]
    procs: list[subprocess.Popen[str]] = []
    cluster = Cluster(initialize_head=True, head_node_args={
        **NODE, "include_dashboard": False, "env_vars": {"VLLM_OFFLOAD_SHM_DIR": dirs[0]}})
    try:
        for d in dirs[1:]:
            cluster.add_node(**NODE, env_vars={"VLLM_OFFLOAD_SHM_DIR": d})
        cluster.wait_for_nodes()
        for i, d in enumerate(dirs):
            populate(d, i, args.regions, procs)
        env_free = {k: v for k, v in os.environ.items() if k != "VLLM_OFFLOAD_SHM_DIR"}
        os.environ.clear()
        os.environ.update(env_free)
        run("fleet", "inspect", "--address", cluster.address, "--json")  # warm the workers
        local = median_time(lambda: [run("inspect", "--json", "--shm-dir", d) for d in dirs],
                            args.repeat)
        fleet = median_time(lambda: run("fleet", "inspect", "--address", cluster.address,
                                        "--json"), args.repeat)
        options = {"engine_ids": None, "fmt": "table", "output": None,
                   "no_residency": False}
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        try:
            connected = median_time(lambda: run_fleet("inspect", options, shm_dir=None,
                                                      address=None, timeout=60), args.repeat)
        finally:
            ray.shutdown()
        total = args.nodes * args.regions
        print(f"{args.nodes} nodes x {args.regions} regions ({total} in all), median of "
              f"{args.repeat}:")
        print(f"  local inspect x {args.nodes} (sum)  {local:7.3f} s")
        print(f"  fleet inspect               {fleet:7.3f} s  ({fleet / local:.2f}x the sum)")
        print(f"  fleet, driver connected     {connected:7.3f} s")
        print()
        sys.stdout.flush()
        subprocess.run([sys.executable, "-m", "vllm_offload_cli", "fleet", "inspect",
                        "--address", cluster.address, "--no-residency"], timeout=300,
                       check=False)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        cluster.shutdown()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    if os.geteuid() == 0 and os.environ.get("VLLM_OFFLOAD_TEST_NETNS") != "1" \
            and shutil.which("unshare") and shutil.which("ip"):
        os.environ["VLLM_OFFLOAD_TEST_NETNS"] = "1"
        argv = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
                sys.executable, *sys.argv]
        os.execvp(argv[0], argv)
    main()
