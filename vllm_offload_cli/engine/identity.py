"""Which processes are "this engine": a token every process of one `vllm serve` shares.

An engine_id says which region a process wants, not who started it: two
replicas launched with the same pinned id want the same name. So the hook
gives each engine a random token, set in the environment of the first
process (the API server or engine core, via the plugin) before any worker is
spawned; children inherit it. Attachments in the manifest record it, and a
holder's token can also be read from `/proc/<pid>/environ` (same user only).

`/proc/<pid>/environ` shows the environment a process was exec'd with, so a
worker forked after the token was set does not show it there. Every process
that knows the token therefore also holds a beacon: an anonymous memfd named
after it (nothing in /dev/shm, gone with the process), which forked children
inherit and `/proc/<pid>/fd` shows to the same user.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import MutableMapping

from vllm_offload_cli.core.base.errors import RegionBusyError
from vllm_offload_cli.core.system import processes, procfs

ENGINE_TOKEN_ENV = "VLLM_OFFLOAD_ENGINE_TOKEN"
_TOKEN_RE = re.compile(r"[0-9a-f]{32}")


class EngineIdCollisionError(RegionBusyError):
    """The engine_id's region is held by a live process of another engine."""

    code = "engine_id_collision"


def valid_token(token: str | None) -> bool:
    return token is not None and _TOKEN_RE.fullmatch(token) is not None


BEACON_PREFIX = "vllm-offload-engine-"
_BEACON_RE = re.compile(r"/memfd:" + BEACON_PREFIX + r"([0-9a-f]{32})(?: \(deleted\))?")
_beacon: tuple[str, int] | None = None  # (token, fd), held for the life of the process


def engine_token(environ: MutableMapping[str, str] | None = None) -> str:
    """This engine's token; made (and exported to future children) when absent or malformed.

    For the process's own environment it also holds the token's beacon.
    """
    env = os.environ if environ is None else environ
    token = env.get(ENGINE_TOKEN_ENV)
    if not valid_token(token):
        token = secrets.token_hex(16)
        env[ENGINE_TOKEN_ENV] = token
    assert token is not None
    if environ is None:
        _hold_beacon(token)
    return token


def _hold_beacon(token: str) -> None:
    global _beacon
    if _beacon is not None and _beacon[0] == token:
        return
    try:  # close-on-exec: an exec'd child of this engine has the token in its environment
        fd = os.memfd_create(BEACON_PREFIX + token, os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # no memfd here: the environment is the only proof
        return
    if _beacon is not None:
        os.close(_beacon[1])
    _beacon = (token, fd)


def read_token(pid: int) -> tuple[str | None, bool]:
    """(token, readable): another process's token, from its initial environment, else
    from a beacon it holds (None if neither can be read), and whether its environment
    could be read at all (False: nothing can be told). One read of the environment."""
    env = processes.environ(pid)
    value = None if env is None else env.get(ENGINE_TOKEN_ENV)
    if valid_token(value):
        return value, True
    return _beacon_token(pid), env is not None


def _beacon_token(pid: int) -> str | None:
    targets = procfs.fd_targets(pid)
    if isinstance(targets, procfs.Unreadable):
        return None
    for target in targets:
        found = _BEACON_RE.fullmatch(target)
        if found:
            return found.group(1)
    return None
