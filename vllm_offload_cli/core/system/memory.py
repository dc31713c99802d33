"""This host's memory: NUMA topology (sysfs; without it, one node 0), and the limits that
apply to a new tmpfs file: cgroups, available memory, THP policy."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from vllm_offload_cli.core.system.procfs import PROC

SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
CGROUP_ROOT = "/sys/fs/cgroup"
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge number


def _read_int(path: Path) -> int | None:
    """A cgroup number; None for "max", v1's huge "no limit", or none at all."""
    try:
        value = int(path.read_text())
    except (OSError, ValueError):
        return None
    return None if value >= _UNLIMITED else value


def cgroup_headroom(proc_root: Path = Path(PROC),
                    cgroup_root: Path = Path(CGROUP_ROOT)) -> tuple[int | None, int | None]:
    """(limit, free) of the tightest memory cgroup above this process, or (None, None).
    tmpfs pages are charged to the faulting process's cgroup and every ancestor's
    limit applies (v2 and v1 alike: a pod's limit sits above its containers')."""
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None, None
    found: list[tuple[int, int]] = []  # (limit, free) of every memory cgroup above us
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":
            top, files = cgroup_root, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            top, files = cgroup_root / "memory", ("memory.limit_in_bytes",
                                                  "memory.usage_in_bytes")
        else:
            continue
        for node in _up(top, rel.lstrip("/")):
            limit, used = (_read_int(node / name) for name in files)
            if limit is not None and used is not None:
                found.append((limit, max(limit - used, 0)))
    return min(found, key=lambda x: x[1]) if found else (None, None)


def _up(top: Path, rel: str) -> Iterator[Path]:
    """The cgroup `rel` under `top`, then each ancestor up to `top` itself."""
    node = top / rel if rel else top
    while True:
        yield node
        if node == top or top not in node.parents:
            return
        node = node.parent


def mem_available() -> int | None:
    """The kernel's estimate of memory available without swapping; None if unknown."""
    try:
        return int(psutil.virtual_memory().available)
    except (OSError, RuntimeError, ValueError):
        return None


def shmem_thp_setting(path: str = SHMEM_ENABLED) -> str | None:
    """The selected word of shmem_enabled ('never', 'advise', ...); None without THP."""
    try:
        with open(path, encoding="ascii") as f:
            return selected_word(f.read())
    except (OSError, UnicodeDecodeError):
        return None


def selected_word(text: str) -> str:
    """'always [never] deny' -> 'never' (the kernel's choice-list format); '' if none."""
    return next((w[1:-1] for w in text.split() if w.startswith("[") and w.endswith("]")), "")


NODE_ROOT = "/sys/devices/system/node"


def parse_cpulist(text: str) -> frozenset[int]:
    """'0-3,8,10-11' (the kernel's list format) -> {0, 1, 2, 3, 8, 10, 11}."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, dash, last = part.partition("-")
        span = range(int(first), int(last if dash else first) + 1)
        if not span:
            raise ValueError(f"bad CPU range {part!r}")
        out.update(span)
    return frozenset(out)


def _cpulist(path: str, default: frozenset[int] = frozenset()) -> frozenset[int]:
    """A sysfs list file, parsed; `default` when it is absent or garbled."""
    try:
        with open(path, encoding="ascii") as f:
            return parse_cpulist(f.read())
    except (OSError, UnicodeDecodeError, ValueError):
        return default


@dataclass(frozen=True)
class Topology:
    """Online nodes and the CPUs of each; `from_sysfs` is False for the one-node fallback."""

    cpus: dict[int, frozenset[int]]  # node -> CPUs
    with_memory: frozenset[int]
    from_sysfs: bool

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(sorted(self.cpus))

    @property
    def single_node(self) -> bool:
        return len(self.cpus) <= 1

    def nodes_of_cpus(self, cpus: frozenset[int]) -> frozenset[int]:
        return frozenset(n for n, mine in self.cpus.items() if mine & cpus)


def topology(root: str = NODE_ROOT) -> Topology:
    """Read the online nodes; one node 0 with every CPU where sysfs says nothing."""
    nodes = _cpulist(os.path.join(root, "online"))
    if not nodes:
        return Topology({0: frozenset(range(os.cpu_count() or 1))}, frozenset({0}), False)
    cpus = {node: _cpulist(os.path.join(root, f"node{node}", "cpulist"))
            for node in sorted(nodes)}
    with_memory = _cpulist(os.path.join(root, "has_memory"), nodes)
    return Topology(cpus, with_memory & nodes or nodes, True)
