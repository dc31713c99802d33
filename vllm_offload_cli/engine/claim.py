"""Identity, reclaim and pre-flight: what an engine process does before it maps a region.

Run by every rank of an engine (and by `vllm-offload preflight`) under one
startup lock, so exactly one process reclaims a leftover and the others then
see the name gone or freshly made by their own engine:

* identity: a region held by a live process of another engine (same
  engine_id, another token) is refused, naming the pid; it is never joined;
* reclaim: a region whose discovery state is exactly `stale` is removed by the
  garbage collector's own rules (minus the minimum age: every holder is proven
  absent by /proc and flock, and the startup lock keeps our own ranks out);
  any other state (a future `unknown`, `creating`, ...) is never reclaimed;
* pre-flight: the bytes a new region will take are checked against the
  tmpfs, the memory cgroup and available memory before anything is created.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_offload_cli.core.base.errors import (
    OperationFailedError,
    RegionBusyError,
    UnsafeRegionError,
)
from vllm_offload_cli.core.base.text import pids_text
from vllm_offload_cli.core.host.discovery import (
    PERSISTENT,
    STALE,
    Inventory,
    RegionInfo,
    discover_engine,
)
from vllm_offload_cli.core.host.procscan import flock_holders
from vllm_offload_cli.core.reclaim import audit
from vllm_offload_cli.core.reclaim import report as gc_report
from vllm_offload_cli.core.reclaim.collector import reclaim
from vllm_offload_cli.core.reclaim.report import RemovedRegion
from vllm_offload_cli.core.region import capacity, fsguard
from vllm_offload_cli.core.region.locking import lock_waiting
from vllm_offload_cli.core.region.naming import manifest_path, region_path, validate_engine_id
from vllm_offload_cli.core.system import procfs
from vllm_offload_cli.core.system.files import UNTRUSTED_OPEN_FLAGS, FileId
from vllm_offload_cli.core.system.processes import comm
from vllm_offload_cli.engine.identity import (
    EngineIdCollisionError,
    read_token,
)
from vllm_offload_cli.engine.room import enabled as room_enabled
from vllm_offload_cli.engine.room import make_room
from vllm_offload_cli.engine.shape import (
    RegionShape,
    mismatch,
    refuse_held_other_shape,
    refuse_persistent_other_shape,
)

# What a claim did, or (dry run) would do.
CREATE, RECLAIMED, JOIN, WOULD_RECLAIM = "create", "reclaimed", "join", "would_reclaim"

# Kept-reasons that no retry can change: the leftover is not ours to remove.
_UNSAFE_KEPT = {gc_report.SYMLINK, gc_report.FOREIGN_OWNER, gc_report.NOT_REGULAR,
                gc_report.LINK_COUNT, gc_report.OTHER_FILESYSTEM,
                gc_report.UNREADABLE, gc_report.UNKNOWN}


@dataclass(frozen=True, kw_only=True)
class ClaimResult:
    """What one engine_id's name holds now, and what starting the engine will take."""

    engine_id: str
    path: str
    action: str  # CREATE, RECLAIMED, JOIN or WOULD_RECLAIM
    state_seen: str | None  # discovery state of the region found first, None if none
    engine_holders: tuple[int, ...]  # pids of this engine already holding it
    reclaimed_paths: tuple[str, ...]
    reclaimed_bytes: int  # tmpfs memory given back
    needed_bytes: int  # new bytes the engine will map (0 when joining)
    free_bytes: int | None = None  # tightest limit after the reclaim (None: not checked)
    notes: tuple[str, ...] = field(default_factory=tuple)
    # other engine_ids' stale leftovers removed (or, dry, to be) to make room (engine.room)
    reclaimed_for_room: tuple[RemovedRegion, ...] = ()


STARTUP_LOCK_NAME = "startup.lock"


@contextlib.contextmanager
def startup_lock(shm_dir: str | os.PathLike[str], *, timeout: float = 120.0) -> Iterator[None]:
    """Serialise this user's engine start-ups on this shm directory.

    The lock is a file in this user's private directory
    (`{shm_dir}/.vllm-offload-{uid}/`, mode 0700, judged on its descriptor),
    so nobody but this user and root can open it, let alone hold it: another
    user can neither stall nor time out our start-up. Another user's engines
    need no serialising against ours: they can neither join nor remove our
    files. The kernel drops the lock when its holder dies, even by SIGKILL.
    Not had within `timeout`: RegionBusyError (a refusal) naming the holder.
    """
    for attempt in range(3):
        dfd = fsguard.private_dir(shm_dir)
        try:
            fd = os.open(STARTUP_LOCK_NAME, os.O_RDWR | os.O_CREAT | UNTRUSTED_OPEN_FLAGS,
                         0o600, dir_fd=dfd)
            break
        except FileNotFoundError:  # a gc removed the (then empty) directory just now
            if attempt == 2:
                raise
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise fsguard.no_space(os.path.join(os.fspath(shm_dir),
                                                    fsguard.private_dir_name(),
                                                    STARTUP_LOCK_NAME), exc) from None
            raise
        finally:
            os.close(dfd)
    path = os.path.join(os.fspath(shm_dir), fsguard.private_dir_name(), STARTUP_LOCK_NAME)
    try:
        lock_waiting(fd, fcntl.LOCK_EX, timeout=timeout,
                     timed_out=lambda: _lock_busy(path, fd, timeout))
        yield
    finally:
        os.close(fd)


def _lock_busy(path: str, fd: int, timeout: float) -> RegionBusyError:
    pids = [pid for pid, _ in flock_holders(FileId.of(os.fstat(fd)))
            if pid > 0 and pid != os.getpid()]
    who = pids_text(pids, 3, comm) or "an unseen process"
    return RegionBusyError(
        f"the start-up lock {path} is still held after {timeout:.0f} s by {who}: another "
        "start-up of this user is stuck or slow; refusing to start without it",
        path=path, pid=pids[0] if pids else None, code="startup_lock_busy")


@dataclass(frozen=True)
class _Holders:
    ours: tuple[int, ...]
    foreign: tuple[tuple[int, str], ...]  # (pid, why)
    unknown: tuple[int, ...]  # cannot tell yet (not attached, environment unreadable)
    readers: tuple[int, ...] = ()  # hold it only in ways that cannot write it


def classify_holders(r: RegionInfo, token: str | None) -> _Holders:
    """Split a region's holders into this engine's, another engine's, readers and undecided.

    Proof of "ours", in order: this process; a live attachment in the manifest
    with our token; the manifest's live creator with our token; our token in
    the holder's environment. Without a token (a launcher) no holder is ours.
    A holder that is not ours and holds the region only read-only (every
    descriptor opened O_RDONLY, no mapping that may write; `procfs.may_write`)
    is a reader: our own probes (inspect measuring residency, gc judging) are,
    and no engine is, since an engine maps its region writable. That is the
    kernel's record, not a name or a marker the process chose, so nothing can
    pose as a reader and still write the bytes; and another user can hold our
    0600 files at all only through a descriptor one of ours handed it.
    """
    m = r.manifest
    fids = {s.file_id for s in r.segments if s.file_id is not None}
    known: dict[int, str | None] = {}  # pid -> token, of live attachments and our creator
    if m is not None:
        known = {a.pid: a.engine_token for a in m.live_attachments()}
        if (token is not None and m.engine_token == token and m.creator_pid not in known
                and m.creator_alive()):
            known[m.creator_pid] = token
    buckets: dict[str, list[int]] = {"ours": [], "unknown": [], "reader": []}
    foreign: list[tuple[int, str]] = []
    for h in r.holders:
        kind = _holder_kind(h.pid, token, known, fids)
        if kind in buckets:
            buckets[kind].append(h.pid)
        else:
            foreign.append((h.pid, kind))
    return _Holders(tuple(buckets["ours"]), tuple(foreign), tuple(buckets["unknown"]),
                    tuple(buckets["reader"]))


def _holder_kind(pid: int, token: str | None, known: dict[int, str | None],
                 fids: set[FileId]) -> str:
    """One holder: "ours", "reader", "unknown", or why it is another engine's."""
    if token is not None and (pid == os.getpid() or known.get(pid) == token):
        return "ours"
    if token is not None and pid in known:
        return "is attached to it for another engine"
    theirs, readable = read_token(pid) if token is not None else (None, True)
    if token is not None and theirs == token:
        return "ours"
    writes = procfs.may_write(pid, fids)
    if writes is False:
        return "reader"
    if writes is procfs.GONE:
        return "unknown"  # it exited since the scan: the next look settles it
    if token is None:
        return "holds it"
    if theirs is not None:
        return "belongs to another engine"
    return "was not started by this engine" if readable else "unknown"


_SHARED_BYTES = "two engines with one engine_id would share KV bytes"
_RELEASED = ("its name was released, so a new engine would get a fresh file and share no "
             "bytes with it, but two live engines under one engine_id cannot be told apart "
             "by inspect, gc or verify-rank-layout")


def _collision(engine_id: str, path: str, pid: int, why: str,
               harm: str = _SHARED_BYTES) -> EngineIdCollisionError:
    return EngineIdCollisionError(
        f"engine_id {engine_id!r} is in use: pid {pid} ({comm(pid) or '?'}) {why} "
        f"({path}); {harm}. Stop that engine or pick another engine_id",
        path=path, engine_id=engine_id, pid=pid,
    )


@dataclass
class _Progress:
    """What one claim has seen and done so far, for its result."""

    engine_id: str
    path: str
    state_seen: str | None = None
    reclaimed_paths: list[str] = field(default_factory=list)
    reclaimed_bytes: int = 0

    def result(self, action: str, **rest: Any) -> ClaimResult:
        fields: dict[str, Any] = {
            "engine_holders": (), "needed_bytes": 0, "state_seen": self.state_seen,
            "reclaimed_paths": tuple(self.reclaimed_paths),
            "reclaimed_bytes": self.reclaimed_bytes}
        return ClaimResult(engine_id=self.engine_id, path=self.path, action=action,
                           **(fields | rest))


@dataclass(frozen=True)
class _Verdict:
    """What to do with the region under the name: JOIN, WAIT (undecided) or RECLAIM."""

    action: str
    holders: tuple[int, ...] = ()
    note: str | None = None


_WAIT, _RECLAIM = "wait", "reclaim"


def claim(
    engine_id: str,
    *,
    shm_dir: str | os.PathLike[str],
    token: str | None,
    size_bytes: int | None = None,
    dry_run: bool = False,
    identity: bool = True,
    grace: float = 5.0,
    shape: RegionShape | None = None,
) -> ClaimResult:
    """Make the name `engine_id` safe to create or join; call under `startup_lock`.

    `identity=False` (no shared token could be established) joins any live
    region as vLLM would, but still reclaims only what is provably stale.
    A region to join must have the requested `shape` (default: `size_bytes`):
    held, another shape is exit 4 naming the holder; persistent, exit 6 with the
    command that removes it; stale, it is reclaimed like any leftover.
    """
    validate_engine_id(engine_id)
    want = shape if shape is not None or size_bytes is None else RegionShape(
        size_bytes=size_bytes)
    done = _Progress(engine_id, str(region_path(shm_dir, engine_id)))
    deadline = time.monotonic() + grace
    for _ in range(100):
        inv = discover_engine(shm_dir, engine_id)
        _refuse_squatters(inv.regions, str(manifest_path(shm_dir, engine_id)), engine_id)
        if identity:
            _refuse_released_by_another_engine(_own(inv.regions), token, engine_id)
        r = next((r for r in inv.regions if r.linked), None)
        if r is None:
            return _fits(done, CREATE if not done.reclaimed_paths else RECLAIMED,
                         size_bytes, shm_dir)
        done.state_seen = done.state_seen or r.state
        verdict = _classify(r, want, done.path, shm_dir, token, identity=identity,
                            patient=time.monotonic() < deadline)
        if verdict.action == _WAIT:
            time.sleep(0.05)
            continue
        if verdict.action == JOIN:
            return done.result(JOIN, engine_holders=verdict.holders,
                               notes=() if verdict.note is None else (verdict.note,))
        if dry_run:
            return _would_reclaim(done, r, want)
        if _reclaim_once(inv, done):
            # the name is free again: no second /proc pass (the next creator's O_EXCL
            # settles any race, as it would after a second look)
            return _fits(done, RECLAIMED, size_bytes, shm_dir)
    raise OperationFailedError(f"{done.path} kept changing while starting; is something "
                               "recreating it?", path=done.path, engine_id=engine_id)


def _classify(r: RegionInfo, want: RegionShape | None, path: str,
              shm_dir: str | os.PathLike[str], token: str | None, *, identity: bool,
              patient: bool) -> _Verdict:
    """Join, wait or reclaim the named region `r`; refuse (raise) what is neither.

    Held: joined when every holder is this engine's and the shape fits; a
    holder not yet told apart is waited for while `patient`. Persistent: joined
    when the shape fits. Stale: reclaimed. Anything else is never touched.
    """
    engine_id = r.engine_id
    if r.holders or r.locked:
        who = classify_holders(r, token) if identity else _Holders(
            tuple(h.pid for h in r.holders), (), ())
        if who.foreign:
            raise _collision(engine_id, path, *who.foreign[0])
        if who.unknown or not who.ours:  # undecided, readers only, or a lock we cannot place
            if patient:
                return _Verdict(_WAIT)
            if who.unknown:
                raise _collision(engine_id, path, who.unknown[0],
                                 "holds it and cannot be told apart from another engine")
            if who.readers:
                raise RegionBusyError(
                    f"{path} is held only by {pids_text(who.readers, 3, comm)}, which "
                    "only read it (an inspect or gc of this tool?), and still was after "
                    f"the wait: it is neither joined nor removed while held; retry",
                    path=path, engine_id=engine_id, pid=who.readers[0], code="region_busy")
            raise EngineIdCollisionError(
                f"{path} stays locked by a process this user cannot see (another pid "
                "namespace?); refusing to share it", path=path, engine_id=engine_id)
        refuse_held_other_shape(r, want, path, who.ours)
        return _Verdict(JOIN, who.ours)
    if r.state == PERSISTENT:
        refuse_persistent_other_shape(r, want, path, shm_dir)
        return _Verdict(JOIN, note="pre-provisioned by `vllm-offload create`")
    if r.state != STALE:
        why = f" ({r.problems[-1].message})" if r.problems else ""
        raise UnsafeRegionError(
            f"{path} is {r.state}: nothing proves it unused{why}, so it is neither joined "
            "nor removed; `vllm-offload inspect` shows why", path=path,
            engine_id=engine_id, code="region_not_stale")
    return _Verdict(_RECLAIM)


def _would_reclaim(done: _Progress, r: RegionInfo, want: RegionShape | None) -> ClaimResult:
    """A dry run's answer for a stale region: what the reclaim would free."""
    other = None if want is None else mismatch(r, want)
    return done.result(WOULD_RECLAIM, reclaimed_paths=tuple(r.paths),
                       # what the real run reports: tmpfs memory freed (st_blocks), not
                       # the apparent size of a partly written (sparse) leftover
                       reclaimed_bytes=r.allocated_bytes,
                       notes=() if other is None else (f"another shape: {other}",))


def _reclaim_once(inv: Inventory, done: _Progress) -> bool:
    """Remove the stale region by gc's own rules, audit-logged; True when its name is free.

    A leftover gc keeps for a reason no retry changes is refused here.
    """
    engine_id, path = done.engine_id, done.path
    report = reclaim(inv, gc_report.GcOptions(dry_run=False, min_age=0.0),
                     engine_ids=[engine_id])
    audit.record_removals(report.removed)  # "what deleted my region?": this start-up
    for removed in report.removed:
        done.reclaimed_paths += removed.paths
        done.reclaimed_bytes += removed.freed_bytes
    for kept in report.kept:
        if kept.code in _UNSAFE_KEPT:
            raise UnsafeRegionError(f"cannot reclaim the leftover {path}: {kept.message}",
                                    path=path, engine_id=engine_id, code=kept.code)
    if report.errors:
        raise OperationFailedError(report.errors[0].message, path=path, engine_id=engine_id)
    return bool(report.removed) and not report.kept and not os.path.lexists(path)


def _own(regions: Iterable[RegionInfo]) -> list[RegionInfo]:
    """Regions that are this user's: another user's file, linked or not, never makes a
    name in use for us, and neither does one whose owner could not be read (a mapping
    without a descriptor, seen without CAP_SYS_ADMIN): an unknown owner is never ours.
    An engine started through the hook keeps a descriptor, so its owner reads."""
    me = os.geteuid()
    return [r for r in regions if r.uid == me]


def _refuse_squatters(regions: Iterable[RegionInfo], mpath: str, engine_id: str) -> None:
    """A name of this engine_id taken by another user, or by anything but a regular
    file (segments, manifest), is refused naming the squatter: it can be neither
    created, nor joined, nor removed by us."""
    me = os.geteuid()
    for r in regions:
        if not r.linked:
            continue
        for seg in r.segments:
            if seg.file_id is not None and seg.uid == me:
                continue
            codes = {p.code for p in seg.problems}
            what, code = (("a symbolic link", "symlink") if "symlink" in codes else
                          ("not a regular file", "not_regular_file") if seg.file_id is None
                          else ("a regular file", "foreign_owner"))
            holders = ", ".join(f"pid {h.pid} ({h.name or '?'})" for h in r.holders[:3])
            raise _squat_error(seg.path, engine_id, seg.uid, what, code, holders,
                               r.holders[0].pid if r.holders else None)
    try:
        st = os.stat(mpath, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_uid == me:
        return
    what, code = (("a symbolic link", "symlink") if stat.S_ISLNK(st.st_mode) else
                  ("a directory", "not_regular_file") if stat.S_ISDIR(st.st_mode) else
                  ("a regular file", "foreign_owner") if stat.S_ISREG(st.st_mode) else
                  ("not a regular file", "not_regular_file"))
    raise _squat_error(mpath, engine_id, st.st_uid, what, code, "", None)


def _squat_error(path: str, engine_id: str, uid: int | None, what: str, code: str,
                 holders: str, pid: int | None) -> UnsafeRegionError:
    owner = "an unknown user" if uid is None else fsguard.user_text(uid)
    held = f", held by {holders}" if holders else ""
    return UnsafeRegionError(
        f"{path} is {what} owned by {owner}{held}: the name engine_id {engine_id!r} needs is "
        "squatted, so the engine can neither create nor join it; remove it as root after "
        "checking, or pick another engine_id", path=path, engine_id=engine_id, pid=pid,
        code=code)


def _refuse_released_by_another_engine(regions: Iterable[RegionInfo], token: str | None,
                                       engine_id: str) -> None:
    """A region whose name was released still belongs to a live engine with this id.

    It blocks no name, and a new region would share no bytes with it, but two engines
    under one engine_id is the collision this step exists to catch. Only a holder
    proven to be another engine's refuses; one we cannot read does not.
    """
    for r in regions:
        if r.linked:
            continue
        who = classify_holders(r, token)
        if who.foreign:
            pid, why = who.foreign[0]
            raise _collision(engine_id, r.paths[0] + " (deleted)", pid, why, _RELEASED)


def _fits(done: _Progress, action: str, size_bytes: int | None,
          shm_dir: str | os.PathLike[str]) -> ClaimResult:
    """The name is free: check that `size_bytes` fit (exit 5 when not)."""
    free: int | None = None
    room: tuple[RemovedRegion, ...] = ()
    if size_bytes is not None:
        if room_enabled():
            room = make_room(shm_dir, size_bytes)
        cap = capacity.measure(Path(shm_dir))
        capacity.check_fits(size_bytes, cap, shm_dir=Path(shm_dir), engine_id=done.engine_id)
        free = min(x for x in (cap.shm.free_bytes, cap.cgroup_free_bytes,
                               cap.mem_available_bytes) if x is not None)
    return done.result(action, needed_bytes=size_bytes or 0, free_bytes=free,
                       reclaimed_for_room=room)
