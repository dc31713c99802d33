"""Find every region in a shm directory and say what state it is in.

A region is found by name (`vllm_offload_{id}.mmap`, segments `.mmap.N`) or, once its
name is unlinked, through the processes that still map or hold it open. Nothing here
writes, and nothing imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import heapq
import operator
import os
import stat
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from vllm_offload_cli.core.base import deadline, errors
from vllm_offload_cli.core.base.problems import Problem, jsonable
from vllm_offload_cli.core.base.text import pids_text
from vllm_offload_cli.core.host import residency, visibility
from vllm_offload_cli.core.host.procscan import FileUse, ProcessScan, scan_processes
from vllm_offload_cli.core.host.visibility import Visibility
from vllm_offload_cli.core.region import carried, fsguard, naming
from vllm_offload_cli.core.region import manifest as manifest_io
from vllm_offload_cli.core.region.capacity import ShmUsage, shm_usage
from vllm_offload_cli.core.region.geometry import Geometry
from vllm_offload_cli.core.region.manifest import Manifest
from vllm_offload_cli.core.region.naming import manifest_path, parse_region_filename
from vllm_offload_cli.core.system import procfs
from vllm_offload_cli.core.system.files import FileId, open_proc_link, stat_proc_link
from vllm_offload_cli.core.system.processes import comm

LIVE, PERSISTENT, STALE, CREATING, UNKNOWN = "live", "persistent", "stale", "creating", "unknown"


@dataclass(frozen=True, kw_only=True)
class Holder:
    """A process using a region; `rank` comes from the manifest when it knows."""

    pid: int
    name: str | None
    rank: int | None
    via: tuple[str, ...]  # "map", "fd", "lock"


@dataclass(frozen=True, kw_only=True)
class SegmentFile:
    """One file of a region: the bare name (segment 0) or `.mmap.N`."""

    path: str
    segment: int
    file_id: FileId | None  # None when not a regular file we could stat safely
    size_bytes: int
    uid: int | None
    mode: int | None = None
    mtime: float | None = None
    resident_bytes: int | None = None
    problems: tuple[Problem, ...] = ()
    resident_error: str | None = None  # why resident_bytes is None: a refusal ("mincore: ...")
    allocated_bytes: int | None = None  # st_blocks: what removing it gives back, as gc counts
    # the kernel's answer to "open anywhere else?", asked only when /proc may miss a holder
    sole_opener: fsguard.OpenersVerdict | None = None


@dataclass(frozen=True, kw_only=True)
class RegionInfo:
    engine_id: str
    base_engine_id: str
    dp_rank: int | None
    segments: tuple[SegmentFile, ...]
    linked: bool
    size_bytes: int
    resident_bytes: int | None
    uid: int | None
    mode: str | None
    age_seconds: float | None
    geometry: Geometry | None
    manifest: Manifest | None
    manifest_path: str | None
    holders: tuple[Holder, ...]
    locked: bool  # an exclusive flock could not be taken
    state: str
    problems: tuple[Problem, ...]

    @property
    def paths(self) -> list[str]:
        return [s.path for s in self.segments]

    @property
    def resident_error(self) -> str | None:
        """Why residency is unknown when a system call was refused ("mincore: ...")."""
        return next((s.resident_error for s in self.segments if s.resident_error), None)

    @property
    def allocated_bytes(self) -> int:
        """The tmpfs memory its files hold (st_blocks): what removing it gives back."""
        return sum(s.allocated_bytes or 0 for s in self.segments)

    @property
    def persistent(self) -> bool:
        """Pre-provisioned and finished: a create killed half-way provisioned nothing."""
        return self.manifest is not None and self.manifest.persistent and self.manifest.complete

    def to_dict(self) -> dict[str, object]:
        return {
            "engine_id": self.engine_id,
            "kind": naming.region_kind(self.engine_id),
            "base_engine_id": self.base_engine_id,
            "dp_rank": self.dp_rank,
            "paths": self.paths,
            "linked": self.linked,
            "size_bytes": self.size_bytes,
            "resident_bytes": self.resident_bytes,
            "uid": self.uid,
            "mode": self.mode,
            "age_seconds": None if self.age_seconds is None else round(self.age_seconds, 3),
            "geometry": jsonable(self.geometry),
            "manifest": self.manifest_path,
            "holders": jsonable(self.holders),
            "state": self.state,
            "persistent": self.persistent,
            "problems": [p.to_dict() for p in self.problems],
        }


@dataclass(frozen=True, kw_only=True)
class OrphanManifest:
    engine_id: str
    path: str
    file_id: FileId
    uid: int


@dataclass(frozen=True, kw_only=True)
class Tally:
    """Region-named files of one owner that a run counted instead of listing."""

    uid: int
    files: int
    size_bytes: int  # apparent sizes: what their owners set
    allocated_bytes: int  # what they hold in memory (st_blocks)


@dataclass(frozen=True, kw_only=True)
class Inventory:
    shm_dir: str
    regions: tuple[RegionInfo, ...]
    orphan_manifests: tuple[OrphanManifest, ...]
    shm: ShmUsage
    uninspectable_processes: int
    visibility: Visibility = field(default_factory=lambda: Visibility((), ()))
    not_judged: tuple[Tally, ...] = ()  # judgeable, but out of time or past JUDGED_OTHERS
    counted: tuple[Tally, ...] = ()  # of owners not judged, past the first LISTED_UNJUDGED
    listed_all: bool = True  # False: the deadline came before the directory was listed
    maybe_temp_files: bool = True  # False: a finished listing saw no manifest temporary
    # (pid, files): shm files a process holds past procscan.NAMED_PER_PROCESS, counted
    unnamed_held: tuple[tuple[int, int], ...] = ()

    def find(self, engine_id: str) -> list[RegionInfo]:
        return [r for r in self.regions if r.engine_id == engine_id]


# A run's cost is set by the caller's own files, never by what others pile up: of other
# users' files it judges the largest JUDGED_OTHERS, of owners it does not judge it lists
# the first LISTED_UNJUDGED (lstat alone); the rest are counted per owner. A segment past
# MAX_SEGMENT (vLLM makes at most 32) is counted, never grouped.
JUDGED_OTHERS = 4096
LISTED_UNJUDGED = 256
MAX_SEGMENT = 64

_TEMP_PREFIX = "." + naming.PREFIX  # manifest.write()'s temporary files
# (segment, path, lstat) of one file
_Entry = tuple[int, str, os.stat_result]


class Counts(dict[int, tuple[int, int, int]]):
    """Per-owner counts (files, size, allocated) of files a run left out of its list."""

    def add_file(self, uid: int, size: int = 0, allocated: int = 0, files: int = 1) -> None:
        had = self.get(uid, (0, 0, 0))
        self[uid] = (had[0] + files, had[1] + size, had[2] + allocated)

    def add(self, *stats: os.stat_result) -> None:
        for st in stats:
            self.add_file(st.st_uid, st.st_size, st.st_blocks * 512)

    def add_region(self, r: RegionInfo) -> None:
        for s in r.segments:
            if s.uid is not None:
                self.add_file(s.uid, s.size_bytes, s.allocated_bytes or 0)

    def tallies(self) -> tuple[Tally, ...]:
        return tuple(Tally(uid=uid, files=c[0], size_bytes=c[1], allocated_bytes=c[2])
                     for uid, c in sorted(self.items()))


@dataclass
class _Listing:
    """Region files by engine_id: judged ones (opened), and others seen by lstat only."""

    judge_uids: fsguard.AllowedUids = None
    judged: dict[str, list[_Entry]] = field(default_factory=lambda: defaultdict(list))
    unjudged: dict[str, list[_Entry]] = field(default_factory=lambda: defaultdict(list))
    manifests: dict[str, str] = field(default_factory=dict)
    not_judged: Counts = field(default_factory=Counts)
    counted: Counts = field(default_factory=Counts)
    overflow: bool = False  # some judged files were left out: complete their regions
    complete: bool = True  # False: the deadline came before the listing ended
    temps: bool = True  # a manifest temporary's name was seen (unknown until listed)
    # other users' files to judge, a heap of the largest: (st_blocks, n, engine_id, entry)
    others: list[tuple[int, int, str, _Entry]] = field(default_factory=list)
    listed: int = 0  # files listed from lstat alone
    me: int = field(default_factory=os.geteuid)

    def file(self, n: int, engine_id: str, entry: _Entry) -> None:
        """Judged (ours, or among the largest of others'), listed from lstat, or counted."""
        st, me = entry[2], self.me
        if entry[0] > MAX_SEGMENT:
            self.not_judged.add(st)
        elif st.st_uid == me and fsguard.uid_allowed(me, self.judge_uids):
            self.judged[engine_id].append(entry)
        elif fsguard.uid_allowed(st.st_uid, self.judge_uids):
            item = (st.st_blocks, n, engine_id, entry)
            if len(self.others) < JUDGED_OTHERS:
                heapq.heappush(self.others, item)
            else:
                self.overflow = True
                self.not_judged.add(heapq.heappushpop(self.others, item)[3][2])
        elif self.listed < LISTED_UNJUDGED:
            self.listed += 1
            self.unjudged[engine_id].append(entry)
        else:
            self.counted.add(st)


def _list_dir(shm_dir: str, wanted: Collection[str] | None, judge_uids: fsguard.AllowedUids,
              partial: bool = False) -> _Listing:
    """One pass over the directory, one lstat per region-named file, nothing opened:
    memory is bounded by the caller's own files plus a fixed number of others."""
    # None is "the caller alone": resolved once here, not by a geteuid per listed file
    listing = _Listing(judge_uids=(os.geteuid(),) if judge_uids is None else judge_uids,
                       temps=False)
    with os.scandir(shm_dir) as it:
        for n, entry in enumerate(it):
            if not n % 4096 and deadline.expired():
                if not partial:
                    deadline.check("listing the shm directory")
                listing.complete = False
                break
            if not entry.name.startswith(naming.PREFIX):  # most of a busy /dev/shm: no regex
                listing.temps = listing.temps or entry.name.startswith(_TEMP_PREFIX)
                continue
            parsed = parse_region_filename(entry.name)
            engine_id = (naming.parse_manifest_filename(entry.name) if parsed is None
                         else parsed.engine_id)
            if engine_id is None or (wanted is not None and engine_id not in wanted):
                continue
            if parsed is None:
                listing.manifests[engine_id] = entry.path
                if len(listing.manifests) > 4 * JUDGED_OTHERS:
                    listing.manifests.pop(engine_id)  # looked up by name if needed
                continue
            with contextlib.suppress(FileNotFoundError):  # removed since the listing
                listing.file(n, engine_id, (parsed.segment, entry.path,
                                            entry.stat(follow_symlinks=False)))
    for _, _, engine_id, judged in listing.others:
        listing.judged[engine_id].append(judged)
    if listing.overflow:
        _complete(listing, shm_dir)
    return listing


def _complete(listing: _Listing, shm_dir: str) -> None:
    """Segments of a judged region that the bound left out, found by name: a region
    is judged whole or not at all."""
    for engine_id, entries in listing.judged.items():
        uid = entries[0][2].st_uid
        entries += [e for e in _by_name(shm_dir, engine_id, {e[0] for e in entries})
                    if e[2].st_uid == uid]


def _by_name(shm_dir: str, engine_id: str, have: Collection[int] | None = None
             ) -> list[_Entry]:
    """A region's files looked up by name, not listed: every possible segment, or (given
    those it `have`s) up to the first one missing."""
    base = str(naming.region_path(shm_dir, engine_id))
    found: list[_Entry] = []
    for segment in range(MAX_SEGMENT + 1):
        path = base if segment == 0 else f"{base}.{segment}"
        if have is not None and segment in have:
            continue
        try:
            found.append((segment, path, os.stat(path, follow_symlinks=False)))
        except FileNotFoundError:
            if segment and have is not None:
                break
    return found


def _order(engine_id: str, entries: list[_Entry]) -> tuple[int, int, str]:
    """The caller's own regions first, then the largest (in memory): what serves the
    host best when a run cannot judge everything."""
    me = os.geteuid()
    own = all(st.st_uid == me for _, _, st in entries)
    return (0 if own else 1, -sum(st.st_blocks for _, _, st in entries), engine_id)


@dataclass
class _Run:
    """What judging a region needs from the run that judges it."""

    shm: str
    scan: ProcessScan
    vis: Visibility = field(default_factory=lambda: Visibility((), ()))
    allowed_uids: fsguard.AllowedUids = field(default_factory=fsguard.inspection_uids)
    measure: bool = False  # residency
    listing: _Listing = field(default_factory=_Listing)
    now: float = field(default_factory=time.time)
    lease_wait: fsguard.LeaseWait = field(default_factory=fsguard.LeaseWait)  # one for all opens
    linked: set[FileId] = field(default_factory=set)  # files judged by name
    memfds: dict[int, dict[tuple[int, int], int] | None] = field(default_factory=dict)
    # a process's name, read once per run however many regions it holds
    name_of: Callable[[int], str | None] = field(default_factory=lambda: functools.cache(comm))


def _from_stat(path: str, segment: int, st: os.stat_result, problems: Iterable[Problem] = (),
               resident: tuple[int | None, str | None] = (None, None),
               sole_opener: fsguard.OpenersVerdict | None = None) -> SegmentFile:
    """A linked file as its stat shows it. `mtime` is its ctime: an owner can set mtime
    (a future one would make a leftover look young for ever), nobody can set ctime."""
    regular = stat.S_ISREG(st.st_mode)
    return SegmentFile(path=path, segment=segment, file_id=FileId.of(st) if regular else None,
                       size_bytes=st.st_size if regular else 0, uid=st.st_uid,
                       allocated_bytes=st.st_blocks * 512 if regular else None,
                       mode=stat.S_IMODE(st.st_mode), mtime=st.st_ctime, resident_bytes=resident[0],
                       resident_error=resident[1], problems=tuple(problems),
                       sole_opener=sole_opener)


def _inspect_file(path: str, segment: int, run: _Run) -> tuple[SegmentFile, bool]:
    """lstat, open without following, fstat, residency and a lock probe: (file, locked)."""
    lst = os.stat(path, follow_symlinks=False)  # FileNotFoundError: vanished, caller skips
    if not stat.S_ISREG(lst.st_mode):
        return _from_stat(path, segment, lst, fsguard.stat_problems(
            lst, allowed_uids=run.allowed_uids)), False
    # another user's lease is held by a process that has the file open: it is in use,
    # and answering at once is the same answer; only our own files share the wait
    wait = run.lease_wait if lst.st_uid == os.geteuid() else fsguard.LeaseWait(0.0)
    try:
        fd = fsguard.open_existing(path, os.O_RDONLY, lease_wait=wait)
    except errors.RegionNotFoundError:
        raise FileNotFoundError(path) from None
    except errors.RegionBusyError:  # a long-held lease: someone is at it; not stale
        return _from_stat(path, segment, lst), True
    except (errors.OffloadError, OSError):  # refused or unsafe; a bug is not "unreadable"
        return _from_stat(path, segment, lst, fsguard.stat_problems(
            lst, allowed_uids=run.allowed_uids) or [
            Problem("unreadable", "cannot be opened by this user")]), False
    try:
        st = os.fstat(fd)
        if FileId.of(st) != FileId.of(lst):
            raise FileNotFoundError(path)  # replaced between lstat and open: rescan later
        resident = _resident(fd, st) if run.measure else (None, None)
        locked = not fsguard.try_lock(fd)
        # ask the kernel only where /proc may have missed a holder and saw none
        probe = (not locked and not run.vis.blind and not run.scan.uses.get(FileId.of(st))
                 and bool(run.vis.could_hide(st.st_uid, st.st_mode)))
        return _from_stat(path, segment, st, fsguard.stat_problems(
            st, allowed_uids=run.allowed_uids), resident,
            fsguard.probe(fd, retry=fsguard.QUICK_RETRY) if probe else None), locked
    finally:
        os.close(fd)  # also drops the probe lock


def _resident(fd: int, st: os.stat_result | None = None) -> tuple[int | None, str | None]:
    """(resident bytes, None), or (None, why) when the system call was refused; (None,
    None) where the file cannot be measured (no mmap on it, no memory to map it)."""
    try:
        return residency.resident_bytes(fd, st), None
    except OSError as exc:
        if residency.refused(exc):
            return None, exc.strerror or str(exc)
        if exc.errno in (errno.ENODEV, errno.EINVAL, errno.ENOMEM):
            return None, None
        raise


def holders_of(uses: Iterable[FileUse], manifest: Manifest | None = None,
               name: Callable[[int], str | None] = comm) -> tuple[Holder, ...]:
    """One Holder per process, with its rank when the manifest records it."""
    kinds: dict[int, set[str]] = defaultdict(set)
    for use in uses:
        kinds[use.pid].add(use.kind)
    ranks = {} if manifest is None else {a.pid: a.rank for a in manifest.live_attachments()}
    return tuple(Holder(pid=pid, name=name(pid), rank=ranks.get(pid),
                        via=tuple(sorted(kinds[pid]))) for pid in sorted(kinds))


def _deleted_only(scan: ProcessScan, linked_ids: set[FileId], shm_dir: str
                  ) -> dict[str, dict[FileId, list[FileUse]]]:
    """Regions known only from /proc: unlinked names still mapped or open, in shm_dir
    by (device, inode), whatever mount path the holder opened it by."""
    found: dict[str, dict[FileId, list[FileUse]]] = defaultdict(dict)
    want = _dir_id(shm_dir)
    same_dir = functools.cache(
        lambda d: d == shm_dir or (want is not None and _dir_id(d) == want))
    for fid, uses in scan.uses.items():
        named = [u for u in uses if u.path]  # none: only a lock entry, no name to go by
        # none deleted: still linked, a name this run counted rather than listed
        if fid in linked_ids or not any(u.deleted for u in named):
            continue
        directory, name = os.path.split(named[0].path)
        parsed = parse_region_filename(name)
        if parsed is not None and same_dir(directory):
            found[parsed.engine_id][fid] = uses
    return found


def _dir_id(path: str) -> FileId | None:
    try:
        return FileId.of(os.stat(path))
    except (OSError, ValueError):  # not there from our mount namespace
        return None


def discover(
    shm_dir: str | os.PathLike[str],
    *,
    engine_ids: Collection[str] | None = None,
    measure_residency: bool = True,
    shm_private_to_namespace: bool = False,
    judge_uids: fsguard.AllowedUids = None,
    judge_until: float | None = None,
    partial: bool = False,
    only: visibility.MayOpen | None = None,
) -> Inventory:
    """Every region in shm_dir (or only `engine_ids`), with holders, state and problems.

    `shm_private_to_namespace` waives the PID-namespace blind spot. Files of owners not
    in `judge_uids` (default: `inspection_uids()`) are classified from `lstat` alone. With
    `partial`, what `judge_until` (monotonic) or the deadline leaves is counted in
    `not_judged` instead of raising. `only`: read only the processes it admits, for a
    caller whose every removal the collector re-checks against all of them.
    """
    shm = _shm_dir(shm_dir)
    wanted = None if engine_ids is None else {naming.validate_engine_id(e) for e in engine_ids}
    now = time.time()
    listing = _list_dir(shm, wanted, fsguard.inspection_uids() if judge_uids is None
                        else judge_uids, partial)
    order = sorted(listing.judged.items(), key=lambda item: _order(*item))
    try:
        # before we open anything ourselves; region names found by lstat
        scan = scan_processes(shm, {FileId.of(st) for _, entries in order
                                    for _, _, st in entries}, only=only)
    except deadline.DeadlineExpiredError:
        if not partial:
            raise
        listing.not_judged.add(*(st for _, entries in order for _, _, st in entries))
        return _inventory(shm, [], [], listing, ProcessScan(), visibility.assess([]))
    vis = visibility.assess(scan.denied_pids, namespace_waived=shm_private_to_namespace,
                            seen=None if only is None else only.seen)
    run = _Run(shm=shm, scan=scan, vis=vis, measure=measure_residency, listing=listing, now=now)
    regions = _judge_listed(run, order, judge_until, partial) + _seen_only(run)
    regions = _flag_collisions(regions + _unlinked(run, wanted, partial))
    orphans = _orphan_manifests(listing, {r.engine_id for r in regions})
    return _inventory(shm, regions, orphans, listing, scan, vis)


def _judge_listed(run: _Run, order: list[tuple[str, list[_Entry]]],
                  judge_until: float | None, partial: bool) -> list[RegionInfo]:
    """The regions whose files this run opens, in `order`: with `partial`, those the
    time left does not reach are counted in `not_judged`."""
    regions = []
    for i, (engine_id, entries) in enumerate(order):
        # the first (the caller's own, or the largest) is judged whenever the deadline
        # allows: every run makes progress, however little of its share is left
        if not partial:
            deadline.check("looking at regions")
        elif deadline.expired() or (i > 0 and judge_until is not None
                                    and time.monotonic() >= judge_until):
            run.listing.not_judged.add(*(st for _, later in order[i:] for _, _, st in later))
            break
        try:
            region = _judge(run, engine_id, entries)
        except deadline.DeadlineExpiredError:  # the backstop cut one file's wait short
            if not partial:
                raise
            run.listing.not_judged.add(*(st for _, _, st in entries))
            continue
        if region is not None:
            run.linked.update(s.file_id for s in region.segments if s.file_id is not None)
            regions.append(judge_visibility(region, run.vis))
    return regions


def _seen_only(run: _Run) -> list[RegionInfo]:
    """The regions of owners this run does not judge, from lstat alone."""
    regions = []
    for engine_id, entries in sorted(run.listing.unjudged.items()):
        segments = [_from_stat(path, segment, st, fsguard.stat_problems(
            st, allowed_uids=run.allowed_uids)) for segment, path, st in sorted(entries)]
        run.linked.update(s.file_id for s in segments if s.file_id is not None)
        regions.append(judge_visibility(_region(run, engine_id, segments, False, None), run.vis))
    return regions


def _unlinked(run: _Run, wanted: Collection[str] | None, partial: bool) -> list[RegionInfo]:
    """The regions known only from /proc; with `partial`, those judged before the deadline.
    Of another owner's, past JUDGED_OTHERS each is counted under its holder (one stat),
    however many processes hold them."""
    regions = []
    others: dict[int, int] = {}
    # with `partial` (gc) what was judged counts: unlinked regions are in use, never removed
    with contextlib.suppress(*((deadline.DeadlineExpiredError,) if partial else ())):
        for engine_id, by_inode in sorted(_deleted_only(run.scan, run.linked, run.shm).items()):
            if wanted is not None and engine_id not in wanted:
                continue
            for fid, uses in by_inode.items():
                # its own stat (its owner above all), through a user: nothing read
                st = _through_users(uses, fid, stat_proc_link)
                if st is not None and st.st_uid != os.geteuid():
                    others[st.st_uid] = others.get(st.st_uid, 0) + 1
                    if others[st.st_uid] > JUDGED_OTHERS:
                        run.scan.unnamed[uses[0].pid] = run.scan.unnamed.get(uses[0].pid, 0) + 1
                        continue
                regions.append(_deleted_region(run, engine_id, fid, uses, st))
    return regions


def _inventory(shm: str, regions: list[RegionInfo], orphans: list[OrphanManifest],
               listing: _Listing, scan: ProcessScan, vis: Visibility) -> Inventory:
    return Inventory(
        shm_dir=shm, regions=tuple(regions), orphan_manifests=tuple(orphans),
        shm=shm_usage(shm), uninspectable_processes=len(scan.denied_pids), visibility=vis,
        not_judged=listing.not_judged.tallies(), counted=listing.counted.tallies(),
        listed_all=listing.complete, unnamed_held=tuple(sorted(scan.unnamed.items())),
        maybe_temp_files=listing.temps or not listing.complete,
    )


def _shm_dir(shm_dir: str | os.PathLike[str]) -> str:
    shm = os.path.realpath(shm_dir)
    if not os.path.isdir(shm):
        raise errors.InvalidInputError(
            f"shm directory {shm_dir} does not exist or is not a directory",
            path=str(shm_dir), code="bad_shm_dir")
    return shm


def _judge(run: _Run, engine_id: str, entries: list[_Entry]) -> RegionInfo | None:
    """One region, its files opened and judged; None when they all vanished."""
    judged: list[tuple[SegmentFile, bool]] = []
    for segment, path, _ in sorted(entries, key=lambda e: e[0]):
        with contextlib.suppress(FileNotFoundError):  # vanished while we looked
            judged.append(_inspect_file(path, segment, run))
    if not judged:
        return None
    segments = [seg for seg, _ in judged]
    owner = next((s for s in segments if s.segment == 0), segments[0]).uid
    locked = any(seg_locked for seg, seg_locked in judged if seg.uid == owner)
    mpath = run.listing.manifests.get(engine_id)
    if mpath is None:  # the listing keeps a bounded number: look it up by name
        candidate = str(manifest_path(run.shm, engine_id))
        mpath = candidate if os.path.lexists(candidate) else None
    return _region(run, engine_id, segments, locked, mpath)


def _region(run: _Run, engine_id: str, segments: list[SegmentFile], locked: bool,
            mpath: str | None) -> RegionInfo:
    """A linked region from its files: manifest, holders, state and problems."""
    bare = next((s for s in segments if s.segment == 0), None)
    segments, problems = _owned(segments, (bare or segments[0]).uid)
    manifest, mproblem = _manifest_of(run, mpath, bare)
    size = sum(s.size_bytes for s in segments)
    geometry = manifest.geometry if manifest is not None else None
    problems += [p for p in (mproblem, *_files_problems(segments, bare, size, geometry))
                 if p is not None]
    uses = [u for s in segments if s.file_id is not None
            for u in run.scan.uses.get(s.file_id, ())]
    holders = holders_of(uses, manifest, run.name_of)
    age = _age(segments, manifest, run.now)
    first = bare or segments[0]
    state, creation = _state(manifest, bool(holders or locked))
    parts = naming.split_engine_id(engine_id)
    return RegionInfo(
        engine_id=engine_id, base_engine_id=parts.base_engine_id, dp_rank=parts.dp_rank,
        segments=tuple(segments), linked=True, size_bytes=size,
        resident_bytes=None if any(s.resident_bytes is None for s in segments) else sum(
            s.resident_bytes or 0 for s in segments),
        uid=first.uid, mode=None if first.mode is None else f"{first.mode:04o}",
        age_seconds=None if age is None else max(age, 0.0), geometry=geometry,
        manifest=manifest, manifest_path=mpath, holders=holders, locked=locked, state=state,
        problems=(*problems, *(() if creation is None else (creation,))),
    )


def _manifest_of(run: _Run, mpath: str | None, bare: SegmentFile | None
                 ) -> tuple[Manifest | None, Problem | None]:
    """The manifest, if there is one and it describes the bare file (inode and owner)."""
    if mpath is None:
        return None, None
    return manifest_io.read_matching(mpath, None if bare is None else bare.file_id,
                                     allowed_uids=run.allowed_uids,
                                     owner_uid=None if bare is None else bare.uid)


def _owned(segments: list[SegmentFile], owner: int | None
           ) -> tuple[list[SegmentFile], list[Problem]]:
    """The files of the region's owner, and what is wrong with them. Another owner's file
    is no part of it: grouped by name alone, a squatter's held segment would keep (and
    show as holding) someone else's stale region for ever."""
    problems = [Problem("squatted_segment", (
        f"{os.path.basename(sq.path)} is owned by uid {sq.uid}, not by the region's owner "
        f"(uid {owner}): another user's file under its name, not part of it"))
        for sq in segments if sq.uid != owner]
    owned = [s for s in segments if s.uid == owner]
    return owned, problems + [Problem(p.code, f"{os.path.basename(s.path)} {p.message}")
                              for s in owned for p in s.problems]


def _files_problems(segments: list[SegmentFile], bare: SegmentFile | None, size: int,
                    geometry: Geometry | None) -> list[Problem]:
    """No bare file, a gap in the segment numbers, or a size the geometry does not describe."""
    problems = [] if bare is not None else [
        Problem("missing_segment", "segment files exist without the bare .mmap")]
    numbers = sorted(s.segment for s in segments)
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        problems.append(Problem("segment_gap", f"segments {numbers} are not consecutive"))
    if geometry is not None and size != geometry.size_bytes:
        problems.append(Problem(
            "size_mismatch",
            f"files hold {size} bytes but the manifest geometry needs {geometry.size_bytes} "
            f"({geometry.num_blocks} rows of {geometry.row_stride})",
        ))
    return problems


def _age(segments: list[SegmentFile], manifest: Manifest | None, now: float) -> float | None:
    """Seconds since the region last changed: its newest file, or its manifest's creation."""
    mtimes = [s.mtime for s in segments if s.mtime is not None]
    if manifest is not None and manifest.created_at <= now:  # a future one proves nothing
        return now - max(manifest.created_at, max(mtimes, default=manifest.created_at))
    return now - max(mtimes) if mtimes else None


def _state(manifest: Manifest | None, held: bool) -> tuple[str, Problem | None]:
    """The region's state, and a problem when a create died before finishing it."""
    if manifest is not None and not manifest.complete:
        if manifest.creator_alive():
            return CREATING, None
        died = Problem("creator_died", f"its creator (pid {manifest.creator_pid}) is gone "
                       "(or not visible from this PID namespace) and never finished it "
                       "(killed during create?); it is incomplete")
        return (LIVE if held else STALE), died
    if held:
        return LIVE, None
    return (PERSISTENT if manifest is not None and manifest.persistent else STALE), None


def _deleted_region(run: _Run, engine_id: str, fid: FileId, uses: list[FileUse],
                    st: os.stat_result | None) -> RegionInfo:
    """A region whose name is gone: all we know comes through its users' /proc entries
    (`st`: its stat through one, None if none gave it), the manifest they carry included."""
    parts = naming.split_engine_id(engine_id)
    path = next(u.path for u in uses if u.path)
    size = max((u.size_hint or 0) for u in uses)
    uid, mode = None, None
    if st is not None:
        size, uid, mode = st.st_size, st.st_uid, f"{stat.S_IMODE(st.st_mode):04o}"
    resident, refusal = _resident_through(uses, fid) if run.measure else (None, None)
    parsed = parse_region_filename(os.path.basename(path))
    seg = SegmentFile(path=path, segment=0 if parsed is None else parsed.segment, file_id=fid,
                      size_bytes=size, uid=uid, resident_bytes=resident, resident_error=refusal)
    manifest = carried.carried_by((u.pid for u in uses if u.kind != "lock"), fid, uid,
                                  run.memfds)
    if manifest is not None and manifest.engine_id != engine_id:
        manifest = None  # describes another name: nothing this region's holders may claim
    return RegionInfo(
        engine_id=engine_id, base_engine_id=parts.base_engine_id, dp_rank=parts.dp_rank,
        segments=(seg,), linked=False, size_bytes=size, resident_bytes=resident, uid=uid,
        mode=mode,
        age_seconds=None if manifest is None else max(run.now - manifest.created_at, 0.0),
        geometry=None if manifest is None else manifest.geometry, manifest=manifest,
        manifest_path=None, holders=holders_of(uses, manifest, run.name_of), locked=False,
        state=LIVE, problems=())


def _resident_through(uses: list[FileUse], fid: FileId) -> tuple[int | None, str | None]:
    """An unlinked file's residency, measured through a holder's descriptor."""
    fd = _through_users([u for u in uses if u.kind == "fd"], fid, open_proc_link)
    if fd is None:
        return None, None
    try:
        return _resident(fd)
    finally:
        os.close(fd)


_T = TypeVar("_T")


def _through_users(uses: list[FileUse], fid: FileId,
                   reach: Callable[[str, FileId], _T | None]) -> _T | None:
    """The first answer about `fid` reached through one of its users' descriptors or
    mappings (an unlinked file has no name of its own)."""
    for u in uses:
        got = None
        if u.kind == "fd" and u.fd is not None:
            got = reach(procfs.fd_link(u.pid, u.fd), fid)
        elif u.kind == "map" and u.span is not None:
            got = reach(procfs.map_link(u.pid, *u.span), fid)
        if got is not None:
            return got
    return None


def judge_visibility(r: RegionInfo, vis: Visibility) -> RegionInfo:
    """A region nobody visibly holds is `stale` only if no holder could be hidden:
    host-wide blind spots make it `unknown`; so do hidden processes that could open it,
    unless the kernel proved nobody else has its files open (`live`: proved the opposite)."""
    if r.state not in (STALE, PERSISTENT) or not r.linked:
        return r
    if any(s.file_id is None for s in r.segments):
        return r  # a symlink or not a regular file: never removed, its problem says why
    if vis.blind:
        spot = vis.effective[0]
        return r if r.state == PERSISTENT else _with_problem(r, UNKNOWN, Problem(spot.code, (
            f"{spot.message}; a holder could be hidden, so it is not called stale")))
    suspects = sorted({pid for s in r.segments for pid in vis.could_hide(s.uid, s.mode)})
    return _lease_verdict(r, pids_text(suspects)) if suspects else r


def _lease_verdict(r: RegionInfo, who: str) -> RegionInfo:
    """A region that processes `who` (hidden) could hold, by the kernel's lease test."""
    verdicts = [s.sole_opener for s in r.segments]
    if any(v is not None and v.sole is False for v in verdicts):
        return _with_problem(r, LIVE, Problem("hidden_holder", (
            f"open or mapped by a process that cannot be inspected (one of {who}); the "
            "kernel's lease test says another process has it open")))
    if all(v is not None and v.sole for v in verdicts) or r.state == PERSISTENT:
        return r
    why = next((v.why for v in verdicts if v is not None and v.why), "not tested")
    return _with_problem(r, UNKNOWN, Problem(
        visibility.HIDDEN_HOLDERS,
        f"could be held by {who}, which cannot be inspected, and the lease test that would "
        f"prove it unused is not available ({why})"))


def _with_problem(r: RegionInfo, state: str, p: Problem) -> RegionInfo:
    return replace(r, state=state, problems=(*r.problems, p))


def _flag_collisions(regions: list[RegionInfo]) -> list[RegionInfo]:
    """Two regions claiming one (base id, dp rank): a restarted replica beside its ghost."""
    claims = Counter((r.base_engine_id, r.dp_rank) for r in regions)
    out = []
    for r in regions:
        n = claims[(r.base_engine_id, r.dp_rank)]
        rank = "no dp suffix" if r.dp_rank is None else f"dp rank {r.dp_rank}"
        out.append(r if n < 2 else _with_problem(r, r.state, Problem("dp_collision", (
            f"{n} regions claim base id {r.base_engine_id!r} with {rank} (a linked file and "
            "unlinked ones still mapped); processes of one replica may be split between them"))))
    return out


def _orphan(engine_id: str, path: str) -> OrphanManifest | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return OrphanManifest(engine_id=engine_id, path=path, file_id=FileId.of(st), uid=st.st_uid)


def _orphan_manifests(listing: _Listing, present: set[str]) -> list[OrphanManifest]:
    """Manifests whose region is gone, both by name and from every process (the listing
    kept only the wanted ones)."""
    seen = present | set(listing.judged) | set(listing.unjudged)
    found = [_orphan(e, path) for e, path in sorted(listing.manifests.items()) if e not in seen]
    # a region there may have been counted rather than listed
    return [o for o in found if o is not None and not os.path.lexists(
        naming.region_path(os.path.dirname(o.path), o.engine_id))]


def discover_engine(shm_dir: str | os.PathLike[str], engine_id: str) -> Inventory:
    """One engine_id's regions, for the start-up claim every rank runs under its lock.

    Its names are looked up, never listed, and only processes that could have opened a
    file of this user (`visibility.MayOpen`) are read, so others' files and processes
    cost nothing; another process holds it only if one of those handed it a descriptor
    (gc, which removes, looks at every process). Residency is not measured.
    """
    shm = _shm_dir(shm_dir)
    found = _by_name(shm, engine_id)
    me = os.geteuid()
    only = visibility.MayOpen(me, functools.reduce(operator.or_, (
        stat.S_IMODE(st.st_mode) for _, _, st in found if st.st_uid == me), 0o600))
    scan = scan_processes(shm, {FileId.of(st) for _, _, st in found},
                          name=naming.region_filename(engine_id), only=only)
    run = _Run(shm=shm, scan=scan, vis=visibility.assess(scan.denied_pids, seen=only.seen))
    # the same judgement as discover()'s: a lock counts only on the owner's files
    regions = _judge_listed(run, [(engine_id, found)], None, False)
    regions += _unlinked(run, {engine_id}, partial=False)
    orphan = None if regions else _orphan(engine_id, str(manifest_path(shm, engine_id)))
    return _inventory(shm, _flag_collisions(regions), [orphan] if orphan else [], run.listing,
                      scan, run.vis)


def open_released(shm_dir: str | os.PathLike[str], engine_id: str
                  ) -> tuple[int, RegionInfo] | None:
    """A read-only descriptor of `engine_id`'s region whose name was released (its bare
    file; one whose holders carry a manifest first), and what discovery knows of it.
    Opened through a holder's descriptor or mapping, checked to be that very inode;
    None when no such region is held or none can be opened."""
    shm = _shm_dir(shm_dir)
    naming.validate_engine_id(engine_id)
    run = _Run(shm=shm, scan=scan_processes(shm, name=naming.region_filename(engine_id)))
    found = _deleted_only(run.scan, set(), shm).get(engine_id, {}).items()
    infos = [(_deleted_region(run, engine_id, fid, uses, _through_users(
        uses, fid, stat_proc_link)), fid, uses) for fid, uses in found]
    for info, fid, uses in sorted(infos, key=lambda x: x[0].manifest is None):
        fd = None if info.segments[0].segment else _through_users(uses, fid, open_proc_link)
        if fd is not None:
            return fd, info
    return None
