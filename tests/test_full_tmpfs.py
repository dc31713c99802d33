"""A tmpfs that is too small: the failure is clear and leaves nothing behind.

Mounts a real 1 MiB tmpfs (needs root and mount rights; skipped otherwise, and
failed with VLLM_OFFLOAD_REQUIRE_ROOT=1).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_root
from vllm_offload_cli.core.base.errors import InsufficientSpaceError
from vllm_offload_cli.core.region import SharedOffloadRegion


@pytest.fixture
def tiny_tmpfs() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="vllm-offload-test-tiny-", dir="/dev/shm"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M,mode=0700", "tmpfs",
                              str(path)], capture_output=True).returncode == 0
    try:
        require_root("cannot mount a tmpfs here (needs root and mount rights)",
                     granted=mounted)
        yield path
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=True)
        path.rmdir()


def test_preflight_refuses_before_touching_anything(tiny_tmpfs: Path, cli: Any) -> None:
    r = cli("create", "big", "--world-size", "1", "--cpu-page-size", "64KiB",
            "--size", "2MiB", "--shm-dir", str(tiny_tmpfs), "--json")
    assert r.exit_code == 5
    assert r.json["errors"][0]["code"] == "shm_full"
    assert "1.0 MiB free" in r.json["errors"][0]["message"]
    assert os.listdir(tiny_tmpfs) == []


def test_populate_failure_is_reported_and_cleaned_up(tiny_tmpfs: Path) -> None:
    """Without the pre-flight (as when tmpfs fills up meanwhile) pre-fault fails cleanly."""
    with pytest.raises(InsufficientSpaceError, match="pre-faulting"):
        SharedOffloadRegion("big", 32, None, 65536, 65536, shm_dir=tiny_tmpfs,
                            preflight=False)
    assert os.listdir(tiny_tmpfs) == []
