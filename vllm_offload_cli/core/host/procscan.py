"""Who uses which region: every process's mappings and descriptors, and /proc/locks.

Matching is by (device, inode), never by name: an unlinked region, one reached through
a removed hard link or another mount of the tmpfs is found, and a same-named newer file
is not confused with it. Vanished processes are skipped, denied ones counted. The
descriptors are read before the maps: a user that opens, maps, then closes shows up.
"""

from __future__ import annotations

import os
import re
import stat
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from vllm_offload_cli.core.base import deadline
from vllm_offload_cli.core.region.naming import PREFIX
from vllm_offload_cli.core.system import processes, procfs
from vllm_offload_cli.core.system.files import FileId


@dataclass(frozen=True, kw_only=True, slots=True)
class FileUse:
    """One process's use of a region file."""

    pid: int
    kind: str  # "map", "fd" or "lock"
    path: str = ""  # as /proc shows it, without " (deleted)"
    deleted: bool = False
    size_hint: int | None = None  # bytes mapped (maps) or st_size (fd)
    fd: int | None = None
    span: tuple[int, int] | None = None  # one mapping's (start, end), for map_files


# Files a process holds on the shm filesystem that only a name could make ours cost a
# readlink each: past this many per process they are counted, not named.
NAMED_PER_PROCESS = 256


@dataclass
class ProcessScan:
    uses: dict[FileId, list[FileUse]] = field(default_factory=lambda: defaultdict(list))
    denied_pids: list[int] = field(default_factory=list)
    # pid -> files on the shm filesystem past NAMED_PER_PROCESS, counted, not looked up
    unnamed: dict[int, int] = field(default_factory=dict)


class _Filter:
    """Which files a scan keeps: exact identities, and (with `name`) any file on the
    devices whose path contains `name`. A maps text is searched whole before any line
    is parsed, so what another user adds costs little."""

    def __init__(self, dev: int | None = None, ids: Collection[FileId] = (),
                 name: bytes | None = None) -> None:
        self.ids = set(ids)
        self.devs = {f.dev for f in self.ids} | ({dev} if dev is not None else set())
        self.name = name
        self._name_text = None if name is None else name.decode("utf-8", "surrogateescape")
        self.tokens = [procfs.maps_dev_token(d) for d in self.devs]
        self.inodes = {str(f.ino).encode() for f in self.ids}
        # the inode printed after one of the devices: one small pattern, whatever the count
        # of files (an alternation of every inode cost ms to build, 10x more to search)
        self._inode_field = re.compile(
            b"(?:" + b"|".join(re.escape(t) for t in self.tokens) + rb")(\d+) ")

    def keeps(self, fid: FileId, path: str | None) -> bool:
        return fid in self.ids or (self._name_text is not None and path is not None
                                   and fid.dev in self.devs and self._name_text in path)

    def may_hold(self, text: bytes) -> bool:
        """A device we watch is in `text`, and our name or one of our inodes."""
        return any(t in text for t in self.tokens) and (
            (self.name is not None and self.name in text)
            or (bool(self.inodes) and not self.inodes.isdisjoint(self._inode_field.findall(text))))

    def lines(self, maps: bytes) -> bytes:
        """Only the lines that may be kept, for parsing."""
        return b"\n".join(line for line in maps.splitlines() if self.may_hold(line))


def _scan_fds(pid: int, want: _Filter, skip: Collection[int], scan: ProcessScan
              ) -> bool | None:
    """Matching descriptors of `pid` into `scan.uses` (one per file); True denied, None
    gone. Past NAMED_PER_PROCESS files only a name could make ours, the rest are counted."""
    stats = procfs.fd_stats(pid, skip)
    if isinstance(stats, procfs.Unreadable):
        return None if stats is procfs.GONE else True
    named = 0
    for fd, st in stats:  # one per distinct file
        if st.st_dev not in want.devs or not stat.S_ISREG(st.st_mode):
            continue
        fid = FileId.of(st)
        if fid not in want.ids:
            if want.name is None:
                continue  # nothing its name could add: spare the readlink
            named += 1
            if named > NAMED_PER_PROCESS:
                scan.unnamed[pid] = scan.unnamed.get(pid, 0) + 1
                continue
        target = procfs.fd_target(pid, fd)
        if not want.keeps(fid, target):
            continue
        path, deleted = procfs.strip_deleted(target or "")
        scan.uses[fid].append(FileUse(pid=pid, kind="fd", path=path, deleted=deleted,
                                      size_hint=st.st_size, fd=fd))
    return False


def _scan_maps(pid: int, want: _Filter, uses: dict[FileId, list[FileUse]]) -> bool | None:
    """Matching mappings of `pid` into `uses`, one FileUse per file and name shown."""
    data = procfs.read(pid, "maps")
    if isinstance(data, procfs.Unreadable):
        return None if data is procfs.GONE else True
    if not want.may_hold(data):
        return False
    extents: dict[tuple[FileId, str, bool], tuple[int, tuple[int, int]]] = {}
    for m in procfs.parse_maps(want.lines(data)):
        if want.keeps(m.file_id, m.path):
            key = (m.file_id, m.path, m.deleted)
            extent, span = extents.get(key, (0, (m.start, m.end)))
            extents[key] = (max(extent, m.offset + m.end - m.start), span)
    for (fid, path, deleted), (extent, span) in extents.items():
        uses[fid].append(FileUse(pid=pid, kind="map", path=path, deleted=deleted,
                                 size_hint=extent, span=span))
    return False


def _scan(want: _Filter, own_fds: Collection[int], locks: Callable[[procfs.LockEntry], bool],
          only: Callable[[int], bool] | None = None) -> ProcessScan:
    """Every process's matching uses, then the `locks` of /proc/locks that count."""
    scan = ProcessScan()
    me = os.getpid()
    for pid in processes.pids():
        deadline.check("scanning processes")
        if only is not None and pid != me and not only(pid):
            continue
        fds = _scan_fds(pid, want, own_fds if pid == me else (), scan)
        # the maps are read even where the descriptors were denied: they may still show it
        maps = None if fds is None else _scan_maps(pid, want, scan.uses)
        if maps is None:
            continue  # exited mid-scan: it holds nothing now
        if fds or maps:
            scan.denied_pids.append(pid)
    for lock in procfs.lock_entries():
        if locks(lock):
            scan.uses[lock.file_id].append(FileUse(pid=lock.pid, kind="lock"))
    return scan


def scan_processes(shm_dir: str | os.PathLike[str], ids: Collection[FileId] = (), *,
                   name: str = PREFIX, only: Callable[[int], bool] | None = None
                   ) -> ProcessScan:
    """Every use (locks included) of the files `ids`, and of any file on shm_dir's
    filesystem named `name`* (a region's by default), by any process `only` admits."""
    shm_dev = os.stat(os.path.realpath(shm_dir)).st_dev
    return _scan(_Filter(dev=shm_dev, ids=ids, name=b"/" + name.encode()), (),
                 lambda lock: lock.file_id.dev == shm_dev, only)


def users_of(fids: Collection[FileId], *, own_fds: Collection[int] = ()
             ) -> tuple[dict[FileId, list[FileUse]], list[int]]:
    """Who uses these exact files right now, and which processes denied us: gc's
    re-check under the exclusive lock. `own_fds` do not count; POSIX and OFD locks do,
    flocks do not (the caller holds LOCK_EX, so any flock on them is its own)."""
    if not fids:
        return defaultdict(list), []
    want = _Filter(ids=fids)
    scan = _scan(want, own_fds, lambda lock: lock.kind != "FLOCK" and lock.file_id in want.ids)
    return scan.uses, scan.denied_pids


def flock_holders(fid: FileId) -> list[tuple[int, bool]]:
    """(pid, exclusive) for each flock on one inode, from /proc/locks."""
    return [(lock.pid, lock.exclusive) for lock in procfs.lock_entries()
            if lock.kind == "FLOCK" and lock.file_id == fid]
