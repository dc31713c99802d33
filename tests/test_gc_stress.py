"""gc in a loop while many real processes create, join and leave regions.

Two collectors run at once (this process and a second real process), with
--min-age 0 and --include-persistent so that every region is a candidate the
moment nobody holds it. Every session process checks, every few
milliseconds while it lives, that its path still names the inode it opened;
a session that saw otherwise is a region gc removed wrongly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_offload_cli.core.reclaim.collector import collect
from vllm_offload_cli.core.reclaim.report import GcOptions

CHURN = Path(__file__).parent / "helpers" / "churn.py"
# a fixed amount of work, not a time box: what is asserted is correctness, never speed
SESSIONS = int(os.environ.get("VLLM_OFFLOAD_STRESS_SESSIONS", "300"))

_COLLECTOR = textwrap.dedent("""
    import json, os, sys
    from vllm_offload_cli.core.reclaim.collector import collect
    from vllm_offload_cli.core.reclaim.report import GcOptions
    cycles = removed = 0
    errors = []
    while not os.path.exists(sys.argv[2]):
        rep = collect(sys.argv[1], GcOptions(min_age=0, include_persistent=True))
        cycles += 1
        removed += len(rep.removed)
        errors += [e.message for e in rep.errors]
    print(json.dumps({"cycles": cycles, "removed": removed, "errors": errors}), flush=True)
""")


@pytest.mark.slow
def test_gc_never_removes_a_region_in_use(shm_dir: Path, tmp_path: Path) -> None:
    results = tmp_path / "sessions"
    results.mkdir()
    churn = subprocess.Popen(
        [sys.executable, str(CHURN), str(shm_dir), str(results), str(SESSIONS), "6", "7"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    stop = tmp_path / "stop"
    other = subprocess.Popen([sys.executable, "-c", _COLLECTOR, str(shm_dir), str(stop)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cycles = removed = kept_live = 0
    errors: list[str] = []
    try:
        while churn.poll() is None:
            rep = collect(shm_dir, GcOptions(min_age=0, include_persistent=True))
            cycles += 1
            removed += len(rep.removed)
            kept_live += sum(1 for k in rep.kept if k.code in ("live", "busy"))
            errors += [e.message for e in rep.errors]
        stop.touch()
        out, err = other.communicate(timeout=60)
        assert other.returncode == 0 and out.strip(), f"second collector failed:\n{err}"
        theirs = json.loads(out.splitlines()[-1])
    finally:
        for p in (churn, other):
            if p.poll() is None:
                p.kill()
                p.wait()
    churned = json.loads(churn.stdout.read() if churn.stdout else "{}")

    sessions = [json.loads(p.read_text()) for p in results.glob("*.json")]
    lost = [s for s in sessions if s["lost"]]
    failed = [s for s in sessions if s["error"]]
    created = sum(1 for s in sessions if s["creator"])
    checks = sum(int(s.get("checks", 0)) for s in sessions)
    # vLLM-style sessions that left cleanly unlinked their own file; every other
    # region ever created leaked and is gc's to remove, exactly once
    self_removed = sum(1 for s in sessions if str(s.get("mode", "")).startswith("vllm")
                       and s.get("clean"))

    # everybody is gone now: one last run must leave nothing of ours behind
    final = collect(shm_dir, GcOptions(min_age=0, include_persistent=True))
    leftovers = sorted(os.listdir(shm_dir))
    total_removed = removed + theirs["removed"] + len(final.removed)
    summary = (f"{cycles} + {theirs['cycles']} gc cycles in two processes, "
               f"{churned['sessions']} sessions, {created} regions created, {total_removed} "
               f"removed by gc ({self_removed} more by their own creator), {kept_live} in-use "
               f"regions kept (this process), {checks} liveness checks")

    assert len(sessions) == churned["sessions"] == SESSIONS, summary
    assert lost == [], f"gc removed regions still in use: {lost}; {summary}"
    assert failed == [], f"sessions failed: {failed[:5]}; {summary}"
    assert errors == [] and theirs["errors"] == [] and final.errors == ()
    assert final.kept == (), f"nothing is alive any more: {final.kept}"
    assert leftovers == [], f"left behind: {leftovers}"
    assert total_removed + self_removed == created, summary
    assert total_removed > 0, summary  # sessions that died leaked regions: gc removed them

