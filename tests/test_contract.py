"""The JSON envelope and exit codes are a contract with scripts: pin them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_offload_cli.cli import common

ENVELOPE_KEYS = ["schema_version", "command", "ok", "exit_code", "data", "errors", "warnings"]
REGION_KEYS = {"engine_id", "base_engine_id", "dp_rank", "paths", "linked", "size_bytes",
               "resident_bytes", "uid", "mode", "age_seconds", "geometry", "holders", "state",
               "problems"}


def test_exit_codes_are_the_documented_ones() -> None:
    assert (common.EXIT_OK, common.EXIT_FAILED, common.EXIT_USAGE, common.EXIT_VERIFY,
            common.EXIT_BUSY, common.EXIT_NO_SPACE, common.EXIT_UNSAFE,
            common.EXIT_INTERRUPTED) == (0, 1, 2, 3, 4, 5, 6, 130)


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
