"""Identity, reclaim, shape and room: what an engine process does before it maps a region,
under one start-up lock per user (docs/architecture.md, "engine hook")."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from pathlib import Path

from vllm_offload_cli.core.base import errors
from vllm_offload_cli.core.base.deadline import poll_until
from vllm_offload_cli.core.base.text import pids_text
from vllm_offload_cli.core.base.units import format_bytes
from vllm_offload_cli.core.host import discovery, visibility
from vllm_offload_cli.core.host.discovery import STALE, Inventory, RegionInfo
from vllm_offload_cli.core.host.procscan import flock_holders
from vllm_offload_cli.core.reclaim import audit
from vllm_offload_cli.core.reclaim import report as gc_report
from vllm_offload_cli.core.reclaim.collector import reclaim
from vllm_offload_cli.core.region import capacity, fsguard, naming
from vllm_offload_cli.core.region.geometry import mismatches
from vllm_offload_cli.core.system import procfs
from vllm_offload_cli.core.system.files import UNTRUSTED_OPEN_FLAGS, FileId
from vllm_offload_cli.core.system.processes import comm
from vllm_offload_cli.engine.identity import EngineIdCollisionError, read_token

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
    action: str = CREATE  # CREATE, RECLAIMED, JOIN or WOULD_RECLAIM
    state_seen: str | None = None  # discovery state of the region found first, None if none
    engine_holders: tuple[int, ...] = ()  # pids of this engine already holding it
    reclaimed_paths: tuple[str, ...] = ()
    reclaimed_bytes: int = 0  # tmpfs memory given back
    needed_bytes: int = 0  # new bytes the engine will map (0 when joining)
    free_bytes: int | None = None  # tightest limit after the reclaim (None: not checked)
    notes: tuple[str, ...] = ()
    # other engine_ids' stale leftovers removed (or, dry, to be) to make room (make_room)
    reclaimed_for_room: tuple[gc_report.RemovedRegion, ...] = ()


STARTUP_LOCK_NAME = "startup.lock"


@contextlib.contextmanager
def startup_lock(shm_dir: str | os.PathLike[str], *, timeout: float = 120.0) -> Iterator[None]:
    """Serialise this user's engine start-ups on this shm directory (RegionBusyError after
    `timeout`); in this user's private directory (0700), so no other user can stall it."""
    path = os.path.join(os.fspath(shm_dir), fsguard.private_dir_name(), STARTUP_LOCK_NAME)
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
                raise fsguard.no_space(path, exc) from None
            raise
        finally:
            os.close(dfd)
    try:
        fsguard.lock_waiting(fd, fcntl.LOCK_EX, timeout=timeout,
                             timed_out=lambda: _lock_busy(path, fd, timeout))
        yield
    finally:
        os.close(fd)


def _lock_busy(path: str, fd: int, timeout: float) -> errors.RegionBusyError:
    pids = [pid for pid, _ in flock_holders(FileId.of(os.fstat(fd)))
            if pid > 0 and pid != os.getpid()]
    who = pids_text(pids, 3, comm) or "an unseen process"
    return errors.RegionBusyError(
        f"the start-up lock {path} is still held after {timeout:.0f} s by {who}: another "
        "start-up of this user is stuck or slow; refusing to start without it",
        path=path, pid=pids[0] if pids else None, code="startup_lock_busy")


@dataclass(frozen=True)
class _Holders:
    ours: tuple[int, ...]
    foreign: tuple[tuple[int, str], ...]  # (pid, why)
    unknown: tuple[int, ...]  # cannot tell yet (not attached, environment unreadable)
    readers: tuple[int, ...] = ()  # hold it only in ways that cannot write it


_Tokens = dict[int, tuple[str | None, bool]]  # pid -> read_token(pid), one read per look
_UNDECIDED = ("ours", "unknown", "reader")  # every other kind says why it is foreign


def classify_holders(r: RegionInfo, token: str | None, tokens: _Tokens) -> _Holders:
    """Split a region's holders into this engine's (this process, or our token in a live
    attachment, the live creator's manifest or its environment), another engine's, undecided
    and readers (read-only holds, `procfs.may_write`: our own probes, never an engine)."""
    m = r.manifest
    fids = {s.file_id for s in r.segments if s.file_id is not None}
    known: dict[int, str | None] = {}  # pid -> token, of live attachments and our creator
    if m is not None:
        known = {a.pid: a.engine_token for a in m.live_attachments()}
        if (token is not None and m.engine_token == token and m.creator_pid not in known
                and m.creator_alive()):
            known[m.creator_pid] = token
    kinds = [(h.pid, _holder_kind(h.pid, token, known, fids, tokens)) for h in r.holders]
    ours, unknown, readers = (tuple(p for p, k in kinds if k == kind) for kind in _UNDECIDED)
    return _Holders(ours, tuple(x for x in kinds if x[1] not in _UNDECIDED), unknown, readers)


def _holder_kind(pid: int, token: str | None, known: dict[int, str | None],
                 fids: set[FileId], tokens: _Tokens) -> str:
    """One holder: "ours", "reader", "unknown", or why it is another engine's."""
    theirs, readable = None, True  # without a token nothing is read, nothing is ours
    if token is not None:
        if pid == os.getpid() or known.get(pid) == token:
            return "ours"
        if pid in known:
            return "is attached to it for another engine"
        if pid not in tokens:
            tokens[pid] = read_token(pid)
        theirs, readable = tokens[pid]
        if theirs == token:
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


_WAIT, _RECLAIM = "wait", "reclaim"
_CLAIM_TIMEOUT = 10.0  # seconds; the patient window for an unplaced holder is 5


def claim(
    engine_id: str,
    *,
    shm_dir: str | os.PathLike[str],
    token: str | None,
    size_bytes: int | None = None,
    dry_run: bool = False,
    identity: bool = True,
    shape: RegionShape | None = None,
) -> ClaimResult:
    """Make the name `engine_id` safe to create or join; call under `startup_lock`.
    `identity=False` (no shared token) joins any live region as vLLM would; only a stale
    one is reclaimed. Another `shape` (default: `size_bytes`) is exit 4 held, 6 persistent."""
    naming.validate_engine_id(engine_id)
    want = shape if shape is not None or size_bytes is None else RegionShape(
        size_bytes=size_bytes)
    done = ClaimResult(engine_id=engine_id, path=str(naming.region_path(shm_dir, engine_id)))
    deadline = time.monotonic() + 5.0  # for a holder not yet told apart

    def look() -> ClaimResult | None:
        """One look at the name: the claim, or None to look again."""
        nonlocal done
        inv = discovery.discover_engine(shm_dir, engine_id)
        _refuse_squatters(inv.regions, str(naming.manifest_path(shm_dir, engine_id)), engine_id)
        tokens: _Tokens = {}
        if identity:
            _refuse_released_by_another_engine(inv.regions, token, engine_id, tokens)
        r = next((r for r in inv.regions if r.linked), None)
        if r is None:
            return _fits(done, size_bytes, shm_dir)
        done = replace(done, state_seen=done.state_seen or r.state)
        verdict = _classify(r, want, done, shm_dir, token, tokens if identity else None,
                            patient=time.monotonic() < deadline)
        if isinstance(verdict, ClaimResult):
            return verdict
        if verdict == _WAIT:
            return None
        if dry_run:  # what the reclaim would free
            other = mismatch(r, want)
            return replace(done, action=WOULD_RECLAIM, reclaimed_paths=tuple(r.paths),
                           reclaimed_bytes=r.allocated_bytes,  # st_blocks, as a real run says
                           notes=() if other is None else (f"another shape: {other}",))
        done, free = _reclaim_once(inv, done)
        # no second /proc pass when free: the next creator's O_EXCL settles any race
        return _fits(done, size_bytes, shm_dir) if free else None

    # past the patient window an undecided holder is refused, so only a name that is
    # recreated as fast as it is reclaimed runs out this limit
    claimed = poll_until(look, timeout=_CLAIM_TIMEOUT, backoff=(0.05, 0.05))
    if claimed is None:
        raise errors.OperationFailedError(
            f"{done.path} kept changing while starting; is something recreating it?",
            path=done.path, engine_id=engine_id)
    return claimed


def _classify(r: RegionInfo, want: RegionShape | None, done: ClaimResult,
              shm_dir: str | os.PathLike[str], token: str | None, tokens: _Tokens | None, *,
              patient: bool) -> ClaimResult | str:
    """Join (the result), wait or reclaim the named region `r`; refuse (raise) the rest.
    `tokens` None: identity is not checked."""
    path = done.path
    if r.holders or r.locked:
        who = classify_holders(r, token, tokens) if tokens is not None else _Holders(
            tuple(h.pid for h in r.holders), (), ())
        if who.foreign:
            raise _collision(r.engine_id, path, *who.foreign[0])
        if who.unknown or not who.ours:  # undecided, readers only, or a lock we cannot place
            if patient:
                return _WAIT
            raise _undecided(who, path, r.engine_id)
        refuse_other_shape(r, want, path, shm_dir, who.ours)
        return replace(done, action=JOIN, engine_holders=who.ours)
    if r.state == discovery.PERSISTENT:
        refuse_other_shape(r, want, path, shm_dir, None)
        return replace(done, action=JOIN, notes=("pre-provisioned by `vllm-offload create`",))
    if r.state != STALE:
        why = f" ({r.problems[-1].message})" if r.problems else ""
        raise errors.UnsafeRegionError(
            f"{path} is {r.state}: nothing proves it unused{why}, so it is neither joined "
            "nor removed; `vllm-offload inspect` shows why", path=path,
            engine_id=r.engine_id, code="region_not_stale")
    return _RECLAIM


def _undecided(who: _Holders, path: str, engine_id: str) -> errors.RegionBusyError:
    """Why a held region is still neither joined nor removed after the wait."""
    if who.unknown:
        return _collision(engine_id, path, who.unknown[0],
                          "holds it and cannot be told apart from another engine")
    if who.readers:
        return errors.RegionBusyError(
            f"{path} is held only by {pids_text(who.readers, 3, comm)}, which "
            "only read it (an inspect or gc of this tool?), and still was after "
            f"the wait: it is neither joined nor removed while held; retry",
            path=path, engine_id=engine_id, pid=who.readers[0], code="region_busy")
    return EngineIdCollisionError(
        f"{path} stays locked by a process this user cannot see (another pid "
        "namespace?); refusing to share it", path=path, engine_id=engine_id)


def _reclaim_once(inv: Inventory, done: ClaimResult) -> tuple[ClaimResult, bool]:
    """Remove the stale region by gc's own rules, audit-logged: (the claim so far,
    whether its name is free); a leftover gc keeps for good is refused."""
    report = reclaim(inv, gc_report.GcOptions(dry_run=False, min_age=0.0),
                     engine_ids=[done.engine_id])
    audit.record_removals(report.removed)  # "what deleted my region?": this start-up
    done = replace(done, reclaimed_paths=done.reclaimed_paths + tuple(
        p for removed in report.removed for p in removed.paths),
        reclaimed_bytes=done.reclaimed_bytes + sum(x.freed_bytes for x in report.removed))
    for kept in report.kept:
        if kept.code in _UNSAFE_KEPT:
            raise errors.UnsafeRegionError(
                f"cannot reclaim the leftover {done.path}: {kept.message}", path=done.path,
                engine_id=done.engine_id, code=kept.code)
    if report.errors:
        raise errors.OperationFailedError(report.errors[0].message, path=done.path,
                                          engine_id=done.engine_id)
    return done, bool(report.removed) and not report.kept and not os.path.lexists(done.path)


# What a squatted name is: (in words, error code).
_SYMLINK = ("a symbolic link", "symlink")
_NOT_REGULAR = ("not a regular file", "not_regular_file")
_FOREIGN = ("a regular file", "foreign_owner")


def _refuse_squatters(regions: Iterable[RegionInfo], mpath: str, engine_id: str) -> None:
    """Refuse, naming the squatter, a name of this engine_id another user or a non-file holds."""
    me = os.geteuid()
    for r in (r for r in regions if r.linked):
        for seg in r.segments:
            if seg.file_id is None or seg.uid != me:
                kind = (_SYMLINK if any(p.code == "symlink" for p in seg.problems) else
                        _NOT_REGULAR if seg.file_id is None else _FOREIGN)
                raise _squat_error(seg.path, engine_id, seg.uid, kind, r.holders)
    try:
        st = os.stat(mpath, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode) or st.st_uid != me:
        kind = (_SYMLINK if stat.S_ISLNK(st.st_mode) else
                ("a directory", "not_regular_file") if stat.S_ISDIR(st.st_mode) else
                _FOREIGN if stat.S_ISREG(st.st_mode) else _NOT_REGULAR)
        raise _squat_error(mpath, engine_id, st.st_uid, kind, ())


def _squat_error(path: str, engine_id: str, uid: int | None, kind: tuple[str, str],
                 holders: Sequence[discovery.Holder]) -> errors.UnsafeRegionError:
    owner = "an unknown user" if uid is None else fsguard.user_text(uid)
    shown = ", ".join(f"pid {h.pid} ({h.name or '?'})" for h in holders[:3])
    held = f", held by {shown}" if shown else ""
    return errors.UnsafeRegionError(
        f"{path} is {kind[0]} owned by {owner}{held}: the name engine_id {engine_id!r} needs "
        "is squatted, so the engine can neither create nor join it; remove it as root after "
        "checking, or pick another engine_id", path=path, engine_id=engine_id,
        pid=holders[0].pid if holders else None, code=kind[1])


def _refuse_released_by_another_engine(regions: Iterable[RegionInfo], token: str | None,
                                       engine_id: str, tokens: _Tokens) -> None:
    """Two live engines under one engine_id collide even when one's name was released;
    only a holder proven another engine's refuses, and only in this user's region."""
    for r in regions:
        if not r.linked and r.uid == os.geteuid() and (
                foreign := classify_holders(r, token, tokens).foreign):
            raise _collision(engine_id, r.paths[0] + " (deleted)", *foreign[0], _RELEASED)


def _fits(done: ClaimResult, size_bytes: int | None,
          shm_dir: str | os.PathLike[str]) -> ClaimResult:
    """The name is free: check that `size_bytes` fit (exit 5 when not)."""
    done = replace(done, action=RECLAIMED if done.reclaimed_paths else CREATE,
                   needed_bytes=size_bytes or 0)
    if size_bytes is None:
        return done
    room = make_room(shm_dir, size_bytes)
    cap = capacity.measure(Path(shm_dir))
    capacity.check_fits(size_bytes, cap, shm_dir=Path(shm_dir), engine_id=done.engine_id)
    return replace(done, free_bytes=tightest(cap), reclaimed_for_room=room)


@dataclass(frozen=True, kw_only=True)
class RegionShape:
    """What the engine will map (None fields are not compared): a joiner of another size
    hangs, of another geometry reads its neighbours' KV bytes."""

    size_bytes: int
    num_segments: int | None = None
    num_blocks: int | None = None
    row_stride: int | None = None
    cpu_page_size: int | None = None
    world_size: int | None = None


def mismatch(r: RegionInfo, want: RegionShape | None) -> str | None:
    """How the region `r` differs from `want`, in words; None when it fits (or no `want`)."""
    if want is None:
        return None
    why = []
    if r.size_bytes != want.size_bytes:
        why.append(f"it is {format_bytes(r.size_bytes)} ({r.size_bytes} bytes), the engine "
                   f"maps {format_bytes(want.size_bytes)} ({want.size_bytes} bytes)")
    segments = len(r.segments)
    if want.num_segments is not None and segments != want.num_segments:
        why.append(f"it has {segments} segment file(s), the engine expects "
                   f"{want.num_segments}")
    if r.geometry is not None:
        why += mismatches(r.geometry, num_blocks=want.num_blocks, row_stride=want.row_stride,
                          cpu_page_size=want.cpu_page_size, world_size=want.world_size)
    return "; ".join(why) or None


def refuse_other_shape(r: RegionInfo, want: RegionShape | None, path: str,
                       shm_dir: str | os.PathLike[str], ours: tuple[int, ...] | None) -> None:
    """Joining a held region (`ours` not None) of another shape would hang (size) or corrupt
    (geometry); a pre-provisioned one is never removed for an engine: say how to remove it."""
    why = mismatch(r, want)
    if why is None:
        return
    code = "geometry_mismatch" if want and r.size_bytes == want.size_bytes else "size_mismatch"
    if ours is not None:
        pids = ours or tuple(h.pid for h in r.holders)
        who = pids_text(pids, 3, comm) or "a process"
        raise errors.RegionBusyError(
            f"{path} is in use by {who} with another shape than this engine asks for ({why}); "
            "it cannot be joined. Start every rank with the same configuration, or stop "
            f"{'that process' if len(pids) == 1 else 'those processes'} first",
            path=path, engine_id=r.engine_id, pid=pids[0] if pids else None, code=code)
    command = naming.gc_command(shm_dir, r.engine_id, include_persistent=True,
                                all_users=r.uid is not None and r.uid != os.geteuid())
    raise errors.UnsafeRegionError(
        f"{path} was pre-provisioned (`vllm-offload create`) with another shape than this "
        f"engine asks for ({why}); it is neither joined nor removed. Remove it with "
        f"`{command}`, or pre-provision it again with the engine's shape",
        path=path, engine_id=r.engine_id, code=code)


# -- room: this user's stale leftovers give way (a restarted engine has a fresh engine_id).

RECLAIM_FOR_ROOM_ENV = "VLLM_OFFLOAD_RECLAIM_FOR_ROOM"


def room_enabled() -> bool:
    """Whether leftovers of other engine_ids may give way (on unless the setting says 0)."""
    value = os.environ.get(RECLAIM_FOR_ROOM_ENV, "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def tightest(cap: capacity.Capacity) -> int:
    """The free bytes of the tightest limit: tmpfs, memory cgroup or available memory."""
    return min(x for x in (cap.shm.free_bytes, cap.cgroup_free_bytes, cap.mem_available_bytes)
               if x is not None)


def make_room(shm_dir: str | os.PathLike[str], size_bytes: int, *,
              dry_run: bool = False) -> tuple[gc_report.RemovedRegion, ...]:
    """Remove (or, dry, name) this user's oldest stale leftovers until `size_bytes` fit;
    what was removed (nothing when it fits, or `room_enabled()` says no)."""
    if not room_enabled():
        return ()
    if (short := size_bytes - tightest(capacity.measure(os.fspath(shm_dir)))) <= 0:
        return ()
    me = os.geteuid()
    # the collector re-checks each removal against every process and the kernel's lease
    inv = discovery.discover(shm_dir, measure_residency=False, judge_uids=[me],
                             only=visibility.MayOpen(me, 0o600))
    # gc's own verdict: a linked `stale` region (not persistent) whose every file we own
    oldest = sorted((r for r in inv.regions if r.linked and r.state == STALE
                     and not r.persistent and all(s.uid == me for s in r.segments)),
                    key=lambda r: -(r.age_seconds or 0.0))
    freed_before = accumulate((r.allocated_bytes for r in oldest), initial=0)
    picked = [r for r, freed in zip(oldest, freed_before, strict=False) if freed < short]
    if not picked:
        return ()
    report = reclaim(replace(inv, regions=tuple(picked), orphan_manifests=()),
                     gc_report.GcOptions(dry_run=dry_run, min_age=0.0),
                     engine_ids=[r.engine_id for r in picked])
    if not dry_run:
        audit.record_removals(report.removed)
    return report.removed
