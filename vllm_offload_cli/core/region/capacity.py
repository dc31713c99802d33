"""Capacity pre-flight: tmpfs allocates on first touch, so a region that does not fit
fails late and obscurely (EFAULT, SIGBUS). Check the tmpfs size, the memory cgroup (it
is charged for shmem) and available memory first, and name the tightest."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from vllm_offload_cli.core.base.errors import InsufficientSpaceError
from vllm_offload_cli.core.base.units import format_bytes
from vllm_offload_cli.core.system import memory


@dataclass(frozen=True)
class ShmUsage:
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """What a new region can take; None where a limit does not apply or cannot be read."""

    shm: ShmUsage
    cgroup_limit_bytes: int | None
    cgroup_free_bytes: int | None
    mem_available_bytes: int | None


def shm_usage(shm_dir: str | Path) -> ShmUsage:
    st = os.statvfs(shm_dir)
    return ShmUsage(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


def measure(shm_dir: str | Path) -> Capacity:
    limit, free = memory.cgroup_headroom()
    return Capacity(shm=shm_usage(shm_dir), cgroup_limit_bytes=limit, cgroup_free_bytes=free,
                    mem_available_bytes=memory.mem_available())


def check_fits(size_bytes: int, capacity: Capacity, *, shm_dir: str | Path,
               engine_id: str | None = None) -> None:
    """Raise InsufficientSpaceError naming the tightest limit and how to lift it."""
    need, c = format_bytes(size_bytes), capacity
    for free, code, why in (
        (c.shm.free_bytes, "shm_full",
         f"{shm_dir} has only {format_bytes(c.shm.free_bytes)} free of "
         f"{format_bytes(c.shm.total_bytes)}; free space with `vllm-offload gc`, or enlarge the "
         "tmpfs (docker run --shm-size, a Kubernetes emptyDir with medium: Memory and a "
         "sizeLimit, or mount -o remount,size=...)"),
        (c.cgroup_free_bytes, "cgroup_limit",
         f"the memory cgroup allows only {format_bytes(c.cgroup_free_bytes)} more (limit "
         f"{format_bytes(c.cgroup_limit_bytes)}); tmpfs pages count against the container's "
         "memory limit, so raise that limit or shrink the region"),
        (c.mem_available_bytes, "memory",
         f"only {format_bytes(c.mem_available_bytes)} of memory is available on this host; "
         "shrink the region or free memory"),
    ):
        if free is not None and size_bytes > free:
            raise InsufficientSpaceError(f"region needs {need} but {why}", path=str(shm_dir),
                                         engine_id=engine_id, code=code)
