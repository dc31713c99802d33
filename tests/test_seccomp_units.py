"""The shipped systemd units' system call filter lets the commands they run measure.

Each test runs the real command under the seccomp filter built from the unit's own
`SystemCallFilter=` lines (helpers/seccomp_filter.py: groups expanded by
systemd-analyze, loaded with libseccomp). Without mincore residency would vanish
(systemd 252's @system-service lacks it); a refusal must then be said (stderr, JSON,
metric), never a silent `-`, and never a traceback.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import require_root
from helpers import seccomp_filter
from region_files import SIZE, region_file

from vllm_offload_cli.core.system import libc

ROOT = Path(__file__).resolve().parent.parent
UNITS = ["vllm-offload-gc.service", "vllm-offload-metrics.service"]


@pytest.fixture(autouse=True)
def _needs_seccomp() -> None:
    why = seccomp_filter.available()
    require_root(why or "", granted=why is None)


def _unit(name: str) -> str:
    return (ROOT / "contrib" / "systemd" / name).read_text()


def _exec_start(name: str, textfile: Path) -> list[str]:
    [line] = [ln for ln in _unit(name).splitlines() if ln.startswith("ExecStart=")]
    argv = line.removeprefix("ExecStart=").replace("${STATE_DIRECTORY}", str(textfile)).split()
    assert argv[0] == "/usr/local/bin/vllm-offload"
    return [sys.executable, "-m", "vllm_offload_cli", *argv[1:]]


def _run(argv: list[str], allowed: set[str], number: int, tmp_path: Path,
         shm_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(seccomp_filter.command(argv, allowed, number, tmp_path),
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "VLLM_OFFLOAD_SHM_DIR": str(shm_dir),
                               "VLLM_OFFLOAD_SYSLOG_SOCKET": str(tmp_path / "no-log")})


def _without(unit: str, *calls: str) -> tuple[set[str], int]:
    """The unit's filter less `calls`: what systemd 252 builds from @system-service alone."""
    allowed, number = seccomp_filter.unit_filter(_unit(unit))
    return allowed - set(calls), number


@pytest.mark.parametrize("unit", UNITS)
def test_units_allow_every_call_the_code_makes(unit: str) -> None:
    """libc.PROBE_CALLS is what gc, inspect and verify-rank-layout call beyond the stdlib;
    the unit allows each, and its comment names those outside @system-service."""
    source = (ROOT / "vllm_offload_cli" / "core" / "system" / "libc.py").read_text()
    made = set(re.findall(r'_check\([^"]*"(\w+)"\)', source)) | set(
        re.findall(r'OSError\([^"]*f"(\w+):', source))
    assert made == set(libc.PROBE_CALLS) | set(libc.WRITE_CALLS)  # the lists are complete
    allowed, _ = seccomp_filter.unit_filter(_unit(unit))
    assert set(libc.PROBE_CALLS) <= allowed
    outside = set(libc.PROBE_CALLS) - seccomp_filter.expand("@system-service")
    comment = "\n".join(ln for ln in _unit(unit).splitlines() if ln.startswith("#"))
    for call in outside | {"move_pages"}:  # move_pages: in @resources, which the unit removes
        assert re.search(rf"^#\s+{call}\s", comment, re.M), call


def test_metrics_unit_measures_residency_under_its_filter(shm_dir: Path,
                                                          tmp_path: Path) -> None:
    region_file(shm_dir, "leaked")
    allowed, number = seccomp_filter.unit_filter(_unit("vllm-offload-metrics.service"))
    proc = _run(_exec_start("vllm-offload-metrics.service", tmp_path), allowed, number,
                tmp_path, shm_dir)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "vllm_offload_regions.prom").read_text()
    assert re.search(r'vllm_offload_region_resident_bytes\{[^}]*engine_id="leaked"[^}]*\} '
                     rf"{SIZE}\.0", text), text
    assert 'vllm_offload_measurement_errors{what="residency"} 0.0' in text


def test_gc_unit_collects_under_its_filter(shm_dir: Path, tmp_path: Path) -> None:
    leaked = region_file(shm_dir, "leaked")
    allowed, number = seccomp_filter.unit_filter(_unit("vllm-offload-gc.service"))
    proc = _run([*_exec_start("vllm-offload-gc.service", tmp_path), "--min-age", "0"],
                allowed, number, tmp_path, shm_dir)
    assert proc.returncode == 0, proc.stderr
    assert not leaked.exists()
    assert "vllm_offload_gc_regions_removed 1.0" in (tmp_path / "vllm_offload_gc.prom"
                                                      ).read_text()


def test_a_refused_residency_measurement_is_said(shm_dir: Path, tmp_path: Path) -> None:
    """Under systemd 252's @system-service alone: a warning, a JSON entry, a metric."""
    region_file(shm_dir, "leaked")
    allowed, number = _without("vllm-offload-metrics.service", "mincore")
    base = [sys.executable, "-m", "vllm_offload_cli", "inspect"]

    table = _run(base, allowed, number, tmp_path, shm_dir)
    assert table.returncode == 0, table.stderr
    assert "residency of 1 region(s) not measured: mincore: Operation not permitted" \
        in table.stderr
    [row] = [ln for ln in table.stdout.splitlines() if ln.startswith("leaked ")]
    assert " ? " in row  # not the `-` of --no-residency

    doc = json.loads(_run([*base, "--json"], allowed, number, tmp_path, shm_dir).stdout)
    assert doc["data"]["measurement_errors"]["residency"] == {
        "regions": 1, "message": "mincore: Operation not permitted"}
    assert "measurement_refused" in [w["code"] for w in doc["warnings"]]
    assert doc["data"]["regions"][0]["resident_bytes"] is None

    prom = _run([*base, "--format", "prometheus"], allowed, number, tmp_path, shm_dir)
    assert 'vllm_offload_measurement_errors{what="residency"} 1.0' in prom.stdout


def test_verify_rank_layout_without_mincore_says_so(shm_dir: Path, tmp_path: Path,
                                                     holders: Any) -> None:
    """It died with `PermissionError: mincore`; now the slots are reported unchecked."""
    holders("region", str(shm_dir), "svc", "4", "0", "8192", "4096", "2", "0",
            "device-modulo")
    allowed, number = _without("vllm-offload-metrics.service", "mincore")
    proc = _run([sys.executable, "-m", "vllm_offload_cli", "verify-rank-layout", "svc",
                 "--json"], allowed, number, tmp_path, shm_dir)
    assert "Traceback" not in proc.stderr, proc.stderr
    doc = json.loads(proc.stdout)
    [note] = [w for w in doc["warnings"] if w["code"] == "measurement_refused"]
    assert "mincore: Operation not permitted" in note["message"]
    assert doc["data"]["slots"] == []


_TWO_NODES = """
import runpy, sys
from vllm_offload_cli.core.system import memory
# A two-node host cannot exist on this machine: its topology is the one stand-in.
two = memory.Topology(cpus={0: frozenset({0}), 1: frozenset({1})},
                    with_memory=frozenset({0, 1}), from_sysfs=True)
memory.topology = lambda *args, **kwargs: two
sys.argv = ["vllm-offload", "verify-rank-layout", "svc", "--json"]
runpy.run_module("vllm_offload_cli", run_name="__main__")
"""


def test_verify_rank_layout_without_move_pages_says_so(shm_dir: Path, tmp_path: Path,
                                                        holders: Any) -> None:
    """On a multi-node host a refused move_pages left each worker's NUMA placement
    silently unknown; now it is a measurement_refused warning like mincore's."""
    holders("region", str(shm_dir), "svc", "4", "0", "8192", "4096", "2", "0",
            "device-modulo")
    allowed, number = _without("vllm-offload-metrics.service", "move_pages")
    proc = _run([sys.executable, "-c", _TWO_NODES], allowed, number, tmp_path, shm_dir)
    assert "Traceback" not in proc.stderr, proc.stderr
    doc = json.loads(proc.stdout)
    [note] = [w for w in doc["warnings"] if w["code"] == "measurement_refused"]
    assert note["message"].startswith("NUMA placement not checked: move_pages: ")
    assert doc["data"]["slots"]  # residency was measured: only the placement is missing
