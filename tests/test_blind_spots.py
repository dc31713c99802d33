"""gc and inspect must know when a holder could be hidden from them (issue 9).

Real processes hide for real here: another PID namespace (`unshare`), a
hidepid /proc (a private mount namespace), non-dumpable processes of another
user (`setpriv`), root without CAP_SYS_PTRACE / CAP_LEASE (a container's
capability set). What needs root or unshare skips where it is not permitted (and
fails with VLLM_OFFLOAD_REQUIRE_ROOT=1). What runs as nobody runs from a copy of
the code that nobody can read (the `nobody` fixture): the checkout may be private.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import require_root, wait_until
from helpers.other_user import NOBODY, OtherUser
from helpers.ready_process import ReadyProcess
from region_files import region_file

from vllm_offload_cli.core.host import visibility
from vllm_offload_cli.core.host.discovery import discover
from vllm_offload_cli.core.region import fsguard
from vllm_offload_cli.core.system import mounts

SNEAKY = Path(__file__).parent / "helpers" / "sneaky_holder.py"


def without_caps(caps: str, cmd: list[str]) -> list[str]:
    """Root as in a default container: these capabilities dropped for good."""
    require_root("needs root to drop capabilities")
    require_root("setpriv is not installed", granted=shutil.which("setpriv") is not None)
    drop = ",".join(f"-{c}" for c in caps.split(","))
    return ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", *cmd]


@pytest.fixture
def sneaky(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Start sneaky holders, as this user or (user="nobody") as nobody; killed at teardown."""
    started: list[ReadyProcess] = []

    def start(path: Path, how: str, *extra: str, user: str = "root") -> ReadyProcess:
        if user == "nobody":
            nobody: OtherUser = request.getfixturevalue("nobody")
            cmd = nobody.python_command(nobody.helper(SNEAKY.name), str(path), how, *extra)
        else:
            cmd = [sys.executable, str(SNEAKY), str(path), how, *extra]
        s = ReadyProcess(cmd)
        started.append(s)
        return s

    try:
        yield start
    finally:
        for s in started:
            if s.proc.poll() is None:
                s.proc.kill()
            s.stop()


@pytest.fixture
def shared_dir(shm_dir: Path) -> Path:
    """The private test directory, made sticky and world-writable like /dev/shm."""
    os.chmod(shm_dir, 0o1777)
    return shm_dir


def run(cmd: list[str], timeout: float = 90) -> tuple[int, dict[str, Any], str]:
    """Run a command that prints one JSON document; (exit code, document, stderr)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    doc = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return proc.returncode, doc, proc.stderr


CLI = [sys.executable, "-m", "vllm_offload_cli"]


def gc_args(shm_dir: Path, *args: str) -> list[str]:
    return ["gc", "--shm-dir", str(shm_dir), "--min-age", "0", "--json", *args]


def gc_cmd(shm_dir: Path, *args: str) -> list[str]:
    return [*CLI, *gc_args(shm_dir, *args)]


def kept(doc: dict[str, Any], engine_id: str) -> dict[str, Any]:
    [k] = [k for k in doc["data"]["kept"] if k["engine_id"] == engine_id]
    return k


def nobody_region(shm_dir: Path, engine_id: str) -> Path:
    path = region_file(shm_dir, engine_id)
    os.chown(path, NOBODY, NOBODY)
    return path


def unreadable_to(python: Callable[..., list[str]], pid: int) -> bool:
    """Whether a Python started by `python(*args)` may not read pid's descriptors."""
    probe = subprocess.run(python("-c", (
        f"import os\ntry:\n    [os.stat('/proc/{pid}/fd/' + n) for n in "
        f"os.listdir('/proc/{pid}/fd')]\nexcept PermissionError:\n    print('denied')")),
        capture_output=True, text=True, timeout=30)
    return "denied" in probe.stdout


def weak_root_python(caps: str) -> Callable[..., list[str]]:
    return lambda *args: without_caps(caps, [sys.executable, *args])


# -- /proc mount options ---------------------------------------------------------------

def table(*lines: str) -> list[mounts.Mount]:
    """A mount table from 'point fstype options' lines, in mount order."""
    return [mounts.Mount(point, fstype, mounts.parse_options(options))
            for point, fstype, options in (line.split() for line in lines)]


PROC_AND_BINFMT = ("/proc proc rw", "/proc/sys/fs/binfmt_misc autofs rw")


@pytest.mark.parametrize(("options", "codes"), [
    ("rw", []),
    ("rw,hidepid=0", []),
    ("rw,hidepid=off", []),
    ("rw,hidepid=2", [visibility.HIDEPID]),
    ("rw,hidepid=invisible", [visibility.HIDEPID]),
    ("rw,hidepid=noaccess", [visibility.HIDEPID]),
    ("rw,hidepid=1,gid=4242", []),  # we are in the gid= group: nothing is hidden from us
    ("rw,hidepid=1,gid=4243", [visibility.HIDEPID]),
    ("rw,subset=pid", [visibility.PROC_SUBSET]),
    ("rw,hidepid=invisible,subset=pid", [visibility.HIDEPID, visibility.PROC_SUBSET]),
])
def test_proc_mount_options(options: str, codes: list[str]) -> None:
    spots = visibility.mount_blind_spots(table(f"/proc proc {options}", PROC_AND_BINFMT[1]),
                                         {4242})
    assert [s.code for s in spots] == codes


def test_the_proc_mount_on_top_is_the_one_that_counts() -> None:
    over = (*PROC_AND_BINFMT, "/proc proc rw,nosuid,hidepid=2")
    [on_top] = visibility.mount_blind_spots(table(*over), set())
    assert on_top.code == visibility.HIDEPID and "hidepid=2" in on_top.message
    covered = (*over, "/proc tmpfs rw")
    # not a proc at all any more
    assert visibility.mount_blind_spots(table(*covered), set()) == []


def test_this_host_is_seen_whole() -> None:
    """The suite runs in the host's namespace with a plain /proc (else the rest skips)."""
    require_root("the test suite itself runs in a PID namespace",
                 granted=os.stat("/proc/self/ns/pid").st_ino == visibility.PROC_PID_INIT_INO)
    assert visibility.host_blind_spots() == []


# -- another PID namespace: the headline ---------------------------------------


def _unshare_refusal(wrap: list[str]) -> str | None:
    """Why `wrap true` fails here (None: it works)."""
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    probe = subprocess.run([*wrap, "true"], capture_output=True, timeout=30, check=False)
    return None if probe.returncode == 0 else probe.stderr.decode().strip()


def in_new_pid_namespace(cmd: list[str]) -> list[str]:
    require_root("needs root for a PID namespace of its own")
    wrap = ["unshare", "--pid", "--fork", "--mount-proc"]
    refused = _unshare_refusal(wrap)
    require_root(f"unshare --pid is not permitted here: {refused}", granted=refused is None)
    return [*wrap, *cmd]


def test_gc_in_another_pid_namespace_keeps_a_live_region_and_exits_6(
        shm_dir: Path, sneaky: Any) -> None:
    path = region_file(shm_dir, "live", fill=False)
    holder = sneaky(path, "map-quiet")  # the reproducer: mapped, never touched

    for extra in ((), ("--dry-run",)):
        code, doc, err = run(in_new_pid_namespace(gc_cmd(shm_dir, *extra)))
        assert code == 6, err
        assert doc["exit_code"] == 6 and doc["ok"] is False
        assert doc["errors"][0]["code"] == visibility.PID_NAMESPACE
        assert "hostPID" in doc["errors"][0]["message"]
        k = kept(doc, "live")
        assert (k["code"], k["blind_spot"]) == ("unknown", visibility.PID_NAMESPACE)
        assert doc["data"]["removed"] == []
        assert path.exists()

    # the same run on the host names the holder
    code, doc, err = run(gc_cmd(shm_dir))
    assert code == 0, err
    assert kept(doc, "live")["pid"] == holder.pid


def test_gc_in_another_pid_namespace_says_why_in_words(shm_dir: Path) -> None:
    region_file(shm_dir, "old")
    cmd = [c for c in gc_cmd(shm_dir) if c != "--json"]
    proc = subprocess.run(in_new_pid_namespace(cmd), capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == 6
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "PID namespace" in errors[0]
    assert "--shm-private-to-namespace" in errors[0]
    assert "Kept old: not proven unused" in proc.stdout
    assert (shm_dir / "vllm_offload_old.mmap").exists()


def test_inspect_in_another_pid_namespace_shows_unknown(shm_dir: Path) -> None:
    region_file(shm_dir, "maybe")
    code, doc, err = run(in_new_pid_namespace(
        [*CLI, "inspect", "--shm-dir", str(shm_dir), "--json"]))
    assert code == 0, err
    [region] = doc["data"]["regions"]
    assert region["state"] == "unknown"
    assert [p["code"] for p in region["problems"]] == [visibility.PID_NAMESPACE]
    vis = doc["data"]["visibility"]
    assert [b["code"] for b in vis["blind_spots"]] == [visibility.PID_NAMESPACE]
    assert vis["complete"] is False
    assert visibility.PID_NAMESPACE in [w["code"] for w in doc["warnings"]]


def test_inspect_table_in_another_pid_namespace_says_unknown(shm_dir: Path) -> None:
    region_file(shm_dir, "maybe")
    proc = subprocess.run(in_new_pid_namespace(
        [*CLI, "inspect", "--shm-dir", str(shm_dir)]), capture_output=True, text=True,
        timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert "unknown" in proc.stdout and "1 unknown (a holder could be hidden)" in proc.stdout
    assert "Warning:" in proc.stderr and "PID namespace" in proc.stderr


def test_the_namespace_waiver_outside_a_namespace_is_pointed_out(cli: Any,
                                                                 shm_dir: Path) -> None:
    require_root("the test suite itself runs in a PID namespace",
                 granted=not visibility.namespace_blind_spots())
    result = cli("gc", "--shm-dir", str(shm_dir), "--shm-private-to-namespace", "--json")
    assert result.exit_code == 0
    assert "waiver_unused" in [w["code"] for w in result.json["warnings"]]


def test_a_shm_dir_private_to_the_namespace_can_be_collected_there(shm_dir: Path) -> None:
    path = region_file(shm_dir, "mine")
    code, doc, err = run(in_new_pid_namespace(
        gc_cmd(shm_dir, "--shm-private-to-namespace")))
    assert code == 0, err
    assert [r["engine_id"] for r in doc["data"]["removed"]] == ["mine"]
    assert doc["data"]["visibility"]["shm_private_to_namespace"] is True
    assert not path.exists()


# -- hidepid ---------------------------------------------------------------------------


def with_hidepid(cmd: list[str]) -> list[str]:
    """cmd in a private mount namespace whose /proc is mounted hidepid=2."""
    require_root("needs root to mount a hidepid /proc")
    script = 'mount -t proc -o hidepid=2 proc /proc && exec "$@"'
    wrap = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh"]
    refused = _unshare_refusal(wrap)
    require_root(f"cannot mount a hidepid /proc here: {refused}", granted=refused is None)
    return [*wrap, *cmd]


def test_hidepid_proc_is_a_blind_spot_no_override_waives(shm_dir: Path) -> None:
    path = region_file(shm_dir, "hid")
    for extra in ((), ("--shm-private-to-namespace",)):
        code, doc, err = run(with_hidepid(gc_cmd(shm_dir, *extra)))
        assert code == 6, err
        assert doc["errors"][0]["code"] == visibility.HIDEPID
        assert kept(doc, "hid")["code"] == "unknown"
        assert path.exists()
    code, doc, _ = run(with_hidepid([*CLI, "inspect", "--shm-dir", str(shm_dir), "--json"]))
    assert doc["data"]["regions"][0]["state"] == "unknown"


# -- processes we may not inspect ----------------------------------------------------


def test_non_dumpable_holder_of_the_same_user_keeps_the_region(
        shared_dir: Path, sneaky: Any, nobody: OtherUser) -> None:
    """Row 6: gc as the owner cannot read a non-dumpable holder's /proc entries."""
    path = nobody_region(shared_dir, "nd")
    holder = sneaky(path, "map", "--non-dumpable", user="nobody")
    gc_as_nobody = nobody.cli(*gc_args(shared_dir))
    if not unreadable_to(nobody.python_command, holder.pid):
        pytest.skip("this kernel lets the owner read a non-dumpable process")

    code, doc, err = run(gc_as_nobody)
    assert code == 0, err
    k = kept(doc, "nd")
    assert k["code"] == "live" and "cannot be inspected" in k["reason"]
    assert holder.pid in doc["data"]["visibility"]["uninspectable_pids"]
    assert path.exists()
    code, doc, _ = run(nobody.cli("inspect", "--shm-dir", str(shared_dir), "--json"))
    region = doc["data"]["regions"][0]
    assert region["state"] == "live" and region["holders"] == []
    assert "hidden_holder" in [p["code"] for p in region["problems"]]

    holder.stop()
    code, doc, err = run(gc_as_nobody)  # proven unused now, although root's processes hide
    assert code == 0, err
    assert [r["engine_id"] for r in doc["data"]["removed"]] == ["nd"]
    assert not path.exists()


def test_without_a_lease_a_possibly_hidden_holder_means_unknown_and_exit_6(
        shared_dir: Path, sneaky: Any) -> None:
    """Root without CAP_SYS_PTRACE and CAP_LEASE (a default container) cannot see a
    non-dumpable holder's descriptors, nor ask the kernel: it must not guess."""
    path = nobody_region(shared_dir, "blind")
    holder = sneaky(path, "fd", "--non-dumpable", user="nobody")
    if not unreadable_to(weak_root_python("sys_ptrace,lease"), holder.pid):
        pytest.skip("root without CAP_SYS_PTRACE can still read that process here")

    for extra in ((), ("--dry-run",)):
        code, doc, err = run(without_caps("sys_ptrace,lease", gc_cmd(
            shared_dir, "--all-users", *extra)))
        assert code == 6, err
        k = kept(doc, "blind")
        assert (k["code"], k["blind_spot"]) == ("unknown", visibility.HIDDEN_HOLDERS)
        assert "cannot be inspected" in k["reason"] and "CAP_LEASE" in k["reason"]
        assert holder.pid in doc["data"]["visibility"]["uninspectable_pids"]
        assert [e["code"] for e in doc["errors"]] == [visibility.HIDDEN_HOLDERS]
        assert path.exists()

    code, doc, err = run(gc_cmd(shared_dir, "--all-users"))  # full root: the lease says held
    assert code == 0, err
    assert kept(doc, "blind")["code"] in ("live", "busy")
    holder.stop()
    code, doc, err = run(gc_cmd(shared_dir, "--all-users"))
    assert code == 0, err
    assert not path.exists()


def test_stale_regions_go_although_some_processes_cannot_be_inspected(
        shm_dir: Path, sneaky: Any) -> None:
    """gc stays useful where /proc is partly unreadable (as for PID 1 in some
    sandboxes): a region nobody has open is proven unused by the lease."""
    path = region_file(shm_dir, "open", mode=0o644)  # any process could map this one
    other = region_file(shm_dir, "other", mode=0o666)
    os.chmod(shm_dir, 0o755)
    idle = sneaky(other, "fd", "--non-dumpable", user="nobody")  # hidden, holds "other"
    if not unreadable_to(weak_root_python("sys_ptrace"), idle.pid):
        pytest.skip("root without CAP_SYS_PTRACE can still read that process here")

    code, doc, err = run(without_caps("sys_ptrace", gc_cmd(shm_dir)))

    assert code == 0, err
    assert idle.pid in doc["data"]["visibility"]["uninspectable_pids"]
    assert [r["engine_id"] for r in doc["data"]["removed"]] == ["open"]
    assert not path.exists()
    assert kept(doc, "other")["code"] == "live" and other.exists()


# -- hard links: holders matched by (dev, ino), never by name ------------------------


@pytest.mark.parametrize("how", ["fd", "map"])
def test_a_holder_that_opened_a_removed_hard_link_is_found(
        cli: Any, shm_dir: Path, sneaky: Any, how: str) -> None:
    """Row 7: /proc shows the holder's file under a name that no longer exists."""
    path = region_file(shm_dir, "hl")
    holder = sneaky(path, how, "--via-link", str(shm_dir / "alias"))
    assert os.stat(path).st_nlink == 1
    shown = (os.readlink(f"/proc/{holder.pid}/fd/3") if how == "fd"
             else Path(f"/proc/{holder.pid}/maps").read_text())
    assert "alias (deleted)" in shown and "vllm_offload_hl" not in shown

    result = cli("gc", "--shm-dir", str(shm_dir), "--min-age", "0", "--json")

    assert result.exit_code == 0, result.stderr
    k = kept(result.json, "hl")
    assert (k["code"], k["pid"]) == ("live", holder.pid)
    assert path.exists()
    [region] = discover(shm_dir).regions
    assert [h.pid for h in region.holders] == [holder.pid]


def test_the_recheck_under_the_lock_matches_by_inode(shm_dir: Path, sneaky: Any) -> None:
    """Discovery saw nobody; the holder arrives through a hard link before the lock."""
    from vllm_offload_cli.core.reclaim import collector
    from vllm_offload_cli.core.reclaim.report import GcOptions

    path = region_file(shm_dir, "late")
    inventory = discover(shm_dir)
    holder = sneaky(path, "fd", "--via-link", str(shm_dir / "alias"))

    report = collector.reclaim(inventory, GcOptions(min_age=0))

    assert (report.kept[0].code, report.kept[0].pid) == ("live", holder.pid)
    assert path.exists()


# -- the kernel's count of openers -------------------------------------------------------


@pytest.fixture
def scratch_file() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="vllm-offload-test-", dir="/dev/shm"))
    path = d / "f"
    path.write_bytes(b"\0" * 8192)
    try:
        yield path
    finally:
        shutil.rmtree(d, ignore_errors=True)


def probe(path: Path) -> bool | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        return fsguard.probe(fd).sole
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["fd", "map"])
def test_the_lease_sees_descriptors_and_mappings_of_any_process(
        scratch_file: Path, sneaky: Any, how: str) -> None:
    assert probe(scratch_file) is True
    holder = sneaky(scratch_file, how)
    assert probe(scratch_file) is False
    holder.stop()
    assert probe(scratch_file) is True


def test_the_lease_cannot_tell_without_ownership_or_cap_lease(scratch_file: Path,
                                                             nobody: OtherUser) -> None:
    os.chmod(scratch_file, 0o644)
    os.chmod(scratch_file.parent, 0o755)
    code = ("import os; from vllm_offload_cli.core.region import fsguard; "
            f"fd = os.open({str(scratch_file)!r}, os.O_RDONLY); v = fsguard.probe(fd); "
            "print(v.sole, v.why)")
    proc = subprocess.run(nobody.python_command("-c", code), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("None ") and "CAP_LEASE" in proc.stdout


def test_an_open_that_waits_on_our_lease_is_noticed(scratch_file: Path) -> None:
    """gc checks this just before it unlinks: an opener is waiting on us right now.
    The kernel signals us (SIGIO, deadly by default) meanwhile: we must survive it."""
    before = signal.getsignal(signal.SIGIO)
    fd = os.open(scratch_file, os.O_RDONLY)
    try:
        with fsguard.sole_opener([fd]) as verdict:
            assert verdict.sole is True and fsguard.still_sole(fd)
            opener = subprocess.Popen([sys.executable, "-c",
                                       f"open({str(scratch_file)!r}, 'rb').close()"])
            assert wait_until(lambda: not fsguard.still_sole(fd), timeout=30)
            assert opener.poll() is None  # blocked until we let go
        assert opener.wait(timeout=30) == 0
        assert signal.getsignal(signal.SIGIO) == before  # restored once no lease is held
    finally:
        os.close(fd)


def test_only_regular_files_are_judged_by_what_may_be_hidden(shm_dir: Path) -> None:
    """A symlink named like a region stays what it is (never removed anyway); a stale
    regular file with a possible hidden holder and no lease verdict is unknown."""
    (shm_dir / "vllm_offload_trap.mmap").symlink_to("/etc/passwd")
    region_file(shm_dir, "plain")
    hidden = visibility.Visibility((), (visibility.HiddenProcess(1, None, True),))
    by_id = {r.engine_id: r for r in discover(shm_dir).regions}

    assert visibility_state(by_id["trap"], hidden) == "stale"
    assert visibility_state(by_id["plain"], hidden) == "unknown"


def visibility_state(region: Any, vis: visibility.Visibility) -> str:
    from dataclasses import replace

    from vllm_offload_cli.core.host.discovery import judge_visibility

    bare = replace(region, segments=tuple(replace(s, sole_opener=None)
                                          for s in region.segments))
    return str(judge_visibility(replace(bare, state="stale"), vis).state)
