"""Capacity pre-flight: will a region of N bytes fit before we commit to it?

tmpfs allocates on first touch, so a region that does not fit fails late and
obscurely (EFAULT from madvise, SIGBUS in a worker). Three limits apply at
once: the tmpfs size, the memory cgroup (shmem pages are charged to it), and
the host's available memory. We check all three and name the tightest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from vllm_offload_cli.core.base.errors import InsufficientSpaceError
from vllm_offload_cli.core.base.units import format_bytes

_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge number


@dataclass(frozen=True)
class ShmUsage:
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class Capacity:
    """What a new region can take; None where a limit does not apply or cannot be read."""

    shm: ShmUsage
    cgroup_limit_bytes: int | None
    cgroup_free_bytes: int | None
    mem_available_bytes: int | None


def shm_usage(shm_dir: str | Path) -> ShmUsage:
    st = os.statvfs(shm_dir)
    return ShmUsage(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def cgroup_headroom(proc_root: Path = Path("/proc"),
                    cgroup_root: Path = Path("/sys/fs/cgroup")) -> tuple[int | None, int | None]:
    """(limit, free) of the tightest memory cgroup above this process, or (None, None)."""
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None, None
    best: tuple[int, int] | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":  # cgroup v2: walk up, every ancestor's limit applies
            node = cgroup_root / rel if rel else cgroup_root
            while True:
                best = _tighter(best, node / "memory.max", node / "memory.current")
                if node == cgroup_root or cgroup_root not in node.parents:
                    break
                node = node.parent
        elif "memory" in controllers.split(","):
            base = cgroup_root / "memory" / rel
            best = _tighter(best, base / "memory.limit_in_bytes", base / "memory.usage_in_bytes")
    return best if best is not None else (None, None)


def _tighter(best: tuple[int, int] | None, limit_file: Path,
             usage_file: Path) -> tuple[int, int] | None:
    """`best` or this cgroup's (limit, free), whichever leaves less free."""
    limit, used = _read_int(limit_file), _read_int(usage_file)
    if limit is None or used is None:
        return best
    free = max(limit - used, 0)
    return (limit, free) if best is None or free < best[1] else best


def mem_available(proc_root: Path = Path("/proc")) -> int | None:
    try:
        for line in (proc_root / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def measure(shm_dir: str | Path, *, proc_root: Path = Path("/proc"),
            cgroup_root: Path = Path("/sys/fs/cgroup")) -> Capacity:
    limit, free = cgroup_headroom(proc_root, cgroup_root)
    return Capacity(shm_usage(shm_dir), limit, free, mem_available(proc_root))


def check_fits(size_bytes: int, capacity: Capacity, *, shm_dir: str | Path,
               engine_id: str | None = None) -> None:
    """Raise InsufficientSpaceError naming the tightest limit and how to lift it."""
    need = format_bytes(size_bytes)
    if size_bytes > capacity.shm.free_bytes:
        raise InsufficientSpaceError(
            f"region needs {need} but {shm_dir} has only {format_bytes(capacity.shm.free_bytes)} "
            f"free of {format_bytes(capacity.shm.total_bytes)}; free space with "
            "`vllm-offload gc`, or enlarge the tmpfs (docker run --shm-size, a Kubernetes "
            "emptyDir with medium: Memory and a sizeLimit, or mount -o remount,size=...)",
            path=str(shm_dir), engine_id=engine_id, code="shm_full",
        )
    if capacity.cgroup_free_bytes is not None and size_bytes > capacity.cgroup_free_bytes:
        raise InsufficientSpaceError(
            f"region needs {need} but the memory cgroup allows only "
            f"{format_bytes(capacity.cgroup_free_bytes)} more (limit "
            f"{format_bytes(capacity.cgroup_limit_bytes)}); tmpfs pages count against the "
            "container's memory limit, so raise that limit or shrink the region",
            path=str(shm_dir), engine_id=engine_id, code="cgroup_limit",
        )
    if capacity.mem_available_bytes is not None and size_bytes > capacity.mem_available_bytes:
        raise InsufficientSpaceError(
            f"region needs {need} but only {format_bytes(capacity.mem_available_bytes)} of "
            "memory is available on this host; shrink the region or free memory",
            path=str(shm_dir), engine_id=engine_id, code="memory",
        )


def preflight(size_bytes: int, shm_dir: str | Path, *, engine_id: str | None = None) -> Capacity:
    capacity = measure(shm_dir)
    check_fits(size_bytes, capacity, shm_dir=shm_dir, engine_id=engine_id)
    return capacity
