"""Hand-written /proc readers for what psutil has no reader for: matching by (device,
inode), start times in clock ticks, locks, status. A vanished process reads as `GONE`,
one that refuses us as `DENIED`."""

from __future__ import annotations

import contextlib
import enum
import os
import re
from collections import defaultdict
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

from vllm_offload_cli.core.system.files import FileId

PROC = "/proc"


class Unreadable(enum.Enum):
    """Why a per-process read gave nothing."""

    GONE = "gone"
    DENIED = "denied"


GONE, DENIED = Unreadable.GONE, Unreadable.DENIED


def _why(exc: OSError) -> Unreadable:
    return DENIED if isinstance(exc, PermissionError) else GONE


def read(pid: int, name: str) -> bytes | Unreadable:
    """/proc/PID/`name` as raw bytes (maps: so a caller can skip a process by a substring
    test before parsing it)."""
    try:
        with open(f"{PROC}/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError as exc:
        return _why(exc)


def strip_deleted(path: str) -> tuple[str, bool]:
    """'/dev/shm/x (deleted)' -> ('/dev/shm/x', True)."""
    stripped = path.removesuffix(" (deleted)")
    return stripped, stripped != path


def parse_dev(text: str) -> int:
    """'00:1a' (hex major:minor, as maps and locks print it) -> st_dev."""
    major, minor = text.split(":")
    return os.makedev(int(major, 16), int(minor, 16))


def maps_dev_token(dev: int) -> bytes:
    """How /proc/PID/maps prints a device: ' 00:1a ' (hex major:minor)."""
    return f" {os.major(dev):02x}:{os.minor(dev):02x} ".encode()


def stat_identity(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of `pid`; None if unreadable."""
    data = read(pid, "stat")
    if isinstance(data, Unreadable):
        return None
    # comm may contain spaces and parentheses: the fields resume after the last ')'
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return fields[0].decode("ascii"), int(fields[19])  # fields 3 and 22 overall
    except (IndexError, ValueError, UnicodeDecodeError):
        return None


@dataclass(frozen=True, kw_only=True)
class Mapping:
    """One line of /proc/PID/maps that maps a file."""

    start: int
    end: int
    offset: int
    file_id: FileId
    path: str  # as shown, without " (deleted)"
    deleted: bool


def parse_maps_line(raw: bytes) -> Mapping | None:
    """One line of maps (or a mapping's first line in smaps); None for any other line."""
    parts = raw.decode("utf-8", "surrogateescape").split(maxsplit=5)
    if len(parts) < 5:
        return None
    addr, _perms, offset, dev, inode = parts[:5]
    try:
        start, end = (int(x, 16) for x in addr.split("-"))
        fid = FileId(parse_dev(dev), int(inode))
        off = int(offset, 16)
    except ValueError:
        return None
    path, deleted = strip_deleted(parts[5] if len(parts) > 5 else "")
    return Mapping(start=start, end=end, offset=off, file_id=fid, path=path, deleted=deleted)


def parse_maps(data: bytes) -> Iterator[Mapping]:
    """File mappings in maps text (anonymous memory skipped)."""
    for raw in data.splitlines():
        m = parse_maps_line(raw)
        if m is not None and m.file_id.ino != 0:
            yield m


def fd_stats(pid: int, skip: Collection[int] = ()
             ) -> list[tuple[int, os.stat_result]] | Unreadable:
    """(fd, stat of the open file) for each distinct file a process has open: a million
    dups cost one entry. A directory we may list but not follow is DENIED."""
    out: dict[tuple[int, int], tuple[int, os.stat_result]] = {}
    try:
        with os.scandir(f"{PROC}/{pid}/fd") as entries:
            for entry in entries:
                fd = int(entry.name)
                if fd in skip:
                    continue
                try:
                    st = os.stat(entry.path)
                except PermissionError:
                    return DENIED
                except OSError:
                    continue
                # a plain tuple, not a FileId: this runs once per descriptor
                out.setdefault((st.st_dev, st.st_ino), (fd, st))
    except OSError as exc:
        return _why(exc)
    return list(out.values())


def may_write(pid: int, fids: Collection[FileId]) -> bool | Unreadable:
    """Whether a process holds any of these files in a way that can write them, by the
    kernel's record: a descriptor opened for writing (fdinfo) or a mapping that may write
    (smaps `mw`). smaps, a page-table walk, is read only up to the files' last mapping."""
    try:
        with os.scandir(f"{PROC}/{pid}/fd") as entries:
            for entry in entries:
                try:
                    if FileId.of(os.stat(entry.path)) not in fids:
                        continue
                    with open(f"{PROC}/{pid}/fdinfo/{entry.name}", "rb") as f:
                        info = f.read()
                except PermissionError:
                    return DENIED
                except OSError:
                    continue  # closed meanwhile
                flags = next((int(line.split()[1], 8) for line in info.splitlines()
                              if line.startswith(b"flags:")), None)
                if flags is None or flags & os.O_ACCMODE != os.O_RDONLY:
                    return True
        maps = read(pid, "maps")
        if isinstance(maps, Unreadable):
            return maps
        devs = {maps_dev_token(fid.dev) for fid in fids}  # parse only lines of their devices
        lines = b"\n".join(x for x in maps.splitlines() if any(d in x for d in devs))
        starts = {m.start for m in parse_maps(lines) if m.file_id in fids}
        if starts:  # smaps read in address order, up to the last of them
            return any(p.may_write for p in _smaps(pid, None, starts).values())
    except OSError as exc:
        return _why(exc)
    return False


def fd_links(pid: int) -> list[tuple[int, str]] | Unreadable:
    """(descriptor, target) of each descriptor of a process (readlink)."""
    try:
        entries = os.listdir(f"{PROC}/{pid}/fd")
    except OSError as exc:
        return _why(exc)
    return [(int(e), t) for e in entries if (t := fd_target(pid, int(e))) is not None]


def fd_target(pid: int, fd: int) -> str | None:
    try:
        return os.readlink(fd_link(pid, fd))
    except OSError:
        return None


# Another process's open (or, root only, mapped) file, by its /proc magic link: for
# files.open_proc_link (our own descriptor of it) or stat_proc_link (which opens nothing).

def fd_link(pid: int, fd: int) -> str:
    return f"{PROC}/{pid}/fd/{fd}"


def map_link(pid: int, start: int, end: int) -> str:
    return f"{PROC}/{pid}/map_files/{start:x}-{end:x}"


# smaps and numa_maps are a page-table walk each: read at most once per process, for
# every file wanted at once
_NODE = re.compile(rb"\bN(\d+)=(\d+)")
_KPAGE = re.compile(rb"\bkernelpagesize_kB=(\d+)")
_HUGE_KEYS = (b"ShmemPmdMapped", b"FilePmdMapped")


@dataclass(kw_only=True)
class MappedPages:
    """What smaps says of one mapping: resident and PMD (huge) mapped bytes, and whether
    it may write (VmFlags `mw`)."""

    file_id: FileId
    rss_bytes: int = 0
    huge_bytes: int = 0
    may_write: bool = False
    nodes: dict[int, int] = field(default_factory=dict)  # node -> bytes, from numa_maps


def read_smaps(pid: int, *, wanted: set[FileId] | None = None,
               starts: Collection[int] | None = None) -> dict[int, MappedPages] | None:
    """Mappings by start address, only of `wanted` files and only those at `starts`;
    None when smaps cannot be read or parsed."""
    try:
        return _smaps(pid, wanted, starts)
    except (OSError, ValueError, IndexError):
        return None


def _smaps(pid: int, wanted: set[FileId] | None, starts: Collection[int] | None
           ) -> dict[int, MappedPages]:
    out: dict[int, MappedPages] = {}
    last = None if starts is None else max(starts, default=-1)
    with open(f"{PROC}/{pid}/smaps", "rb") as f:
        current: MappedPages | None = None
        for line in f:
            m = parse_maps_line(line)
            if m is not None:
                if last is not None and m.start > last:
                    break  # mappings come in address order: the ones wanted are read
                keep = ((wanted is None or m.file_id in wanted)
                        and (starts is None or m.start in starts))
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
            elif key == b"VmFlags":
                current.may_write = b"mw" in rest.split()
    return out


def add_numa_nodes(pid: int, mappings: dict[int, MappedPages], page_size: int) -> None:
    """Fill each mapping's bytes per NUMA node from numa_maps, as far as it can be read."""
    if not mappings:
        return
    with contextlib.suppress(OSError), open(f"{PROC}/{pid}/numa_maps", "rb") as f:
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


@dataclass(frozen=True, kw_only=True)
class LockEntry:
    """One granted lock from /proc/locks (waiters are skipped)."""

    kind: str  # "FLOCK", "POSIX" or "OFDLCK"
    exclusive: bool
    pid: int  # 0 for a holder outside our PID namespace
    file_id: FileId


def lock_entries() -> Iterator[LockEntry]:
    try:
        with open(f"{PROC}/locks", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return
    for line in text.splitlines():
        fields = line.split()
        if "->" in fields or len(fields) < 8 or fields[1] not in ("FLOCK", "POSIX", "OFDLCK"):
            continue
        try:
            pid = int(fields[4])
            dev, inode = fields[5].rsplit(":", 1)
            fid = FileId(parse_dev(dev), int(inode))
        except ValueError:
            continue
        yield LockEntry(kind=fields[1], exclusive=fields[3] == "WRITE", pid=pid, file_id=fid)


def credentials(pid: int) -> tuple[frozenset[int], int] | Unreadable:
    """(real, effective, saved and filesystem uids; CapPrm | CapEff): one status read."""
    data = read(pid, "status")
    if isinstance(data, Unreadable):
        return data
    caps, uids = 0, frozenset[int]()
    for line in data.decode("ascii", "replace").splitlines():
        key, _, value = line.partition(":")
        try:
            if key in ("CapPrm", "CapEff"):
                caps |= int(value.strip(), 16)
            elif key == "Uid":
                uids = frozenset(int(u) for u in value.split())
        except ValueError:
            return DENIED
    return (uids, caps) if uids else DENIED


def proc_shows_self() -> bool:
    """/proc/self names this process: /proc belongs to our PID namespace."""
    try:
        return os.readlink(f"{PROC}/self") == str(os.getpid())
    except OSError:
        return False


def pid_namespace_inode() -> int | None:
    try:
        return os.stat(f"{PROC}/self/ns/pid").st_ino
    except OSError:
        return None
