"""gc's record of what it removed: validated outputs, a full report when a write fails
late, one system-log line per removal, and no noise on a clean run (issue 20)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import wait_until
from region_files import SIZE, region_file

from vllm_offload_cli.core.base.testhook import PAUSE_ENV
from vllm_offload_cli.core.base.units import format_bytes
from vllm_offload_cli.core.reclaim.audit import SOCKET_ENV

CLI = [sys.executable, "-m", "vllm_offload_cli"]


class SyslogSink:
    """A private syslog socket: a bound unix datagram socket gc is pointed at."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)

    def lines(self) -> list[str]:
        out = []
        while True:
            try:
                out.append(self.sock.recv(65536).decode())
            except BlockingIOError:
                return out

    def fill(self) -> int:
        """Queue datagrams nobody reads until the socket would block (a stuck journald)."""
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sender.setblocking(False)
        sent = 0
        try:
            while True:
                sender.sendto(b"x" * 1024, str(self.path))
                sent += 1
        except BlockingIOError:
            return sent
        finally:
            sender.close()


@pytest.fixture
def syslog(tmp_path: Path) -> Iterator[SyslogSink]:
    sink = SyslogSink(tmp_path / "log")
    try:
        yield sink
    finally:
        sink.sock.close()


def gc(shm_dir: Path, *args: str, env: dict[str, str] | None = None
       ) -> tuple[int, dict[str, Any], str]:
    proc = subprocess.run([*CLI, "gc", "--shm-dir", str(shm_dir), "--min-age", "0", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    doc = json.loads(proc.stdout) if "--json" in args else {"stdout": proc.stdout}
    return proc.returncode, doc, proc.stderr


@pytest.mark.parametrize("where", ["missing_dir", "not_a_dir", "name_is_a_dir"])
def test_an_unwritable_metrics_path_removes_nothing(shm_dir: Path, tmp_path: Path,
                                                    where: str) -> None:
    leaked = region_file(shm_dir, "leaked")
    (tmp_path / "file").write_text("")
    (tmp_path / "adir").mkdir()
    target = {"missing_dir": tmp_path / "nonexistent" / "x.prom",
              "not_a_dir": tmp_path / "file" / "x.prom",
              "name_is_a_dir": tmp_path / "adir"}[where]

    code, doc, _ = gc(shm_dir, "--include-persistent", "--prometheus", str(target), "--json")

    assert code == 2, doc
    # the option's own check (usage) or gc's probe of the directory (bad_output)
    assert doc["errors"][0]["code"] in ("bad_output", "usage"), doc
    assert target.name in doc["errors"][0]["message"]
    assert leaked.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "file"]  # no probe left


def _gc_whose_output_breaks(shm_dir: Path, prom: Path, *args: str,
                            env: dict[str, str] | None = None
                            ) -> tuple[subprocess.Popen[str], str, str]:
    """gc stopped after its removals (the test hook), `prom` turned into a directory,
    then resumed: the rename over it fails. (process, stdout, stderr)"""
    proc = subprocess.Popen([*CLI, "gc", "--shm-dir", str(shm_dir), "--min-age", "0",
                             "--prometheus", str(prom), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, PAUSE_ENV: "gc_before_outputs", **(env or {})})
    try:
        assert wait_until(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED,
                          timeout=60)
        prom.mkdir()
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc, out, err


def test_a_write_that_fails_after_removals_reports_them_and_exits_7(
        shm_dir: Path, tmp_path: Path, syslog: SyslogSink) -> None:
    """A real late failure: gc is stopped after its removals, the target turns into a
    directory, and the rename over it fails."""
    region_file(shm_dir, "leaked")
    prom = tmp_path / "gc.prom"
    proc, out, err = _gc_whose_output_breaks(shm_dir, prom, "--json",
                                             env={SOCKET_ENV: str(syslog.path)})
    doc = json.loads(out)
    assert proc.returncode == 7 and doc["exit_code"] == 7 and doc["ok"] is False, err
    assert [r["engine_id"] for r in doc["data"]["removed"]] == ["leaked"]
    assert doc["data"]["freed_bytes"] == SIZE
    assert [e["code"] for e in doc["errors"]] == ["output_failed"]
    assert not (shm_dir / "vllm_offload_leaked.mmap").exists()
    # recorded before the write was tried: the removal, then the run's summary
    assert [line.split("]: ")[1].split()[0] for line in syslog.lines()] == ["removed", "run"]
    assert [p.name for p in tmp_path.iterdir() if p.name != "log"] == ["gc.prom"]


def test_the_table_also_lists_removals_when_the_write_fails(shm_dir: Path,
                                                             tmp_path: Path) -> None:
    region_file(shm_dir, "leaked")
    prom = tmp_path / "gc.prom"
    proc, out, err = _gc_whose_output_breaks(shm_dir, prom, "--no-syslog")
    assert proc.returncode == 7
    assert "Removed leaked" in out and "Freed" in out
    assert f"Error: cannot write {prom}" in err


def test_quiet_is_one_summary_line_when_something_was_removed(shm_dir: Path,
                                                              tmp_path: Path) -> None:
    """-q is for cron, which mails what it prints: one line, whatever the volume."""
    for i in range(5):
        region_file(shm_dir, f"leaked{i}")
    prom = tmp_path / "gc.prom"
    proc, out, err = _gc_whose_output_breaks(shm_dir, prom, "-q", "--no-syslog")
    assert proc.returncode == 7
    assert out.splitlines() == [f"Freed {format_bytes(5 * SIZE)} from 5 region(s) in "
                                f"{shm_dir}; kept 0 of 5 seen."]
    assert f"Error: cannot write {prom}" in err


def test_every_removal_is_one_syslog_line_and_the_run_one_more(shm_dir: Path,
                                                                 syslog: SyslogSink) -> None:
    region_file(shm_dir, "one")
    region_file(shm_dir, "two")
    region_file(shm_dir, "two", segment=1)
    os.chown(shm_dir / "vllm_offload_two.mmap", os.getuid(), os.getgid())

    code, doc, _ = gc(shm_dir, "--json", env={SOCKET_ENV: str(syslog.path)})

    assert code == 0, doc
    assert doc["data"]["syslog"] == {"socket": str(syslog.path), "sent": 3, "dropped": 0,
                                     "problem": None}
    *lines, summary = syslog.lines()
    assert f"]: run Freed {format_bytes(3 * SIZE)} from 2 region(s)" in summary, summary
    lines.sort()
    assert len(lines) == 2
    pid = None
    for line, eid, files in zip(lines, ["one", "two"], [1, 2], strict=True):
        head, _, body = line.partition("]: ")
        prio, _, ident = head.partition(">")
        assert prio == "<29"  # facility daemon (3) * 8 + notice (5)
        name, _, pid = ident.partition("[")
        assert name == "vllm-offload" and int(pid) > 0
        assert body.startswith(f'removed region engine_id="{eid}" uid={os.getuid()} ')
        assert f"size_bytes={SIZE * files} freed_bytes={SIZE * files} files={files}" in body
        assert 'stale="' in body and "its exclusive lock was free" in body
        assert "--min-age 0 s" in body
        assert 'command="vllm-offload gc --shm-dir ' in body
    removed = {r["engine_id"]: r for r in doc["data"]["removed"]}
    assert removed["two"]["uid"] == os.getuid() and removed["two"]["reason"]


def test_no_syslog_and_dry_run_send_nothing(shm_dir: Path, syslog: SyslogSink) -> None:
    region_file(shm_dir, "leaked")
    code, doc, _ = gc(shm_dir, "--json", "--dry-run", env={SOCKET_ENV: str(syslog.path)})
    assert code == 0 and len(doc["data"]["removed"]) == 1 and "syslog" not in doc["data"]
    code, doc, _ = gc(shm_dir, "--json", "--no-syslog", env={SOCKET_ENV: str(syslog.path)})
    assert code == 0 and len(doc["data"]["removed"]) == 1 and "syslog" not in doc["data"]
    assert syslog.lines() == []


def test_a_missing_or_stuck_syslog_never_fails_or_stalls_gc(shm_dir: Path, tmp_path: Path,
                                                            syslog: SyslogSink) -> None:
    region_file(shm_dir, "a")
    code, doc, err = gc(shm_dir, "--json", env={SOCKET_ENV: str(tmp_path / "absent")})
    assert code == 0 and [r["engine_id"] for r in doc["data"]["removed"]] == ["a"]
    assert doc["data"]["syslog"]["dropped"] == 2  # the removal and the run's summary
    assert "system log" not in err and "syslog" not in err  # --json: one document, no noise
    assert "syslog_dropped" in [w["code"] for w in doc["warnings"]]
    region_file(shm_dir, "c")  # text mode, even -q as the schedules run it: said on stderr
    proc = subprocess.run([*CLI, "gc", "-q", "--min-age", "0", "--shm-dir", str(shm_dir)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, SOCKET_ENV: str(tmp_path / "absent")})
    assert proc.returncode == 0 and "Removed c:" in proc.stdout
    assert ("Warning: system log: 2 record(s) not written "
            f"({tmp_path / 'absent'}: no syslog socket: No such file or directory)") \
        in proc.stderr

    assert syslog.fill() > 0  # nobody reads it: a send would block
    region_file(shm_dir, "b")
    code, doc, _ = gc(shm_dir, "--json", env={SOCKET_ENV: str(syslog.path)})
    assert code == 0 and [r["engine_id"] for r in doc["data"]["removed"]] == ["b"]
    assert doc["data"]["syslog"]["sent"] == 0 and doc["data"]["syslog"]["dropped"] == 2


@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_a_clean_run_says_nothing(shm_dir: Path, holders: Any, dry: bool) -> None:
    """Uninspectable processes (if this host has any) changed no decision: no warning."""
    from region_files import GEOMETRY

    region_file(shm_dir, "live")
    holders("map-only", str(shm_dir), "live", *GEOMETRY)
    code, doc, err = gc(shm_dir, *(["--dry-run"] if dry else []))
    assert code == 0 and err == "", err
    assert "Kept live" in doc["stdout"]
    code, doc, err = gc(shm_dir, "-q", *(["--dry-run"] if dry else []))
    assert code == 0 and err == "" and doc["stdout"] == ""


def test_a_full_textfile_filesystem_with_nothing_removed_is_exit_5(
        shm_dir: Path, tiny_tmpfs: Path) -> None:
    """It exited 1, which says a removal failed; nothing was removed: the disk is full."""
    with open(tiny_tmpfs / "filler", "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    proc = subprocess.run([*CLI, "gc", "--shm-dir", str(shm_dir), "--no-syslog",
                           "--prometheus", str(tiny_tmpfs / "gc.prom"), "--json"],
                          capture_output=True, text=True, timeout=60)
    doc = json.loads(proc.stdout)
    assert proc.returncode == 5 and doc["exit_code"] == 5, proc.stderr
    [error] = doc["errors"]
    assert error["code"] == "output_failed" and "No space left" in error["message"]
    assert "removal" not in error["message"]
