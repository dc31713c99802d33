"""A zombie creator is gone: its half-made region is stale while the zombie still exists.

A `create` killed by SIGKILL whose parent does not reap it (a container's PID 1
that never calls wait, or `timeout -s KILL` dying first) stays a zombie. Its
/proc entry still shows the manifest's pid and start time, but it has exited:
it maps nothing, holds no descriptor, and will never finish the region.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import psutil

from tests.conftest import wait_until
from vllm_offload_cli.core.base.testhook import PAUSE_ENV
from vllm_offload_cli.core.region.naming import region_path
from vllm_offload_cli.core.system.processes import ProcessRef, start_ticks

# A parent that starts `create` paused after its manifest, reports the child's
# pid, and then never reaps it: it only waits for its own stdin to close.
_NEGLECTFUL_PARENT = textwrap.dedent("""\
    import subprocess, sys
    child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    print(child.pid, flush=True)
    sys.stdin.read()
""")


def _status(pid: int) -> str | None:
    try:
        return str(psutil.Process(pid).status())
    except psutil.Error:
        return None


def test_a_zombie_creator_leaves_a_stale_region_that_gc_reclaims(cli: Any,
                                                                  shm_dir: Path) -> None:
    create = [sys.executable, "-m", "vllm_offload_cli", "create", "zomb", "--world-size", "1",
              "--cpu-page-size", "64KiB", "--size", "4MiB", "--shm-dir", str(shm_dir), "--json"]
    parent = subprocess.Popen([sys.executable, "-c", _NEGLECTFUL_PARENT, *create],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, PAUSE_ENV: "after_manifest"})
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert wait_until(lambda: _status(pid) == psutil.STATUS_STOPPED, timeout=30)
        ticks = start_ticks(pid)
        before = cli("inspect", "zomb", "--shm-dir", str(shm_dir), "--json")
        assert before.json["data"]["regions"][0]["state"] == "creating"

        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: _status(pid) == psutil.STATUS_ZOMBIE, timeout=30)
        assert start_ticks(pid) == ticks  # the same process by pid and start time...
        assert not ProcessRef(pid, ticks).alive()  # ...but exited

        seen = cli("inspect", "zomb", "--shm-dir", str(shm_dir), "--json")
        region = seen.json["data"]["regions"][0]
        assert region["state"] == "stale", region
        assert "creator_died" in [p["code"] for p in region["problems"]]

        gc = cli("gc", "--min-age", "0", "--shm-dir", str(shm_dir), "--json")
        assert gc.exit_code == 0, gc.stdout
        assert [r["engine_id"] for r in gc.json["data"]["removed"]] == ["zomb"]
        assert not region_path(shm_dir, "zomb").exists()
        assert _status(pid) == psutil.STATUS_ZOMBIE  # reclaimed while the zombie lives on
    finally:
        parent.communicate(input="", timeout=30)  # the parent exits; init reaps the child
