"""Fault campaign (not a speed benchmark): gc against holders it cannot see.

Repeats each scenario of issue 9's blind-spot rows with real processes and
counts what gc did to a region that was in use the whole time: each round
makes one held region and runs gc three times (plain, --dry-run,
--all-users). Needs root, setpriv and unshare; a scenario this host does not
permit is reported as skipped. Prints one row per scenario: rounds (held
regions), gc runs, exit codes seen, held regions wrongly removed (must be 0).

Usage: python benchmarks/faults_blind_spots.py [--rounds N]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

SNEAKY = Path(__file__).resolve().parent.parent / "tests" / "helpers" / "sneaky_holder.py"
CLI = [sys.executable, "-m", "vllm_offload_cli"]
NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
WEAK_ROOT = ["setpriv", "--bounding-set=-sys_ptrace,-lease", "--inh-caps=-sys_ptrace,-lease"]
PIDNS = ["unshare", "--pid", "--fork", "--mount-proc"]
HIDEPID = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
           'mount -t proc -o hidepid=2 proc /proc && exec "$@"', "sh"]


def region(d: Path, name: str, owner: int = 0) -> Path:
    path = d / f"vllm_offload_{name}.mmap"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 1 << 16)
    os.pwrite(fd, b"\1" * (1 << 16), 0)
    os.fchown(fd, owner, owner)
    os.close(fd)
    return path


def hold(cmd: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if not proc.stdout.readline().startswith("ready"):
        raise RuntimeError(f"holder failed: {cmd}")
    return proc


def gc(prefix: list[str], d: Path, *extra: str) -> int:
    cmd = [*prefix, *CLI, "gc", "--shm-dir", str(d), "--min-age", "0", "--json", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    json.loads(proc.stdout)  # always one document
    return proc.returncode


Scenario = Callable[[Path], tuple[list[str], list[str], int]]


def pid_namespace(d: Path) -> tuple[list[str], list[str], int]:
    path = region(d, "r")
    return [sys.executable, str(SNEAKY), str(path), "map-quiet"], PIDNS, 0


def non_dumpable_same_user(d: Path) -> tuple[list[str], list[str], int]:
    path = region(d, "r", owner=65534)
    return ([*NOBODY, "/usr/bin/python3", str(SNEAKY), str(path), "map", "--non-dumpable"],
            NOBODY, 65534)


def no_lease_weak_root(d: Path) -> tuple[list[str], list[str], int]:
    path = region(d, "r", owner=65534)
    return ([*NOBODY, "/usr/bin/python3", str(SNEAKY), str(path), "fd", "--non-dumpable"],
            WEAK_ROOT, 65534)


def removed_hard_link(d: Path) -> tuple[list[str], list[str], int]:
    path = region(d, "r")
    return [sys.executable, str(SNEAKY), str(path), "fd", "--via-link", str(d / "alias")], [], 0


def hidepid(d: Path) -> tuple[list[str], list[str], int]:
    path = region(d, "r")
    return [sys.executable, str(SNEAKY), str(path), "map"], HIDEPID, 0


SCENARIOS: dict[str, Scenario] = {
    "other PID namespace (mapped, untouched)": pid_namespace,
    "hidepid=2 /proc": hidepid,
    "non-dumpable holder, gc as same user": non_dumpable_same_user,
    "hidden fd holder, root w/o PTRACE+LEASE": no_lease_weak_root,
    "fd via a removed hard link": removed_hard_link,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root")
    print(f"{'scenario':42} {'rounds':>6} {'gc runs':>7}  exit codes        wrongly removed")
    for name, scenario in SCENARIOS.items():
        codes: collections.Counter[int] = collections.Counter()
        lost = runs = rounds = 0
        skipped = ""
        for _ in range(args.rounds):
            d = Path(tempfile.mkdtemp(prefix="vllm-offload-faults-", dir="/dev/shm"))
            os.chmod(d, 0o1777)
            holder = None
            try:
                holder_cmd, prefix, _owner = scenario(d)
                holder = hold(holder_cmd)
                rounds += 1
                for extra in ((), ("--dry-run",), ("--all-users",)):
                    try:
                        codes[gc(prefix, d, *extra)] += 1
                    except (json.JSONDecodeError, subprocess.SubprocessError) as exc:
                        skipped = f"not permitted here ({type(exc).__name__})"
                        break
                    runs += 1
                lost += not (d / "vllm_offload_r.mmap").exists()
            finally:
                if holder is not None:
                    holder.kill()
                    holder.wait()
                shutil.rmtree(d, ignore_errors=True)
            if skipped:
                break
        shown = ", ".join(f"{c}x{n}" for c, n in sorted(codes.items()))
        print(f"{name:42} {rounds:>6} {runs:>7}  {shown:17} {lost}"
              f"{'  ' + skipped if skipped else ''}")


if __name__ == "__main__":
    main()
