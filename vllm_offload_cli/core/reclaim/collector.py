"""Garbage collection: remove offload regions that are provably stale, and nothing else.

A region goes only when every test of docs/architecture.md ("Why gc removes only what
nobody uses") agrees on state read under its exclusive lock; the manifest goes first, the
bare name last, each checked through this user's private directory.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from vllm_offload_cli.core.base import deadline
from vllm_offload_cli.core.base.errors import OffloadError
from vllm_offload_cli.core.base.problems import Problem
from vllm_offload_cli.core.base.text import pids_text
from vllm_offload_cli.core.host import discovery, visibility
from vllm_offload_cli.core.host.discovery import RegionInfo
from vllm_offload_cli.core.host.procscan import FileUse, flock_holders, users_of
from vllm_offload_cli.core.host.visibility import Visibility
from vllm_offload_cli.core.reclaim import report
from vllm_offload_cli.core.reclaim.report import GcOptions, GcReport, RemovedRegion
from vllm_offload_cli.core.region import fsguard, naming, untrusted_json
from vllm_offload_cli.core.region import manifest as manifest_io
from vllm_offload_cli.core.region.manifest import Manifest
from vllm_offload_cli.core.region.naming import manifest_path
from vllm_offload_cli.core.system.files import UNTRUSTED_OPEN_FLAGS, FileId, open_regular
from vllm_offload_cli.core.system.processes import ProcessRef, comm

logger = logging.getLogger(__name__)

# Regions locked at once (one /proc scan each): bounds our descriptors and a joiner's wait.
_BATCH = 64

# manifest.write()'s temporary file: `.{manifest name}.tmp.{pid}.{hex}`
_TEMP_RE = re.compile(  # fullmatch: `$` would accept a trailing newline
    r"\." + re.escape(naming.PREFIX) + r"(?P<engine_id>.+)" + re.escape(naming.MANIFEST_SUFFIX)
    + r"\.tmp\.(?P<pid>[0-9]{1,10})\.(?P<token>[0-9a-f]{1,64})"
)

# A segment as `_lock` holds it: open, exclusively locked, and its fstat.
_Held = tuple[discovery.SegmentFile, int, os.stat_result]


def collect(
    shm_dir: str | os.PathLike[str],
    options: GcOptions,
    *,
    engine_ids: Collection[str] | None = None,
    judge_seconds: float | None = None,
) -> GcReport:
    """Remove every provably stale region in shm_dir (or only `engine_ids`); what is not
    judged within `judge_seconds` is counted as `not_judged` (the run exits PARTIAL)."""
    started = time.time(), time.monotonic()
    inventory = discovery.discover(
        shm_dir, engine_ids=engine_ids, measure_residency=False,
        shm_private_to_namespace=options.shm_private_to_namespace, judge_uids=options.owners,
        partial=True, judge_until=None if judge_seconds is None else started[1] + judge_seconds)
    return reclaim(inventory, options, engine_ids=engine_ids, started=started)


def reclaim(
    inventory: discovery.Inventory,
    options: GcOptions,
    *,
    engine_ids: Collection[str] | None = None,
    started: tuple[float, float] | None = None,  # time.time(), time.monotonic()
) -> GcReport:
    """Act on an inventory: every decision is re-checked on the files themselves,
    so an inventory that aged (files replaced, new users) is still safe to pass."""
    run = _Run(inventory=inventory, options=options)
    try:
        run.blind = visibility.assess(
            (), namespace_waived=options.shm_private_to_namespace).effective
        run.regions(inventory.regions)
        # pid-based judgements need the whole host and the time left
        if not run.blind and not run.expired:
            with contextlib.suppress(deadline.DeadlineExpiredError):
                run.orphan_manifests(inventory.orphan_manifests)
                if inventory.maybe_temp_files:  # else its listing saw none: no second one
                    run.temp_files(None if engine_ids is None else set(engine_ids))
        run.settle()
    finally:
        run.close()
    known = {r.engine_id for r in inventory.regions} | {
        o.engine_id for o in inventory.orphan_manifests}
    return GcReport(
        shm_dir=inventory.shm_dir, options=options, removed=tuple(run.removed),
        kept=tuple(run.kept), orphan_manifests_removed=tuple(run.orphans),
        temp_files_removed=tuple(run.temps), vanished=tuple(dict.fromkeys(run.vanished)),
        not_found=tuple(e for e in dict.fromkeys(engine_ids or ()) if e not in known),
        errors=tuple(run.errors), regions_seen=len(inventory.regions),
        uninspectable_processes=max(inventory.uninspectable_processes, len(run.denied)),
        started_at=time.time() if started is None else started[0],
        duration_seconds=0.0 if started is None else time.monotonic() - started[1],
        blind_spots=run.blind,
        uninspectable_pids=tuple(sorted(run.denied or {
            h.pid for h in inventory.visibility.hidden})),
        not_judged=run.not_judged.tallies(), counted=inventory.counted,
        listed_all=inventory.listed_all,
    )


@dataclass(kw_only=True)
class _Locked:
    """A candidate whose files we hold open and exclusively locked."""

    region: RegionInfo
    files: list[_Held]
    manifest_path: str
    manifest_fd: int | None = None
    manifest: Manifest | None = None

    @property
    def fds(self) -> list[int]:
        fds = [fd for _, fd, _ in self.files]
        return fds if self.manifest_fd is None else [*fds, self.manifest_fd]

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)  # also drops our lock
        self.files.clear()
        self.manifest_fd = None


@dataclass(kw_only=True)
class _Run:
    inventory: discovery.Inventory
    options: GcOptions
    removed: list[RemovedRegion] = field(default_factory=list)
    kept: list[Problem] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    temps: list[str] = field(default_factory=list)
    vanished: list[str] = field(default_factory=list)
    errors: list[Problem] = field(default_factory=list)
    denied: set[int] = field(default_factory=set)
    blind: tuple[Problem, ...] = ()
    expired: bool = False
    not_judged: discovery.Counts = field(default_factory=discovery.Counts)

    def __post_init__(self) -> None:
        self.shm_dir = self.inventory.shm_dir
        self.shm_dev = os.stat(self.shm_dir).st_dev
        self.owners = self.options.owners
        self.private_fd: int | None = None
        self.private_tried = self.private_made = False
        self.known_inodes = {seg.file_id for r in self.inventory.regions
                             for seg in r.segments if seg.file_id is not None}
        for t in self.inventory.not_judged:  # discovery's count, which this run adds to
            self.not_judged.add_file(t.uid, t.size_bytes, t.allocated_bytes, files=t.files)

    def _private(self) -> int | None:
        """This user's private directory (fsguard.unlink_if_same), made on first use."""
        if self.private_fd is None and not self.private_tried:
            self.private_tried = True
            existed = os.path.lexists(os.path.join(self.shm_dir, fsguard.private_dir_name()))
            try:
                self.private_fd = fsguard.private_dir(self.shm_dir)
            except (OSError, OffloadError) as exc:  # unwritable directory, squatted name
                logger.warning("removals are checked by name only: %s", exc)
            self.private_made = not existed
        return self.private_fd

    def close(self) -> None:
        if self.private_fd is None:
            return
        os.close(self.private_fd)
        self.private_fd = None
        if self.private_made:  # not when an engine's start-up lock lives there
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(self.shm_dir, fsguard.private_dir_name()))

    def _unlink(self, path: str, fd: int, engine_id: str | None) -> bool | None:
        """Unlink `path` if it still names `fd`'s inode (dry run: True); None if refused."""
        if self.options.dry_run:
            return True
        try:
            return fsguard.unlink_if_same(path, fd, private_fd=self._private())
        except OSError as exc:
            self._fail(path, exc, engine_id)
            return None

    # -- regions ---------------------------------------------------------------

    def regions(self, regions: Sequence[RegionInfo]) -> None:
        candidates = [r for r in regions if self._precheck(r) is None]  # the rest are kept
        # discovery's order: the caller's own regions first, then the largest
        for start in range(0, len(candidates), _BATCH):
            try:
                deadline.check("removing stale regions")
                self._batch(candidates[start:start + _BATCH])
            except deadline.DeadlineExpiredError:
                # what this batch did not decide, and every later one, waits for the next run
                decided = {k.engine_id for k in self.kept} | {r.engine_id for r in self.removed}
                for r in candidates[start:]:
                    if r.engine_id not in decided:
                        self.not_judged.add_region(r)
                self.expired = True
                return

    def _precheck(self, r: RegionInfo) -> Problem | None:
        """Keeps what discovery already proves must stay: cheap reasons, before any lock."""
        if not r.linked:
            users = _holders_text(r.holders) or "a process this run cannot name"
            return self._keep(r, report.LIVE, f"unlinked, still in use by {users}; its memory is "
                              "freed when the last of them exits",
                              r.holders[0].pid if r.holders else None)
        if (unsafe := self._unsafe_file(r)) is not None:
            return unsafe
        if r.state == discovery.CREATING and r.manifest is not None:
            return self._creating(r, r.manifest)
        if r.holders:
            return self._held(r, r.holders)
        if r.locked:
            return self._lock_refused(r, next(
                (s.file_id for s in r.segments if s.file_id is not None), None))
        if r.persistent and not self.options.include_persistent:
            return self._keep(r, report.PERSISTENT, _PERSISTENT_TEXT)
        if r.age_seconds is not None and r.age_seconds < self.options.min_age:
            return self._keep(r, report.TOO_YOUNG, self._young_text(r.age_seconds))
        return self._blind_kept(r) if self.blind else None

    def _unsafe_file(self, r: RegionInfo) -> Problem | None:
        """A symbolic link, not a regular file, or another user's: not ours to remove."""
        for seg in r.segments:
            name = os.path.basename(seg.path)
            codes = {p.code for p in seg.problems}
            if report.SYMLINK in codes:
                return self._keep(r, report.SYMLINK, f"{name} is a symbolic link; region names are "
                                  "never followed (remove it by hand after checking it)")
            if seg.file_id is None or report.NOT_REGULAR in codes:
                return self._keep(r, report.NOT_REGULAR, f"{name} is not a regular file")
            if seg.uid is None or not fsguard.uid_allowed(seg.uid, self.owners):
                return self._keep(r, report.FOREIGN_OWNER, self._foreign_text(name, seg.uid))
        return None

    def _batch(self, batch: list[RegionInfo]) -> None:
        locked: list[_Locked] = []
        try:
            for r in batch:
                held = self._lock(r)
                if held is not None:
                    locked.append(held)
            # /proc is walked again only for what the kernel's lease cannot clear
            rescan = [h for h in locked if not _sole_now(h)]
            uses: dict[FileId, list[FileUse]] = {}
            vis = self.inventory.visibility
            if rescan:
                own = [fd for h in locked for fd in h.fds]
                fids = [FileId.of(st) for h in rescan for _, _, st in h.files]
                uses, denied = users_of(fids, own_fds=own)
                self.denied.update(denied)
                vis = visibility.assess(denied,
                                        namespace_waived=self.options.shm_private_to_namespace)
                if vis.blind:  # appeared since the run started: judge nothing more
                    self.blind = self.blind or vis.effective
            for h in locked:
                if self.blind:
                    self._blind_kept(h.region)
                else:
                    self._decide(h, [u for _, _, st in h.files
                                     for u in uses.get(FileId.of(st), [])], vis)
        finally:
            for h in locked:
                h.close()

    def _lock(self, r: RegionInfo) -> _Locked | None:
        """Open, judge and exclusively lock every file of a region, or say why not."""
        held = _Locked(region=r, files=[], manifest_path=str(manifest_path(self.shm_dir,
                                                                           r.engine_id)))
        ok = False
        try:
            for seg in sorted(r.segments, key=lambda s: s.segment):
                try:
                    fd = os.open(seg.path, os.O_RDONLY | UNTRUSTED_OPEN_FLAGS)
                except FileNotFoundError:
                    self.vanished.append(r.engine_id)
                    return None
                except OSError as exc:
                    self._keep(r, *_open_refused(os.path.basename(seg.path), exc))
                    return None
                held.files.append((seg, fd, os.fstat(fd)))
                if self._fd_problem(r, *held.files[-1]) is not None:
                    return None
            self._read_manifest(held)
            ok = True
            return held
        finally:
            if not ok:
                held.close()

    def _fd_problem(self, r: RegionInfo, seg: discovery.SegmentFile, fd: int, st: os.stat_result
                    ) -> Problem | None:
        """Judges a segment on its descriptor and locks it."""
        name = os.path.basename(seg.path)
        if FileId.of(st) != seg.file_id:
            return self._keep(r, report.CHANGED, f"{name} was replaced by another file during this "
                              "run; it is looked at again next run")
        if not stat.S_ISREG(st.st_mode):
            return self._keep(r, report.NOT_REGULAR, f"{name} is not a regular file")
        if not fsguard.uid_allowed(st.st_uid, self.owners):
            return self._keep(r, report.FOREIGN_OWNER, self._foreign_text(name, st.st_uid))
        if st.st_dev != self.shm_dev:
            return self._keep(r, report.OTHER_FILESYSTEM, f"{name} is on another filesystem than "
                              f"{self.shm_dir} (a mount over the name?)")
        if st.st_nlink != 1:
            return self._keep(r, report.LINK_COUNT, f"{name} has {st.st_nlink} hard links; "
                              "removing this name would not free it, and another name may be "
                              "in use")
        if not fsguard.try_lock(fd):
            return self._lock_refused(r, FileId.of(st))
        return None

    def _read_manifest(self, held: _Locked) -> None:
        """The manifest, kept open so only this inode is ever unlinked; one describing
        another inode stays, to be judged as an orphan once the region is gone."""
        fd = open_regular(held.manifest_path)
        if fd is None:
            return  # absent (made by vLLM), a symlink or not a file: left alone
        if not fsguard.uid_allowed(os.fstat(fd).st_uid, self.owners) or not fsguard.try_lock(fd):
            os.close(fd)  # not ours to remove, or being rewritten right now: leave it
            return
        bare = next((s for seg, _, s in held.files if seg.segment == 0), None)
        m: Manifest | None = None
        try:
            m = manifest_io.read_fd(fd, held.manifest_path, allowed_uids=self.owners,
                                    owner_uid=None if bare is None else bare.st_uid)
        except (manifest_io.ManifestError, OSError):  # invalid: tells nothing, goes with
            recorded = _recorded_region(fd)  # the region unless it names another inode
            ours = bare is None or recorded is None or recorded == FileId.of(bare)
        else:
            ours = bare is not None and FileId(m.region_dev, m.region_ino) == FileId.of(bare)
        if ours:
            held.manifest_fd, held.manifest = fd, m
        else:
            os.close(fd)

    def _decide(self, held: _Locked, uses: list[FileUse], vis: Visibility) -> Problem | None:
        """Removes a locked region that is proven stale; returns what kept it otherwise."""
        r, m = held.region, held.manifest
        if uses:
            return self._held(r, discovery.holders_of(uses), " (seen after locking it)")
        if m is not None and not m.complete and m.creator_alive():
            return self._creating(r, m)
        if m is not None and m.persistent and m.complete and not self.options.include_persistent:
            return self._keep(r, report.PERSISTENT, _PERSISTENT_TEXT)
        # ctime: anyone can set a file's mtime (a future one would make it immune), not ctime
        now = time.time()
        times = [st.st_ctime for _, _, st in held.files]
        if m is not None and m.created_at <= now:
            times.append(m.created_at)
        age = now - max(times)
        if age < self.options.min_age:  # min_age >= 0: an age past this is never negative
            return self._keep(r, report.TOO_YOUNG, self._young_text(age))
        suspects = sorted({pid for _, _, st in held.files
                           for pid in vis.could_hide(st.st_uid, st.st_mode)})
        with fsguard.sole_opener([fd for _, fd, _ in held.files]) as verdict:
            if verdict.sole is False:
                return self._opened_elsewhere(r, suspects)
            if verdict.sole is None and suspects:
                return self._keep(r, report.UNKNOWN, (
                    f"could be held by {pids_text(suspects)}, which cannot be inspected, and "
                    f"the lease test that would prove it unused is not available "
                    f"({verdict.why}); run gc as root with CAP_SYS_PTRACE and CAP_LEASE"),
                    blind_spot=visibility.HIDDEN_HOLDERS)
            return self._remove(held, age, leased=verdict.sole is True,
                                suspects=tuple(suspects))

    def _stale_text(self, m: Manifest | None, age: float, leased: bool) -> str:
        why = [("the kernel granted a write lease: no process anywhere has it open or mapped"
                if leased else
                "no process maps it or has it open (/proc, scanned again after locking)"),
               "its exclusive lock was free"]
        if m is not None and not m.complete:
            why.append(f"its creator pid {m.creator_pid} died before finishing")
        if m is not None and m.persistent and m.complete:
            why.append("persistent, removed with --include-persistent")
        why.append(f"unchanged for {age:.0f} s (--min-age {self.options.min_age:g} s)")
        return "; ".join(why)

    def _opened_elsewhere(self, r: RegionInfo, suspects: list[int]) -> Problem:
        if suspects:
            return self._keep(r, report.LIVE, "open or mapped by a process that cannot be "
                              f"inspected (one of {pids_text(suspects)}): the kernel refused a "
                              "lease")
        return self._keep(r, report.BUSY, "open in a process not found in /proc (one that "
                          "opened it just now, or another gc or inspect probing it); looked at "
                          "again next run")

    def _blind_kept(self, r: RegionInfo) -> Problem:
        return self._keep(r, report.UNKNOWN, f"not proven unused: {self.blind[0].message}; "
                          f"{visibility.advice(self.blind)}", blind_spot=self.blind[0].code)

    def _remove(self, held: _Locked, age: float, *, leased: bool,
                suspects: tuple[int, ...]) -> Problem | None:
        """Removes (dry run: records) what is held, the lease asked again: the manifest first
        (no creator writes one while the name is taken), the bare name last (a creator
        starts from it); records what really went."""
        r = held.region
        if leased and not all(fsguard.still_sole(fd) for _, fd, _ in held.files):
            return self._opened_elsewhere(r, [])  # an open() waits on our lease
        manifest = None
        if held.manifest_fd is not None and self._unlink(held.manifest_path,
                                                         held.manifest_fd, r.engine_id):
            manifest = held.manifest_path
        gone: list[_Held] = []
        for seg, fd, st in reversed(held.files):  # `_lock` holds them in segment order
            unlinked = self._unlink(seg.path, fd, r.engine_id)
            if unlinked:
                gone.insert(0, (seg, fd, st))
            elif unlinked is False:
                self.vanished.append(r.engine_id)
        if not gone:
            return None
        paths, size = tuple(seg.path for seg, _, _ in gone), sum(st.st_size for _, _, st in gone)
        if not self.options.dry_run:
            logger.info("removed %s (%d bytes)", ", ".join(paths), size)
        self.removed.append(RemovedRegion(
            engine_id=r.engine_id, paths=paths, bytes=size,
            freed_bytes=sum(st.st_blocks * 512 for _, _, st in gone), manifest=manifest,
            age_seconds=age, uid=held.files[0][2].st_uid,
            reason=self._stale_text(held.manifest, age, leased),
            hidden_pids=suspects if leased else ()))
        return None

    # -- manifests and temporary files --------------------------------------------

    def orphan_manifests(self, orphans: Sequence[discovery.OrphanManifest]) -> None:
        ours = [o for o in orphans if fsguard.uid_allowed(o.uid, self.owners)]
        for i, o in enumerate(ours):
            if deadline.expired():
                for left in ours[i:]:
                    self.not_judged.add_file(left.uid)
                return
            if self._unlink_old(o.path, o.engine_id, orphan=o):
                self.orphans.append(o.path)

    def temp_files(self, wanted: set[str] | None) -> None:
        """manifest.write()'s temporaries left by a writer that died before its rename."""
        try:
            entries = os.scandir(self.shm_dir)
        except OSError:
            return
        with entries:
            for n, entry in enumerate(entries):  # one at a time: a million names cost no memory
                if not n % 4096:
                    deadline.check("removing temporary files")
                match = _TEMP_RE.fullmatch(entry.name) if entry.name.startswith(".") else None
                if (match is None or naming.engine_id_problem(match["engine_id"]) is not None
                        or (wanted is not None and match["engine_id"] not in wanted)):
                    continue
                try:  # another user's file is judged by lstat, never opened
                    uid = entry.stat(follow_symlinks=False).st_uid
                except OSError:
                    continue
                # a live writer may be between write and rename
                if (fsguard.uid_allowed(uid, self.owners)
                        and not ProcessRef(int(match["pid"]), None).alive()
                        and self._unlink_old(entry.path, None)):
                    self.temps.append(entry.path)

    def _unlink_old(self, path: str, engine_id: str | None,
                    orphan: discovery.OrphanManifest | None = None) -> bool:
        """Unlinks a small file of ours older than --min-age, judged on its descriptor;
        True when removed (dry run: would be)."""
        fd = open_regular(path, None if orphan is None else orphan.file_id)
        if fd is None:
            return False  # gone, replaced, a symlink or not a file: never ours
        try:
            st = os.fstat(fd)
            if (not fsguard.uid_allowed(st.st_uid, self.owners)
                    or time.time() - st.st_ctime < self.options.min_age
                    or (orphan is not None and not self._still_orphan(orphan, fd))):
                return False
            return bool(self._unlink(path, fd, engine_id))
        except OSError as exc:
            self._fail(path, exc, engine_id)
            return False
        finally:
            os.close(fd)

    def _still_orphan(self, o: discovery.OrphanManifest, fd: int) -> bool:
        """Locked (manifests change under LOCK_EX), no region back since, and not a live
        region's manifest renamed onto this name (open_regular checked the inode)."""
        return (fsguard.try_lock(fd)
                and not os.path.lexists(naming.region_path(self.shm_dir, o.engine_id))
                and _recorded_region(fd) not in self.known_inodes)

    # -- bookkeeping -----------------------------------------------------------

    def settle(self) -> None:
        """A region kept because another collector was at it, then removed, is gone."""
        gone = [k.linked and not any(map(os.path.lexists, k.paths)) for k in self.kept]
        self.vanished += [str(k.engine_id) for k, g in zip(self.kept, gone, strict=True) if g]
        self.kept = [k for k, g in zip(self.kept, gone, strict=True) if not g]

    def _keep(self, r: RegionInfo, code: str, reason: str, pid: int | None = None, *,
              blind_spot: str | None = None) -> Problem:
        kept = Problem(code, reason, engine_id=r.engine_id, paths=tuple(r.paths), pid=pid,
                       linked=r.linked, blind_spot=blind_spot, uid=r.uid)
        logger.debug("keeping %s: %s", r.engine_id, reason)
        self.kept.append(kept)
        return kept

    def _held(self, r: RegionInfo, holders: Sequence[discovery.Holder], note: str = "") -> Problem:
        return self._keep(r, report.LIVE, f"held by {_holders_text(holders)}{note}",
                          holders[0].pid if holders else None)

    def _fail(self, path: str, exc: OSError, engine_id: str | None) -> None:
        if isinstance(exc, FileNotFoundError):
            if engine_id is not None:
                self.vanished.append(engine_id)
            return
        self.errors.append(Problem(report.REMOVE_FAILED,
                                   f"cannot remove {path}: {exc.strerror or exc}",
                                   path=path, engine_id=engine_id))

    def _lock_refused(self, r: RegionInfo, fid: FileId | None) -> Problem:
        holders = [] if fid is None else flock_holders(fid)
        exclusive = [pid for pid, excl in holders if excl and pid != os.getpid()]
        if exclusive:
            return self._keep(r, report.BUSY, f"pid {exclusive[0]} holds its exclusive lock "
                              "(another gc or inspect run is examining it)", exclusive[0])
        shared = [pid for pid, excl in holders if not excl and pid > 0]
        if shared:
            return self._keep(r, report.LIVE, f"holds a shared lock: {pids_text(shared, 3, comm)}",
                              shared[0])
        if holders:  # /proc/locks shows pid 0 for a holder outside our pid namespace
            return self._keep(r, report.LIVE, "locked by a process in another pid namespace "
                              "(a container?)")
        return self._keep(r, report.BUSY, "was locked a moment ago and released since (another gc "
                          "or inspect run?); looked at again next run")

    def _creating(self, r: RegionInfo, m: Manifest) -> Problem:
        return self._keep(r, report.CREATION_RUNNING, f"pid {m.creator_pid} is still creating it "
                          "(sizing or pre-faulting)", m.creator_pid)

    def _foreign_text(self, name: str, uid: int | None) -> str:
        hint = "; root may remove it with --all-users" if os.geteuid() == 0 else ""
        return f"{name} is owned by uid {uid}, not by this user{hint}"

    def _young_text(self, age: float) -> str:
        return (f"changed {age:.0f} s ago, younger than --min-age {self.options.min_age:g} s "
                "(its creator may still be sizing it)")


_PERSISTENT_TEXT = ("pre-provisioned by `vllm-offload create`; add --include-persistent to "
                    "remove it")


def _open_refused(name: str, exc: OSError) -> tuple[str, str]:
    """Why a segment that is there could not be opened: the kept code and reason."""
    if isinstance(exc, BlockingIOError):  # leased: another collector is removing it now
        return report.BUSY, (f"{name} is being examined by another gc run right now; looked at "
                      "again next run")
    if exc.errno == errno.ELOOP:
        return report.SYMLINK, f"{name} became a symbolic link; never followed"
    return report.UNREADABLE, f"{name} cannot be opened: {exc.strerror}"


def _recorded_region(fd: int) -> FileId | None:
    """The region inode a manifest records, read leniently; None when it records none."""
    try:
        doc = untrusted_json.loads(os.pread(fd, manifest_io.MAX_BYTES + 1, 0),
                                   max_bytes=manifest_io.MAX_BYTES)
    except (OSError, ValueError):
        return None
    region = doc.get("region") if isinstance(doc, dict) else None
    if not isinstance(region, dict):
        return None
    dev, ino = region.get("dev"), region.get("ino")
    return FileId(dev, ino) if type(dev) is int and type(ino) is int else None


def _sole_now(held: _Locked) -> bool:
    """A lease on every file: nobody else has one open or mapped (`_remove` asks again)."""
    with fsguard.sole_opener([fd for _, fd, _ in held.files], retry=fsguard.QUICK_RETRY) as verdict:
        return verdict.sole is True


def _holders_text(holders: Sequence[discovery.Holder]) -> str:
    names = {h.pid: f"{h.name or '?'}, {'+'.join(h.via)}" for h in holders}
    return pids_text([h.pid for h in holders], 3, names.get)
