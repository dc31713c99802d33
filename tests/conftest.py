"""Shared fixtures: a private tmpfs directory, the real CLI, real holder processes.

Tests that need root or another privilege (another user, a PID or mount
namespace, a tmpfs mount) call `require_root`: they skip without it, and fail
with VLLM_OFFLOAD_REQUIRE_ROOT=1 (CI), so that a run without those privileges
cannot pass by skipping what only they can test.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from click.testing import CliRunner

from tests.region_files import private_shm_dir
from vllm_offload_cli.cli.app import app

if TYPE_CHECKING:
    from helpers.other_user import OtherUser

HELPER = Path(__file__).parent / "helpers" / "holder.py"
REQUIRE_ROOT = "VLLM_OFFLOAD_REQUIRE_ROOT"


def require_root(reason: str, *, granted: bool | None = None) -> None:
    """Skip the calling test (or fixture) unless it has the privilege it needs.

    `granted` says whether it has it (a probe's answer: unshare permitted, a
    tool installed, a mount made); None means "runs as root". Without it the
    test skips with `reason`, or fails when VLLM_OFFLOAD_REQUIRE_ROOT=1.
    """
    __tracebackhide__ = True  # reported where the test or fixture called it
    if (os.geteuid() == 0) if granted is None else granted:
        return
    if os.environ.get(REQUIRE_ROOT) == "1":
        pytest.fail(f"{reason} (and {REQUIRE_ROOT}=1 turns this skip into a failure)",
                    pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session", autouse=True)
def _no_private_dir_left_in_dev_shm() -> Iterator[None]:
    """Tests that run vLLM's own code use /dev/shm itself (vLLM's path is fixed), and an
    engine's start-up lock lives in /dev/shm/.vllm-offload-UID: remove it again if this
    session made it, so the suite leaves /dev/shm as it found it."""
    from vllm_offload_cli.core.region import fsguard

    private = Path("/dev/shm") / fsguard.private_dir_name()
    existed = private.exists()
    yield
    if not existed and private.is_dir() and not private.is_symlink():
        for leftover in ("startup.lock",):
            (private / leftover).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            private.rmdir()


@pytest.fixture(scope="session")
def nobody() -> Iterator[OtherUser]:
    """Run commands as user nobody, from a copy of the code that user can read
    (tests/helpers/other_user.py); skips (fails under the switch) where that cannot be."""
    from helpers import other_user

    require_root("needs root to run commands as another user")
    with other_user.prepared(other_user.NOBODY) as user:
        if isinstance(user, str):
            require_root(user, granted=False)
        yield user


@contextlib.contextmanager
def mounted_tmpfs(size: str, prefix: str) -> Iterator[Path]:
    """A real tmpfs of `size` under /dev/shm, to fill up (needs root and mount rights)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                              str(path)], capture_output=True).returncode == 0
    try:
        require_root("cannot mount a tmpfs here (needs root and mount rights)",
                     granted=mounted)
        yield path
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=True)
        path.rmdir()


@pytest.fixture
def tiny_tmpfs() -> Iterator[Path]:
    """A real 1 MiB tmpfs, to fill up."""
    with mounted_tmpfs("1M", "vllm-offload-test-tiny-") as path:
        yield path


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private directory on /dev/shm (real tmpfs), removed afterwards."""
    with private_shm_dir() as path:
        yield path


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def json(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.stdout)
        return doc


@pytest.fixture
def cli() -> Any:
    """Run the CLI in-process (CliRunner); stdout and stderr kept apart."""
    runner = CliRunner()

    def run(*args: str, env: dict[str, str] | None = None) -> CliResult:
        result = runner.invoke(app, list(args), env=env, catch_exceptions=False)
        return CliResult(result.exit_code, result.stdout, result.stderr)

    return run


def run_cli_subprocess(*args: str, env: dict[str, str] | None = None,
                       timeout: float = 60) -> CliResult:
    """Run `python -m vllm_offload_cli` as a real process."""
    proc = subprocess.run([sys.executable, "-m", "vllm_offload_cli", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


class Holder:
    """A real child process that opens a region through the core (or like vLLM) and waits.

    It prints one JSON line when ready, then sleeps until killed or told to
    exit on stdin ("exit" runs cleanup(), "crash" exits without cleanup).
    """

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HELPER), *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"holder failed to start: {err}")
        self.info: dict[str, Any] = json.loads(line)
        if "error" in self.info:
            self.proc.wait(timeout=10)
            raise RuntimeError(f"holder failed: {self.info}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def stop(self, command: str = "exit", timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.send(command)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def holders() -> Iterator[Any]:
    """Start holder processes; every one is killed at teardown."""
    started: list[Holder] = []

    def start(*args: str) -> Holder:
        h = Holder(*args)
        started.append(h)
        return h

    try:
        yield start
    finally:
        for h in started:
            h.close()


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll for a condition set by another process (never used to measure speed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Ray tests run in a private network namespace (tests/test_fleet_netns.py)."""
    from helpers import netns

    if netns.inside() or not netns.available():
        return
    moved = [item for item in items if item.get_closest_marker("ray") is not None]
    if moved:
        config.hook.pytest_deselected(items=moved)
        items[:] = [item for item in items if item.get_closest_marker("ray") is None]
