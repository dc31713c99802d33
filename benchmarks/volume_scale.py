"""What another user's volume costs root's `gc` and `inspect` (issue 30), as processes.

Scenarios (each in a fresh directory on /dev/shm, mode 1777, removed afterwards):
  empty   --files N empty region-named files of user nobody (made in seconds, no process
          left) beside root's stale 8 MiB region; `gc --all-users --timeout 55s` (the
          cron line): time, peak RSS, exit status, whether root's region went
  held    --procs P processes of nobody, each holding --held F unlinked region-named
          files; `inspect` (JSON, textfile) and `gc --all-users --timeout 55s`: time, RSS
  fds     --procs P processes of nobody with --fds descriptors and --maps mappings of
          one file (hostile_scale.ATTACKER); `inspect`, `gc` against `lsof +D DIR`
With --before TREE (a checkout of an earlier commit) each command also runs from TREE
in the same run, for before/after figures. Needs root (setpriv to nobody).
Usage: python benchmarks/volume_scale.py [empty|held|fds ...] [--files 1000000]
       [--procs 20] [--held 19900] [--fds 20000] [--maps 30000] [--before TREE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hostile_scale import ATTACKER

NOBODY = 65534
PY = "/usr/bin/python3"  # one that user nobody can run
VICTIM = 8 << 20
CRON = ["--all-users", "--min-age", "0", "--timeout", "55s", "--json"]

MAKE_EMPTY = """
import os, sys
d, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    os.close(os.open(f"{d}/vllm_offload_junk{i}.mmap", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
"""

HOLD = """
import os, resource, sys
d, prefix, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held = []
for i in range(min(n, hard - 50)):
    p = f"{d}/vllm_offload_{prefix}{i}.mmap"
    held.append(os.open(p, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    os.unlink(p)
print("ready", flush=True)
sys.stdin.read()
"""


def as_nobody(*argv: str) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]


@contextmanager
def shared_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="vllm-offload-volume-", dir="/dev/shm")
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def victim(d: str) -> str:
    path = f"{d}/vllm_offload_victim.mmap"
    with open(path, "wb") as f:
        f.write(b"\1" * VICTIM)
    os.chmod(path, 0o600)
    return path


def measure(tree: str | None, *args: str, watch: str | None = None) -> dict[str, object]:
    """One CLI run as a process: wall seconds, peak RSS (MiB), exit status, JSON data,
    and (with `watch`) the seconds until that path was gone."""
    cwd = tree or str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": cwd}
    began = time.monotonic()
    gone: list[float] = []

    def watcher() -> None:
        while watch is not None and os.path.exists(watch) and proc.poll() is None:
            time.sleep(0.05)
        if watch is not None and not os.path.exists(watch):
            gone.append(time.monotonic() - began)
    # GNU time forks the command from its own small image: the peak RSS of a child
    # spawned from here would start at this process's (Linux keeps it over exec)
    proc = subprocess.Popen(["/usr/bin/time", "-f", "%M", sys.executable, "-m",
                             "vllm_offload_cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    thread = threading.Thread(target=watcher, daemon=True)
    thread.start()
    out, err = proc.communicate()
    took = time.monotonic() - began
    thread.join()
    try:
        data = json.loads(out)["data"]
    except (ValueError, KeyError):
        data = {}
    return {"seconds": round(took, 2), "rss_mib": round(int(err.split()[-1]) / 1024, 1),
            "exit": proc.returncode, "json_bytes": len(out), "data": data,
            "gone_after": round(gone[0], 2) if gone else None}


def show(label: str, r: dict[str, object], extra: str = "") -> None:
    print(f"  {label:<28} {r['seconds']:>8.2f} s {r['rss_mib']:>8.1f} MiB  exit {r['exit']}"
          f"  json {r['json_bytes']} B {extra}", flush=True)


def trees(before: str | None) -> list[tuple[str, str | None]]:
    return [("after", None)] + ([("before", before)] if before else [])


def empty(n: int, before: str | None) -> None:
    print(f"empty: {n} empty region-named files of nobody + root's stale region", flush=True)
    for label, tree in trees(before):
        with shared_dir() as d:
            began = time.monotonic()
            subprocess.run(as_nobody(PY, "-c", MAKE_EMPTY, d, str(n)), check=True)
            made = time.monotonic() - began
            path = victim(d)
            r = measure(tree, "gc", "--shm-dir", d, *CRON, watch=path)
            data = r["data"] if isinstance(r["data"], dict) else {}
            show(f"gc {label}", r, f"victim gone after {r['gone_after']} s; removed "
                 f"{len(data.get('removed', []))}; not judged "
                 f"{data.get('not_judged_files', '-')} (files made in {made:.1f} s)")


def held(procs: int, files: int, before: str | None) -> None:
    print(f"held: {procs} processes of nobody x {files} held unlinked files", flush=True)
    with shared_dir() as d:
        holders = [subprocess.Popen(as_nobody(PY, "-c", HOLD, d, f"p{i}_", str(files)),
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                   for i in range(procs)]
        try:
            for h in holders:
                assert h.stdout is not None and h.stdout.readline().strip() == "ready"
            victim(d)
            for label, tree in trees(before):
                for fmt in ("json", "prometheus"):  # the textfile was OOM-killed at 4 GiB
                    show(f"inspect -f {fmt} {label}", measure(
                        tree, "inspect", "--shm-dir", d, "-f", fmt, "--timeout", "300s"))
                show(f"gc --dry-run {label}", measure(tree, "gc", "--shm-dir", d, *CRON,
                                                      "--dry-run"))
        finally:
            for h in holders:
                h.communicate("")


def fds(procs: int, nfds: int, nmaps: int, before: str | None) -> None:
    print(f"fds: {procs} processes of nobody x {nfds} fds + {nmaps} maps vs lsof +D",
          flush=True)
    with shared_dir() as d:
        target = f"{d}/attacker.bin"
        with open(target, "wb") as f:
            f.write(b"\0" * 4096)
        os.chmod(target, 0o644)
        victim(d)
        attackers = [subprocess.Popen(as_nobody(PY, "-c", ATTACKER, target, str(nfds),
                                                str(nmaps)),
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                     for _ in range(procs)]
        try:
            for a in attackers:
                assert a.stdout is not None and a.stdout.readline().strip() == "ready"
            began = time.monotonic()
            subprocess.run(["lsof", "+D", d], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, check=False)
            print(f"  {'lsof +D':<28} {time.monotonic() - began:>8.2f} s", flush=True)
            for label, tree in trees(before):
                show(f"inspect --json {label}", measure(tree, "inspect", "--shm-dir", d,
                                                         "--json"))
                show(f"gc --dry-run {label}", measure(tree, "gc", "--shm-dir", d, *CRON,
                                                      "--dry-run"))
        finally:
            for a in attackers:
                a.communicate("")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenarios", nargs="*", default=["empty", "held", "fds"])
    p.add_argument("--files", type=int, default=1_000_000)
    p.add_argument("--procs", type=int, default=20)
    p.add_argument("--held", type=int, default=19_900)
    p.add_argument("--fds", type=int, default=20_000)
    p.add_argument("--maps", type=int, default=30_000)
    p.add_argument("--before", help="a checkout of an earlier commit, run in the same run")
    a = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (runs the attacks as user nobody)")
    for s in a.scenarios:
        if s == "empty":
            empty(a.files, a.before)
        elif s == "held":
            held(a.procs, a.held, a.before)
        elif s == "fds":
            fds(a.procs, a.fds, a.maps, a.before)
        else:
            raise SystemExit(f"unknown scenario {s}")


if __name__ == "__main__":
    main()
