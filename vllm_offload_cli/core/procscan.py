"""Who uses which region: /proc/*/maps, /proc/*/fd and /proc/locks.

Matching is by (device, inode), so a region is found even after its name was
unlinked (newer vLLM unlinks once all workers mapped it) and a process using
a same-named newer file is not confused with one using the old one.
Processes that vanish mid-scan are skipped; those that deny access are
counted, so callers can say "N processes could not be inspected".
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from vllm_offload_cli.core.fsguard import FileId
from vllm_offload_cli.core.naming import PREFIX

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
    denied: int = 0

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


def _scan_maps(pid: int, needle: bytes, shm_dev: int, scan: ProcessScan) -> None:
    with open(f"/proc/{pid}/maps", "rb") as f:
        data = f.read()
    if needle not in data:
        return
    spans: dict[tuple[FileId, str], int] = {}
    for raw in data.splitlines():
        if needle not in raw:
            continue
        parts = raw.decode("utf-8", "surrogateescape").split(maxsplit=5)
        if len(parts) < 6:
            continue
        addr, _perms, offset, dev, inode, path = parts
        try:
            fid = FileId(_parse_dev(dev), int(inode))
        except ValueError:
            continue
        if fid.dev != shm_dev:
            continue
        start, end = (int(x, 16) for x in addr.split("-"))
        key = (fid, path)
        spans[key] = max(spans.get(key, 0), int(offset, 16) + end - start)
    for (fid, shown), extent in spans.items():
        path, deleted = _strip_deleted(shown)
        scan.uses[fid].append(FileUse(pid, "map", path, deleted, extent))


def _scan_fds(pid: int, prefix: str, scan: ProcessScan) -> None:
    fd_dir = f"/proc/{pid}/fd"
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue
        if not target.startswith(prefix):
            continue
        try:
            st = os.stat(f"{fd_dir}/{name}")
        except OSError:
            continue
        path, deleted = _strip_deleted(target)
        scan.uses[FileId.of(st)].append(
            FileUse(pid, "fd", path, deleted, st.st_size, int(name)))


def _scan_locks(scan: ProcessScan, shm_dev: int) -> None:
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return
    for line in text.splitlines():
        fields = line.split()
        if "->" in fields:  # a waiter, not a holder
            continue
        if len(fields) < 8 or fields[1] not in ("FLOCK", "POSIX", "OFDLCK"):
            continue
        try:
            pid = int(fields[4])
            major, minor, inode = fields[5].split(":")
            fid = FileId(os.makedev(int(major, 16), int(minor, 16)), int(inode))
        except ValueError:
            continue
        if fid.dev == shm_dev:
            scan.uses[fid].append(FileUse(pid, "lock", "", False))


def scan_processes(shm_dir: str | Path) -> ProcessScan:
    """Every use of a region-named file on shm_dir's filesystem, by any process."""
    shm_dir = os.path.realpath(shm_dir)
    shm_dev = os.stat(shm_dir).st_dev
    prefix = os.path.join(shm_dir, PREFIX)
    needle = prefix.encode()
    scan = ProcessScan()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        denied = False
        try:
            _scan_maps(pid, needle, shm_dev, scan)
        except (FileNotFoundError, ProcessLookupError):
            continue
        except PermissionError:
            denied = True
        except OSError:
            continue
        try:
            _scan_fds(pid, prefix, scan)
        except (FileNotFoundError, ProcessLookupError):
            continue
        except PermissionError:
            denied = True
        except OSError:
            continue
        scan.scanned += 1
        scan.denied += denied
    _scan_locks(scan, shm_dev)
    return scan
