"""The scheduling examples in contrib/ are valid and do what they say.

systemd-tmpfiles and systemd-analyze run where they are installed; the
command lines of the cron entry, the systemd services and the Kubernetes
DaemonSet are run as shipped (paths moved into a private directory) against a
region a service user's SIGKILLed engine leaked.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.other_user import NOBODY, OtherUser
from region_files import GEOMETRY, SIZE, region_file

from vllm_offload_cli.core.base.units import format_bytes

CONTRIB = Path(__file__).resolve().parent.parent / "contrib"
TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"


def _cron() -> tuple[dict[str, str], list[str]]:
    """The shipped /etc/cron.d file: its environment lines and its commands."""
    env: dict[str, str] = {}
    commands = []
    for line in (CONTRIB / "cron" / "vllm-offload-gc").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if "=" in line.split()[0]:
            name, _, value = line.partition("=")
            env[name.strip()] = value.strip()
            continue
        fields = line.split(None, 6)
        assert fields[:5] == ["*"] * 5 and fields[5] == "root"  # /etc/cron.d format
        commands.append(fields[6])
    return env, commands


def _cron_command(word: str) -> str:
    [command] = [c for c in _cron()[1] if f"vllm-offload {word}" in c]
    return command


def _unit(name: str) -> str:
    return (CONTRIB / "systemd" / name).read_text()


def _exec_start(name: str) -> str:
    [line] = [ln for ln in _unit(name).splitlines() if ln.startswith("ExecStart=")]
    return line.removeprefix("ExecStart=")


def _kubernetes_command(word: str) -> str:
    import yaml

    docs = list(yaml.safe_load_all((CONTRIB / "kubernetes" / "vllm-offload-gc.yaml").read_text()))
    [ds] = [d for d in docs if d and d["kind"] == "DaemonSet"]
    [container] = ds["spec"]["template"]["spec"]["containers"]
    [line] = [ln.strip() for ln in container["args"][0].splitlines()
              if f"vllm-offload {word}" in ln]
    return line.split(" || ")[0]


def _shim(tmp_path: Path) -> Path:
    """`vllm-offload` as this test's installation: the shipped lines call it by name."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "vllm-offload"
    exe.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m vllm_offload_cli "$@"\n')
    exe.chmod(0o755)
    return exe


def _schedule(kind: str, word: str, tmp_path: Path, shm_dir: Path) -> list[str]:
    """The exact command a shipped schedule runs, its paths moved into tmp_path."""
    textfile = tmp_path / "textfile"
    textfile.mkdir(exist_ok=True)
    exe = _shim(tmp_path)
    if kind == "systemd":
        unit = "vllm-offload-gc.service" if word == "garbage-collect" \
            else "vllm-offload-metrics.service"
        assert f"StateDirectory={TEXTFILE_DIR.removeprefix('/var/lib/')}" in _unit(unit)
        argv = shlex.split(_exec_start(unit).replace("${STATE_DIRECTORY}", str(textfile)))
        assert argv[0] == "/usr/local/bin/vllm-offload"
        return [str(exe), *argv[1:]]
    if kind == "cron":
        env, _ = _cron()
        assert env["TEXTFILE_DIR"] == TEXTFILE_DIR
        command = _cron_command(word).replace("/run/vllm-offload-gc.lock",
                                              str(tmp_path / "gc.lock"))
        path = f"{exe.parent}:{env['PATH']}"
        return ["env", f"PATH={path}", f"TEXTFILE_DIR={textfile}", env["SHELL"], "-c", command]
    command = _kubernetes_command(word).replace("/textfile/", f"{textfile}/")
    return ["env", f"PATH={exe.parent}:{os.environ['PATH']}", "/bin/sh", "-c", command]


def _with_min_age_0(argv: list[str]) -> list[str]:
    """The region is seconds old: add --min-age 0 to the gc command (shell or not)."""
    if argv[-2] == "-c":
        return [*argv[:-1], argv[-1] + " --min-age 0"]
    return [*argv, "--min-age", "0"]


SCHEDULES = ["cron", "systemd", "kubernetes"]


def _nobody_holder(nobody: OtherUser, path: Path) -> subprocess.Popen[str]:
    """A process of uid 65534 that maps `path` (like a vLLM worker of a service user)."""
    proc = subprocess.Popen(
        nobody.python_command(nobody.helper("sneaky_holder.py"), str(path), "map"),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("ready"), proc.stderr.read() if proc.stderr else ""
    return proc


@pytest.mark.parametrize("kind", SCHEDULES)
def test_each_shipped_schedule_collects_a_service_users_leak(
        kind: str, shm_dir: Path, tmp_path: Path, nobody: OtherUser) -> None:
    """Root runs the shipped line: a SIGKILLed service user's region goes, a live one stays,
    the textfile is written and the removal is in the system log."""
    os.chmod(shm_dir, 0o1777)  # sticky and world-writable, like /dev/shm
    leaked, live = region_file(shm_dir, "svc"), region_file(shm_dir, "svc_live")
    for path in (leaked, live):
        os.chown(path, NOBODY, NOBODY)
    killed, running = _nobody_holder(nobody, leaked), _nobody_holder(nobody, live)
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        killed.kill()  # SIGKILL: no cleanup, the region leaks
        killed.communicate(timeout=10)
        sink.bind(str(tmp_path / "log"))
        sink.settimeout(10)
        env = {**os.environ, "VLLM_OFFLOAD_SHM_DIR": str(shm_dir),
               "VLLM_OFFLOAD_SYSLOG_SOCKET": str(tmp_path / "log")}
        argv = _with_min_age_0(_schedule(kind, "garbage-collect", tmp_path, shm_dir))

        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)

        assert proc.returncode == 0, proc.stdout + proc.stderr
        # --quiet: one summary line for the cron mail; the removal itself is in the log
        assert proc.stdout.splitlines() == [
            f"Freed {format_bytes(SIZE)} from 1 region(s) in {shm_dir}; kept 1 of 2 "
            "seen."], proc.stdout
        assert not leaked.exists() and live.exists()
        prom = (tmp_path / "textfile" / "vllm_offload_gc.prom").read_text()
        assert "vllm_offload_gc_regions_removed 1.0" in prom
        line = sink.recv(65536).decode()
        assert 'removed region engine_id="svc" uid=65534 ' in line
        assert "--all-users" in line

        again = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        assert again.returncode == 0 and again.stdout == "", again.stderr  # nothing to mail
        assert live.exists()
    finally:
        sink.close()
        assert running.stdin is not None
        running.stdin.close()
        running.wait(timeout=20)
        for p in (killed, running):
            for stream in (p.stdout, p.stderr):
                if stream is not None:
                    stream.close()


@pytest.mark.parametrize("kind", SCHEDULES)
def test_each_schedule_writes_region_metrics_too(kind: str, shm_dir: Path,
                                                 tmp_path: Path) -> None:
    region_file(shm_dir, "leaked")
    argv = _schedule(kind, "inspect", tmp_path, shm_dir)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "VLLM_OFFLOAD_SHM_DIR": str(shm_dir)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # --quiet: a warning every minute would be mailed every minute
    # nothing for cron to mail, the journal or the pod's log: every schedule writes it with
    # --prometheus FILE, the option gc has, which prints nothing
    assert proc.stdout == ""
    assert "--prometheus" in " ".join(argv)
    text = (tmp_path / "textfile" / "vllm_offload_regions.prom").read_text()
    assert 'engine_id="leaked"' in text


def test_one_textfile_directory_everywhere() -> None:
    """The node-exporter package's directory, in every shipped file and the docs."""
    root = CONTRIB.parent
    files = [p for p in CONTRIB.rglob("*") if p.is_file() and p.name != "Containerfile"]
    for path in [*files, root / "README.md", root / "man" / "vllm-offload.1"]:
        for found in re.findall(r"/var/lib/[\w./-]+", path.read_text().replace("\\-", "-")):
            assert found.startswith(TEXTFILE_DIR), f"{path}: {found}"
    for rel in ["cron/vllm-offload-gc", "kubernetes/vllm-offload-gc.yaml"]:
        assert TEXTFILE_DIR in (CONTRIB / rel).read_text()
    for unit in ["vllm-offload-gc.service", "vllm-offload-metrics.service"]:
        assert "StateDirectory=prometheus/node-exporter\n" in _unit(unit)  # under /var/lib


def _man_dir(tmp_path: Path) -> Path:
    """The repository's man page where man(1) looks for it (the wheel installs it)."""
    man1 = tmp_path / "man" / "man1"
    man1.mkdir(parents=True)
    shutil.copy(CONTRIB.parent / "man" / "vllm-offload.1", man1)
    return man1.parent


UNITS = ["vllm-offload-gc.service", "vllm-offload-gc.timer", "vllm-offload-metrics.service",
         "vllm-offload-metrics.timer"]


def test_systemd_units_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None or shutil.which("man") is None:
        pytest.skip("needs systemd-analyze and man")
    exe = _shim(tmp_path)
    units = tmp_path / "units"
    units.mkdir()
    for name in UNITS:  # verify checks that ExecStart= exists: point it at this installation
        (units / name).write_text(_unit(name).replace("/usr/local/bin/vllm-offload", str(exe)))
    proc = subprocess.run([analyze, "verify", *(str(units / n) for n in UNITS)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MANPATH": str(_man_dir(tmp_path))})
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("unit", ["vllm-offload-gc.service", "vllm-offload-metrics.service"])
def test_systemd_security_exposure_stays_low(tmp_path: Path, unit: str) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("needs systemd-analyze")
    (tmp_path / unit).write_text(_unit(unit))
    proc = subprocess.run([analyze, "security", "--offline=true", "--no-pager",
                           str(tmp_path / unit)], capture_output=True, text=True, timeout=60)
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", proc.stdout + proc.stderr)
    if match is None:
        pytest.skip(f"this systemd-analyze cannot score unit files offline: {proc.stderr}")
    assert float(match.group(1)) <= 2.0, proc.stdout
    text = _unit(unit)
    assert "CAP_DAC_OVERRIDE" not in text.split("CapabilityBoundingSet=")[1].splitlines()[0]


def _tmpfiles_clean(shm_dir: Path, tmp_path: Path, *, with_ours: bool) -> None:
    tool = shutil.which("systemd-tmpfiles")
    if tool is None:
        pytest.skip("needs systemd-tmpfiles")
    rules = [f"e {shm_dir} - - - 0"]  # an aggressive age rule: everything is old
    if with_ours:
        shipped = (CONTRIB / "tmpfiles.d" / "vllm-offload.conf").read_text()
        rules += [line.replace("/dev/shm/", f"{shm_dir}/") for line in shipped.splitlines()
                  if line and not line.startswith("#")]
    conf = tmp_path / "test.conf"
    conf.write_text("\n".join(rules) + "\n")
    proc = subprocess.run([tool, "--clean", str(conf)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


def _population(shm_dir: Path, holders: Any) -> list[str]:
    region_file(shm_dir, "live")
    holders("map-only", str(shm_dir), "live", *GEOMETRY)  # in use, like vLLM: no lock
    region_file(shm_dir, "live", segment=1)
    (shm_dir / "vllm_offload_live.manifest.json").write_text("{}")
    (shm_dir / ".vllm_offload_live.manifest.json.tmp.1.abcdef01").write_text("{}")
    (shm_dir / "unrelated.bin").write_text("aged out")
    return ["vllm_offload_live.mmap", "vllm_offload_live.mmap.1",
            "vllm_offload_live.manifest.json", ".vllm_offload_live.manifest.json.tmp.1.abcdef01"]


def test_tmpfiles_rule_keeps_ageing_away_from_regions(shm_dir: Path, tmp_path: Path,
                                                      holders: Any) -> None:
    ours = _population(shm_dir, holders)
    _tmpfiles_clean(shm_dir, tmp_path, with_ours=True)
    assert sorted(os.listdir(shm_dir)) == sorted(ours)  # only the unrelated file aged out


def test_without_the_rule_ageing_unlinks_a_region_in_use(shm_dir: Path, tmp_path: Path,
                                                          holders: Any) -> None:
    """Why the rule ships: timestamps and (vLLM's absent) locks do not protect a region."""
    _population(shm_dir, holders)
    _tmpfiles_clean(shm_dir, tmp_path, with_ours=False)
    assert not (shm_dir / "vllm_offload_live.mmap").exists()


def _hold_startup_lock(shm_dir: Path) -> subprocess.Popen[str]:
    """A process inside an engine's start-up: it holds {shm_dir}/.vllm-offload-UID/startup.lock."""
    code = ("import sys\nfrom vllm_offload_cli.engine.claim import startup_lock\n"
            "with startup_lock(sys.argv[1]):\n    print('ready', flush=True)\n"
            "    sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(shm_dir)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


@pytest.mark.parametrize("with_ours", [True, False])
def test_tmpfiles_rule_keeps_the_startup_lock(shm_dir: Path, tmp_path: Path,
                                              with_ours: bool) -> None:
    """Ageing would delete an engine's start-up lock (and its directory) while it is
    held: the next start-up then takes a new lock beside it. The shipped rule keeps it."""
    from vllm_offload_cli.core.region.fsguard import private_dir_name

    holder = _hold_startup_lock(shm_dir)
    try:
        lock = shm_dir / private_dir_name() / "startup.lock"
        assert lock.exists()
        _tmpfiles_clean(shm_dir, tmp_path, with_ours=with_ours)
        assert lock.exists() == with_ours
        assert (shm_dir / private_dir_name()).is_dir() == with_ours
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=20)
        if holder.stdout is not None:
            holder.stdout.close()
