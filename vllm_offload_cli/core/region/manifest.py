"""The sidecar manifest: what the region's headerless bytes mean, written beside them
(atomically, mode 0600) by the creator; every opener adds itself to `attachments`. Updates
lock-then-verify: flock it, check that the name still names the locked inode (a writer may
have renamed another over it), write, rename."""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

from vllm_offload_cli.core.base import errors
from vllm_offload_cli.core.base.deadline import poll_until
from vllm_offload_cli.core.base.problems import Problem, jsonable
from vllm_offload_cli.core.region import fsguard, naming, page_policy
from vllm_offload_cli.core.region import untrusted_json as uj
from vllm_offload_cli.core.region.geometry import Geometry, layout_of
from vllm_offload_cli.core.system.files import FileId
from vllm_offload_cli.core.system.processes import ProcessRef

MANIFEST_VERSION = 1
# How its vLLM layout was decided: the vLLM in use's, the newest (no vLLM found), asked
LAYOUT_BASES = ("vllm", "newest", "requested")
MAX_BYTES = 1 << 20  # a manifest is small; anything bigger is not ours
# Two-phase creation: `creating` until the region is sized and pre-faulted.
CREATING, READY = "creating", "ready"
# written as they are; the rest of a manifest is grouped (region, creator) or nested
_TOP_LEVEL = ("engine_id", "base_engine_id", "dp_rank", "layout", "rank_source", "persistent",
              "state", "segments", "engine_token", "vllm_layout_basis")
T = TypeVar("T")


class ManifestError(errors.UnsafeRegionError):
    """The manifest is unreadable, not ours, or not valid."""

    code = "manifest_invalid"


@dataclass(frozen=True, kw_only=True)
class Attachment:
    pid: int
    start_ticks: int | None
    rank: int | None
    device_index: int | None = None
    rank_source: str | None = None
    host: str | None = None
    attached_at: float = 0.0
    engine_token: str | None = None  # shared by every process of one engine (engine hook)


@dataclass(frozen=True, kw_only=True)
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
    placement: dict[str, Any] | None = None  # optional: NUMA policy and huge pages asked for
    state: str = READY
    segments: int = 1  # files `.mmap`, `.mmap.1`, ... (vLLM's CPU spec splits big regions)
    engine_token: str | None = None  # the creating engine's token (engine hook), else None
    vllm_layout_basis: str | None = None  # one of LAYOUT_BASES; None in older manifests

    @property
    def complete(self) -> bool:
        """False while the creator has not finished: then it is no region to keep."""
        return self.state == READY

    def creator_alive(self) -> bool:
        """The very creator process (pid and start time, so a reused pid does not count)."""
        return ProcessRef(self.creator_pid, self.creator_start_ticks).alive()

    def live_attachments(self) -> tuple[Attachment, ...]:
        """Openers still running (pid and start time): a dead one's entry stays until pruned."""
        return tuple(a for a in self.attachments if ProcessRef(a.pid, a.start_ticks).alive())

    @property
    def vllm_layout(self) -> str:
        """Which vLLM can join it (geometry.SEGMENTED or SINGLE_FILE): its file count says."""
        return layout_of(self.segments)

    @property
    def base_engine_id(self) -> str:
        return naming.split_engine_id(self.engine_id).base_engine_id

    @property
    def dp_rank(self) -> int | None:
        return naming.split_engine_id(self.engine_id).dp_rank

    def to_json(self) -> dict[str, Any]:
        doc = {key: getattr(self, key) for key in _TOP_LEVEL}
        doc.update(manifest_version=MANIFEST_VERSION, geometry=jsonable(self.geometry),
                   region={"dev": self.region_dev, "ino": self.region_ino},
                   creator={"pid": self.creator_pid, "start_ticks": self.creator_start_ticks,
                            "host": self.creator_host, "created_at": self.created_at},
                   attachments=[asdict(a) for a in self.attachments])
        if self.placement is not None:
            doc["placement"] = self.placement
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> Manifest:
        """Type- and range-check every field (a manifest steers what we delete), raising
        UntrustedJsonError; unknown fields are ignored, for a later version's additions."""
        doc = uj.obj(doc, "manifest")
        version = uj.field(doc, "manifest_version", "manifest")
        if version != MANIFEST_VERSION or isinstance(version, bool):
            raise uj.UntrustedJsonError(f"unsupported manifest_version {version!r:.40}")
        engine_id = uj.string(uj.field(doc, "engine_id", "manifest"), "engine_id")
        if (problem := naming.engine_id_problem(engine_id)) is not None:
            raise uj.UntrustedJsonError(problem)
        region = uj.obj(uj.field(doc, "region", "manifest"), "region")
        creator = uj.obj(uj.field(doc, "creator", "manifest"), "creator")
        return cls(
            engine_id=engine_id,
            geometry=_geometry(uj.obj(uj.field(doc, "geometry", "manifest"), "geometry")),
            region_dev=uj.integer(uj.field(region, "dev", "region"), "region.dev", 0, _U64),
            region_ino=uj.integer(uj.field(region, "ino", "region"), "region.ino", 0, _U64),
            creator_pid=uj.integer(uj.field(creator, "pid", "creator"), "creator.pid", 1,
                                   _MAX_PID),
            creator_start_ticks=uj.opt_integer(creator.get("start_ticks"),
                                               "creator.start_ticks", 0, _U64),
            creator_host=uj.string(creator.get("host", ""), "creator.host"),
            created_at=uj.number(uj.field(creator, "created_at", "creator"),
                                 "creator.created_at", 0.0, _MAX_TIME),
            layout=uj.string(doc.get("layout", "worker"), "layout", 32),
            rank_source=uj.opt_string(doc.get("rank_source"), "rank_source", 64),
            persistent=uj.boolean(doc.get("persistent", False), "persistent"),
            state=_one_of(doc.get("state", READY), "state", (CREATING, READY)),
            segments=uj.integer(doc.get("segments", 1), "segments", 1, MAX_SEGMENTS),
            engine_token=uj.opt_string(doc.get("engine_token"), "engine_token", 64),
            vllm_layout_basis=_one_of(doc.get("vllm_layout_basis"), "vllm_layout_basis",
                                      (None, *LAYOUT_BASES)),
            placement=_placement(doc.get("placement")),
            attachments=tuple(
                _attachment(uj.obj(a, "attachment"))
                for a in uj.array(doc.get("attachments", []), "attachments", MAX_ATTACHMENTS)
            ),
        )


# Ranges a real manifest stays within; anything outside is not one we wrote.
_U64 = 2**64 - 1
_MAX_PID = 2**22  # the kernel's PID_MAX_LIMIT
_MAX_TIME = 2.0**33  # seconds since 1970: the year 2242
_MAX_ROWS = 2**40
_MAX_BYTES_PER_ROW = 2**40
_MAX_WORKERS = 2**16
MAX_ATTACHMENTS = 4096
MAX_SEGMENTS = 4096


def _one_of(value: Any, what: str, allowed: tuple[str | None, ...]) -> Any:
    if value not in allowed:
        raise uj.UntrustedJsonError(f"{what} must be one of {', '.join(filter(None, allowed))}")
    return value


def _placement(doc: Any) -> dict[str, Any] | None:
    """The optional NUMA policy and huge pages asked for (page_policy's words)."""
    if doc is None:
        return None
    doc = uj.obj(doc, "placement")
    nodes = uj.array(doc.get("numa_nodes", []), "placement.numa_nodes", page_policy.MASK_BITS)
    return {"numa_policy": _one_of(doc.get("numa_policy"), "placement.numa_policy",
                                   (None, *page_policy.NUMA_POLICIES)),
            "numa_nodes": [uj.integer(n, "placement.numa_nodes", 0, page_policy.MASK_BITS - 1)
                           for n in nodes],
            "huge_pages": _one_of(doc.get("huge_pages", "never"), "placement.huge_pages",
                                  page_policy.HUGE_PAGE_CHOICES),
            "huge_pages_advised": uj.boolean(doc.get("huge_pages_advised", False),
                                             "placement.huge_pages_advised")}


def _geometry(g: dict[str, Any]) -> Geometry:
    def size(key: str, hi: int) -> int:
        return uj.integer(uj.field(g, key, "geometry"), f"geometry.{key}", 1, hi)
    try:
        return Geometry(
            num_blocks=size("num_blocks", _MAX_ROWS),
            row_stride=size("row_stride", _MAX_BYTES_PER_ROW),
            cpu_page_size=size("cpu_page_size", _MAX_BYTES_PER_ROW),
            world_size=uj.opt_integer(g.get("world_size"), "geometry.world_size", 1, _MAX_WORKERS),
        )
    except errors.OffloadError as exc:
        raise uj.UntrustedJsonError(exc.message) from None


def _attachment(a: dict[str, Any]) -> Attachment:
    return Attachment(
        pid=uj.integer(uj.field(a, "pid", "attachment"), "attachment.pid", 1, _MAX_PID),
        start_ticks=uj.opt_integer(a.get("start_ticks"), "attachment.start_ticks", 0, _U64),
        rank=uj.opt_integer(a.get("rank"), "attachment.rank", 0, _MAX_WORKERS),
        device_index=uj.opt_integer(a.get("device_index"), "attachment.device_index", 0,
                                    _MAX_WORKERS),
        rank_source=uj.opt_string(a.get("rank_source"), "attachment.rank_source", 64),
        host=uj.opt_string(a.get("host"), "attachment.host"),
        attached_at=uj.number(a.get("attached_at", 0.0), "attachment.attached_at", 0.0,
                              _MAX_TIME),
        engine_token=uj.opt_string(a.get("engine_token"), "attachment.engine_token", 64),
    )


def read_fd(fd: int, path: str, *, allowed_uids: fsguard.AllowedUids = None,
            owner_uid: int | None = None, linked: bool = True) -> Manifest:
    """Parse a manifest open as `fd` (a caller may lock or unlink that very inode); with
    `owner_uid` (the region's owner) anyone else's is refused: it proves nothing."""
    st = os.fstat(fd)
    if owner_uid is not None and st.st_uid != owner_uid:
        raise ManifestError(
            f"manifest {path} is owned by uid {st.st_uid}, not by the region's owner uid "
            f"{owner_uid}; it is ignored (another user may have planted it)", path=path,
            code="manifest_foreign")
    if problems := fsguard.stat_problems(st, allowed_uids=allowed_uids, expect_linked=linked):
        raise ManifestError(f"manifest {path} {problems[0].message}", path=path,
                            code=f"manifest_{problems[0].code}")
    data = os.pread(fd, MAX_BYTES + 1, 0)  # never more, whatever the size says
    try:
        m = Manifest.from_json(uj.loads(data, max_bytes=MAX_BYTES))
        named = naming.parse_manifest_filename(os.path.basename(path))
        if named is not None and m.engine_id != named:
            raise uj.UntrustedJsonError(f"it records engine_id {m.engine_id!r}, not {named!r}")
    except (ValueError, TypeError) as exc:
        # not only UntrustedJsonError: no validator may crash on hostile input either
        raise ManifestError(
            f"manifest {path} is invalid ({str(exc)[:200]}); it is ignored. Remove it, or let "
            "`vllm-offload gc` do so once its region is gone", path=path,
        ) from None
    return m


def read(path: str, *, allowed_uids: fsguard.AllowedUids = None,
         owner_uid: int | None = None) -> Manifest:
    """Read and validate a manifest; RegionNotFoundError if absent, ManifestError if bad."""
    fd = fsguard.open_existing(path, os.O_RDONLY)
    try:
        return read_fd(fd, path, allowed_uids=allowed_uids, owner_uid=owner_uid)
    finally:
        os.close(fd)


def read_matching(path: str, file_id: FileId | None, *,
                  allowed_uids: fsguard.AllowedUids = None,
                  owner_uid: int | None = None,
                  ) -> tuple[Manifest | None, Problem | None]:
    """The manifest describing the file `file_id`, or the problem that stops us using it
    (then the region is judged as if it had none); (None, None) when there is none."""
    try:
        m = read(path, allowed_uids=allowed_uids, owner_uid=owner_uid)
    except errors.RegionNotFoundError:
        return None, None
    except ManifestError as exc:
        return None, Problem(exc.code, exc.message)
    except errors.OffloadError as exc:  # a symlink or someone else's file where ours should be
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
    payload = json.dumps(manifest.to_json(), indent=1, sort_keys=True,
                         allow_nan=False).encode() + b"\n"
    try:
        fd = fsguard.create_exclusive(tmp, os.O_WRONLY)
    except OSError as exc:
        raise errors.OperationFailedError(
            f"cannot write manifest beside {path}: {exc.strerror}", path=path) from exc
    try:
        with open(fd, "wb") as f:  # closes fd
            f.write(payload)
        os.rename(tmp, path)  # replaces a link itself, never its target
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise fsguard.no_space(path, exc) from None
        raise


def _locked(path: str, timeout: float, work: Callable[[int], T | None], doing: str) -> T:
    """`work(fd)` under LOCK_EX on the manifest named `path` now. A lock held elsewhere,
    or `work` returning None (the name was replaced), is retried until `timeout`, never
    waited for in the kernel: a stopped holder (a SIGSTOPped gc) cannot stall us."""
    def attempt() -> T | None:
        fd = fsguard.open_existing(path, os.O_RDONLY)
        try:
            return work(fd) if fsguard.try_lock(fd) else None
        finally:
            os.close(fd)
    if (done := poll_until(attempt, timeout)) is None:
        raise errors.RegionTimeoutError(f"gave up {doing} manifest {path} after {timeout:g} s: "
                                        "another process kept it locked (a stopped gc?)",
                                        path=path)
    return done


def update(path: str, change: Callable[[Manifest], Manifest],
           *, allowed_uids: fsguard.AllowedUids = None, timeout: float = 10.0) -> Manifest:
    """Read-modify-write under the lock-then-verify protocol described above."""
    def work(fd: int) -> Manifest | None:
        if not fsguard.same_file_at(path, fd):
            return None  # replaced by a concurrent writer: lock the new file
        new = change(read_fd(fd, path, allowed_uids=allowed_uids))
        write(path, new)
        return new
    return _locked(path, timeout, work, "updating")


def remove(path: str, *, timeout: float = 10.0) -> None:
    """Unlink under the same lock `update` takes, so no update resurrects it by rename."""
    def work(fd: int) -> bool | None:
        return fsguard.unlink_if_same(path, fd) or not os.path.lexists(path) or None
    try:
        _locked(path, timeout, work, "removing")
    except errors.RegionTimeoutError:
        raise
    except errors.OffloadError:
        pass  # already gone, or not a file we would ever have written


def attach(path: str, attachment: Attachment, *, ready: bool = False, **kw: Any) -> Manifest:
    """Record an opener; one entry per (pid, rank). `ready`: the creator finished."""
    key = (attachment.pid, attachment.rank)

    def add(m: Manifest) -> Manifest:
        kept = tuple(a for a in m.attachments if (a.pid, a.rank) != key)
        return replace(m, attachments=(*kept, attachment), state=READY if ready else m.state)
    return update(path, add, **kw)


def detach(path: str, pid: int, rank: int | None, **kw: Any) -> Manifest:
    return update(path, lambda m: replace(m, attachments=tuple(
        a for a in m.attachments if (a.pid, a.rank) != (pid, rank))), **kw)

