"""Runs the Ray fleet tests where their traffic can only use loopback.

The outer run deselects the `ray` tests (tests/conftest.py) and runs them here,
in a child pytest inside a private network namespace; where no namespace can
be made (not root), they run directly instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import netns

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

FLEET_TESTS = Path(__file__).with_name("test_fleet_ray.py")


def test_ray_tests_pass_in_a_private_network_namespace() -> None:
    pytest.importorskip("ray", reason="the ray extra is not installed")
    if netns.inside() or not netns.available():
        pytest.skip("the ray tests run directly here (already inside, or no namespace)")
    run = subprocess.run(
        netns.command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                       "-o", "addopts=-ra --strict-markers", str(FLEET_TESTS)]),
        env={**os.environ, netns.INSIDE_ENV: "1"}, cwd=FLEET_TESTS.parent.parent,
        capture_output=True, text=True, check=False, timeout=1100)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-4000:]
    assert " passed" in summary and "failed" not in summary, summary
