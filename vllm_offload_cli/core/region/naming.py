"""engine_id validation and vLLM's region file names: in a world-writable directory every
path is built from a validated engine_id, and every name read back is parsed strictly."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from vllm_offload_cli.core.base.errors import InvalidInputError

DEFAULT_SHM_DIR = "/dev/shm"
PREFIX = "vllm_offload_"
REGION_SUFFIX = ".mmap"
MANIFEST_SUFFIX = ".manifest.json"
# 255 (NAME_MAX) minus the prefix and the longest suffix we append.
MAX_ENGINE_ID_LEN = 200

_ENGINE_ID_RE = re.compile(r"[A-Za-z0-9._-]+")
# fullmatch() only: `$` also matches before a trailing newline (`….mmap\n`).
_DP_RE = re.compile(r"(?P<base>.+)_dp(?P<rank>0|[1-9][0-9]*)")
# vLLM's HiSparse path: vllm_offload_hisparse_{instance_id}_dp{index}.mmap, same prefix
_HISPARSE_RE = re.compile(r"hisparse_.+_dp(?:0|[1-9][0-9]*)")
_REGION_FILE_RE = re.compile(
    re.escape(PREFIX) + r"(?P<engine_id>.+)" + re.escape(REGION_SUFFIX)
    + r"(?:\.(?P<segment>[1-9][0-9]*))?"
)
_MANIFEST_FILE_RE = re.compile(
    re.escape(PREFIX) + r"(?P<engine_id>.+)" + re.escape(MANIFEST_SUFFIX)
)


def engine_id_problem(engine_id: str) -> str | None:
    """Say what is wrong with an engine_id, or None when it is safe."""
    if not engine_id:
        return "engine_id is empty"
    if len(engine_id) > MAX_ENGINE_ID_LEN:
        return f"engine_id is {len(engine_id)} characters long; the limit is {MAX_ENGINE_ID_LEN}"
    if engine_id in (".", ".."):
        return f"engine_id {engine_id!r} is a directory reference"
    if not _ENGINE_ID_RE.fullmatch(engine_id):
        bad = sorted({c for c in engine_id if not _ENGINE_ID_RE.fullmatch(c)})
        shown = ", ".join(repr(c) for c in bad)
        return f"engine_id {engine_id!r} contains {shown}; use only letters, digits, '.', '_', '-'"
    return None


def validate_engine_id(engine_id: str) -> str:
    """Return engine_id unchanged, or raise InvalidInputError saying why not."""
    if (problem := engine_id_problem(engine_id)) is not None:
        raise InvalidInputError(problem, engine_id=engine_id, code="invalid_engine_id")
    return engine_id


def with_dp_rank(engine_id: str, dp_rank: int | None) -> str:
    """The engine_id of one data-parallel replica, as vLLM suffixes it."""
    if dp_rank is None:
        return validate_engine_id(engine_id)
    if dp_rank < 0:
        raise InvalidInputError(f"dp rank must be >= 0, got {dp_rank}", code="invalid_dp_rank")
    return validate_engine_id(f"{engine_id}_dp{dp_rank}")


@dataclass(frozen=True)
class EngineIdParts:
    """An engine_id split into the base id and the data-parallel rank."""

    base_engine_id: str
    dp_rank: int | None


def split_engine_id(engine_id: str) -> EngineIdParts:
    """Parse the `_dp{rank}` suffix back out of an engine_id."""
    if (match := _DP_RE.fullmatch(engine_id)) is None:
        return EngineIdParts(engine_id, None)
    return EngineIdParts(match["base"], int(match["rank"]))


def region_kind(engine_id: str) -> str:
    """"hisparse" for vLLM's HiSparse regions, else "offload"; both are regions to us."""
    return "hisparse" if _HISPARSE_RE.fullmatch(engine_id) else "offload"


def region_filename(engine_id: str) -> str:
    return f"{PREFIX}{validate_engine_id(engine_id)}{REGION_SUFFIX}"


def region_path(shm_dir: str | os.PathLike[str], engine_id: str) -> Path:
    """The path vLLM uses for an engine's region: {shm_dir}/vllm_offload_{id}.mmap."""
    return Path(shm_dir) / region_filename(engine_id)


def manifest_path(shm_dir: str | os.PathLike[str], engine_id: str) -> Path:
    """The sidecar manifest beside a region."""
    return Path(shm_dir) / f"{PREFIX}{validate_engine_id(engine_id)}{MANIFEST_SUFFIX}"


@dataclass(frozen=True)
class RegionFileName:
    """A file name recognised as (a segment of) a region."""

    engine_id: str
    segment: int  # 0 for the bare `.mmap` file, N for `.mmap.N`


def parse_region_filename(name: str) -> RegionFileName | None:
    """Recognise `vllm_offload_{id}.mmap[.N]`; None for anything else."""
    match = _REGION_FILE_RE.fullmatch(name)
    if match is None or engine_id_problem(match["engine_id"]) is not None:
        return None
    return RegionFileName(match["engine_id"], int(match["segment"] or 0))


def parse_manifest_filename(name: str) -> str | None:
    """The engine_id a manifest file name belongs to, or None."""
    match = _MANIFEST_FILE_RE.fullmatch(name)
    if match is None or engine_id_problem(match["engine_id"]) is not None:
        return None
    return match["engine_id"]


def gc_command(shm_dir: str | os.PathLike[str], engine_id: str, *,
               include_persistent: bool = False, all_users: bool = False) -> str:
    """The `vllm-offload gc` command line that removes this one region once it is unused."""
    parts = ["vllm-offload", "gc", "--min-age", "0"]
    if include_persistent:
        parts.append("--include-persistent")
    if all_users:
        parts.append("--all-users")  # root removing a service user's region
    if os.path.realpath(shm_dir) != os.path.realpath(DEFAULT_SHM_DIR):
        parts += ["--shm-dir", os.fspath(shm_dir)]
    return shlex.join([*parts, engine_id])
