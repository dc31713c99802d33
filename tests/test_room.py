"""No crash loop after a crash: a dead engine's leftover gives way to a new engine_id.

A pod-sized tmpfs (a Kubernetes emptyDir with `medium: Memory` survives
container restarts) holds one region. The engine crashes, restarts with a
fresh engine_id, and its region does not fit beside the leftover: before the
capacity check refuses (exit 5), the hook and `preflight` remove this user's
leftovers that gc would remove, oldest first, only as many as needed. A live,
pre-provisioned, unknown or another user's leftover is never touched. Mounts a
real 8 MiB tmpfs (needs root and mount rights; skipped otherwise).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import mounted_tmpfs, require_root
from tests.engine_ranks import Engine

PAGE = 64 * 1024
MiB = 1 << 20
CLI = [sys.executable, "-m", "vllm_offload_cli"]


@pytest.fixture
def pod_tmpfs() -> Iterator[Path]:
    """A real 8 MiB tmpfs: room for one 5 MiB region, not two."""
    with mounted_tmpfs("8M", "vllm-offload-test-pod-") as path:
        yield path


def _leftover(holders: Any, shm: Path, engine_id: str, mib: int, *, crash: bool = True
              ) -> Any:
    """A region made and filled through the core; SIGKILL-like exit unless `crash` is False."""
    h = holders("region", str(shm), engine_id, str(mib * MiB // PAGE), "0", str(PAGE),
                str(PAGE), "1")
    if crash:
        h.send("crash")
        h.proc.wait(timeout=20)
    return h


def _preflight(shm: Path, *args: str, env: dict[str, str] | None = None,
               wrap: list[str] | None = None) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run([*(wrap or []), *CLI, "preflight", "new", "--size", "5MiB",
                           "--shm-dir", str(shm), "--json", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})
    return proc.returncode, json.loads(proc.stdout)


def _names(shm: Path) -> list[str]:
    return sorted(n for n in os.listdir(shm) if n.startswith("vllm_offload_"))


def test_a_restarted_engine_under_a_new_engine_id_starts(pod_tmpfs: Path,
                                                         holders: Any) -> None:
    _leftover(holders, pod_tmpfs, "old", 5)
    engine = Engine(pod_tmpfs, "new", num_blocks=5 * MiB // PAGE, row_stride=PAGE,
                    cpu_page_size=PAGE, world_size=1)
    try:
        info = engine.spawn(0).ready()
        assert info.get("action") == "create", info  # was shm_full: a crash loop
    finally:
        engine.close()
    assert not any(n.startswith("vllm_offload_old.") for n in _names(pod_tmpfs))


def test_preflight_removes_the_leftover_and_a_dry_run_only_names_it(pod_tmpfs: Path,
                                                                    holders: Any) -> None:
    _leftover(holders, pod_tmpfs, "old", 5)
    before = _names(pod_tmpfs)
    code, doc = _preflight(pod_tmpfs, "--dry-run")
    assert code == 0, doc
    assert [r["engine_id"] for r in doc["data"]["reclaimed_for_room"]] == ["old"]
    assert _names(pod_tmpfs) == before
    code, doc = _preflight(pod_tmpfs)
    assert code == 0, doc
    [gone] = doc["data"]["reclaimed_for_room"]
    assert gone["engine_id"] == "old" and gone["freed_bytes"] >= 5 * MiB
    assert _names(pod_tmpfs) == []


def test_oldest_first_and_only_as_many_as_needed(pod_tmpfs: Path, holders: Any) -> None:
    _leftover(holders, pod_tmpfs, "older", 3)
    time.sleep(1.1)  # ages are whole events apart
    _leftover(holders, pod_tmpfs, "newer", 3)
    code, doc = _preflight(pod_tmpfs, "--size", "4MiB")  # 2 MiB free: one must go
    assert code == 0, doc
    assert [r["engine_id"] for r in doc["data"]["reclaimed_for_room"]] == ["older"]
    assert any(n.startswith("vllm_offload_newer.") for n in _names(pod_tmpfs))


def _refused_untouched(shm: Path, **kw: Any) -> None:
    before = {n: os.stat(shm / n).st_ino for n in _names(shm)}
    code, doc = _preflight(shm, **kw)
    assert code == 5, doc
    assert doc["errors"][0]["code"] == "shm_full"
    assert {n: os.stat(shm / n).st_ino for n in _names(shm)} == before


def test_a_live_leftover_is_never_touched(pod_tmpfs: Path, holders: Any) -> None:
    _leftover(holders, pod_tmpfs, "old", 5, crash=False)
    _refused_untouched(pod_tmpfs)


def test_a_pre_provisioned_region_is_never_touched(pod_tmpfs: Path) -> None:
    made = subprocess.run([*CLI, "create", "old", "--world-size", "1", "--cpu-page-size",
                           "64KiB", "--size", "5MiB", "--shm-dir", str(pod_tmpfs)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    _refused_untouched(pod_tmpfs)


def test_another_users_leftover_is_never_touched(pod_tmpfs: Path, holders: Any) -> None:
    _leftover(holders, pod_tmpfs, "old", 5)
    for name in _names(pod_tmpfs):
        os.chown(pod_tmpfs / name, 12345, 12345)
    _refused_untouched(pod_tmpfs)


def test_an_unknown_leftover_is_never_touched(pod_tmpfs: Path, holders: Any) -> None:
    """Seen from a PID namespace of its own, nothing proves the leftover unused."""
    require_root("unshare(1) is not installed", granted=shutil.which("unshare") is not None)
    wrap = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
    probe = subprocess.run([*wrap, "true"], capture_output=True, timeout=30)
    require_root("unshare --pid is not permitted here", granted=probe.returncode == 0)
    _leftover(holders, pod_tmpfs, "old", 5)
    _refused_untouched(pod_tmpfs, wrap=wrap)


@pytest.mark.parametrize("how", ["env", "option"])
def test_the_setting_turns_it_off(pod_tmpfs: Path, holders: Any, how: str) -> None:
    _leftover(holders, pod_tmpfs, "old", 5)
    if how == "env":
        _refused_untouched(pod_tmpfs, env={"VLLM_OFFLOAD_RECLAIM_FOR_ROOM": "0"})
    else:
        before = _names(pod_tmpfs)
        code, doc = _preflight(pod_tmpfs, "--no-reclaim-for-room")
        assert code == 5 and _names(pod_tmpfs) == before, doc
