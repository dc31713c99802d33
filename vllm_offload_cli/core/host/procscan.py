"""Who uses which region: /proc/*/maps, /proc/*/fd and /proc/locks.

Matching is by (device, inode), never by name: a region is found after its
name was unlinked (newer vLLM unlinks once all workers mapped it), through a
hard link its user opened and then removed, or through another mount of the
same tmpfs; and a process using a same-named newer file is not confused with
one using the old one.
Processes that vanish mid-scan are skipped; those that deny access are
counted, so callers can say "N processes could not be inspected".
"""

from __future__ import annotations

import os
import re
import stat
from collections import defaultdict
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from vllm_offload_cli.core.region.fsguard import FileId

_DELETED = " (deleted)"


@dataclass(frozen=True)
class FileUse:
    """One process's use of a region file."""

    pid: int
    kind: str  # "map", "fd" or "lock"
    path: str  # as /proc shows it, without " (deleted)"
    deleted: bool
    size_hint: int | None = None  # bytes mapped (maps) or st_size (fd)
    fd: int | None = None


@dataclass
class ProcessScan:
    uses: dict[FileId, list[FileUse]] = field(default_factory=lambda: defaultdict(list))
    scanned: int = 0
    denied_pids: list[int] = field(default_factory=list)

    @property
    def denied(self) -> int:
        return len(self.denied_pids)

    def holders(self, fid: FileId) -> list[FileUse]:
        return self.uses.get(fid, [])


def _parse_dev(text: str) -> int:
    """'00:1a' (hex major:minor, as maps and locks print it) -> st_dev."""
    major, minor = text.split(":")
    return os.makedev(int(major, 16), int(minor, 16))


def _strip_deleted(path: str) -> tuple[str, bool]:
    if path.endswith(_DELETED):
        return path[: -len(_DELETED)], True
    return path, False


def maps_dev_token(dev: int) -> bytes:
    """How /proc/PID/maps prints a device: ' 00:1a ' (hex major:minor)."""
    return f" {os.major(dev):02x}:{os.minor(dev):02x} ".encode()


def _scan_maps(pid: int, token: bytes, shm_dev: int, scan: ProcessScan) -> None:
    """Every mapping of a file on the shm filesystem, whatever name it shows."""
    with open(f"/proc/{pid}/maps", "rb") as f:
        data = f.read()
    if token not in data:
        return
    spans: dict[tuple[FileId, str], int] = {}
    for raw in data.splitlines():
        if token not in raw:
            continue
        parts = raw.decode("utf-8", "surrogateescape").split(maxsplit=5)
        if len(parts) < 5:
            continue
        addr, _perms, offset, dev, inode = parts[:5]
        try:
            fid = FileId(_parse_dev(dev), int(inode))
        except ValueError:
            continue
        if fid.dev != shm_dev or fid.ino == 0:
            continue
        start, end = (int(x, 16) for x in addr.split("-"))
        key = (fid, parts[5] if len(parts) > 5 else "")
        spans[key] = max(spans.get(key, 0), int(offset, 16) + end - start)
    for (fid, shown), extent in spans.items():
        path, deleted = _strip_deleted(shown)
        scan.uses[fid].append(FileUse(pid, "map", path, deleted, extent))


def _fd_files(pid: int, proc: str, skip: Collection[int] = ()
              ) -> Iterator[tuple[int, os.stat_result]]:
    """(fd, stat) of every descriptor of a process, matched later by (dev, ino).

    stat() of /proc/PID/fd/N follows to the open file itself, so its identity
    holds whatever name it was opened by (a hard link removed since included).
    """
    fd_dir = f"{proc}/{pid}/fd"
    for name in os.listdir(fd_dir):
        fd = int(name)
        if fd in skip:
            continue
        try:
            yield fd, os.stat(f"{fd_dir}/{name}")
        except PermissionError:
            raise  # listable but not followable (PID 1 in some sandboxes): uninspected
        except OSError:
            continue  # closed meanwhile


def _fd_use(pid: int, fd: int, st: os.stat_result, proc: str) -> FileUse:
    try:
        path, deleted = _strip_deleted(os.readlink(f"{proc}/{pid}/fd/{fd}"))
    except OSError:
        path, deleted = "", False
    return FileUse(pid, "fd", path, deleted, st.st_size, fd)


def _scan_fds(pid: int, shm_dev: int, scan: ProcessScan) -> None:
    for fd, st in _fd_files(pid, "/proc"):
        if st.st_dev == shm_dev and stat.S_ISREG(st.st_mode):
            scan.uses[FileId.of(st)].append(_fd_use(pid, fd, st, "/proc"))


@dataclass(frozen=True)
class LockEntry:
    """One granted lock from /proc/locks (waiters are skipped)."""

    kind: str  # "FLOCK", "POSIX" or "OFDLCK"
    exclusive: bool
    pid: int
    file_id: FileId


def lock_entries(proc: str = "/proc") -> Iterator[LockEntry]:
    try:
        text = Path(f"{proc}/locks").read_text()
    except OSError:
        return
    for line in text.splitlines():
        fields = line.split()
        if "->" in fields or len(fields) < 8 or fields[1] not in ("FLOCK", "POSIX", "OFDLCK"):
            continue
        try:
            pid = int(fields[4])
            major, minor, inode = fields[5].split(":")
            fid = FileId(os.makedev(int(major, 16), int(minor, 16)), int(inode))
        except ValueError:
            continue
        yield LockEntry(fields[1], fields[3] == "WRITE", pid, fid)


def _scan_locks(scan: ProcessScan, shm_dev: int) -> None:
    for lock in lock_entries():
        if lock.file_id.dev == shm_dev:
            scan.uses[lock.file_id].append(FileUse(lock.pid, "lock", "", False))


def _scan_process(pid: int, token: bytes, shm_dev: int, scan: ProcessScan) -> bool | None:
    """Read one process; True if it denied access, None if it vanished.

    Descriptors before mappings: a user that opens, maps, then closes its
    descriptor is seen by at least one of the two reads.
    """
    denied = False
    for fds in (True, False):
        try:
            if fds:
                _scan_fds(pid, shm_dev, scan)
            else:
                _scan_maps(pid, token, shm_dev, scan)
        except (FileNotFoundError, ProcessLookupError):
            return None
        except PermissionError:
            denied = True
        except OSError:
            return None
    return denied


def scan_processes(shm_dir: str | Path) -> ProcessScan:
    """Every use of a region-named file on shm_dir's filesystem, by any process."""
    shm_dir = os.path.realpath(shm_dir)
    shm_dev = os.stat(shm_dir).st_dev
    token = maps_dev_token(shm_dev)
    scan = ProcessScan()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        denied = _scan_process(pid, token, shm_dev, scan)
        if denied is not None:  # None: it vanished mid-scan
            scan.scanned += 1
            if denied:
                scan.denied_pids.append(pid)
    _scan_locks(scan, shm_dev)
    return scan


def users_of(
    fids: Collection[FileId],
    *,
    own_fds: Collection[int] = (),
    proc: str = "/proc",
) -> tuple[dict[FileId, list[FileUse]], list[int]]:
    """Who uses these exact files right now, and which processes denied us.

    The re-check a garbage collector makes while it holds the exclusive lock,
    so it matches by (device, inode) rather than by path: a process that
    opened the file through another mount of the same tmpfs is still found.
    Per process the descriptors are read before the mappings: a user that
    opens, maps, then closes its descriptor (as vLLM may) shows up in at
    least one of the two reads, whatever moment it does so. Flock entries are
    ignored: the caller holds LOCK_EX, so any flock on these inodes is its own.
    """
    wanted = set(fids)
    found: dict[FileId, list[FileUse]] = defaultdict(list)
    if not wanted:
        return found, []
    inodes = re.compile(rb" (?:" + b"|".join(str(i).encode() for i in
                                              sorted({f.ino for f in wanted})) + rb") ")
    tokens = {maps_dev_token(f.dev) for f in wanted}
    me = os.getpid()
    denied: list[int] = []
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        pid = int(entry)
        refused = False
        for step in (_fds_using, _maps_using):
            try:
                if step is _fds_using:
                    _fds_using(pid, wanted, own_fds if pid == me else (), found, proc)
                else:
                    _maps_using(pid, wanted, tokens, inodes, found, proc)
            except PermissionError:
                refused = True  # the other read may still work: do it
            except OSError:  # vanished (or worse): nothing more to read
                break
        if refused:
            denied.append(pid)
    _locks_on(wanted, found, proc)
    return found, denied


def _fds_using(pid: int, wanted: set[FileId], skip: Collection[int],
               found: dict[FileId, list[FileUse]], proc: str) -> None:
    for fd, st in _fd_files(pid, proc, skip):
        fid = FileId.of(st)
        if fid in wanted:
            found[fid].append(_fd_use(pid, fd, st, proc))


def _maps_using(pid: int, wanted: set[FileId], tokens: set[bytes], inodes: re.Pattern[bytes],
                found: dict[FileId, list[FileUse]], proc: str) -> None:
    with open(f"{proc}/{pid}/maps", "rb") as f:
        data = f.read()
    if not any(t in data for t in tokens) or inodes.search(data) is None:
        return
    seen: set[FileId] = set()
    for raw in data.splitlines():
        if inodes.search(raw) is None:
            continue
        parts = raw.decode("utf-8", "surrogateescape").split(maxsplit=5)
        if len(parts) < 5:
            continue
        try:
            fid = FileId(_parse_dev(parts[3]), int(parts[4]))
        except ValueError:
            continue
        if fid in wanted and fid not in seen:
            seen.add(fid)
            shown = parts[5] if len(parts) > 5 else ""
            path, deleted = _strip_deleted(shown)
            found[fid].append(FileUse(pid, "map", path, deleted))


def _locks_on(wanted: set[FileId], found: dict[FileId, list[FileUse]], proc: str) -> None:
    """POSIX and OFD locks count as users; flock entries are the caller's own."""
    for lock in lock_entries(proc):
        if lock.kind != "FLOCK" and lock.file_id in wanted:
            found[lock.file_id].append(FileUse(lock.pid, "lock", "", False))


def flock_holders(fid: FileId, *, proc: str = "/proc") -> list[tuple[int, bool]]:
    """(pid, exclusive) for each flock on one inode, from /proc/locks."""
    return [(lock.pid, lock.exclusive) for lock in lock_entries(proc)
            if lock.kind == "FLOCK" and lock.file_id == fid]
