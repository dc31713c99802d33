"""Which processes are "this engine": a random token in the first process's environment,
inherited by every worker; as a fork does not show it in /proc/PID/environ, every process
that knows it also holds a beacon, a memfd named after it, seen in /proc/PID/fd."""

from __future__ import annotations

import os
import re
import secrets
from typing import TypeGuard

from vllm_offload_cli.core.base.errors import RegionBusyError
from vllm_offload_cli.core.system import processes, procfs

ENGINE_TOKEN_ENV = "VLLM_OFFLOAD_ENGINE_TOKEN"
_TOKEN_RE = re.compile(r"[0-9a-f]{32}")


class EngineIdCollisionError(RegionBusyError):
    """The engine_id's region is held by a live process of another engine."""

    code = "engine_id_collision"


def valid_token(token: str | None) -> TypeGuard[str]:
    return token is not None and _TOKEN_RE.fullmatch(token) is not None


BEACON_PREFIX = "vllm-offload-engine-"
_BEACON_RE = re.compile(r"/memfd:" + BEACON_PREFIX + r"([0-9a-f]{32})(?: \(deleted\))?")
_beacon: tuple[str, int] | None = None  # (token, fd), held for the life of the process


def engine_token() -> str:
    """This engine's token (made and exported when absent or malformed), its beacon held."""
    global _beacon
    token = os.environ.get(ENGINE_TOKEN_ENV)
    if not valid_token(token):
        token = os.environ[ENGINE_TOKEN_ENV] = secrets.token_hex(16)
    if _beacon is None or _beacon[0] != token:
        try:  # close-on-exec: an exec'd child of this engine has the token in its environment
            fd = os.memfd_create(BEACON_PREFIX + token, os.MFD_CLOEXEC)
        except (AttributeError, OSError):  # no memfd here: the environment is the only proof
            return token
        if _beacon is not None:
            os.close(_beacon[1])
        _beacon = (token, fd)
    return token


def read_token(pid: int) -> tuple[str | None, bool]:
    """(token, readable): another process's token from its environment, else from a
    beacon it holds; `readable` is False when its environment could not be read."""
    env = processes.environ(pid)
    value = None if env is None else env.get(ENGINE_TOKEN_ENV)
    if valid_token(value):
        return value, True
    links = procfs.fd_links(pid)
    beacon = None if isinstance(links, procfs.Unreadable) else next(
        (m.group(1) for _, t in links if (m := _BEACON_RE.fullmatch(t))), None)
    return beacon, env is not None
