"""A released region's manifest, carried by its holders: each keeps a sealed memfd named
after the region's device and inode, freed by the kernel with its process (SIGKILL too), so
inspect, verify and gc find it by inode once the names are gone. Read trusting nothing: only
a holder's memfd of that exact name, owned by the region's owner, mode 0600, bounded,
validated, describing that very inode."""

from __future__ import annotations

import fcntl
import json
import os
import re
from collections.abc import Iterable
from dataclasses import replace

from vllm_offload_cli.core.base import deadline
from vllm_offload_cli.core.base.errors import OffloadError
from vllm_offload_cli.core.region import fsguard
from vllm_offload_cli.core.region import manifest as manifest_io
from vllm_offload_cli.core.region.manifest import Manifest
from vllm_offload_cli.core.system import procfs
from vllm_offload_cli.core.system.files import FileId, open_proc_link

PREFIX = "vllm-offload-manifest-"
_TARGET = re.compile(r"/memfd:" + PREFIX + r"(\d+)-(\d+)(?: \(deleted\))?")


def carry(m: Manifest) -> int | None:
    """This process's sealed copy of the manifest `m` (None where no memfd can be made),
    to keep open while holding the region."""
    if not hasattr(os, "memfd_create"):
        return None
    data = json.dumps(m.to_json(), sort_keys=True, allow_nan=False).encode()
    try:
        fd = os.memfd_create(f"{PREFIX}{m.region_dev}-{m.region_ino}",
                             os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:
        return None
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK  # immutable
                    | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    except OSError:
        os.close(fd)
        return None
    return fd


def carried_by(pids: Iterable[int], region: FileId, owner_uid: int | None,
               memfds: dict[int, dict[tuple[int, int], int] | None] | None = None
               ) -> Manifest | None:
    """The manifest of `region` that its holders `pids` carry, their attachments merged;
    None when none carries a valid one. `memfds` caches, per pid, which descriptor carries
    which region's manifest, so a holder's descriptors are read once per run."""
    if owner_uid is None:
        return None
    cache: dict[int, dict[tuple[int, int], int] | None] = {} if memfds is None else memfds
    found: list[Manifest] = []
    for pid in sorted(set(pids)):
        deadline.check("reading the manifests holders carry")
        if pid not in cache:
            cache[pid] = _memfds(pid)
        if (m := _carried(pid, cache[pid], region, owner_uid)) is not None:
            found.append(m)
    if not found:
        return None
    attachments = {(a.pid, a.start_ticks, a.rank): a for m in found for a in m.attachments}
    return replace(found[0], attachments=tuple(sorted(
        attachments.values(), key=lambda a: (a.attached_at, a.pid))))


def _memfds(pid: int) -> dict[tuple[int, int], int] | None:
    """(region dev, ino) -> descriptor of each manifest memfd a process carries."""
    if isinstance(links := procfs.fd_links(pid), procfs.Unreadable):
        return None
    found: dict[tuple[int, int], int] = {}
    for fd_number, target in links:
        if (named := _TARGET.fullmatch(target)) is not None:
            found.setdefault((int(named.group(1)), int(named.group(2))), fd_number)
    return found


def _carried(pid: int, memfds: dict[tuple[int, int], int] | None, region: FileId,
             owner_uid: int) -> Manifest | None:
    fd_number = None if memfds is None else memfds.get((region.dev, region.ino))
    if fd_number is None:
        return None
    if (fd := open_proc_link(procfs.fd_link(pid, fd_number))) is None:
        return None
    try:  # validated as any manifest (a memfd has no link)
        m = manifest_io.read_fd(fd, f"memfd of pid {pid}", allowed_uids=fsguard.EVERY_UID,
                                owner_uid=owner_uid, linked=False)
    except (OSError, OffloadError):
        return None
    finally:
        os.close(fd)
    return m if (m.region_dev, m.region_ino) == (region.dev, region.ino) else None
