"""The system log's record of every removal (`journalctl -t vllm-offload`): who removed which
region, whose, how big, why. One datagram per removal to the local syslog socket (facility
daemon, severity notice); a witness, never a precondition: non-blocking, each send tried
once, so a missing socket or a stuck journald costs a dropped line, never a removal."""

from __future__ import annotations

import json
import os
import shlex
import socket
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_offload_cli.core.base.text import printable
from vllm_offload_cli.core.reclaim.report import RemovedRegion

IDENT = "vllm-offload"
DEFAULT_SOCKET = "/dev/log"
# Where to send instead of /dev/log (a test's socket, a syslog daemon listening elsewhere).
SOCKET_ENV = "VLLM_OFFLOAD_SYSLOG_SOCKET"
# journald keeps longer lines, classic syslog daemons cut at 1-8 KiB: stay under both
_MAX_FIELD = 512
_PRIORITY = 3 * 8 + 5  # facility daemon (3), severity notice (5): something was deleted


@dataclass(frozen=True, kw_only=True)
class AuditResult:
    """What reached the system log: `sent` lines, `dropped` ones, and why if any dropped."""

    socket: str
    sent: int
    dropped: int
    problem: str | None = None


def command_line() -> str:
    """This process's command line as an operator would type it."""
    prog = os.path.basename(sys.argv[0]) if sys.argv else ""
    if prog in ("__main__.py", "-m", "") or prog.startswith("python"):
        prog = IDENT
    return shlex.join([prog, *sys.argv[1:]])


def _quoted(text: str) -> str:
    text = printable(text)
    return json.dumps(text if len(text) <= _MAX_FIELD else text[:_MAX_FIELD - 3] + "...")


def removal_line(r: RemovedRegion, *, command: str) -> str:
    """One removal as `key=value` fields: greppable, and every outside string quoted."""
    uid = "unknown" if r.uid is None else r.uid
    return (f"removed region engine_id={_quoted(r.engine_id)} uid={uid} size_bytes={r.bytes} "
            f"freed_bytes={r.freed_bytes} files={len(r.paths)} "
            f"path={_quoted(r.paths[0]) if r.paths else '-'} "
            f"manifest={'yes' if r.manifest else 'no'} age_seconds={r.age_seconds:.0f} "
            f"stale={_quoted(r.reason or 'no reason recorded')} command={_quoted(command)}")


def record_removals(removed: Sequence[RemovedRegion], *, summary: str | None = None
                    ) -> AuditResult:
    """Send one line per removed region, then the run's `summary` line, to the system
    log; never raises, never blocks. Lines grow with removals, never with other files."""
    path = os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
    command = command_line()
    lines = [removal_line(r, command=command) for r in removed]
    if summary is not None:
        lines.append(f"run {printable(summary)[:4 * _MAX_FIELD]} command={_quoted(command)}")
    try:
        refused = None if not lines or stat.S_ISSOCK(os.stat(path).st_mode) else "not a socket"
    except OSError as exc:
        refused = f"no syslog socket: {exc.strerror}"
    if refused is not None or not lines:  # nowhere to send, or nothing
        return AuditResult(socket=path, sent=0, dropped=len(lines), problem=refused)
    head = f"<{_PRIORITY}>{IDENT}[{os.getpid()}]: "
    sent, problem = 0, None
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)  # a full queue drops a line, never waits
        try:
            sock.connect(path)
        except OSError as exc:
            return AuditResult(socket=path, sent=0, dropped=len(lines),
                               problem=exc.strerror or str(exc))
        for line in lines:  # each tried once
            try:
                sock.send((head + line).encode())
                sent += 1
            except OSError as exc:
                problem = exc.strerror or str(exc)
    return AuditResult(socket=path, sent=sent, dropped=len(lines) - sent, problem=problem)
