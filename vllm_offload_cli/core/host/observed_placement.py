"""Where a region's pages really are: NUMA node per byte and huge pages, observed.

First from the holder that maps the most (its smaps and numa_maps, matched by (dev, ino)
so an unlinked region counts); for a region nobody maps, through our own read-only
mapping of the resident pages (sampled) and move_pages(2). A one-node host needs no
system call. Nothing here writes to a region or imports torch.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace

from vllm_offload_cli.core.host import residency
from vllm_offload_cli.core.host.discovery import RegionInfo, SegmentFile
from vllm_offload_cli.core.region.geometry import PAGESIZE
from vllm_offload_cli.core.region.page_policy import ThpSupport, pmd_mapped, thp_support
from vllm_offload_cli.core.system import libc, memory, procfs
from vllm_offload_cli.core.system.files import FileId, open_regular

SAMPLE_PAGES = 4096


@dataclass(frozen=True, kw_only=True)
class HolderPages:
    """What one process maps of one file: bytes per node and PMD-mapped (huge) bytes."""

    pid: int
    rss_bytes: int  # of the matching mappings
    huge_bytes: int  # ShmemPmdMapped + FilePmdMapped
    nodes: dict[int, int]  # node -> bytes, from numa_maps (empty if unreadable)


@dataclass(frozen=True, kw_only=True)
class Placement:
    """A region's observed placement; `source` says how it was learned."""

    numa_nodes: dict[int, int] | None  # node -> bytes; None when unknown
    huge_page_bytes: int | None  # bytes mapped with PMD (2 MiB) pages; None when unknown
    source: str  # "numa_maps", "move_pages", "single_node" or "unknown"
    pid: int | None = None  # the holder whose maps were read
    sampled_pages: int | None = None  # move_pages: pages asked (fewer than resident: sampled)
    error: str | None = None  # why it is unknown when a system call was refused


def merge(pid: int, found: list[procfs.MappedPages] | None,
          ids: Collection[FileId]) -> HolderPages | None:
    """One region's share of a scan_holder() result (its segments' mappings added up)."""
    parts = [m for m in found or () if m.file_id in ids]
    if not parts:
        return None
    nodes: Counter[int] = Counter()
    for part in parts:
        nodes.update(part.nodes)
    return HolderPages(pid=pid, rss_bytes=sum(p.rss_bytes for p in parts),
                       huge_bytes=sum(p.huge_bytes for p in parts), nodes=dict(nodes))


def scan_holder(pid: int, wanted: set[FileId]) -> list[procfs.MappedPages] | None:
    """What `pid` maps of the files `wanted` (its smaps and numa_maps read once)."""
    found = procfs.read_smaps(pid, wanted=wanted)
    if found is None:
        return None
    procfs.add_numa_nodes(pid, found, PAGESIZE)
    return list(found.values())


@dataclass(frozen=True)
class Sampled:
    """Placement of a file's resident pages as seen through our own mapping."""

    nodes: dict[int, int]  # node -> bytes, scaled from the sample
    huge_bytes: int | None  # estimated bytes in PMD-mapped huge pages; None if unknown
    asked: int  # pages sampled


_PMD = 2 * 1024 * 1024


def sample_resident(fd: int, length: int, *, sample: int = SAMPLE_PAGES) -> Sampled:
    """Nodes (and huge pages) of the resident pages of the first `length` bytes of `fd`.
    Only resident pages are faulted into our read-only mapping, so nothing is allocated;
    the share of sampled 2 MiB windows smaps calls PMD-mapped estimates the huge bytes."""
    pages = residency.page_map(fd, length)
    return sample_pages(fd, length, [i for i, v in enumerate(pages) if v], sample=sample)


def sample_pages(fd: int, length: int, resident: list[int], *, sample: int = SAMPLE_PAGES
                 ) -> Sampled:
    """Like sample_resident, for the given resident page indices only (e.g. one slot's)."""
    if not resident:
        return Sampled({}, 0, 0)
    picked = resident if len(resident) <= sample else [
        resident[(k * len(resident)) // sample] for k in range(sample)]
    addr = libc.map_readonly(fd, length)
    try:
        with contextlib.suppress(OSError):  # THP not configured: no huge pages to see
            libc.madvise(addr, length, libc.MADV_HUGEPAGE)
        addrs = [addr + i * PAGESIZE for i in picked]
        for a in addrs:
            libc.madvise(a, PAGESIZE, libc.MADV_POPULATE_READ)
        status = libc.page_nodes(addrs)
        pmd = pmd_mapped(os.getpid(), addr)
    finally:
        libc.unmap(addr, length)
    total = min(len(resident) * PAGESIZE, length)
    windows = {(addr + i * PAGESIZE) // _PMD for i in picked}
    huge = None if pmd is None else min(total, total * (pmd // _PMD) // len(windows))
    counts = Counter(node for node in status if node >= 0)
    known = sum(counts.values())
    out = {n: total * c // known for n, c in counts.items()}
    if out:  # rounding leftovers go to the largest node, so the parts add up to the whole
        out[max(out, key=out.__getitem__)] += total - sum(out.values())
    return Sampled(out, huge, len(picked))


HolderScans = dict[int, "list[procfs.MappedPages] | None"]


def observe_all(regions: Iterable[RegionInfo]) -> dict[str, Placement]:
    """Placement of each region, keyed by its first path (unique per region)."""
    regions = list(regions)
    topo = memory.topology()
    thp = {d: thp_support(d) for d in {os.path.dirname(r.segments[0].path) for r in regions}}
    scans: HolderScans = {}
    if not topo.single_node or any(t.allowed for t in thp.values()):
        # each holder's smaps and numa_maps once, for every region it maps
        wanted = {s.file_id for r in regions for s in r.segments if s.file_id is not None}
        scans = {pid: scan_holder(pid, wanted) for pid in {h.pid for r in regions
                                                           for h in r.holders}}
    return {r.segments[0].path: _observe(r, topo, thp[os.path.dirname(r.segments[0].path)],
                                         scans) for r in regions}


def _observe(r: RegionInfo, topo: memory.Topology, thp: ThpSupport, scans: HolderScans
             ) -> Placement:
    """Placement of one region; on a one-node host whose mount gives no huge pages it is
    known without reading any holder."""
    no_huge = not thp.allowed
    if r.resident_bytes is not None and topo.single_node and no_huge:
        nodes = {topo.nodes[0]: r.resident_bytes} if r.resident_bytes else {}
        return Placement(numa_nodes=nodes, huge_page_bytes=0, source="single_node")
    best = _widest_holder([h.pid for h in r.holders],
                          {s.file_id for s in r.segments if s.file_id is not None}, scans)
    if best is not None and best.nodes:
        return Placement(numa_nodes=best.nodes, huge_page_bytes=best.huge_bytes,
                         source="numa_maps", pid=best.pid)
    unknown = Placement(numa_nodes=None, huge_page_bytes=0 if no_huge else None,
                        source="unknown", pid=None if best is None else best.pid)
    if not r.linked or not libc.numa_syscalls_available():  # sampling maps the file by name
        return unknown
    return _sample_files(r.segments, unknown)


def _widest_holder(holder_pids: Iterable[int], ids: set[FileId], scans: HolderScans
                   ) -> HolderPages | None:
    """The holder that maps most of the region (the first of equals): its numa_maps say most."""
    found = [merge(h, scans[h] if h in scans else scan_holder(h, ids), ids) for h in holder_pids]
    return max((f for f in found if f is not None), key=lambda f: f.rss_bytes, default=None)


def _sample_files(segments: Sequence[SegmentFile], unknown: Placement) -> Placement:
    """Sample every segment through our own mapping; `unknown` when one cannot be read,
    with its `error` when a system call was refused."""
    totals: Counter[int] = Counter()
    asked = 0
    huge: int | None = 0
    for s in segments:
        if s.file_id is None or s.size_bytes <= 0:
            continue
        fd = open_regular(s.path, s.file_id)
        if fd is None:
            return unknown
        try:
            got = sample_resident(fd, s.size_bytes,
                                  sample=max(1, SAMPLE_PAGES // len(segments)))
        except OSError as exc:  # no NUMA syscalls, refused, or truncated meanwhile (EFAULT)
            refused = residency.refused(exc)
            return replace(unknown, error=exc.strerror or str(exc)) if refused else unknown
        finally:
            os.close(fd)
        asked += got.asked
        huge = None if got.huge_bytes is None or huge is None else huge + got.huge_bytes
        totals.update(got.nodes)
    return Placement(numa_nodes=dict(totals), huge_page_bytes=huge, source="move_pages",
                     pid=unknown.pid, sampled_pages=asked)
