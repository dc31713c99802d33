"""Where a region's pages really are: NUMA node per byte and huge pages, observed.

Two sources, in order:

* a holder's /proc/PID/smaps and numa_maps: the kernel's own account of the
  pages that process maps (ShmemPmdMapped/FilePmdMapped for huge pages,
  N<node>= per node). Mappings are matched by (dev, ino), so an unlinked
  region's `(deleted)` mapping counts. Of several holders the one mapping the
  most is used (a rank-less opener maps every slot, a worker only its own);
* for a region nobody maps: our own read-only mapping of the pages mincore
  says are resident, faulted in for reading (which allocates nothing: the
  pages exist) and asked with move_pages(2) which node holds them. Large
  regions are sampled (at most SAMPLE_PAGES pages, spread evenly).

On a one-node host the answer needs no system call: every resident byte is
on that node. Nothing here writes to a region or imports torch.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from vllm_offload_cli.core.host import residency
from vllm_offload_cli.core.host.discovery import RegionInfo
from vllm_offload_cli.core.region.geometry import PAGESIZE
from vllm_offload_cli.core.region.page_policy import ThpSupport, pmd_mapped, thp_support
from vllm_offload_cli.core.system import libc, numa, smaps
from vllm_offload_cli.core.system.files import FileId, open_regular

SAMPLE_PAGES = 4096



@dataclass(frozen=True, kw_only=True)
class HolderPages:
    """What one process maps of one file: bytes per node and PMD-mapped (huge) bytes."""

    pid: int
    mapped_bytes: int  # Rss of the matching mappings
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


def merge(pid: int, found: dict[FileId, HolderPages] | None,
          ids: Iterable[FileId]) -> HolderPages | None:
    """One region's share of a scan_holder() result (its segments added up)."""
    parts = [found[i] for i in ids if found and i in found]
    if not parts:
        return None
    nodes: dict[int, int] = defaultdict(int)
    for part in parts:
        for n, b in part.nodes.items():
            nodes[n] += b
    return HolderPages(pid=pid, mapped_bytes=sum(p.mapped_bytes for p in parts),
                       huge_bytes=sum(p.huge_bytes for p in parts), nodes=dict(nodes))


def scan_holder(pid: int, wanted: set[FileId]) -> dict[FileId, HolderPages] | None:
    """Per file in `wanted`: what `pid` maps of it (its smaps and numa_maps read once)."""
    found = smaps.read_smaps(pid, wanted=wanted)
    if found is None:
        return None
    if not found:
        return {}
    smaps.add_numa_nodes(pid, found, PAGESIZE)
    rss: dict[FileId, int] = defaultdict(int)
    huge: dict[FileId, int] = defaultdict(int)
    nodes: dict[FileId, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for m in found.values():
        rss[m.file_id] += m.rss_bytes
        huge[m.file_id] += m.huge_bytes
        for n, b in m.nodes.items():
            nodes[m.file_id][n] += b
    return {fid: HolderPages(pid=pid, mapped_bytes=rss[fid], huge_bytes=huge[fid],
                             nodes=dict(nodes[fid])) for fid in rss}


@dataclass(frozen=True)
class Sampled:
    """Placement of a file's resident pages as seen through our own mapping."""

    nodes: dict[int, int]  # node -> bytes, scaled from the sample
    huge_bytes: int | None  # estimated bytes in PMD-mapped huge pages; None if unknown
    asked: int  # pages sampled


_PMD = 2 * 1024 * 1024


def sample_resident(fd: int, length: int, *, sample: int = SAMPLE_PAGES,
                    pages: bytes | None = None) -> Sampled:
    """Nodes (and huge pages) of the resident pages of the first `length` bytes of `fd`.

    Pages are faulted into our own read-only mapping first (move_pages only
    sees mapped pages); only pages mincore calls resident are touched, so
    nothing is allocated. The mapping asks for huge pages, so a sample that
    lies in a huge page is mapped by one PMD: the share of sampled 2 MiB
    windows that smaps reports PMD-mapped estimates the huge bytes.
    """
    if pages is None:
        pages = residency.page_map(fd, 0, length)
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
    counts: dict[int, int] = defaultdict(int)
    for node in status:
        if node >= 0:
            counts[node] += 1
    known = sum(counts.values())
    if not known:
        return Sampled({}, huge, len(picked))
    out = {n: total * c // known for n, c in counts.items()}
    # give rounding leftovers to the largest node, so the parts add up to the whole
    top = max(out, key=lambda n: out[n])
    out[top] += total - sum(out.values())
    return Sampled(dict(out), huge, len(picked))


HolderScans = dict[int, "dict[FileId, HolderPages] | None"]


def observe(files: list[tuple[str, FileId | None, int]], holder_pids: Iterable[int],
            resident_bytes: int | None, *, topo: numa.Topology | None = None,
            thp: ThpSupport | None = None, measure: bool = True,
            scans: HolderScans | None = None) -> Placement:
    """Placement of one region: `files` are its (path, identity, size) segments.

    `topo`, `thp` and `scans` (scan_holder() results by pid) may be passed in by
    a caller observing many regions. On a one-node host whose mount gives no
    huge pages the answer is known without reading any holder.
    """
    topo = topo or numa.topology()
    if thp is None and files:
        thp = thp_support(os.path.dirname(files[0][0]))
    no_huge = thp is not None and not thp.allowed
    if resident_bytes is not None and topo.single_node and no_huge:
        nodes = {topo.nodes[0]: resident_bytes} if resident_bytes else {}
        return Placement(numa_nodes=nodes, huge_page_bytes=0, source="single_node")
    best = _widest_holder(holder_pids, {fid for _, fid, _ in files if fid is not None}, scans)
    if best is not None and best.nodes:
        return Placement(numa_nodes=best.nodes, huge_page_bytes=best.huge_bytes,
                         source="numa_maps", pid=best.pid)
    pid = None if best is None else best.pid
    unknown = Placement(numa_nodes=None, huge_page_bytes=0 if no_huge else None,
                        source="unknown", pid=pid)
    if not measure or not libc.numa_syscalls_available():
        return unknown
    return _sample_files(files, pid, no_huge) or unknown


def _widest_holder(holder_pids: Iterable[int], ids: set[FileId], scans: HolderScans | None
                   ) -> HolderPages | None:
    """The holder that maps most of the region: its numa_maps say the most."""
    best: HolderPages | None = None
    for holder in holder_pids:
        scan = scans[holder] if scans is not None and holder in scans else scan_holder(
            holder, ids)
        found = merge(holder, scan, ids)
        if found is not None and (best is None or found.mapped_bytes > best.mapped_bytes):
            best = found
    return best


def _sample_files(files: list[tuple[str, FileId | None, int]], pid: int | None,
                  no_huge: bool) -> Placement | None:
    """Sample every segment through our own mapping; None when one cannot be read, an
    unknown placement with its `error` when a system call was refused."""
    totals: dict[int, int] = defaultdict(int)
    asked = 0
    huge: int | None = 0
    for path, fid, size in files:
        if fid is None or size <= 0:
            continue
        fd = open_regular(path, fid)
        if fd is None:
            return None
        try:
            got = sample_resident(fd, size, sample=max(1, SAMPLE_PAGES // len(files)))
        except OSError as exc:  # no NUMA syscalls, refused, or truncated meanwhile (EFAULT)
            if not residency.refused(exc):
                return None
            return Placement(numa_nodes=None, huge_page_bytes=0 if no_huge else None,
                             source="unknown", pid=pid, error=exc.strerror or str(exc))
        finally:
            os.close(fd)
        asked += got.asked
        huge = None if got.huge_bytes is None or huge is None else huge + got.huge_bytes
        for node, b in got.nodes.items():
            totals[node] += b
    return Placement(numa_nodes=dict(totals), huge_page_bytes=huge, source="move_pages", pid=pid,
                     sampled_pages=asked)


def observe_all(regions: Iterable[RegionInfo], *, measure: bool = True
                ) -> dict[str, Placement]:
    """Placement of each region, keyed by its first path (unique per region)."""
    regions = list(regions)
    topo = numa.topology()
    thp: dict[str, ThpSupport] = {}
    for r in regions:
        directory = os.path.dirname(r.segments[0].path)
        if directory not in thp:
            thp[directory] = thp_support(directory)
    easy = topo.single_node and not any(t.allowed for t in thp.values())
    scans: HolderScans = {}
    if not easy:  # each holder's smaps and numa_maps once, for every region it maps
        wanted = {s.file_id for r in regions for s in r.segments if s.file_id is not None}
        for pid in {h.pid for r in regions for h in r.holders}:
            scans[pid] = scan_holder(pid, wanted)
    out: dict[str, Placement] = {}
    for r in regions:
        files = [(s.path, s.file_id, s.size_bytes) for s in r.segments]
        out[r.segments[0].path] = observe(
            files, [h.pid for h in r.holders], r.resident_bytes, topo=topo,
            thp=thp[os.path.dirname(r.segments[0].path)], measure=measure and r.linked,
            scans=scans)
    return out
