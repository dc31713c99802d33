"""`preflight` and the engine claim compare an existing region with the request (issue 20):
another size, segment count or geometry is never "Ready" / joined."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import pytest
from region_files import GEOMETRY, SIZE, region_file

from vllm_offload_cli.core.base.errors import RegionBusyError, UnsafeRegionError
from vllm_offload_cli.core.region import fsguard
from vllm_offload_cli.core.region.naming import gc_command
from vllm_offload_cli.engine.claim import RegionShape, claim, startup_lock
from vllm_offload_cli.engine.region_hold import RegionRequest, open_region

PAGE = 4096


def preflight(cli: Any, shm_dir: Path, *args: str, expect: int) -> dict[str, Any]:
    result = cli("preflight", *args, "--shm-dir", str(shm_dir), "--json")
    assert result.exit_code == expect, result.stdout + result.stderr
    doc: dict[str, Any] = result.json
    return doc


def provision(cli: Any, shm_dir: Path, engine_id: str, size: str) -> None:
    """A region pre-provisioned by `create` (persistent), 2 workers of 4 KiB slots."""
    made = cli("create", engine_id, "--world-size", "2", "--cpu-page-size", str(PAGE),
               "--size", size, "--no-populate", "--shm-dir", str(shm_dir), "--json")
    assert made.exit_code == 0, made.stdout + made.stderr


def test_a_persistent_region_of_another_size_is_exit_6_with_the_command_that_removes_it(
        cli: Any, shm_dir: Path) -> None:
    provision(cli, shm_dir, "u1", "64KiB")
    region = shm_dir / "vllm_offload_u1.mmap"

    doc = preflight(cli, shm_dir, "u1", "--size", "1MiB", expect=6)

    error = doc["errors"][0]
    assert error["code"] == "size_mismatch"
    assert "64KiB" in error["message"] and "1MiB" in error["message"]
    assert region.exists()  # never removed for an engine
    command = error["message"].split("Remove it with `")[1].split("`")[0]
    argv = shlex.split(command)
    assert argv[:2] == ["vllm-offload", "gc"] and argv[-1] == "u1"
    assert "--include-persistent" in argv
    removed = cli(*argv[1:], "--no-syslog")
    assert removed.exit_code == 0, removed.stdout + removed.stderr
    assert not region.exists()
    after = preflight(cli, shm_dir, "u1", "--size", "1MiB", expect=0)
    assert after["data"]["replicas"][0]["action"] == "create"


def test_a_persistent_region_of_the_right_shape_is_ready_to_join(cli: Any,
                                                                 shm_dir: Path) -> None:
    provision(cli, shm_dir, "u1", "64KiB")
    doc = preflight(cli, shm_dir, "u1", "--size", "64KiB", "--segments", "1", expect=0)
    assert doc["data"]["replicas"][0]["action"] == "join"
    result = cli("preflight", "u1", "--size", "64KiB", "--shm-dir", str(shm_dir))
    assert "Ready" in result.stdout


def test_another_segment_count_is_not_ready(cli: Any, shm_dir: Path) -> None:
    provision(cli, shm_dir, "u1", "64KiB")
    doc = preflight(cli, shm_dir, "u1", "--size", "64KiB", "--segments", "2", expect=6)
    assert doc["errors"][0]["code"] == "geometry_mismatch"
    assert "1 segment file(s), the engine expects 2" in doc["errors"][0]["message"]


def test_a_stale_region_of_another_size_is_reclaimed_and_a_dry_run_says_so(
        cli: Any, shm_dir: Path) -> None:
    region_file(shm_dir, "u1")  # SIZE bytes, leaked by vLLM
    dry = preflight(cli, shm_dir, "u1", "--size", "1MiB", "--dry-run", expect=0)
    replica = dry["data"]["replicas"][0]
    assert replica["action"] == "would_reclaim"
    assert any("another shape" in n and str(SIZE) in n for n in replica["notes"])
    assert (shm_dir / "vllm_offload_u1.mmap").exists()
    text = cli("preflight", "u1", "--size", "1MiB", "--dry-run", "--shm-dir", str(shm_dir))
    assert "would be removed" in text.stdout and "another shape" in text.stdout

    doc = preflight(cli, shm_dir, "u1", "--size", "1MiB", expect=0)
    assert doc["data"]["replicas"][0]["action"] == "reclaimed"
    # only the start-up lock's private directory is left, no region file
    assert [p.name for p in shm_dir.iterdir()] == [fsguard.private_dir_name()]


def test_a_live_region_of_another_size_is_exit_4_naming_the_holder(cli: Any, shm_dir: Path,
                                                                   holders: Any) -> None:
    h = holders("vllm", str(shm_dir), "u1", *GEOMETRY)
    doc = preflight(cli, shm_dir, "u1", "--size", "1MiB", expect=4)
    assert f"pid {h.pid}" in doc["errors"][0]["message"]
    assert (shm_dir / "vllm_offload_u1.mmap").exists()


def _request(**change: Any) -> RegionRequest:
    fields: dict[str, Any] = {"engine_id": "eng", "num_blocks": 8, "rank": 0,
                              "row_stride": 2 * PAGE, "cpu_page_size": PAGE, "world_size": 2}
    return RegionRequest(**{**fields, **change})


def test_the_engine_refuses_to_join_its_own_live_region_of_another_geometry(
        shm_dir: Path) -> None:
    """Two ranks started with different configurations: the second one is exit 4."""
    lease = open_region(_request(), token="tok-a", shm_dir=shm_dir)
    try:
        # the same bytes, carved differently: 16 rows of one 4 KiB slot
        other = _request(num_blocks=16, row_stride=PAGE, world_size=1).shape
        with startup_lock(shm_dir), pytest.raises(RegionBusyError) as err:
            claim("eng", shm_dir=shm_dir, token="tok-a", shape=other)
        assert err.value.code == "geometry_mismatch"
        assert f"pid {os.getpid()}" in err.value.message and "row_stride" in err.value.message
        with startup_lock(shm_dir):  # the same shape joins
            assert claim("eng", shm_dir=shm_dir, token="tok-a",
                         shape=_request().shape).action == "join"
    finally:
        lease.close()


def test_the_engine_refuses_a_persistent_region_of_another_geometry(cli: Any,
                                                                    shm_dir: Path) -> None:
    provision(cli, shm_dir, "eng", "64KiB")  # 8 rows of 2 slots of 4 KiB
    same_size = RegionShape(size_bytes=64 << 10, num_segments=1, num_blocks=16,
                            row_stride=PAGE, cpu_page_size=PAGE, world_size=1)
    with startup_lock(shm_dir), pytest.raises(UnsafeRegionError) as err:
        claim("eng", shm_dir=shm_dir, token="tok", shape=same_size)
    assert err.value.code == "geometry_mismatch"
    assert "its num_blocks is 8, the engine's is 16" in err.value.message
    assert gc_command(shm_dir, "eng", include_persistent=True) in err.value.message


def test_a_leftover_the_claim_reclaims_is_in_the_system_log(cli: Any, shm_dir: Path,
                                                            tmp_path: Path,
                                                            monkeypatch: Any) -> None:
    import socket

    from vllm_offload_cli.core.reclaim.audit import SOCKET_ENV

    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(tmp_path / "log"))
    sink.settimeout(10)
    monkeypatch.setenv(SOCKET_ENV, str(tmp_path / "log"))
    try:
        region_file(shm_dir, "u1")
        doc = preflight(cli, shm_dir, "u1", "--size", "1MiB", expect=0)
        assert doc["data"]["replicas"][0]["action"] == "reclaimed"
        line = sink.recv(65536).decode()
    finally:
        sink.close()
    assert f'removed region engine_id="u1" uid={os.getuid()} size_bytes={SIZE}' in line
