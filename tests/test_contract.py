"""The JSON envelope and exit codes are a contract with scripts: pin them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from region_files import region_file

from vllm_offload_cli.core.base import errors
from vllm_offload_cli.core.base.exit_status import PRECEDENCE, ExitStatus, most_important

ENVELOPE_KEYS = ["schema_version", "command", "ok", "exit_code", "data", "errors", "warnings"]
REGION_KEYS = {"engine_id", "base_engine_id", "dp_rank", "paths", "linked", "size_bytes",
               "resident_bytes", "uid", "mode", "age_seconds", "geometry", "holders", "state",
               "problems"}


def test_exit_codes_are_the_documented_ones() -> None:
    assert {s.name: s.value for s in ExitStatus} == {
        "SUCCESS": 0, "FAILED": 1, "USAGE": 2, "PROBLEMS_FOUND": 3, "BUSY": 4, "NO_SPACE": 5,
        "UNSAFE": 6, "PARTIAL": 7, "INTERRUPTED": 130}
    assert all(s.meaning and "\n" not in s.meaning for s in ExitStatus)


def test_precedence_orders_every_status_once() -> None:
    assert sorted(PRECEDENCE) == sorted(ExitStatus)
    assert most_important([]) == ExitStatus.SUCCESS
    assert most_important([7, 3, 4]) == ExitStatus.PROBLEMS_FOUND
    assert most_important([0, 99, None]) == ExitStatus.FAILED  # unknown codes count as failed


@pytest.mark.parametrize(("error", "status"), [
    (errors.InvalidInputError, 2), (errors.RegionNotFoundError, 2),
    (errors.RegionBusyError, 4), (errors.InsufficientSpaceError, 5),
    (errors.DeviceUnavailableError, 5), (errors.UnsafeRegionError, 6),
    (errors.RegionTimeoutError, 1), (errors.OperationFailedError, 1), (errors.OffloadError, 1),
])
def test_each_error_carries_its_exit_status(error: type[errors.OffloadError],
                                            status: int) -> None:
    assert error("x").exit_status == status


@pytest.mark.parametrize("command", ["inspect", "gc"])
def test_a_named_region_that_does_not_exist_is_exit_2_for_inspect_and_gc(
        cli: Any, shm_dir: Path, command: str) -> None:
    """Both say so, both exit 2, both still answer for the names that exist."""
    region_file(shm_dir, "here")
    r = cli(command, "here", "nowhere", "--min-age", "0", "--dry-run", "--shm-dir",
            str(shm_dir), "--json") if command == "gc" else cli(
        command, "here", "nowhere", "--shm-dir", str(shm_dir), "--json")
    assert r.exit_code == 2 and r.json["exit_code"] == 2 and r.json["ok"] is False
    assert [e["code"] for e in r.json["errors"]] == ["not_found"]
    assert "nowhere" in r.json["errors"][0]["message"]
    assert r.json["data"]["not_found"] == ["nowhere"]
    shown = r.json["data"]["removed" if command == "gc" else "regions"]
    assert [x["engine_id"] for x in shown] == ["here"]
    human = cli(command, "nowhere", "--shm-dir", str(shm_dir))
    assert human.exit_code == 2 and "Error: no region" in human.stderr
    assert "nowhere" in human.stderr


@pytest.mark.parametrize("command", ["inspect", "gc"])
def test_without_names_nothing_is_missing(cli: Any, shm_dir: Path, command: str) -> None:
    """Cron's `gc` (and a plain `inspect`) of an empty directory is a success."""
    r = cli(command, "--shm-dir", str(shm_dir), "--json")
    assert r.exit_code == 0 and r.json["errors"] == [] and r.json["data"]["not_found"] == []


def test_success_envelope(cli: Any, shm_dir: Path) -> None:
    doc = cli("create", "c", "--world-size", "1", "--cpu-page-size", "4KiB", "--num-blocks",
              "1", "--shm-dir", str(shm_dir), "--json").json
    assert list(doc) == ENVELOPE_KEYS
    assert (doc["schema_version"], doc["command"], doc["ok"], doc["exit_code"]) == \
        (1, "create", True, 0)
    assert doc["errors"] == [] and doc["warnings"] == []
    assert {"engine_id", "path", "size_bytes", "geometry", "populate_seconds"} <= set(doc["data"])
    assert set(doc["data"]["geometry"]) == {"num_blocks", "row_stride", "cpu_page_size",
                                            "world_size"}
    inspect = cli("inspect", "--shm-dir", str(shm_dir), "--json").json
    assert list(inspect) == ENVELOPE_KEYS
    data = inspect["data"]
    assert {"regions", "shm", "uninspectable_processes"} <= set(data)
    assert set(data["shm"]) == {"total_bytes", "free_bytes"}
    assert set(data["regions"][0]) >= REGION_KEYS


def test_error_envelope(cli: Any, shm_dir: Path) -> None:
    doc = cli("create", "a/b", "--world-size", "1", "--cpu-page-size", "4KiB", "--num-blocks",
              "1", "--shm-dir", str(shm_dir), "--json").json
    assert list(doc) == ENVELOPE_KEYS
    assert (doc["ok"], doc["exit_code"], doc["data"]) == (False, 2, {})
    assert [set(e) for e in doc["errors"]] == [{"code", "message"}]


@pytest.mark.parametrize("argv", [["create", "--json"], ["inspect", "--json", "--nope"],
                                  ["--json", "bogus-command"]])
def test_usage_errors_still_print_one_envelope(cli: Any, argv: list[str]) -> None:
    r = cli(*argv)
    assert r.exit_code == 2
    assert r.json["ok"] is False and r.json["errors"][0]["code"] == "usage"


def test_version() -> None:
    from vllm_offload_cli import __version__

    out = subprocess.run([sys.executable, "-m", "vllm_offload_cli", "--version"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"vllm-offload {__version__}"
