"""`--help`, `inspect` and `garbage-collect` must start without importing torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PROBE = ("import sys, atexit; "
         "atexit.register(lambda: sys.stderr.write('\\nTORCH_IMPORTED=%s\\n' % "
         "('torch' in sys.modules))); "
         "from vllm_offload_cli.cli.app import main; main(sys.argv[1:])")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("argv", [["--help"], ["inspect", "--json"], ["inspect", "--help"],
                                  ["garbage-collect", "--dry-run", "--json"],
                                  ["create", "x", "--world-size", "1", "--cpu-page-size", "4KiB",
                                   "--num-blocks", "1", "--json"]])
def test_no_torch_import(argv: list[str], shm_dir: Path) -> None:
    extra = [] if argv[-1] == "--help" else ["--shm-dir", str(shm_dir)]
    proc = _run(*argv, *extra)
    assert proc.returncode == 0, proc.stderr
    assert "TORCH_IMPORTED=False" in proc.stderr
