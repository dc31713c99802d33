"""/proc/PID/smaps and numa_maps: the pages a process maps (a page-table walk each,
so read at most once per process, for every file wanted at once)."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from vllm_offload_cli.core.system import procfs
from vllm_offload_cli.core.system.files import FileId
from vllm_offload_cli.core.system.procfs import PROC

_NODE = re.compile(rb"\bN(\d+)=(\d+)")
_KPAGE = re.compile(rb"\bkernelpagesize_kB=(\d+)")
_HUGE_KEYS = (b"ShmemPmdMapped", b"FilePmdMapped")


@dataclass(kw_only=True)
class MappedPages:
    """What smaps says of one mapping: resident and PMD (huge) mapped bytes."""

    file_id: FileId
    rss_bytes: int = 0
    huge_bytes: int = 0
    nodes: dict[int, int] = field(default_factory=dict)  # node -> bytes, from numa_maps


def read_smaps(pid: int, *, wanted: set[FileId] | None = None, start: int | None = None
               ) -> dict[int, MappedPages] | None:
    """Mappings by start address, only of `wanted` files or only the one at `start`;
    None when smaps cannot be read or parsed."""
    out: dict[int, MappedPages] = {}
    try:
        with open(f"{PROC}/{pid}/smaps", "rb") as f:
            current: MappedPages | None = None
            for line in f:
                m = procfs.parse_maps_line(line)
                if m is not None:
                    if start is not None and m.start > start:
                        break  # mappings come in address order: the one wanted is read
                    keep = ((wanted is None or m.file_id in wanted)
                            and (start is None or m.start == start))
                    current = (out.setdefault(m.start, MappedPages(file_id=m.file_id)) if keep
                               else None)
                    continue
                if current is None:
                    continue
                key, _, rest = line.partition(b":")
                if key == b"Rss":
                    current.rss_bytes += int(rest.split()[0]) * 1024
                elif key in _HUGE_KEYS:
                    current.huge_bytes += int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return out


def add_numa_nodes(pid: int, mappings: dict[int, MappedPages], page_size: int) -> bool:
    """Fill each mapping's bytes per NUMA node from numa_maps; False if unreadable."""
    if not mappings:
        return True
    try:
        with open(f"{PROC}/{pid}/numa_maps", "rb") as f:
            for line in f:
                addr, _, rest = line.partition(b" ")
                try:
                    found = mappings.get(int(addr, 16))
                except ValueError:
                    continue
                if found is None:
                    continue
                kpage = _KPAGE.search(rest)
                unit = int(kpage.group(1)) * 1024 if kpage else page_size
                nodes: dict[int, int] = defaultdict(int, found.nodes)
                for node, pages in _NODE.findall(rest):
                    nodes[int(node)] += int(pages) * unit
                found.nodes = dict(nodes)
    except OSError:
        return False
    return True
