"""A tmpfs that is too small: the failure is clear and leaves nothing behind.

Mounts a real 1 MiB tmpfs (needs root and mount rights; skipped otherwise, and
failed with VLLM_OFFLOAD_REQUIRE_ROOT=1).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from vllm_offload_cli.core.base.errors import InsufficientSpaceError
from vllm_offload_cli.core.region import SharedOffloadRegion


def test_preflight_refuses_before_touching_anything(tiny_tmpfs: Path, cli: Any) -> None:
    r = cli("create", "big", "--world-size", "1", "--cpu-page-size", "64KiB",
            "--size", "2MiB", "--shm-dir", str(tiny_tmpfs), "--json")
    assert r.exit_code == 5
    assert r.json["errors"][0]["code"] == "shm_full"
    assert "1MiB free" in r.json["errors"][0]["message"]
    assert os.listdir(tiny_tmpfs) == []


def test_populate_failure_is_reported_and_cleaned_up(tiny_tmpfs: Path) -> None:
    """Without the pre-flight (as when tmpfs fills up meanwhile) pre-fault fails cleanly."""
    with pytest.raises(InsufficientSpaceError, match="pre-faulting"):
        SharedOffloadRegion("big", 32, None, 65536, 65536, shm_dir=tiny_tmpfs,
                            preflight=False)
    assert os.listdir(tiny_tmpfs) == []
