"""The host's NUMA topology from sysfs; without it (no NUMA, sysfs hidden), one node 0."""

from __future__ import annotations

import os
from dataclasses import dataclass

NODE_ROOT = "/sys/devices/system/node"


def parse_cpulist(text: str) -> frozenset[int]:
    """'0-3,8,10-11' (the kernel's list format) -> {0, 1, 2, 3, 8, 10, 11}."""
    out: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        first, dash, last = part.partition("-")
        lo = int(first)
        hi = int(last) if dash else lo
        if hi < lo:
            raise ValueError(f"bad CPU range {part!r}")
        out.update(range(lo, hi + 1))
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
