"""Real processes standing in for the ranks of one engine (tests/helpers/engine_rank.py)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

HELPER = Path(__file__).parent / "helpers" / "engine_rank.py"


class Rank:
    """One rank process; `info` is its first JSON line (the claim, or the error)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.info: dict[str, Any] = {}

    def ready(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"rank died before reporting: {err}")
        self.info = json.loads(line)
        return self.info

    @property
    def ok(self) -> bool:
        return "error" not in self.info

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def stop(self) -> int:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
        return self.proc.wait(timeout=30)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        self.kill()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


class Engine:
    """The ranks of one engine: one token, shared by every process, as the plugin makes it."""

    def __init__(self, shm_dir: Path, engine_id: str, *, num_blocks: int, row_stride: int,
                 cpu_page_size: int, world_size: int, segments: int = 1,
                 token: str | None = None) -> None:
        self.shm_dir, self.engine_id = shm_dir, engine_id
        self.args = [str(num_blocks), str(row_stride), str(cpu_page_size), str(world_size),
                     str(segments)]
        self.token = token or secrets.token_hex(16)
        self.ranks: list[Rank] = []

    def spawn(self, rank: int | None, wrap: list[str] | None = None) -> Rank:
        """One process; `wrap` prefixes its command (e.g. `unshare` for a blind rank)."""
        n, stride, page, world, seg = self.args
        proc = subprocess.Popen(
            [*(wrap or []), sys.executable, str(HELPER), str(self.shm_dir), self.engine_id, n,
             "none" if rank is None else str(rank), stride, page, world, seg],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "VLLM_OFFLOAD_ENGINE_TOKEN": self.token},
        )
        r = Rank(proc)
        self.ranks.append(r)
        return r

    def start(self, world: int) -> list[Rank]:
        """All ranks at once, as vLLM starts its workers; then wait for every report."""
        ranks = [self.spawn(k) for k in range(world)]
        for r in ranks:
            r.ready()
        return ranks

    def kill(self) -> None:
        for r in self.ranks:
            r.kill()

    def close(self) -> None:
        for r in self.ranks:
            r.close()
        self.ranks.clear()
