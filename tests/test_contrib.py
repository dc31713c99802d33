"""The scheduling examples in contrib/ are valid and do what they say.

systemd-tmpfiles and systemd-analyze run where they are installed; the
command lines of the cron entry and the service are run through the CLI.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from region_files import GEOMETRY, region_file

CONTRIB = Path(__file__).resolve().parent.parent / "contrib"
PROM = "/var/lib/node_exporter/textfile_collector/vllm_offload_gc.prom"


def _gc_argv(command: str) -> list[str]:
    """The arguments given to vllm-offload in a shipped command line."""
    words = shlex.split(command)
    start = next(i for i, w in enumerate(words) if os.path.basename(w) == "vllm-offload")
    return words[start + 1:]


def _cron_command() -> str:
    entries = [line for line in (CONTRIB / "cron" / "vllm-offload-gc").read_text().splitlines()
               if line.strip() and not line.startswith("#") and "=" not in line.split()[0]]
    assert len(entries) == 1
    fields = entries[0].split(None, 6)
    assert fields[:5] == ["*"] * 5 and fields[5] == "root"  # /etc/cron.d format
    return fields[6]


def _exec_start() -> str:
    text = (CONTRIB / "systemd" / "vllm-offload-gc.service").read_text()
    [line] = [ln for ln in text.splitlines() if ln.startswith("ExecStart=")]
    return line.removeprefix("ExecStart=")


@pytest.mark.parametrize("command", [_cron_command(), _exec_start()], ids=["cron", "systemd"])
def test_shipped_command_lines_run(cli: Any, shm_dir: Path, tmp_path: Path,
                                   command: str) -> None:
    argv = _gc_argv(command)
    assert argv[0] == "garbage-collect" and PROM in argv
    region_file(shm_dir, "leaked")
    prom = tmp_path / "gc.prom"
    argv = [str(prom) if a == PROM else a for a in argv]

    result = cli(*argv, "--min-age", "0", env={"VLLM_OFFLOAD_SHM_DIR": str(shm_dir)})

    assert result.exit_code == 0, result.stderr
    assert "Removed leaked" in result.stdout
    assert "vllm_offload_gc_regions_removed 1.0" in prom.read_text()
    quiet = cli(*argv, env={"VLLM_OFFLOAD_SHM_DIR": str(shm_dir)})
    assert quiet.exit_code == 0 and quiet.stdout == ""  # nothing to do: nothing to mail


def test_systemd_units_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    exe = shutil.which("vllm-offload")
    if analyze is None or exe is None:
        pytest.skip("needs systemd-analyze and an installed vllm-offload")
    units = CONTRIB / "systemd"
    service = (units / "vllm-offload-gc.service").read_text()
    # verify checks that ExecStart= exists: point it at this installation
    (tmp_path / "vllm-offload-gc.service").write_text(
        service.replace("/usr/local/bin/vllm-offload", exe))
    shutil.copy(units / "vllm-offload-gc.timer", tmp_path)
    proc = subprocess.run([analyze, "verify", "--man=no",
                           str(tmp_path / "vllm-offload-gc.service"),
                           str(tmp_path / "vllm-offload-gc.timer")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _tmpfiles_clean(shm_dir: Path, tmp_path: Path, *, with_ours: bool) -> None:
    tool = shutil.which("systemd-tmpfiles")
    if tool is None:
        pytest.skip("needs systemd-tmpfiles")
    rules = [f"e {shm_dir} - - - 0"]  # an aggressive age rule: everything is old
    if with_ours:
        shipped = (CONTRIB / "tmpfiles.d" / "vllm-offload.conf").read_text()
        rules += [line.replace("/dev/shm/", f"{shm_dir}/") for line in shipped.splitlines()
                  if line and not line.startswith("#")]
    conf = tmp_path / "test.conf"
    conf.write_text("\n".join(rules) + "\n")
    proc = subprocess.run([tool, "--clean", str(conf)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


def _population(shm_dir: Path, holders: Any) -> list[str]:
    region_file(shm_dir, "live")
    holders("map-only", str(shm_dir), "live", *GEOMETRY)  # in use, like vLLM: no lock
    region_file(shm_dir, "live", segment=1)
    (shm_dir / "vllm_offload_live.manifest.json").write_text("{}")
    (shm_dir / ".vllm_offload_live.manifest.json.tmp.1.abcdef01").write_text("{}")
    (shm_dir / "unrelated.bin").write_text("aged out")
    return ["vllm_offload_live.mmap", "vllm_offload_live.mmap.1",
            "vllm_offload_live.manifest.json", ".vllm_offload_live.manifest.json.tmp.1.abcdef01"]


def test_tmpfiles_rule_keeps_ageing_away_from_regions(shm_dir: Path, tmp_path: Path,
                                                      holders: Any) -> None:
    ours = _population(shm_dir, holders)
    _tmpfiles_clean(shm_dir, tmp_path, with_ours=True)
    assert sorted(os.listdir(shm_dir)) == sorted(ours)  # only the unrelated file aged out


def test_without_the_rule_ageing_unlinks_a_region_in_use(shm_dir: Path, tmp_path: Path,
                                                          holders: Any) -> None:
    """Why the rule ships: timestamps and (vLLM's absent) locks do not protect a region."""
    _population(shm_dir, holders)
    _tmpfiles_clean(shm_dir, tmp_path, with_ours=False)
    assert not (shm_dir / "vllm_offload_live.mmap").exists()
