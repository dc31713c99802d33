"""Which processes are "this engine": a token every process of one `vllm serve` shares.

An engine_id says which region a process wants, not who started it: two
replicas launched with the same pinned id want the same name. So the hook
gives each engine a random token, set in the environment of the first
process (the API server or engine core, via the plugin) before any worker is
spawned; children inherit it. Attachments in the manifest record it, and a
holder's token can also be read from `/proc/<pid>/environ` (same user only).
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import MutableMapping

from vllm_offload_cli.core.base.errors import RegionBusyError

ENGINE_TOKEN_ENV = "VLLM_OFFLOAD_ENGINE_TOKEN"
_TOKEN_RE = re.compile(r"[0-9a-f]{32}")


class EngineIdCollisionError(RegionBusyError):
    """The engine_id's region is held by a live process of another engine."""

    code = "engine_id_collision"


def valid_token(token: str | None) -> bool:
    return token is not None and _TOKEN_RE.fullmatch(token) is not None


def engine_token(environ: MutableMapping[str, str] | None = None) -> str:
    """This engine's token; made (and exported to future children) when absent or malformed."""
    env = os.environ if environ is None else environ
    token = env.get(ENGINE_TOKEN_ENV)
    if not valid_token(token):
        token = secrets.token_hex(16)
        env[ENGINE_TOKEN_ENV] = token
    assert token is not None
    return token


def process_token(pid: int) -> str | None:
    """The token in another process's initial environment; None if absent or unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read(1 << 20)
    except OSError:
        return None
    prefix = ENGINE_TOKEN_ENV.encode() + b"="
    for entry in data.split(b"\0"):
        if entry.startswith(prefix):
            value = entry[len(prefix):].decode("ascii", "replace")
            return value if valid_token(value) else None
    return None


def environ_readable(pid: int) -> bool:
    """Whether `process_token` can tell anything about this process."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            f.read(1)
    except OSError:
        return False
    return True
