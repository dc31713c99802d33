"""The system log's record of every removal: who removed which region, whose, how big, why.

`journalctl -t vllm-offload` (or `/var/log/syslog`) answers "what deleted my
region?" long after the run's own output is gone (cron mail off, `--quiet`).
One datagram per removed region goes through the local syslog socket with
Python's SysLogHandler, identifier `vllm-offload`, facility daemon, priority
notice. The log is a witness, never a precondition: a missing socket, a
refused one or a full queue (a stuck journald) costs a dropped line, never a
failed or stalled removal, because the socket is non-blocking and every send
is tried once (plus SysLogHandler's one reconnect).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from logging.handlers import SysLogHandler

from vllm_offload_cli.core.base.text import printable
from vllm_offload_cli.core.reclaim.report import RemovedRegion

IDENT = "vllm-offload"
DEFAULT_SOCKET = "/dev/log"
# Where to send instead of /dev/log: for tests (a private datagram socket) and
# for hosts whose syslog daemon listens elsewhere.
SOCKET_ENV = "VLLM_OFFLOAD_SYSLOG_SOCKET"
# journald keeps longer lines, classic syslog daemons cut at 1-8 KiB: stay under both
_MAX_FIELD = 512


@dataclass(frozen=True, kw_only=True)
class AuditResult:
    """What reached the system log: `sent` lines, `dropped` ones, and why if any dropped."""

    socket: str
    sent: int
    dropped: int
    problem: str | None = None


class _NonBlockingSysLog(SysLogHandler):
    """SysLogHandler on a non-blocking datagram socket that counts, never prints, failures."""

    def __init__(self, address: str) -> None:
        self.failures = 0
        self.last_error: str | None = None
        super().__init__(address=address, facility=SysLogHandler.LOG_DAEMON,
                         socktype=socket.SOCK_DGRAM)
        self.ident = f"{IDENT}[{os.getpid()}]: "
        self.append_nul = False

    def _connect_unixsocket(self, address: object) -> None:
        super()._connect_unixsocket(address)  # type: ignore[misc]
        sock: socket.socket = self.socket  # type: ignore[attr-defined]
        sock.setblocking(False)  # a full queue drops this line, never waits

    def mapPriority(self, levelName: str) -> str:  # noqa: N802, N803 (SysLogHandler's names)
        return "notice"  # a normal but significant event: something was deleted

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802
        self.failures += 1
        exc = sys.exc_info()[1]
        self.last_error = None if exc is None else (
            exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc))


def socket_path() -> str:
    return os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


def command_line(argv: Sequence[str] | None = None) -> str:
    """This process's command line as an operator would type it."""
    args = list(sys.argv if argv is None else argv)
    if not args:
        return IDENT
    prog = os.path.basename(args[0])
    if prog in ("__main__.py", "-m", "") or prog.startswith("python"):
        prog = IDENT
    return shlex.join([prog, *args[1:]])


def _quoted(text: str) -> str:
    text = printable(text)
    if len(text) > _MAX_FIELD:
        text = text[:_MAX_FIELD - 3] + "..."
    return json.dumps(text)


def removal_line(r: RemovedRegion, *, command: str) -> str:
    """One removal as `key=value` fields: greppable, and every outside string quoted."""
    uid = "unknown" if r.uid is None else str(r.uid)
    fields = [
        f"removed region engine_id={_quoted(r.engine_id)}",
        f"uid={uid}",
        f"size_bytes={r.bytes}",
        f"resident_bytes={r.freed_bytes}",
        f"files={len(r.paths)}",
        f"path={_quoted(r.paths[0]) if r.paths else '-'}",
        f"manifest={'yes' if r.manifest else 'no'}",
        f"age_seconds={r.age_seconds:.0f}",
        f"stale={_quoted(r.reason or 'no reason recorded')}",
        f"command={_quoted(command)}",
    ]
    return " ".join(fields)


def record_removals(removed: Sequence[RemovedRegion], *, command: str | None = None,
                    address: str | None = None) -> AuditResult:
    """Send one line per removed region to the system log; never raises, never blocks."""
    path = address or socket_path()
    if not removed:
        return AuditResult(socket=path, sent=0, dropped=0)
    try:
        st = os.stat(path)
    except OSError as exc:
        return AuditResult(socket=path, sent=0, dropped=len(removed),
                           problem=f"no syslog socket: {exc.strerror}")
    if not stat.S_ISSOCK(st.st_mode):
        return AuditResult(socket=path, sent=0, dropped=len(removed), problem="not a socket")
    try:
        handler = _NonBlockingSysLog(path)
    except OSError as exc:
        return AuditResult(socket=path, sent=0, dropped=len(removed),
                           problem=exc.strerror or str(exc))
    cmd = command_line() if command is None else command
    try:
        for r in removed:
            handler.handle(logging.LogRecord("vllm_offload_cli.audit", logging.INFO, __file__,
                                             0, removal_line(r, command=cmd), None, None))
    finally:
        handler.close()
    return AuditResult(socket=path, sent=len(removed) - handler.failures, dropped=handler.failures,
                       problem=handler.last_error)
