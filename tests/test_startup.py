"""`--help`, `inspect` and `garbage-collect` must start without importing torch or ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = ("import sys, atexit; "
         "atexit.register(lambda: sys.stderr.write('\\nTORCH_IMPORTED=%s RAY_IMPORTED=%s\\n' % "
         "('torch' in sys.modules, 'ray' in sys.modules))); "
         "from vllm_offload_cli.cli.app import main; main(sys.argv[1:])")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("argv", [["--help"], ["inspect", "--json"], ["inspect", "--help"],
                                  ["garbage-collect", "--dry-run", "--json"],
                                  ["create", "x", "--world-size", "1", "--cpu-page-size", "4KiB",
                                   "--num-blocks", "1", "--json"]])
def test_no_torch_or_ray_import(argv: list[str], shm_dir: Path) -> None:
    extra = [] if argv[-1] == "--help" else ["--shm-dir", str(shm_dir)]
    proc = _run(*argv, *extra)
    assert proc.returncode == 0, proc.stderr
    assert "TORCH_IMPORTED=False RAY_IMPORTED=False" in proc.stderr


@pytest.mark.parametrize("argv", [["fleet", "--help"], ["fleet", "inspect", "--help"],
                                  ["gc", "--help"]])
def test_fleet_help_does_not_import_ray(argv: list[str]) -> None:
    proc = _run(*argv)
    assert proc.returncode == 0, proc.stderr
    assert "RAY_IMPORTED=False" in proc.stderr


@pytest.mark.parametrize("argv", [["inspect"], ["garbage-collect", "--dry-run"],
                                  ["verify-rank-layout", "x"]])
def test_fleet_without_ray_says_how_to_install_it(argv: list[str], shm_dir: Path) -> None:
    """Where ray cannot be imported, a fleet command exits 2 with the install line."""
    no_ray = PROBE.replace("from vllm_offload_cli", "sys.modules['ray'] = None; "
                           "from vllm_offload_cli")
    proc = subprocess.run([sys.executable, "-c", no_ray, "fleet", *argv], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("Error: fleet commands need Ray, which is not installed; "
                                  "install it with: pip install 'vllm-offload[ray]'\n")
    doc = json.loads(subprocess.run([sys.executable, "-c", no_ray, "fleet", *argv, "--json"],
                                    capture_output=True, text=True, timeout=60).stdout)
    assert doc["exit_code"] == 2 and doc["errors"][0]["code"] == "ray_not_installed"
