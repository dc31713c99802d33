"""HiSparse regions (`vllm_offload_hisparse_{instance_id}_dp{index}.mmap`) are regions too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from region_files import GEOMETRY, region_file

from vllm_offload_cli.core.region.naming import region_kind


def test_hisparse_names_are_recognised(cli: Any, shm_dir: Path, holders: Any) -> None:
    region_file(shm_dir, "hisparse_inst7_dp1")
    h = holders("vllm", str(shm_dir), "hisparse_inst8_dp0", *GEOMETRY)
    regions = cli("inspect", "--shm-dir", str(shm_dir), "--json").json["data"]["regions"]
    by_id = {r["engine_id"]: r for r in regions}
    assert by_id["hisparse_inst7_dp1"]["state"] == "stale"
    assert by_id["hisparse_inst7_dp1"]["dp_rank"] == 1
    assert by_id["hisparse_inst7_dp1"]["kind"] == "hisparse"
    assert by_id["hisparse_inst8_dp0"]["holders"][0]["pid"] == h.pid
    gc = cli("gc", "--min-age", "0", "--shm-dir", str(shm_dir), "--json").json["data"]
    assert [r["engine_id"] for r in gc["removed"]] == ["hisparse_inst7_dp1"]
    assert [k["engine_id"] for k in gc["kept"]] == ["hisparse_inst8_dp0"]


def test_region_kind() -> None:
    assert region_kind("hisparse_inst7_dp1") == "hisparse"
    assert region_kind("prod_dp1") == "offload"
    assert region_kind("hisparse") == "offload"
