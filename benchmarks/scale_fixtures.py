"""What the scale benchmarks share: a process that holds regions, and a median timer."""

from __future__ import annotations

import atexit
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable

# argv: SHM_DIR ENGINE_ID...; maps each region through the core, says "ready", holds them
# until its stdin closes
HOLDER = """
import sys
from vllm_offload_cli.core.region import SharedOffloadRegion
rs = [SharedOffloadRegion(e, 4, None, 4096, 4096, shm_dir=sys.argv[1]) for e in sys.argv[2:]]
print("ready", flush=True)
sys.stdin.read()
"""


def installed_bytecode() -> str:
    """Run the child interpreters from compiled bytecode, as a pip-installed package does.

    pip compiles a package's modules when it installs them; a source checkout
    under PYTHONDONTWRITEBYTECODE (set in some CI images and sandboxes)
    recompiles every module of ours in every process, about 15 ms a command
    that no installed tool pays. The children keep their bytecode under a
    private prefix, so the checkout stays clean; the first run of each command
    writes it (warm up before timing). Returns the line that says so.
    """
    prefix = tempfile.mkdtemp(prefix="vllm-offload-pyc-")
    atexit.register(shutil.rmtree, prefix, ignore_errors=True)
    was = os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    unset = " (PYTHONDONTWRITEBYTECODE unset for them)" if was else ""
    return f"children run from compiled bytecode, as installed by pip{unset}"


def median_time(fn: Callable[[], object], repeat: int) -> float:
    """Median wall seconds of `repeat` calls."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def explain(name: str, process: float, in_process: float, python: float, imports: float,
            target_ms: float) -> str:
    """Where a command's process time goes beyond its in-process work, and the verdict.

    process = interpreter start (`python -c pass`) + imports of what the command
    loads (measured as `python -c 'import ...'`, less the interpreter) + the
    in-process work + the rest (option parsing, JSON encoding, process exit).
    """
    imp = imports - python
    rest = process - python - imp - in_process
    verdict = "ok" if process * 1000 <= target_ms else "MISSED"
    return (f"{name}: {process * 1000:.0f} ms as a process (target <= {target_ms:.0f} ms: "
            f"{verdict}) = {python * 1000:.0f} ms interpreter start + {imp * 1000:.0f} ms "
            f"imports + {in_process * 1000:.0f} ms the work in-process + {rest * 1000:.0f} ms "
            "the rest (parsing options, JSON out, exit)")


def stop_all(procs: list[subprocess.Popen[bytes]] | list[subprocess.Popen[str]],
             shm: str | os.PathLike[str]) -> None:
    """Kill the holder processes, reap them, and remove the scratch directory."""
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()
    shutil.rmtree(shm, ignore_errors=True)
