"""`vllm-offload create`: the happy path, --hold, and every bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import run_cli_subprocess, wait_until
from helpers.other_user import NOBODY, OtherUser

from vllm_offload_cli.core.region import manifest as manifest_io
from vllm_offload_cli.core.region.geometry import PAGESIZE

BASE = ("--world-size", "2", "--cpu-page-size", "64KiB")


def test_create_lays_out_like_vllm_and_stays_persistent(cli: Any, shm_dir: Path) -> None:
    r = cli("create", "eng", "--dp-rank", "1", *BASE, "--num-blocks", "16",
            "--shm-dir", str(shm_dir), "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json
    data = doc["data"]
    path = shm_dir / "vllm_offload_eng_dp1.mmap"
    assert data["engine_id"] == "eng_dp1" and data["path"] == str(path)
    assert data["size_bytes"] == 16 * 131072 == path.stat().st_size
    assert data["geometry"] == {"num_blocks": 16, "row_stride": 131072,
                                "cpu_page_size": 65536, "world_size": 2}
    assert data["populate_seconds"] >= 0 and data["persistent"] is True
    m = manifest_io.read(str(shm_dir / "vllm_offload_eng_dp1.manifest.json"))
    assert m.persistent and m.dp_rank == 1 and m.base_engine_id == "eng"
    assert (path.stat().st_mode & 0o777) == 0o600
    assert path.stat().st_blocks * 512 == data["size_bytes"], "fully pre-faulted"


def test_create_by_size_rounds_down_to_rows_and_warns(cli: Any, shm_dir: Path) -> None:
    r = cli("create", "e", *BASE, "--size", "1MiB", "--no-populate", "--shm-dir",
            str(shm_dir), "--json")
    assert r.exit_code == 0
    assert r.json["data"]["geometry"]["num_blocks"] == 8
    assert r.json["data"]["populate_seconds"] is None
    assert (shm_dir / "vllm_offload_e.mmap").stat().st_blocks == 0, "nothing allocated"
    r = cli("create", "f", "--world-size", "3", "--cpu-page-size", "4KiB", "--size", "1MiB",
            "--shm-dir", str(shm_dir), "--json")
    assert r.exit_code == 0
    assert [w["code"] for w in r.json["warnings"]] == ["size_rounded"]


def test_human_output(cli: Any, shm_dir: Path) -> None:
    r = cli("create", "h", *BASE, "--num-blocks", "4", "--shm-dir", str(shm_dir))
    assert r.exit_code == 0
    assert f"Created {shm_dir}/vllm_offload_h.mmap" in r.stdout
    assert "4 rows x 131072 bytes" in r.stdout


def test_shm_dir_from_environment(cli: Any, shm_dir: Path) -> None:
    r = cli("create", "env", *BASE, "--num-blocks", "2", "--json",
            env={"VLLM_OFFLOAD_SHM_DIR": str(shm_dir)})
    assert r.exit_code == 0
    assert (shm_dir / "vllm_offload_env.mmap").exists()


BAD_INPUTS = [
    (["../x", *BASE, "--num-blocks", "1"], 2, "contains '/'"),
    (["a/b", *BASE, "--num-blocks", "1"], 2, "contains '/'"),
    (["", *BASE, "--num-blocks", "1"], 2, "engine_id is empty"),
    (["x" * 201, *BASE, "--num-blocks", "1"], 2, "the limit is 200"),
    (["x", *BASE, "--num-blocks", "0"], 2, "--num-blocks must be greater than 0"),
    (["x", *BASE, "--num-blocks", "-3"], 2, "--num-blocks must be greater than 0"),
    (["x", *BASE, "--size", "0"], 2, "--size must be greater than 0"),
    (["x", *BASE, "--size", "-1GiB"], 2, "is not a size"),
    (["x", *BASE, "--size", "12mb"], 2, "unknown unit"),
    (["x", *BASE], 2, "exactly one of --num-blocks and --size"),
    (["x", *BASE, "--num-blocks", "1", "--size", "1MiB"], 2, "exactly one"),
    (["x", "--world-size", "0", "--cpu-page-size", "4KiB", "--num-blocks", "1"], 2,
     "--world-size must be greater than 0"),
    (["x", "--world-size", "2", "--cpu-page-size", "0", "--num-blocks", "1"], 2,
     "--cpu-page-size must be greater than 0"),
    (["x", *BASE, "--num-blocks", "1", "--dp-rank", "-1"], 2, "dp rank must be >= 0"),
    (["x", *BASE, "--size", "1TiB"], 5, "free"),
    (["x", *BASE, "--num-blocks", "1", "--frobnicate"], 2, "No such option"),
    (["x", *BASE, "--size", "3GiB", "--segments", "4", "--no-populate"], 2,
     "--segments 4 cannot be made for 3GiB (no file may be under 1GiB); possible: 1, 2, 3"),
    (["x", *BASE, "--size", "64MiB", "--segments", "2"], 2, "possible: 1"),
]


@pytest.mark.parametrize(("args", "code", "message"), BAD_INPUTS)
def test_bad_input_is_one_clear_line_and_changes_nothing(
        cli: Any, shm_dir: Path, args: list[str], code: int, message: str) -> None:
    r = cli("create", *args, "--shm-dir", str(shm_dir))
    assert r.exit_code == code
    assert r.stdout == ""
    first = r.stderr.splitlines()[0]
    assert first.startswith("Error: ") and message in r.stderr
    assert "Traceback" not in r.stderr
    assert os.listdir(shm_dir) == []
    j = cli("create", *args, "--shm-dir", str(shm_dir), "--json")
    assert j.exit_code == code
    assert j.json["ok"] is False and j.json["exit_code"] == code
    assert message in j.json["errors"][0]["message"]
    assert os.listdir(shm_dir) == []


def _prepare(shm_dir: Path, kind: str) -> Path:
    path = shm_dir / "vllm_offload_x.mmap"
    target = shm_dir / "target"
    target.write_bytes(b"keep")
    if kind == "symlink":
        path.symlink_to(target)
    elif kind in ("file", "foreign", "mode"):
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
        os.write(fd, b"old")
        os.close(fd)
        if kind == "foreign":
            os.chown(path, 12345, 12345)
        if kind == "mode":
            os.chmod(path, 0o666)
    elif kind == "corrupt-manifest":
        m = shm_dir / "vllm_offload_x.manifest.json"
        m.write_text('{"manifest_version": 1, "engine_id": 5}')
        m.chmod(0o600)
    return path


@pytest.mark.parametrize(("kind", "code", "message"), [
    ("file", 4, "already exists"),
    ("foreign", 6, "owned by uid 12345"),
    ("mode", 6, "mode 0666"),
    ("symlink", 6, "symbolic link"),
    ("corrupt-manifest", 6, "invalid"),
])
def test_existing_names_are_refused_untouched(cli: Any, shm_dir: Path, kind: str, code: int,
                                              message: str) -> None:
    _prepare(shm_dir, kind)
    before = {n: (shm_dir / n).lstat() for n in os.listdir(shm_dir)}
    contents = {n: (shm_dir / n).read_bytes() for n in before if not (shm_dir / n).is_symlink()}
    r = cli("create", "x", *BASE, "--num-blocks", "2", "--shm-dir", str(shm_dir))
    assert r.exit_code == code, r.stderr
    assert message in r.stderr and r.stderr.startswith("Error: ")
    after = {n: (shm_dir / n).lstat() for n in os.listdir(shm_dir)}
    assert {n: (s.st_ino, s.st_mode, s.st_uid, s.st_size) for n, s in before.items()} == \
        {n: (s.st_ino, s.st_mode, s.st_uid, s.st_size) for n, s in after.items()}
    assert contents == {n: (shm_dir / n).read_bytes() for n in contents}


def test_missing_shm_dir_is_usage_error(cli: Any, shm_dir: Path) -> None:
    r = cli("create", "x", *BASE, "--num-blocks", "1", "--shm-dir", str(shm_dir / "nope"))
    assert r.exit_code == 2 and "does not exist" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_hold_removes_the_region_on_signal(shm_dir: Path, sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_offload_cli", "create", "held", *BASE, "--num-blocks", "4",
         "--hold", "--shm-dir", str(shm_dir), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        path = shm_dir / "vllm_offload_held.mmap"
        assert wait_until(lambda: path.exists() and path.stat().st_size == 4 * 131072
                          and len(manifest_io.read(str(shm_dir / "vllm_offload_held.manifest.json"))
                                  .attachments) == 1, timeout=30)
        inspect = run_cli_subprocess("inspect", "held", "--shm-dir", str(shm_dir), "--json")
        region = inspect.json["data"]["regions"][0]
        assert region["state"] == "live" and proc.pid in [h["pid"] for h in region["holders"]]
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    # Ctrl-C is an interruption, as a shell expects (it was 0); SIGTERM the asked-for stop
    assert proc.returncode == (130 if sig == signal.SIGINT else 0), err
    assert os.listdir(shm_dir) == []
    doc = json.loads(out)
    data = doc["data"]
    assert data["held"] is True and data["removed"] is True
    assert data["released_by"] == sig.name
    assert doc["exit_code"] == proc.returncode


def test_rows_are_laid_out_for_a_joining_engine(cli: Any, shm_dir: Path) -> None:
    """A pre-provisioned region is joinable by a worker with the same geometry."""
    from vllm_offload_cli.core.region import SharedOffloadRegion

    assert cli("create", "pre", "--world-size", "2", "--cpu-page-size", "4KiB",
               "--num-blocks", "3", "--shm-dir", str(shm_dir)).exit_code == 0
    with SharedOffloadRegion("pre", 3, 1, 2 * PAGESIZE, PAGESIZE, shm_dir=shm_dir,
                             world_size=2) as worker:
        assert not worker.creator
    assert (shm_dir / "vllm_offload_pre.mmap").exists()


def test_create_on_a_name_a_live_process_holds_names_the_pid(cli: Any, shm_dir: Path,
                                                              holders: Any) -> None:
    h = holders("region", str(shm_dir), "h1", "4", "0", "65536", "65536", "1")
    r = cli("create", "h1", "--world-size", "1", "--cpu-page-size", "64KiB", "--num-blocks",
            "4", "--shm-dir", str(shm_dir))
    assert r.exit_code == 4
    assert f"is in use by pid {h.pid} (python" in r.stderr and "gc" not in r.stderr


def test_decimal_sizes_are_powers_of_1000_and_printed_back(cli: Any, shm_dir: Path) -> None:
    r = cli("create", "dec", "--world-size", "1", "--cpu-page-size", "4KB", "--num-blocks",
            "2", "--no-populate", "--shm-dir", str(shm_dir))
    assert r.exit_code == 0, r.stderr
    assert "1 slot(s) of 4000 bytes" in r.stdout


# -- provisioning for a service user ---------------------------------------------------


def test_root_provisions_a_region_a_service_user_joins(cli: Any, shm_dir: Path,
                                                       nobody: OtherUser) -> None:
    """`create --owner nobody` as root, then a real process of uid 65534 joins it through
    the core class (its owner and mode checks), as an engine running as `vllm` would."""
    os.chmod(shm_dir, 0o1777)  # sticky and world-writable, like /dev/shm
    r = cli("create", "svc", *BASE, "--num-blocks", "4", "--owner", f"{NOBODY}:{NOBODY}",
            "--mode", "600", "--shm-dir", str(shm_dir), "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json["data"]["owner"] == {"uid": NOBODY, "gid": NOBODY, "mode": "0600"}
    for name in ("vllm_offload_svc.mmap", "vllm_offload_svc.manifest.json"):
        st = (shm_dir / name).stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (NOBODY, NOBODY, 0o600), name
    joined = subprocess.run(
        nobody.python_command(nobody.helper("holder.py"), "region", str(shm_dir), "svc", "4",
                              "1", "131072", "65536", "2"),
        input="exit\n", capture_output=True, text=True, timeout=60)
    assert joined.returncode == 0, joined.stderr
    ready = json.loads(joined.stdout.splitlines()[0])
    assert ready["creator"] is False
    region = run_cli_subprocess("inspect", "svc", "--shm-dir", str(shm_dir), "--json")
    assert region.json["data"]["regions"][0]["problems"] == []
    assert region.json["data"]["regions"][0]["state"] == "persistent"


@pytest.mark.parametrize(("option", "value", "code"), [
    ("--mode", "0640", "invalid_mode"), ("--mode", "0400", "invalid_mode"),
    ("--mode", "rw", "invalid_mode"), ("--owner", "no-such-user-here", "invalid_owner"),
    ("--owner", "0:no-such-group-here", "invalid_owner")])
def test_bad_owner_or_mode_creates_nothing(cli: Any, shm_dir: Path, option: str, value: str,
                                           code: str) -> None:
    r = cli("create", "x", *BASE, "--num-blocks", "1", option, value, "--shm-dir",
            str(shm_dir), "--json")
    assert r.exit_code == 2 and r.json["errors"][0]["code"] == code, r.stdout
    assert os.listdir(shm_dir) == []
