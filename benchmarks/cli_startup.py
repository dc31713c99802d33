"""Does `vllm-offload` start like a system tool? Process start-up, measured in one run.

Sets up N regions held by real processes (through the core) in a private
directory on /dev/shm and times, as processes, in the same run (median of
--repeat runs each, interleaved so that load on a shared host hits every row
alike):
  python -c pass            the floor for any Python CLI
  python -c "import click"  the floor for a click CLI (ours)
  python -c "import typer"  the floor for a typer CLI (the target's yardstick; where installed)
  python -c "import click, psutil"  the floor for inspect (framework and process library)
  vllm-offload --version    target: within 1.5x of import typer
  inspect --json            on the N held regions; target: within 2.5x of lsof +D
  inspect --json --no-residency
  inspect (table)           the same scan, printed for people
  lsof +D DIR               what an operator would otherwise run on the same directory
The console script's own wrapper is used when it is beside the interpreter,
else `python -m vllm_offload_cli`. `--compare DIR` adds `python -m
vllm_offload_cli` rows for another copy of the package (DIR holds its
`vllm_offload_cli/`, e.g. `git archive OLD vllm_offload_cli | tar -x -C DIR`) and
for this one, so a change is measured before and after in one run.
Usage: python benchmarks/cli_startup.py [--regions 50] [--repeat 15] [--compare DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scale_fixtures import HOLDER, installed_bytecode, stop_all  # benchmarks/, beside this script

FLOOR = "python -c 'import click, psutil'"


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("vllm-offload")
    return [str(script)] if script.exists() else [sys.executable, "-m", "vllm_offload_cli"]


def _time(argv: list[str], env: dict[str, str] | None) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=env)
    return time.perf_counter() - t0


def _compared(other: Path, shm: str
              ) -> list[tuple[str, list[str], str | None, float, dict[str, str] | None]]:
    """`python -m vllm_offload_cli` rows for `other`'s package and for this one."""
    here = str(Path(__file__).resolve().parent.parent)
    rows: list[tuple[str, list[str], str | None, float, dict[str, str] | None]] = []
    for label, root in (("compared", str(other)), ("this", here)):
        env = {**os.environ, "PYTHONPATH": root}
        module = [sys.executable, "-m", "vllm_offload_cli"]
        for what, extra in (("--version", ["--version"]),
                            ("inspect --json", ["inspect", "--json", "--shm-dir", shm]),
                            ("inspect (table)", ["inspect", "--shm-dir", shm]),
                            ("gc -n --json", ["gc", "-n", "--json", "--shm-dir", shm])):
            rows.append((f"{label}: {what}", [*module, *extra], None, 0, env))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regions", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--compare", type=Path, metavar="DIR",
                    help="another copy of the package to time beside this one")
    args = ap.parse_args()
    if args.repeat < 11:
        ap.error("--repeat must be at least 11 (medians of at least 11 runs)")
    lsof = shutil.which("lsof")
    bytecode = installed_bytecode()
    shm = tempfile.mkdtemp(prefix="vllm-offload-bench-", dir="/dev/shm")
    procs: list[subprocess.Popen[str]] = []
    try:
        ids = [f"startup{i:04d}" for i in range(args.regions)]
        for i in range(0, len(ids), 10):  # ten regions per holder process
            p = subprocess.Popen([sys.executable, "-c", HOLDER, shm, *ids[i:i + 10]],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            procs.append(p)
        cli = _cli()
        typer = "python -c 'import typer'"
        rows: list[tuple[str, list[str], str | None, float, dict[str, str] | None]] = [
            ("python -c pass", [sys.executable, "-c", "pass"], None, 0, None),
            ("python -c 'import click'", [sys.executable, "-c", "import click"], None, 0, None),
            # what any inspect loads before reading a byte: its CLI framework and the
            # process library (the floor under the inspect row)
            (FLOOR, [sys.executable, "-c", "import click, psutil"], None, 0, None),
            ("vllm-offload --version", [*cli, "--version"], typer, 1.5, None),
            ("inspect --json", [*cli, "inspect", "--json", "--shm-dir", shm], "lsof +D DIR",
             2.5, None),
            ("inspect --json --no-residency",
             [*cli, "inspect", "--json", "--no-residency", "--shm-dir", shm], None, 0, None),
            ("inspect (table)", [*cli, "inspect", "--shm-dir", shm], None, 0, None),
        ]
        if importlib.util.find_spec("typer") is not None:
            rows.insert(2, (typer, [sys.executable, "-c", "import typer"], None, 0, None))
        if lsof is not None:
            rows.append(("lsof +D DIR", [lsof, "-n", "-P", "+D", shm], None, 0, None))
        if args.compare is not None:
            rows += _compared(args.compare.resolve(), shm)
        times: dict[str, list[float]] = {name: [] for name, *_ in rows}
        for _, argv, _, _, env in rows:  # warm-up, not timed: writes the bytecode
            _time(argv, env)
        for _ in range(args.repeat):  # interleaved: a load spike costs every row alike
            for name, argv, _, _, env in rows:
                times[name].append(_time(argv, env))
        load = os.getloadavg()
    finally:
        stop_all(procs, shm)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"{args.regions} held regions, {os.cpu_count()} CPUs, load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; median of {args.repeat} runs each"
          f"{'' if lsof else '; lsof not installed'}")
    print(bytecode)
    print(f"{'command':<32} {'median':>9} {'min':>9}  target")
    for name, _, against, factor, _ in rows:
        target = ""
        if against is not None and against in med:
            ratio = med[name] / med[against]
            verdict = "ok" if ratio <= factor else "MISSED"
            target = f"{ratio:.2f}x {against} (<= {factor}x: {verdict})"
        print(f"{name:<32} {med[name] * 1000:6.1f} ms {min(times[name]) * 1000:6.1f} ms  "
              f"{target}".rstrip())
    if "lsof +D DIR" in med:
        lsof_ms, floor_ms = med["lsof +D DIR"] * 1000, med[FLOOR] * 1000
        print(f"the floor ({FLOOR}) alone is {floor_ms / lsof_ms:.2f}x lsof +D DIR; "
              f"inspect --json spends {(med['inspect --json'] - med[FLOOR]) * 1000:.0f} ms "
              "above it (its own modules, the scan, JSON out)")


if __name__ == "__main__":
    main()
