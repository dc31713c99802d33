"""`vllm-offload preflight`: the engine hook's start-up checks for launchers, via the real CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import run_cli_subprocess
from region_files import GEOMETRY, SIZE, region_file

from vllm_offload_cli.core.region import fsguard


def _left(shm_dir: Path) -> list[str]:
    """What is in shm_dir besides this user's private directory (the start-up lock)."""
    return [p.name for p in shm_dir.iterdir() if p.name != fsguard.private_dir_name()]


def preflight(cli: Any, shm_dir: Path, *args: str, expect: int) -> dict[str, Any]:
    result = cli("preflight", *args, "--shm-dir", str(shm_dir), "--json")
    assert result.exit_code == expect, result.stdout + result.stderr
    doc: dict[str, Any] = result.json
    assert doc["command"] == "preflight" and doc["exit_code"] == expect
    return doc


def test_a_free_engine_id_is_ready(cli: Any, shm_dir: Path) -> None:
    doc = preflight(cli, shm_dir, "prod", "--size", "4MiB", expect=0)
    assert doc["data"]["needed_bytes"] == 4 << 20
    assert [r["action"] for r in doc["data"]["replicas"]] == ["create"]
    assert _left(shm_dir) == []  # checks create nothing


def test_a_stale_leftover_is_reclaimed_and_a_dry_run_only_says_so(cli: Any,
                                                                  shm_dir: Path) -> None:
    region_file(shm_dir, "prod")  # vLLM's tiering path leaked it; nobody holds it
    dry = preflight(cli, shm_dir, "prod", "--size", "4MiB", "--dry-run", expect=0)
    assert dry["data"]["replicas"][0]["action"] == "would_reclaim"
    assert (shm_dir / "vllm_offload_prod.mmap").exists()
    doc = preflight(cli, shm_dir, "prod", "--size", "4MiB", expect=0)
    replica = doc["data"]["replicas"][0]
    assert replica["action"] == "reclaimed" and replica["reclaimed_bytes"] == SIZE
    assert _left(shm_dir) == []


def test_a_dry_run_and_a_real_run_report_the_same_bytes(cli: Any, shm_dir: Path) -> None:
    """A leftover an engine died while pre-faulting: half its pages were ever written. The
    dry run said its apparent size, the real run the memory freed."""
    path = region_file(shm_dir, "prod", fill=False)
    with open(path, "r+b") as f:
        f.write(b"\1" * (SIZE // 2))
    freed = path.stat().st_blocks * 512
    assert 0 < freed < SIZE
    dry = preflight(cli, shm_dir, "prod", "--size", "4MiB", "--dry-run", expect=0)
    real = preflight(cli, shm_dir, "prod", "--size", "4MiB", expect=0)
    assert [r["reclaimed_bytes"] for r in (dry["data"]["replicas"][0],
                                           real["data"]["replicas"][0])] == [freed, freed]


def test_an_engine_id_held_by_a_live_process_exits_4_naming_it(cli: Any, shm_dir: Path,
                                                                holders: Any) -> None:
    h = holders("vllm", str(shm_dir), "prod", *GEOMETRY)
    doc = preflight(cli, shm_dir, "prod", "--size", "4MiB", expect=4)
    assert doc["errors"][0]["code"] == "engine_id_collision"
    assert f"pid {h.pid}" in doc["errors"][0]["message"]
    assert (shm_dir / "vllm_offload_prod.mmap").exists()


def test_every_replica_is_checked_and_room_for_all_of_them(cli: Any, shm_dir: Path,
                                                           holders: Any) -> None:
    region_file(shm_dir, "prod_dp1")
    doc = preflight(cli, shm_dir, "prod", "--size", "1MiB", "--dp-size", "3", expect=0)
    assert [(r["engine_id"], r["action"]) for r in doc["data"]["replicas"]] == [
        ("prod_dp0", "create"), ("prod_dp1", "reclaimed"), ("prod_dp2", "create")]
    assert doc["data"]["needed_bytes"] == 3 << 20
    holders("vllm", str(shm_dir), "prod_dp2", *GEOMETRY)
    doc = preflight(cli, shm_dir, "prod", "--size", "1MiB", "--dp-size", "3", expect=4)
    assert "prod_dp2" in doc["errors"][0]["message"]


def test_too_big_for_the_tmpfs_exits_5(cli: Any, shm_dir: Path) -> None:
    doc = preflight(cli, shm_dir, "prod", "--size", "4096TiB", expect=5)
    assert doc["errors"][0]["code"] == "shm_full"


@pytest.mark.parametrize(("args", "code"), [
    (("bad/id", "--size", "1MiB"), 2),
    (("prod", "--size", "lots"), 2),
    (("prod", "--size", "0"), 2),
    (("prod", "--size", "1MiB", "--dp-size", "0"), 2),
])
def test_bad_input_is_one_clear_line(cli: Any, shm_dir: Path, args: tuple[str, ...],
                                     code: int) -> None:
    result = cli("preflight", *args, "--shm-dir", str(shm_dir))
    assert result.exit_code == code
    assert result.stderr.count("Error:") == 1 and "Traceback" not in result.stderr


def test_as_a_real_process_for_systemd(shm_dir: Path, holders: Any) -> None:
    ok = run_cli_subprocess("preflight", "prod", "--size", "1MiB", "--shm-dir", str(shm_dir))
    assert ok.exit_code == 0 and "Ready" in ok.stdout
    h = holders("region", str(shm_dir), "prod", *GEOMETRY)
    busy = run_cli_subprocess("preflight", "prod", "--size", "1MiB", "--shm-dir", str(shm_dir))
    assert busy.exit_code == 4 and f"pid {h.pid}" in busy.stderr


def test_a_leftover_it_may_not_touch_exits_6(cli: Any, shm_dir: Path) -> None:
    (shm_dir / "vllm_offload_prod.mmap").symlink_to("/etc/passwd")
    doc = preflight(cli, shm_dir, "prod", "--size", "1MiB", expect=6)
    assert doc["errors"][0]["code"] == "symlink"
    assert (shm_dir / "vllm_offload_prod.mmap").is_symlink()
