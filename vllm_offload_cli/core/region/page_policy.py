"""Where a new region's pages go: a NUMA policy and transparent huge pages, decided before
the file exists (a request the host cannot meet creates nothing) and applied before
pre-fault, when tmpfs allocates; mbind(2) on a shmem mapping sets the file's shared policy.
A tmpfs file gets huge pages when its mount's `huge=` allows them, unless shmem_enabled
says `deny` or `force`; `always` where the kernel refuses is an error, `auto` only warns."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm_offload_cli.core.base import errors
from vllm_offload_cli.core.system import libc, memory, mounts, procfs

logger = logging.getLogger(__name__)

NUMA_POLICIES = {"bind": 2, "interleave": 3, "preferred": 1}  # MPOL_* of <linux/mempolicy.h>
HUGE_PAGE_CHOICES = ("never", "auto", "always")
MASK_BITS = 1024  # nodes the mask can name; the kernel's own limit is at most this


class HugePagesUnavailableError(errors.InsufficientSpaceError):
    """`--huge-pages always` where the kernel will not give huge pages to this file."""

    code = "huge_pages_unavailable"


@dataclass(frozen=True)
class ThpSupport:
    """Whether files in a directory can get transparent huge pages, and why."""

    allowed: bool
    setting: str  # what decided it: e.g. "huge=advise", "shmem_enabled=deny"
    reason: str


@dataclass(frozen=True, kw_only=True)
class PagePolicy:
    """A creator's placement request, validated; recorded in the manifest as given."""

    numa_policy: str | None  # None: the kernel's default (local node of the faulting CPU)
    numa_nodes: tuple[int, ...]
    huge_pages: str  # never, auto, always (as asked)
    advise_huge: bool  # whether MADV_HUGEPAGE will be applied

    def to_record(self) -> dict[str, Any]:
        return {"numa_policy": self.numa_policy, "numa_nodes": list(self.numa_nodes),
                "huge_pages": self.huge_pages, "huge_pages_advised": self.advise_huge}

    @property
    def is_default(self) -> bool:
        return self.numa_policy is None and not self.advise_huge and self.huge_pages == "never"


def thp_support(shm_dir: str | os.PathLike[str]) -> ThpSupport:
    """Can a file in `shm_dir` get transparent huge pages when its mapping asks?"""
    return judge_thp(shm_dir, memory.shmem_thp_setting(), mounts.mounts())


def judge_thp(shm_dir: str | os.PathLike[str], setting: str | None,
              table: list[mounts.Mount]) -> ThpSupport:
    """thp_support's decision from shmem_enabled's selected word (None: none) and mounts."""
    where = memory.SHMEM_ENABLED
    if setting is None:
        return ThpSupport(False, "no THP", "this kernel has no transparent huge pages for shmem "
                          f"({where} is missing)")
    if setting == "deny":
        return ThpSupport(False, "shmem_enabled=deny", f"{where} is 'deny', which "
                          "turns huge pages off for every tmpfs mount")
    if setting == "force":
        return ThpSupport(True, "shmem_enabled=force", f"{where} is 'force'")
    real = os.path.realpath(shm_dir)
    mount = mounts.mount_of(real, table)
    if mount is None or mount.fstype != "tmpfs":
        what = "unknown" if mount is None else mount.fstype
        return ThpSupport(False, f"fstype={what}", f"{real} is not on tmpfs (filesystem "
                          f"{what}); only tmpfs regions can get transparent huge pages")
    huge = mount.options.get("huge", "never")
    if huge in ("always", "within_size", "advise"):
        return ThpSupport(True, f"huge={huge}", f"the tmpfs at {mount.point} is mounted "
                          f"huge={huge}")
    return ThpSupport(False, f"huge={huge}", (
        f"the tmpfs at {mount.point} is mounted with huge={huge} (the default), which gives "
        f"its files no huge pages; remount it with huge=advise (`mount -o remount,huge=advise "
        f"{mount.point}`) or use a tmpfs that has it"))


def _list(nodes: Iterable[int]) -> str:
    return ",".join(str(n) for n in sorted(nodes)) or "none"


def _numa(nodes: tuple[int, ...], policy: str | None) -> tuple[str, tuple[int, ...]]:
    """The NUMA half of a placement request: the policy (bind by default) and its nodes
    (every node with memory where none is named), or the first refusal that applies."""
    topo = memory.topology()
    policy = policy or "bind"
    needs_node = not nodes and policy != "interleave"
    nodes = nodes or tuple(sorted(topo.with_memory))
    absent = next((n for n in nodes if n not in topo.with_memory), None)
    where = ("this host has no NUMA information (one node 0)" if not topo.from_sysfs
             else f"nodes with memory here: {_list(topo.with_memory)}")
    for bad, message in (  # the first that applies is refused
        (needs_node, f"NUMA policy {policy} needs a node (--numa-node)"),
        (len(set(nodes)) != len(nodes), f"NUMA node list {_list(nodes)} names a node twice"),
        (policy == "preferred" and len(nodes) != 1,
         "NUMA policy preferred takes exactly one node"),
        (absent is not None, f"NUMA node {absent} does not exist or has no memory; {where}"),
    ):
        if bad:
            raise errors.InvalidInputError(message, code="invalid_numa_node")
    if not libc.numa_syscalls_available():
        raise errors.InvalidInputError("NUMA placement is not supported on this architecture",
                                       code="numa_unsupported")
    return policy, nodes


def choose(
    shm_dir: str | os.PathLike[str],
    *,
    numa_nodes: Iterable[int] | int | None = None,
    numa_policy: str | None = None,
    huge_pages: str = "never",
) -> PagePolicy:
    """Validate a placement request before anything is created (errors: exit 2 or 5)."""
    if huge_pages not in HUGE_PAGE_CHOICES:
        raise errors.InvalidInputError(f"huge pages must be one of {', '.join(HUGE_PAGE_CHOICES)}, "
                                       f"got {huge_pages!r}", code="invalid_huge_pages")
    nodes = (numa_nodes,) if isinstance(numa_nodes, int) else tuple(numa_nodes or ())
    if numa_policy is not None and numa_policy not in NUMA_POLICIES:
        raise errors.InvalidInputError(f"NUMA policy must be one of {', '.join(NUMA_POLICIES)}, "
                                       f"got {numa_policy!r}", code="invalid_numa_policy")
    policy, nodes = (None, ()) if not nodes and numa_policy is None else _numa(nodes, numa_policy)
    thp = None if huge_pages == "never" else thp_support(shm_dir)
    if thp is not None and not thp.allowed:
        if huge_pages == "always":
            raise HugePagesUnavailableError(
                f"--huge-pages always: the kernel gives no huge pages here: {thp.reason}")
        logger.warning("huge pages not available, using normal pages: %s", thp.reason,
                       extra={"code": "huge_pages_unavailable"})
    return PagePolicy(numa_policy=policy, numa_nodes=tuple(sorted(nodes)), huge_pages=huge_pages,
                      advise_huge=thp is not None and thp.allowed)


def apply(mm: mmap.mmap, length: int, chosen: PagePolicy) -> None:
    """Bind and advise the mapping; call before pre-fault (pages already there stay put)."""
    anchor = ctypes.c_char.from_buffer(mm)  # pins the mapping while we use its address
    try:
        addr = ctypes.addressof(anchor)
        if chosen.advise_huge:
            try:
                libc.madvise(addr, length, libc.MADV_HUGEPAGE)
            except OSError as exc:
                if chosen.huge_pages == "always":
                    raise HugePagesUnavailableError(
                        f"--huge-pages always: madvise(MADV_HUGEPAGE) failed: {exc.strerror}"
                    ) from exc
                logger.warning("madvise(MADV_HUGEPAGE) failed (%s); using normal pages",
                               exc.strerror, extra={"code": "huge_pages_unavailable"})
        if chosen.numa_policy is not None:
            per = 8 * ctypes.sizeof(ctypes.c_ulong)
            mask = (ctypes.c_ulong * (MASK_BITS // per))()
            for node in chosen.numa_nodes:
                mask[node // per] |= 1 << (node % per)
            try:
                libc.mbind(addr, length, NUMA_POLICIES[chosen.numa_policy], mask)
            except OSError as exc:
                raise errors.OperationFailedError(
                    f"mbind({chosen.numa_policy}, nodes {_list(chosen.numa_nodes)}) failed: "
                    f"{exc.strerror}") from exc
    finally:
        del anchor


def pmd_mapped(pid: int, start: int) -> int | None:
    """Huge (PMD-mapped) bytes of the mapping of `pid` that begins at `start`; None if none."""
    found = (procfs.read_smaps(pid, starts={start}) or {}).get(start)
    return None if found is None else found.huge_bytes
