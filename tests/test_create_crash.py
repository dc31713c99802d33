"""A killed create leaves only what gc reclaims (issue 9, rows 8 and 9).

`create` is a real process, stopped at exact points through the test hook
(VLLM_OFFLOAD_TEST_PAUSE_AT, which makes it SIGSTOP itself there) or killed the
moment a step of it shows from outside (never after a guessed delay). While its
creator lives a region is `creating`; once the creator is gone it is `stale`,
plain `gc --min-age 0` removes it, and `create` over it names a command that
clears it. Regions that were finished survive.
Each step holds at most one 256 MiB region.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.region_files import region_file
from vllm_offload_cli.core.base.testhook import PAUSE_ENV
from vllm_offload_cli.core.base.units import parse_size
from vllm_offload_cli.core.host.discovery import discover
from vllm_offload_cli.core.reclaim.collector import collect
from vllm_offload_cli.core.reclaim.report import GcOptions
from vllm_offload_cli.core.region import manifest as manifest_io
from vllm_offload_cli.core.region.geometry import Geometry
from vllm_offload_cli.core.region.naming import manifest_path, region_path
from vllm_offload_cli.core.system.processes import start_ticks

SIZE = "256MiB"


def _create(shm_dir: Path, engine_id: str, pause_at: str | None = None
            ) -> subprocess.Popen[str]:
    env = {**os.environ, PAUSE_ENV: pause_at or ""}
    return subprocess.Popen(
        [sys.executable, "-m", "vllm_offload_cli", "create", engine_id, "--world-size", "1",
         "--cpu-page-size", "64KiB", "--size", SIZE, "--shm-dir", str(shm_dir), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2:].split()[0] == b"T"


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    try:
        yield started
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)


def _state(cli: Any, shm_dir: Path, engine_id: str) -> dict[str, Any]:
    result = cli("inspect", engine_id, "--shm-dir", str(shm_dir), "--json")
    assert result.exit_code == 0, result.stdout
    region: dict[str, Any] = result.json["data"]["regions"][0]
    return region


def _run_hint(message: str, shm_dir: Path) -> subprocess.CompletedProcess[str]:
    """Run the `vllm-offload ...` command quoted in an error message, as a user would."""
    command = shlex.split(message.split("`")[1])
    assert command[0] == "vllm-offload"
    return subprocess.run([sys.executable, "-m", "vllm_offload_cli", *command[1:]],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "VLLM_OFFLOAD_SHM_DIR": str(shm_dir)})


@pytest.mark.parametrize("point", ["after_manifest", "after_ftruncate", "mid_prefault"])
def test_create_killed_at_an_exact_point(cli: Any, shm_dir: Path, point: str,
                                         procs: list[subprocess.Popen[str]]) -> None:
    proc = _create(shm_dir, "cut", pause_at=point)
    procs.append(proc)
    assert wait_until(lambda: _stopped(proc.pid), timeout=120), proc.poll()
    # its creator is alive: `creating`, kept by gc, and create again says who is at it
    region = _state(cli, shm_dir, "cut")
    assert region["state"] == "creating" and region["persistent"] is False
    gc = cli("gc", "--min-age", "0", "--shm-dir", str(shm_dir), "--json")
    assert [(k["engine_id"], k["code"]) for k in gc.json["data"]["kept"]] == [
        ("cut", "creating")]
    again = cli("create", "cut", "--world-size", "1", "--cpu-page-size", "64KiB",
                "--size", SIZE, "--shm-dir", str(shm_dir))
    assert again.exit_code == 4 and f"pid {proc.pid} is creating it" in again.stderr

    _kill(proc)
    region = _state(cli, shm_dir, "cut")
    assert region["state"] == "stale" and region["persistent"] is False
    assert "creator_died" in [p["code"] for p in region["problems"]]
    # `create` again is refused (exit 4) with a command that clears it: run that command
    again = cli("create", "cut", "--world-size", "1", "--cpu-page-size", "64KiB",
                "--size", SIZE, "--shm-dir", str(shm_dir))
    assert again.exit_code == 4 and "never finished" in again.stderr
    cleared = _run_hint(again.stderr, shm_dir)
    assert cleared.returncode == 0, cleared.stderr
    assert "Removed cut" in cleared.stdout
    assert os.listdir(shm_dir) == []


def test_gc_reclaims_a_dead_creators_region_without_flags(cli: Any, shm_dir: Path,
                                                          procs: list[Any]) -> None:
    """Row 8 as reported: a 0-byte region marked persistent was a dead end."""
    proc = _create(shm_dir, "stub", pause_at="after_manifest")
    procs.append(proc)
    assert wait_until(lambda: _stopped(proc.pid), timeout=120)
    _kill(proc)
    assert (shm_dir / "vllm_offload_stub.mmap").stat().st_size == 0
    gc = cli("gc", "--min-age", "0", "--shm-dir", str(shm_dir), "--json")
    assert [r["engine_id"] for r in gc.json["data"]["removed"]] == ["stub"]
    assert os.listdir(shm_dir) == []


def _fake_creating(shm_dir: Path, engine_id: str, ticks: int | None) -> None:
    path = region_file(shm_dir, engine_id)
    st = path.stat()
    manifest_io.write(str(manifest_path(shm_dir, engine_id)), manifest_io.Manifest(
        engine_id=engine_id, geometry=Geometry(num_blocks=4, row_stride=8192, cpu_page_size=4096,
                                               world_size=2), region_dev=st.st_dev,
        region_ino=st.st_ino, creator_pid=os.getpid(), creator_start_ticks=ticks,
        creator_host="h", created_at=time.time() - 3600, persistent=True,
        state=manifest_io.CREATING))


def test_creator_is_identified_by_pid_and_start_time(shm_dir: Path) -> None:
    """A reused pid does not keep a dead creator's region `creating`."""
    mine = start_ticks(os.getpid())
    assert mine is not None
    _fake_creating(shm_dir, "alive", mine)
    _fake_creating(shm_dir, "reused", mine + 1)  # same pid, another process's start time
    states = {r.engine_id: r.state for r in discover(shm_dir).regions}
    assert states == {"alive": "creating", "reused": "stale"}
    report = collect(shm_dir, GcOptions(min_age=0))
    assert [r.engine_id for r in report.removed] == ["reused"]
    assert [(k.engine_id, k.code) for k in report.kept] == [("alive", "creating")]


def _complete(shm_dir: Path, engine_id: str) -> bool:
    """Did this create finish: a ready manifest describing the very file there?"""
    try:
        m = manifest_io.read(str(manifest_path(shm_dir, engine_id)))
        st = region_path(shm_dir, engine_id).stat()
    except (OSError, manifest_io.ManifestError, LookupError):
        return False
    return m.complete and (m.region_dev, m.region_ino) == (st.st_dev, st.st_ino)


def _resident(path: Path) -> int:
    try:
        return path.stat().st_blocks * 512
    except FileNotFoundError:
        return 0


def _moments(shm_dir: Path, engine_id: str) -> dict[str, Callable[[], bool]]:
    """Points of a create, as seen from outside, in the order a create passes them."""
    path = region_path(shm_dir, engine_id)
    size = parse_size(SIZE)

    def sized() -> bool:
        try:
            return path.stat().st_size == size
        except FileNotFoundError:
            return False

    moments: dict[str, Callable[[], bool]] = {
        "named": path.exists,  # it won O_EXCL
        "described": manifest_path(shm_dir, engine_id).exists,
        "sized": sized,  # ftruncate done
    }
    for quarter in (1, 2, 3):  # pre-fault under way
        moments[f"{quarter}/4 pre-faulted"] = (
            lambda q=quarter: _resident(path) >= size * q // 4)
    moments["ready"] = lambda: _complete(shm_dir, engine_id)
    return moments


def _or_exited(reached: Callable[[], bool], proc: subprocess.Popen[str]
               ) -> Callable[[], bool]:
    return lambda: reached() or proc.poll() is not None


@pytest.mark.slow
def test_create_killed_at_every_moment_it_can_be_seen_at(shm_dir: Path,
                                                         procs: list[Any]) -> None:
    """Kill real creates of 256 MiB the moment each step shows from outside (the name,
    the manifest, the size, a quarter, half and three quarters pre-faulted, ready);
    gc leaves exactly the finished ones and nothing of the others."""
    counts = {"finished_kept": 0, "unfinished_removed": 0, "no_file_yet": 0,
              "wrongly_removed": 0, "half_made_left": 0}
    for i, name in enumerate(list(_moments(shm_dir, "x")) * 2):
        engine_id = f"k{i}"
        proc = _create(shm_dir, engine_id)
        procs.append(proc)
        reached = _moments(shm_dir, engine_id)[name]
        assert wait_until(_or_exited(reached, proc), timeout=120, interval=0.001), name
        _kill(proc)  # the fault lands where the create was seen to be
        finished = _complete(shm_dir, engine_id)
        existed = region_path(shm_dir, engine_id).exists()
        collect(shm_dir, GcOptions(min_age=0))
        left = sorted(os.listdir(shm_dir))
        if finished:
            kept = left == [f"vllm_offload_{engine_id}.manifest.json",
                            f"vllm_offload_{engine_id}.mmap"]
            counts["finished_kept" if kept else "wrongly_removed"] += 1
            collect(shm_dir, GcOptions(min_age=0, include_persistent=True))  # free it for the next
        elif left:
            counts["half_made_left"] += 1
        else:
            counts["unfinished_removed" if existed else "no_file_yet"] += 1
        for leftover in os.listdir(shm_dir):  # whatever was left: never carried over
            os.unlink(shm_dir / leftover)
    assert counts["wrongly_removed"] == 0 and counts["half_made_left"] == 0, counts
    assert counts["unfinished_removed"] > 0, counts  # kills did land inside creates
    assert counts["finished_kept"] > 0, counts  # and after them


@pytest.mark.parametrize("leftover", ["persistent", "vllm"])
def test_create_over_a_taken_name_names_a_command_that_works(cli: Any, shm_dir: Path,
                                                             leftover: str) -> None:
    """The hint is run as printed: it must clear an unused leftover of either kind."""
    if leftover == "persistent":
        made = cli("create", "taken", "--world-size", "1", "--cpu-page-size", "4KiB",
                   "--num-blocks", "4", "--shm-dir", str(shm_dir))
        assert made.exit_code == 0, made.stderr
    else:
        region_file(shm_dir, "taken")  # as vLLM leaves it: no manifest
    again = cli("create", "taken", "--world-size", "1", "--cpu-page-size", "4KiB",
                "--num-blocks", "4", "--shm-dir", str(shm_dir))
    assert again.exit_code == 4
    cleared = _run_hint(again.stderr, shm_dir)
    assert cleared.returncode == 0, cleared.stderr
    assert "Removed taken" in cleared.stdout
    assert os.listdir(shm_dir) == []
