"""Does each worker run near its slot's memory? A worker whose CPUs are on one NUMA node
and whose slot's pages are on another copies every block across the socket link: a
warning (the bytes are right, only slow), never on a one-node host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_offload_cli.core.host import observed_placement, residency
from vllm_offload_cli.core.region.geometry import PAGESIZE, Geometry
from vllm_offload_cli.core.system import libc, numa, processes


@dataclass(frozen=True, kw_only=True)
class WorkerPlacement:
    """One attached worker: the nodes of its CPUs and where its slot's pages are."""

    pid: int
    rank: int
    cpu_nodes: tuple[int, ...] | None  # None: affinity unreadable (process gone, denied)
    slot_numa_nodes: dict[int, int] | None  # node -> resident bytes of the slot; None: unknown
    remote: bool  # some of its slot's pages are on a node its CPUs are not


def _own_columns(g: Geometry, rank: int) -> list[int]:
    """Pages of a row that hold only `rank`'s bytes."""
    slot = g.slot(rank)
    return [j for j in range(g.row_stride // PAGESIZE)
            if j * PAGESIZE >= slot.start and (j + 1) * PAGESIZE <= slot.end]


def slot_nodes(fd: int, g: Geometry, rows: int, rank: int, resident: bytes,
               topo: numa.Topology) -> dict[int, int] | None:
    """Resident bytes of `rank`'s slot per node; sampled rows on a multi-node host."""
    per_row = g.row_stride // PAGESIZE
    cols = _own_columns(g, rank)
    total = sum(resident[j::per_row][:rows].count(1) for j in cols) * PAGESIZE
    if topo.single_node:
        return {topo.nodes[0]: total} if total else {}
    if not total or not libc.numa_syscalls_available():
        return {} if not total else None
    step = max(1, rows * len(cols) // observed_placement.SAMPLE_PAGES)
    picked = [row * per_row + j for row in range(0, rows, step) for j in cols
              if resident[row * per_row + j]]
    try:
        seen = observed_placement.sample_pages(fd, rows * g.row_stride, picked).nodes
    except OSError as exc:
        if residency.refused(exc):  # said by the caller, not a silent "unknown"
            raise
        return None
    whole = sum(seen.values())
    return {n: total * b // whole for n, b in seen.items()} if whole else {}


def check_workers(fd: int, g: Geometry, rows: int, workers: Sequence[tuple[int, int]], *,
                  topo: numa.Topology | None = None) -> list[WorkerPlacement]:
    """Affinity of each (pid, rank) against its slot's resident pages."""
    topo = topo or numa.topology()
    if not workers or rows <= 0:
        return []
    resident = residency.page_map(fd, 0, rows * g.row_stride)
    out = []
    for pid, rank in workers:
        cpus = processes.allowed_cpus(pid)
        cpu_nodes = None if cpus is None else tuple(sorted(topo.nodes_of_cpus(cpus)))
        nodes = slot_nodes(fd, g, rows, rank, resident, topo)
        remote = bool(cpu_nodes and nodes and any(
            n not in cpu_nodes for n, b in nodes.items() if b))
        out.append(WorkerPlacement(pid=pid, rank=rank, cpu_nodes=cpu_nodes, slot_numa_nodes=nodes,
                                   remote=remote))
    return out


def remote_message(w: WorkerPlacement) -> str:
    far = sorted(n for n, b in (w.slot_numa_nodes or {}).items()
                 if b and n not in (w.cpu_nodes or ()))
    nodes = ",".join(str(n) for n in w.cpu_nodes or ())
    return (f"rank {w.rank} (pid {w.pid}) runs on CPUs of NUMA node(s) {nodes} but its slot's "
            f"pages are (partly) on node(s) {','.join(str(n) for n in far)}: every copy crosses "
            "the socket link; bind the region (`create --numa-node`) or pin the worker near it")
