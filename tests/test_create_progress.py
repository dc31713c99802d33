"""`create` shows a transient progress bar on stderr only when a person is watching.

Real processes: stderr is a pseudo-terminal (pty) for the interactive case and
a pipe otherwise; stdout is always a pipe, so the bar never mixes into it.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest


def _create_on(shm_dir: Path, name: str, *extra: str, tty: bool) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a real `create`, stderr on a pty when `tty`."""
    argv = [sys.executable, "-m", "vllm_offload_cli", "create", name, "--world-size", "1",
            "--cpu-page-size", "64KiB", "--size", "16MiB", "--threads", "1", "--shm-dir",
            str(shm_dir), *extra]
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    if not tty:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
        return proc.returncode, proc.stdout, proc.stderr
    master, slave = pty.openpty()
    try:
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, env=env)
    finally:
        os.close(slave)
    err = b""
    try:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            err += chunk
    finally:
        os.close(master)
    assert child.stdout is not None
    out = child.stdout.read().decode()
    child.stdout.close()
    return child.wait(timeout=60), out, err.decode(errors="replace")


def test_bar_on_a_terminal(shm_dir: Path) -> None:
    code, out, err = _create_on(shm_dir, "tty", tty=True)
    assert code == 0, err
    assert "pre-faulting" in err  # the bar, by bytes with rate and ETA
    assert "/16.0 MiB" in err and ("B/s" in err or "?" in err)
    assert "\x1b[2K" in err.rsplit("pre-faulting", 1)[1]  # transient: erased at the end
    assert "pre-faulting" not in out and out.startswith("Created ")


@pytest.mark.parametrize("extra", [("--json",), ("-q",)], ids=["json", "quiet"])
def test_no_bar_with_json_or_quiet_even_on_a_terminal(shm_dir: Path,
                                                      extra: tuple[str, ...]) -> None:
    code, out, err = _create_on(shm_dir, "quiet", *extra, tty=True)
    assert code == 0, err
    assert "pre-faulting" not in err and "MiB" not in err
    if extra == ("--json",):
        assert json.loads(out)["data"]["populated"] is True


def test_no_bar_without_a_terminal(shm_dir: Path) -> None:
    code, out, err = _create_on(shm_dir, "piped", tty=False)
    assert code == 0, err
    assert err == ""
    assert out.startswith("Created ")
