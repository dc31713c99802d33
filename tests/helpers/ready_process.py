"""A helper process that says `ready PID` on stdout once set up, and exits when its
stdin closes (sneaky_holder.py, adversary.py)."""

from __future__ import annotations

import subprocess


class ReadyProcess:
    """Started from `cmd`; `pid` is what it reported; `stop()` closes its stdin."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "ready":
            err = self.proc.stderr.read() if self.proc.stderr else ""
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"{cmd[-1]!r} helper failed to start: {err}")
        self.pid = int(line[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
