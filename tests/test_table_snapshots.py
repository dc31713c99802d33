"""Tables keep one line per item at any width, piped or on a terminal.

The snapshots render fixed records (no process, no clock) as the CLI writes
them (plain text: no width to depend on); one test runs the real CLI with six
real holders on an 80-column terminal.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_offload_cli.cli import common
from vllm_offload_cli.cli import inspect as inspect_cli
from vllm_offload_cli.cli.inspect import owner_name, render_table
from vllm_offload_cli.core.base.problems import Problem
from vllm_offload_cli.core.host.discovery import Holder, Inventory, RegionInfo, SegmentFile
from vllm_offload_cli.core.region.capacity import ShmUsage
from vllm_offload_cli.core.region.geometry import PAGESIZE

NOBODY = 65534


def _region(engine_id: str, *, state: str, holders: int = 0, linked: bool = True,
            problems: tuple[Problem, ...] = (), uid: int = NOBODY) -> RegionInfo:
    base, _, rank = engine_id.rpartition("_dp")
    seg = SegmentFile(path=f"/dev/shm/vllm_offload_{engine_id}.mmap", segment=0,
                      file_id=None, size_bytes=3 << 30, uid=uid, mode=0o600, mtime=0.0,
                      resident_bytes=1 << 30, allocated_bytes=1 << 30)
    return RegionInfo(
        engine_id=engine_id, base_engine_id=base if rank.isdigit() else engine_id,
        dp_rank=int(rank) if rank.isdigit() else None, segments=(seg,), linked=linked,
        size_bytes=3 << 30, resident_bytes=1 << 30, uid=uid, mode="0600",
        age_seconds=5400.0, geometry=None, manifest=None, manifest_path=None,
        holders=tuple(Holder(pid=4200 + i, name="python3", rank=i, via=("map", "fd"))
                      for i in range(holders)),
        locked=False, state=state, problems=problems)


INVENTORY = Inventory(
    shm_dir="/dev/shm",
    regions=(
        _region("0f3a8c51-6c4e-4b8e-9d7e-2a51c0de9f11_dp0", state="live", holders=6),
        _region("leaked_dp1", state="stale", problems=(
            Problem("unsafe_mode", "mode 0644 lets other users read the region"),
            Problem("size_mismatch", "files hold 3221225472 bytes but the manifest geometry "
                    "needs 3221225473 (1 rows of 3221225473)"))),
        _region("del", state="live", holders=1, linked=False),
    ),
    orphan_manifests=(), shm=ShmUsage(total_bytes=64 << 30, free_bytes=55 << 30),
    uninspectable_processes=0)

SNAPSHOT = (Path(__file__).parent / "snapshots" / "inspect_table.txt").read_text()


@pytest.fixture(autouse=True)
def _nobody(monkeypatch: pytest.MonkeyPatch) -> None:
    """Owner names differ between hosts; uid 65534 is `nobody` here."""
    monkeypatch.setattr(inspect_cli, "owner_name", lambda uid: "nobody")


def test_owner_is_the_user_name_or_the_number() -> None:
    assert owner_name(os.geteuid()) not in ("", "-")
    assert owner_name(None) == "-"
    assert owner_name(2**31 - 7) == str(2**31 - 7)


def test_inspect_table_snapshot() -> None:
    sink = io.StringIO()
    render_table(common.Out(sink), inspect_cli.inventory_data(INVENTORY))
    assert sink.getvalue() == SNAPSHOT


def test_wide_lists_every_holder_on_the_same_line() -> None:
    sink = io.StringIO()
    render_table(common.Out(sink), inspect_cli.inventory_data(INVENTORY), wide=True)
    first = sink.getvalue().splitlines()[1]
    assert first.endswith(", ".join(f"{4200 + i} python3 r{i}" for i in range(6)) + "  -")


def test_text_table_has_no_trailing_spaces_and_aligns_numbers() -> None:
    text = common.text_table(["A", "N", "LAST"], [["x", "5", ""], ["long", "123", "z"]],
                             right=(1,))
    assert text.splitlines() == ["A       N  LAST", "x       5", "long  123  z"]


def _pty_run(argv: list[str], env: dict[str, str], expect: int = 0) -> str:
    """stdout of `argv` when it is a terminal."""
    main, sub = os.openpty()
    try:
        proc = subprocess.Popen(argv, stdout=sub, stderr=subprocess.DEVNULL, env=env)
    finally:
        os.close(sub)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the other side closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    assert proc.wait(timeout=60) == expect
    return b"".join(chunks).decode().replace("\r\n", "\n")


def test_six_holders_at_80_columns_piped_and_on_a_terminal(shm_dir: Path, holders: Any) -> None:
    procs = [holders("region", str(shm_dir), "six", "4", str(r), str(6 * PAGESIZE),
                     str(PAGESIZE), "6") for r in range(6)]
    (shm_dir / "vllm_offload_bad_dp3.mmap").write_bytes(b"\0" * PAGESIZE)
    os.chmod(shm_dir / "vllm_offload_bad_dp3.mmap", 0o644)
    argv = [sys.executable, "-m", "vllm_offload_cli", "inspect", "--shm-dir", str(shm_dir)]
    env = {**os.environ, "COLUMNS": "80"}
    piped = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60,
                           check=True).stdout
    on_tty = _pty_run(argv, env)
    for out in (piped, on_tty):
        lines = out.splitlines()
        assert not [line for line in lines if line != line.rstrip()], "no trailing spaces"
        six = [line for line in lines if line.startswith("six ")]
        pids = sorted(p.pid for p in procs)
        assert len(six) == 1 and f" 6 ({six[0].split('(')[1].split(',')[0]}," in six[0]
        assert int(six[0].split("(")[1].split(",")[0]) in pids
        bad = [line for line in lines if line.startswith("bad_dp3 ")]
        assert len(bad) == 1 and bad[0].split()[-1].startswith("unsafe"), bad
        assert "…" not in out


@pytest.mark.parametrize("columns", ["80", "200"])
@pytest.mark.parametrize("terminal", [False, True], ids=["piped", "terminal"])
def test_verify_plan_table_snapshot(columns: str, terminal: bool) -> None:
    """A plan with a collision: the same table and verdict at every width."""
    argv = [sys.executable, "-m", "vllm_offload_cli", "verify-rank-layout", "--world-size",
            "2", "--dp-size", "2", "--devices", "0,0;1,2", "--rank-source", "device-modulo"]
    env = {**os.environ, "COLUMNS": columns}
    if terminal:
        out = _pty_run(argv, env, expect=3)
    else:
        run = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
        assert run.returncode == 3
        out = run.stdout
    expected = (Path(__file__).parent / "snapshots" / "verify_plan.txt").read_text()
    assert out == expected
