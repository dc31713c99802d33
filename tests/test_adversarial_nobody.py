"""No user can hang, stall or block another user's gc, inspect or engine start-up (issue 24).

The adversary is user nobody (uid 65534) in a shared directory (mode 1777,
like /dev/shm), the victim root's commands; those tests need root (to become
nobody) and skip elsewhere. A hang is bounded by the subprocess timeout and
fails the test. Each test names the finding it covers.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import require_root
from helpers.other_user import NOBODY, OtherUser
from helpers.ready_process import ReadyProcess
from region_files import GEOMETRY, region_file

from vllm_offload_cli.cli import metrics
from vllm_offload_cli.core.base import deadline
from vllm_offload_cli.core.base.errors import RegionBusyError, UnsafeRegionError
from vllm_offload_cli.core.base.exit_status import ExitStatus
from vllm_offload_cli.core.host.discovery import discover
from vllm_offload_cli.core.reclaim import collector
from vllm_offload_cli.core.reclaim.report import GcOptions
from vllm_offload_cli.core.region import fsguard
from vllm_offload_cli.core.system import processes, procfs
from vllm_offload_cli.core.system.files import FileId
from vllm_offload_cli.engine.claim import claim, startup_lock

ADVERSARY = Path(__file__).parent / "helpers" / "adversary.py"
INTERRUPT_IMPORT = Path(__file__).parent / "helpers" / "interrupt_import"
CLI = [sys.executable, "-m", "vllm_offload_cli"]


def need_root() -> None:
    require_root("needs root to play another user against root")


@pytest.fixture
def tricks(nobody: OtherUser) -> Iterator[Any]:
    """Start adversary.py tricks as user nobody; all stopped at teardown."""
    started: list[ReadyProcess] = []

    def start(*args: str) -> ReadyProcess:
        t = ReadyProcess(nobody.python_command(nobody.helper(ADVERSARY.name), *args))
        started.append(t)
        return t

    try:
        yield start
    finally:
        for t in started:
            t.stop()


@pytest.fixture
def shared(shm_dir: Path) -> Path:
    os.chmod(shm_dir, 0o1777)
    return shm_dir


def run(*args: str, timeout: float = 60, env: dict[str, str] | None = None
        ) -> tuple[int, dict[str, Any], str]:
    """The real CLI as root, bounded: a hang fails the test (TimeoutExpired)."""
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    doc = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    return proc.returncode, doc, proc.stderr


def as_nobody_run(user: OtherUser, *cmd: str) -> None:
    subprocess.run(user.command(*cmd), check=True, timeout=30)


# -- finding 1: a FIFO behind a descriptor ---------------------------------------------

def test_a_fifo_behind_a_descriptor_is_neither_opened_nor_waited_on(tmp_path: Path) -> None:
    """open_proc_link judges the object on an O_PATH descriptor: a FIFO without a writer (where
    a plain open blocks for ever) is refused at once, a regular file is reopened."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code = (
        "import os, sys\n"
        "from vllm_offload_cli.core.system import procfs\n"
        "from vllm_offload_cli.core.system.files import FileId, open_proc_link as o, "
        "stat_proc_link as st\n"
        f"ffd = os.open({str(fifo)!r}, os.O_RDONLY | os.O_NONBLOCK)\n"
        "rfd = os.open(sys.executable, os.O_RDONLY)\n"
        "pid = os.getpid()\n"
        "fifo_id, reg_id = FileId.of(os.fstat(ffd)), FileId.of(os.fstat(rfd))\n"
        "assert o(procfs.fd_link(pid, ffd), fifo_id) is None\n"
        "assert st(procfs.fd_link(pid, ffd), fifo_id) is None\n"
        "got = o(procfs.fd_link(pid, rfd), reg_id)\n"
        "assert got is not None and FileId.of(os.fstat(got)) == reg_id\n"
        "assert st(procfs.fd_link(pid, rfd), reg_id).st_ino == reg_id.ino\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30)
    assert proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize("kind", ["fd", "map"])
def test_another_users_unlinked_region_shows_its_owner(shared: Path, tricks: Any,
                                                       kind: str) -> None:
    """Whose an unlinked region is comes from the file itself (through the holder's
    descriptor or mapping), so ownership can decide what it blocks."""
    need_root()
    trick = tricks("unlinked", str(shared), "gone1", kind)
    inv = discover(shared, measure_residency=False)
    [r] = [r for r in inv.regions if r.engine_id == "gone1"]
    assert not r.linked and r.uid == NOBODY and r.holders[0].pid == trick.pid


def test_a_fifo_flipping_user_cannot_hang_gc_inspect_or_preflight(shared: Path,
                                                                  tricks: Any) -> None:
    need_root()
    tricks("fifo-flip", str(shared), "flip")
    for _ in range(4):
        for args in (["gc", "--dry-run", "--min-age", "0"], ["inspect"],
                     ["preflight", "flip", "--size", "64KiB"]):
            code, doc, err = run(*args, "--shm-dir", str(shared), "--json", timeout=60)
            assert code == 0, (args, doc, err)


# -- finding 2: the start-up lock --------------------------------------------------------

def test_a_lock_on_the_shm_directory_does_not_stall_start_up(shared: Path,
                                                             tricks: Any) -> None:
    need_root()
    tricks("flock", str(shared))
    code, doc, err = run("preflight", "prod", "--size", "64KiB", "--shm-dir", str(shared),
                         "--json", timeout=60)
    assert code == 0, (doc, err)


def test_the_start_up_lock_is_in_a_directory_only_its_user_can_enter(shared: Path,
                                                                     nobody: OtherUser) -> None:
    need_root()
    with startup_lock(shared, timeout=5):
        private = shared / fsguard.private_dir_name()
        st = private.lstat()
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
        assert stat.S_IMODE(st.st_mode) == 0o700
        probe = subprocess.run(nobody.python_command("-c", (
            f"import os\ntry:\n    os.open({str(private / 'startup.lock')!r}, os.O_RDONLY)\n"
            "except PermissionError:\n    print('denied')")),
            capture_output=True, text=True, timeout=30)
        assert probe.stdout.strip() == "denied"


def test_a_start_up_lock_that_cannot_be_had_is_a_busy_refusal_naming_its_holder(
        shm_dir: Path) -> None:
    code = ("import sys\nfrom vllm_offload_cli.engine.claim import startup_lock\n"
            "with startup_lock(sys.argv[1]):\n    print('ready', flush=True)\n"
            "    sys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(shm_dir)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        with pytest.raises(RegionBusyError) as caught, startup_lock(shm_dir, timeout=0.2):
            pass
        assert f"pid {holder.pid}" in caught.value.message
        assert caught.value.pid == holder.pid
        assert caught.value.exit_status == ExitStatus.BUSY
    finally:
        holder.kill()
        holder.wait()


def test_a_squatted_private_directory_is_a_refusal_naming_the_squatter(
        shared: Path, nobody: OtherUser) -> None:
    need_root()
    as_nobody_run(nobody, "mkdir", "-m", "0700", str(shared / fsguard.private_dir_name()))
    code, doc, _ = run("preflight", "prod", "--size", "64KiB", "--shm-dir", str(shared),
                       "--json")
    assert code == 6
    assert "nobody" in doc["errors"][0]["message"] and doc["errors"][0]["code"] == "squatted"


# -- findings 3 and 4: ownership decides; squatters are refused ---------------------------

@pytest.mark.parametrize("kind", ["fd", "map"])
def test_another_users_unlinked_file_does_not_take_the_name(shared: Path, tricks: Any,
                                                            kind: str) -> None:
    need_root()
    tricks("unlinked", str(shared), "prodb", kind)
    code, doc, err = run("preflight", "prodb", "--size", "64KiB", "--shm-dir", str(shared),
                         "--json")
    assert code == 0, (doc, err)
    assert doc["data"]["replicas"][0]["action"] == "create"


@pytest.mark.parametrize("squat", ["manifest-dir", "manifest-file", "region-file"])
def test_a_squatted_name_is_refused_by_preflight_and_by_the_engine_alike(
        shared: Path, squat: str, nobody: OtherUser) -> None:
    need_root()
    manifest = shared / "vllm_offload_sq2.manifest.json"
    if squat == "manifest-dir":
        as_nobody_run(nobody, "mkdir", str(manifest))
    elif squat == "manifest-file":
        as_nobody_run(nobody, "touch", str(manifest))
    else:
        as_nobody_run(nobody, "touch", str(shared / "vllm_offload_sq2.mmap"))
    code, doc, _ = run("preflight", "sq2", "--size", "64KiB", "--shm-dir", str(shared),
                       "--json")
    assert code == 6, doc
    assert doc["errors"][0]["code"] == ("not_regular_file" if squat == "manifest-dir"
                                        else "foreign_owner")
    assert "squatted" in doc["errors"][0]["message"]
    assert "nobody" in doc["errors"][0]["message"]
    from vllm_offload_cli.engine.region_hold import RegionRequest, open_region

    request = RegionRequest(engine_id="sq2", num_blocks=4, rank=0, row_stride=8192,
                            cpu_page_size=4096, world_size=2)
    with pytest.raises(UnsafeRegionError, match="nobody"):
        open_region(request, token=None, shm_dir=shared)


# -- finding 5: scale -------------------------------------------------------------------

@pytest.fixture
def proc_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts walks over /proc (calls of processes.pids())."""
    calls: list[int] = []
    real = processes.pids

    def counted() -> list[int]:
        calls.append(1)
        return real()

    monkeypatch.setattr(processes, "pids", counted)
    return calls


def test_gc_walks_proc_once_however_many_regions(shm_dir: Path, proc_passes: list[int]
                                                 ) -> None:
    for i in range(2 * collector._BATCH + 2):
        region_file(shm_dir, f"s{i}", size=4096, fill=False)
    report = collector.collect(shm_dir, GcOptions(min_age=0))
    assert len(report.removed) == 2 * collector._BATCH + 2
    assert len(proc_passes) == 1


def test_a_claim_that_reclaims_a_leftover_walks_proc_once(shm_dir: Path,
                                                          proc_passes: list[int]) -> None:
    region_file(shm_dir, "left")
    with startup_lock(shm_dir, timeout=5):
        result = claim("left", shm_dir=shm_dir, token=None)
    assert result.action == "reclaimed" and len(proc_passes) == 1


def test_a_million_dups_of_one_file_are_one_entry(tmp_path: Path) -> None:
    """Memory per process grows with the files it has open, not with its descriptors."""
    target = tmp_path / "f"
    target.touch()
    fd = os.open(target, os.O_RDONLY)
    dups = [os.dup(fd) for _ in range(200)]
    try:
        stats = procfs.fd_stats(os.getpid())
        assert isinstance(stats, list)
        ours = [n for n, st in stats if FileId.of(st) == FileId.of(os.fstat(fd))]
        assert len(ours) == 1
    finally:
        for d in [fd, *dups]:
            os.close(d)


# -- overall deadline -------------------------------------------------------------------

def test_gc_stops_at_its_deadline_and_reports_what_it_removed(
        shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(collector._BATCH + 3):
        region_file(shm_dir, f"d{i}", size=4096, fill=False)
    real = collector._Run._batch

    def then_expire(self: Any, batch: list[Any]) -> None:
        real(self, batch)
        deadline._active = (0.0, 3600)  # the deadline passes during the first batch

    monkeypatch.setattr(collector._Run, "_batch", then_expire)
    with deadline.within(3600):
        report = collector.collect(shm_dir, GcOptions(min_age=0))
    assert len(report.removed) == collector._BATCH
    assert report.errors == ()  # running out of time is no failure: the rest waits
    [left] = report.not_judged
    assert (left.uid, left.files, left.size_bytes) == (os.geteuid(), 3, 3 * 4096)
    assert len(list(shm_dir.glob("vllm_offload_*"))) == 3


def test_an_expired_timeout_exits_1_for_inspect_with_the_reason(cli: Any, shm_dir: Path
                                                                ) -> None:
    region_file(shm_dir, "t")
    result = cli("inspect", "--shm-dir", str(shm_dir), "--timeout", "0", "--json")
    assert result.exit_code == 1
    assert result.json["errors"][0]["code"] == "timeout"
    assert (shm_dir / "vllm_offload_t.mmap").exists()


def test_poll_until_tries_until_an_answer_or_its_limit() -> None:
    """The one back-off loop: every wait on another process ends by itself."""
    answers = iter([None, None, 7])
    assert deadline.poll_until(lambda: next(answers), timeout=60) == 7
    tries: list[int] = []
    assert deadline.poll_until(lambda: tries.append(1), timeout=0.05) is None
    assert len(tries) >= 2  # the first try, and a last one at the limit


def test_gc_out_of_time_is_partial_exit_7_and_still_writes_its_textfile(
        cli: Any, shm_dir: Path, tmp_path: Path) -> None:
    region_file(shm_dir, "t")
    prom = tmp_path / "gc.prom"
    result = cli("gc", "--shm-dir", str(shm_dir), "--timeout", "0", "--prometheus", str(prom),
                 "--json")
    assert result.exit_code == ExitStatus.PARTIAL == 7
    data = result.json["data"]  # no time even to list the directory: that is said
    assert data["listed_all"] is False and result.json["errors"] == []
    assert (shm_dir / "vllm_offload_t.mmap").exists()
    assert "vllm_offload_gc_exit_code 7.0" in prom.read_text()


# -- finding 6: the environment's failures are exit codes, not tracebacks -----------------

@pytest.fixture
def tiny_tmpfs() -> Iterator[Path]:
    need_root()
    path = Path(tempfile.mkdtemp(prefix="vllm-offload-inodes-"))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,nr_inodes=3", "none",
                       str(path)], capture_output=True).returncode != 0:
        os.rmdir(path)
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)
        os.rmdir(path)


def test_create_on_a_tmpfs_out_of_inodes_exits_5_saying_so(tiny_tmpfs: Path) -> None:
    (tiny_tmpfs / "filler").touch()  # the root directory and this take two of three
    (tiny_tmpfs / "filler2").touch()
    code, doc, err = run("create", "ino", "--shm-dir", str(tiny_tmpfs), "--world-size", "1",
                         "--cpu-page-size", "4KiB", "--num-blocks", "4", "--json")
    assert code == 5, (doc, err)
    assert "inodes" in doc["errors"][0]["message"]
    code, doc, err = run("preflight", "ino", "--size", "16KiB", "--shm-dir", str(tiny_tmpfs),
                         "--json")  # not even its start-up lock fits
    assert code == 5, (doc, err)
    assert "inodes" in doc["errors"][0]["message"]
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["filler", "filler2"]


def test_sigint_while_modules_load_is_one_line_and_exit_130() -> None:
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(INTERRUPT_IMPORT),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([*CLI, "inspect", "--help"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "Error: interrupted\n"


# -- finding 7: unlink only what was checked --------------------------------------------

def test_a_name_swapped_after_the_check_is_not_unlinked(
        shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user exchanges a stale region's name with a live one's just after gc checked
    it: the live file must survive under one of the two names."""
    stale = region_file(shm_dir, "stale")
    live = region_file(shm_dir, "live")
    live_id = FileId.of(live.stat())
    real = fsguard.same_file_at

    def check_then_swap(path: str, fd: int) -> bool:
        same = real(path, fd)
        if same and path == str(stale):
            os.rename(stale, shm_dir / "swap")
            os.rename(live, stale)
            os.rename(shm_dir / "swap", live)
        return same

    monkeypatch.setattr(fsguard, "same_file_at", check_then_swap)
    collector.collect(shm_dir, GcOptions(min_age=0), engine_ids=["stale"])
    survivors = {FileId.of(p.lstat()) for p in shm_dir.iterdir() if p.is_file()}
    assert live_id in survivors


def test_manifests_exchanged_between_a_live_and_a_stale_region_stay(
        cli: Any, shm_dir: Path, holders: Any) -> None:
    """The user swaps the manifest names of a live region and a stale one: gc removes
    the stale region, but not the live one's manifest now sitting at its name."""
    holders("region", str(shm_dir), "live", *GEOMETRY)
    crashed = holders("region", str(shm_dir), "dead", *GEOMETRY)
    crashed.stop("crash")
    live_m, dead_m = (shm_dir / f"vllm_offload_{e}.manifest.json" for e in ("live", "dead"))
    os.rename(live_m, shm_dir / "swap")
    os.rename(dead_m, live_m)
    os.rename(shm_dir / "swap", dead_m)
    live_manifest = FileId.of(dead_m.stat())  # the live region's, under the dead one's name
    result = cli("gc", "--shm-dir", str(shm_dir), "--min-age", "0", "--json")
    assert [r["engine_id"] for r in result.json["data"]["removed"]] == ["dead"]
    assert FileId.of(dead_m.stat()) == live_manifest
    # next run: an orphan by its name, but it describes a region that is still there
    result = cli("gc", "--shm-dir", str(shm_dir), "--min-age", "0", "--json")
    assert result.json["data"]["orphan_manifests_removed"] == []
    assert FileId.of(dead_m.stat()) == live_manifest


# -- finding 8: output files ------------------------------------------------------------

def test_the_textfile_is_never_written_through_a_planted_symlink(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, Gauge

    output = tmp_path / "vllm_offload.prom"
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    # prometheus_client's own writer used exactly this name
    (tmp_path / f"{output.name}.{os.getpid()}.{threading.get_ident()}").symlink_to(victim)
    registry = CollectorRegistry()
    Gauge("x_bytes", "x", registry=registry).set(1)
    metrics.emit(registry, output)
    assert victim.read_text() == "precious\n"
    assert "x_bytes 1.0" in output.read_text()
    assert not list(tmp_path.glob(".vllm_offload.prom.*"))


def test_the_textfile_temporary_is_exclusive(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Even a guessed name is never reused: O_EXCL fails, nothing is written there."""
    output = tmp_path / "out.prom"
    monkeypatch.setattr(metrics, "_temp_name",
                        lambda out: out.parent / f".{out.name}.guessed.tmp")
    planted = tmp_path / ".out.prom.guessed.tmp"
    planted.symlink_to(tmp_path / "victim")
    with pytest.raises(OSError) as caught:
        metrics.write_atomically(output, b"data\n")
    assert caught.value.errno == errno.EEXIST
    assert not (tmp_path / "victim").exists() and not output.exists()


# -- issue 30: the start-up claim looks only where it must -------------------------------

def test_the_claim_reads_no_process_that_could_not_open_our_files(shared: Path,
                                                                   tricks: Any) -> None:
    """Another user's processes are skipped on their credentials: their descriptors and
    mappings (19,900 each in the attack) are never read by a root engine's claim."""
    need_root()
    from vllm_offload_cli.core.host.discovery import discover_engine

    trick = tricks("unlinked", str(shared), "prodc", "fd")
    everything = discover(shared, engine_ids=["prodc"], measure_residency=False)
    assert [h.pid for r in everything.regions for h in r.holders] == [trick.pid]
    assert discover_engine(shared, "prodc").regions == ()  # its process was never read
    code, doc, err = run("preflight", "prodc", "--size", "64KiB", "--shm-dir", str(shared),
                         "--json")
    assert code == 0 and doc["data"]["replicas"][0]["action"] == "create", (doc, err)


@pytest.mark.parametrize("kind", ["fd", "map"])
def test_a_mapped_only_squat_does_not_stop_a_root_engine_without_cap_sys_admin(
        shared: Path, tricks: Any, kind: str) -> None:
    """Without CAP_SYS_ADMIN (as under the shipped units) the owner of a mapping that has
    no descriptor is unreadable (/proc/PID/map_files): an unknown owner is never ours,
    so nobody's released squat of the name is no engine of ours (was engine_id_collision)."""
    need_root()
    require_root("setpriv(1) is not installed", granted=shutil.which("setpriv") is not None)
    tricks("unlinked", str(shared), "prodm", kind)
    caps = "-sys_admin,-checkpoint_restore"  # either one reads /proc/PID/map_files
    proc = subprocess.run(["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}",
                           *CLI, "preflight", "prodm", "--size", "64KiB", "--shm-dir",
                           str(shared), "--json"], capture_output=True, text=True, timeout=60)
    doc = json.loads(proc.stdout)
    assert proc.returncode == 0, doc
    assert doc["data"]["replicas"][0]["action"] == "create"
