"""The sidecar manifest: what the region's bytes mean, written beside them.

vLLM's region has no header, so nobody outside the engine can tell its
geometry or who is attached. The creator writes this JSON file next to the
region (atomically, mode 0600); every opener adds itself to `attachments`.

Concurrent updates use a lock-then-verify protocol: flock the manifest, check
that its name still points at the locked inode (a writer may have replaced it
by rename meanwhile), then write a new file and rename it into place.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from vllm_offload_cli.core.base.errors import (
    OffloadError,
    OperationFailedError,
    RegionNotFoundError,
    UnsafeRegionError,
)
from vllm_offload_cli.core.base.problems import Problem
from vllm_offload_cli.core.region import fsguard
from vllm_offload_cli.core.region.geometry import Geometry
from vllm_offload_cli.core.region.naming import split_engine_id

MANIFEST_VERSION = 1
_MAX_BYTES = 1 << 20  # a manifest is small; anything bigger is not ours


class ManifestError(UnsafeRegionError):
    """The manifest is unreadable, not ours, or not valid."""

    code = "manifest_corrupt"


@dataclass(frozen=True)
class Attachment:
    pid: int
    start_ticks: int | None
    rank: int | None
    device_index: int | None = None
    rank_source: str | None = None
    host: str | None = None
    attached_at: float = 0.0
    engine_token: str | None = None  # shared by every process of one engine (engine hook)


@dataclass(frozen=True)
class Manifest:
    engine_id: str
    geometry: Geometry
    region_dev: int
    region_ino: int
    creator_pid: int
    creator_start_ticks: int | None
    creator_host: str
    created_at: float
    layout: str = "worker"
    rank_source: str | None = None
    persistent: bool = False
    attachments: tuple[Attachment, ...] = field(default_factory=tuple)
    segments: int = 1  # files `.mmap`, `.mmap.1`, ... (vLLM's CPU spec splits big regions)
    engine_token: str | None = None  # the creating engine's token (engine hook), else None

    @property
    def base_engine_id(self) -> str:
        return split_engine_id(self.engine_id).base_engine_id

    @property
    def dp_rank(self) -> int | None:
        return split_engine_id(self.engine_id).dp_rank

    def to_json(self) -> dict[str, Any]:
        return {
            "manifest_version": MANIFEST_VERSION,
            "engine_id": self.engine_id,
            "base_engine_id": self.base_engine_id,
            "dp_rank": self.dp_rank,
            "geometry": self.geometry.to_dict(),
            "layout": self.layout,
            "rank_source": self.rank_source,
            "persistent": self.persistent,
            "region": {"dev": self.region_dev, "ino": self.region_ino},
            "creator": {
                "pid": self.creator_pid,
                "start_ticks": self.creator_start_ticks,
                "host": self.creator_host,
                "created_at": self.created_at,
            },
            "attachments": [asdict(a) for a in self.attachments],
            "segments": self.segments,
            "engine_token": self.engine_token,
        }

    @classmethod
    def from_json(cls, doc: Any) -> Manifest:
        """Validate strictly: a manifest steers what we delete and how we read bytes."""
        try:
            if doc["manifest_version"] != MANIFEST_VERSION:
                raise ValueError(f"unsupported manifest_version {doc['manifest_version']!r}")
            g = doc["geometry"]
            creator = doc["creator"]
            attachments = tuple(
                Attachment(
                    pid=_int(a["pid"]), start_ticks=_opt_int(a.get("start_ticks")),
                    rank=_opt_int(a.get("rank")), device_index=_opt_int(a.get("device_index")),
                    rank_source=_opt_str(a.get("rank_source")), host=_opt_str(a.get("host")),
                    attached_at=float(a.get("attached_at", 0.0)),
                    engine_token=_opt_str(a.get("engine_token")),
                )
                for a in doc.get("attachments", [])
            )
            return cls(
                engine_id=str(doc["engine_id"]),
                geometry=Geometry(_int(g["num_blocks"]), _int(g["row_stride"]),
                                  _int(g["cpu_page_size"]), _opt_int(g.get("world_size"))),
                region_dev=_int(doc["region"]["dev"]),
                region_ino=_int(doc["region"]["ino"]),
                creator_pid=_int(creator["pid"]),
                creator_start_ticks=_opt_int(creator.get("start_ticks")),
                creator_host=str(creator.get("host", "")),
                created_at=float(creator["created_at"]),
                layout=str(doc.get("layout", "worker")),
                rank_source=_opt_str(doc.get("rank_source")),
                persistent=bool(doc.get("persistent", False)),
                attachments=attachments,
                segments=_segments(doc.get("segments", 1)),
                engine_token=_opt_str(doc.get("engine_token")),
            )
        except OffloadError as exc:
            raise ValueError(exc.message) from exc
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"missing or malformed field {exc}") from exc


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _segments(value: Any) -> int:
    if _int(value) < 1 or value > 4096:
        raise ValueError(f"segments {value!r} is out of range")
    return int(value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else _int(value)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _parse(fd: int, path: str, allowed_uids: Collection[int] | None) -> Manifest:
    st = os.fstat(fd)
    problems = fsguard.stat_problems(st, allowed_uids=allowed_uids)
    if problems:
        raise ManifestError(f"manifest {path} {problems[0].message}", path=path,
                            code=problems[0].code)
    if st.st_size > _MAX_BYTES:
        raise ManifestError(f"manifest {path} is {st.st_size} bytes, too large to be ours",
                            path=path)
    data = os.pread(fd, _MAX_BYTES, 0)
    try:
        return Manifest.from_json(json.loads(data))
    except ValueError as exc:
        raise ManifestError(
            f"manifest {path} is corrupt ({exc}); remove it, or let `vllm-offload gc` do so "
            "once its region is gone", path=path,
        ) from None


def read(path: str, *, allowed_uids: Collection[int] | None = None) -> Manifest:
    """Read and validate a manifest; RegionNotFoundError if absent, ManifestError if bad."""
    fd = fsguard.open_existing(path, os.O_RDONLY)
    try:
        return _parse(fd, path, allowed_uids)
    finally:
        os.close(fd)


def read_fd(fd: int, path: str, *, allowed_uids: Collection[int] | None = None) -> Manifest:
    """Parse a manifest already open as `fd`: a caller that also wants to lock
    or later unlink that very inode reads it through the same descriptor."""
    return _parse(fd, path, allowed_uids)


def read_matching(path: str, file_id: fsguard.FileId | None, *,
                  allowed_uids: Collection[int] | None = None
                  ) -> tuple[Manifest | None, Problem | None]:
    """The manifest describing the file `file_id`, or the problem that stops us using it.

    (None, None) when there is no manifest (a region made by vLLM). A manifest
    left from an earlier file of the same name is never trusted.
    """
    try:
        m = read(path, allowed_uids=allowed_uids)
    except RegionNotFoundError:
        return None, None
    except ManifestError as exc:
        return None, Problem("manifest_corrupt", exc.message)
    except OffloadError as exc:  # a symlink or someone else's file where ours should be
        return None, Problem(f"manifest_{exc.code}", f"manifest: {exc.message}")
    except OSError as exc:
        return None, Problem("manifest_unreadable", f"manifest {path}: {exc.strerror}")
    if file_id is None or (m.region_dev, m.region_ino) != (file_id.dev, file_id.ino):
        return None, Problem("manifest_mismatch",
                             f"manifest {path} describes an earlier file with this name; "
                             "its geometry is ignored")
    return m, None


def write(path: str, manifest: Manifest) -> None:
    """Write atomically: a fresh 0600 file beside the target, then rename over it."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.tmp.{os.getpid()}.{os.urandom(4).hex()}")
    payload = json.dumps(manifest.to_json(), indent=1, sort_keys=True).encode() + b"\n"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError as exc:
        raise OperationFailedError(f"cannot write manifest beside {path}: {exc.strerror}",
                                   path=path) from exc
    try:
        try:
            os.write(fd, payload)
        finally:
            os.close(fd)
        os.rename(tmp, path)  # replaces a link itself, never its target
    except BaseException:
        _silent_unlink(tmp)
        raise


def update(path: str, change: Callable[[Manifest], Manifest],
           *, allowed_uids: Collection[int] | None = None, timeout: float = 10.0) -> Manifest:
    """Read-modify-write under the lock-then-verify protocol described above."""
    deadline = time.monotonic() + timeout
    while True:
        fd = fsguard.open_existing(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if fsguard.same_file_at(path, fd):
                new = change(_parse(fd, path, allowed_uids))
                write(path, new)
                return new
        finally:
            os.close(fd)
        # replaced by a concurrent writer while we waited: lock the new file
        if time.monotonic() > deadline:
            raise OperationFailedError(f"gave up updating manifest {path}", path=path)


def remove(path: str, *, timeout: float = 10.0) -> None:
    """Unlink under the same lock `update` takes, so no update resurrects it by rename."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = fsguard.open_existing(path, os.O_RDONLY)
        except OffloadError:
            return  # already gone, or not a file we would ever have written
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if fsguard.unlink_if_same(path, fd) or not os.path.lexists(path):
                return
        finally:
            os.close(fd)
        if time.monotonic() > deadline:
            raise OperationFailedError(f"gave up removing manifest {path}", path=path)


def attach(path: str, attachment: Attachment, **kw: Any) -> Manifest:
    """Record an opener; one entry per (pid, rank)."""
    key = (attachment.pid, attachment.rank)

    def add(m: Manifest) -> Manifest:
        kept = tuple(a for a in m.attachments if (a.pid, a.rank) != key)
        return replace(m, attachments=(*kept, attachment))
    return update(path, add, **kw)


def detach(path: str, pid: int, rank: int | None, **kw: Any) -> Manifest:
    def remove(m: Manifest) -> Manifest:
        return replace(m, attachments=tuple(a for a in m.attachments
                                            if (a.pid, a.rank) != (pid, rank)))
    return update(path, remove, **kw)


def _silent_unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
