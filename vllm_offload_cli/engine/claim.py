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
import fcntl
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from vllm_offload_cli.core.base.errors import (
    OperationFailedError,
    RegionTimeoutError,
    UnsafeRegionError,
)
from vllm_offload_cli.core.host.discovery import PERSISTENT, STALE, RegionInfo, discover
from vllm_offload_cli.core.host.procscan import flock_holders
from vllm_offload_cli.core.reclaim import audit
from vllm_offload_cli.core.reclaim import report as gc_report
from vllm_offload_cli.core.reclaim.collector import reclaim
from vllm_offload_cli.core.region import capacity
from vllm_offload_cli.core.region.locking import lock_waiting
from vllm_offload_cli.core.region.naming import region_path, validate_engine_id
from vllm_offload_cli.core.system.files import FileId
from vllm_offload_cli.core.system.processes import ProcessRef, comm
from vllm_offload_cli.engine.identity import (
    EngineIdCollisionError,
    environ_readable,
    process_token,
)
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


@dataclass(frozen=True)
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

    def to_dict(self) -> dict[str, object]:
        return {"engine_id": self.engine_id, "path": self.path, "action": self.action,
                "state_seen": self.state_seen, "engine_holders": list(self.engine_holders),
                "reclaimed_paths": list(self.reclaimed_paths),
                "reclaimed_bytes": self.reclaimed_bytes, "needed_bytes": self.needed_bytes,
                "free_bytes": self.free_bytes, "notes": list(self.notes)}


@contextlib.contextmanager
def startup_lock(shm_dir: str | os.PathLike[str], *, timeout: float = 120.0) -> Iterator[None]:
    """Serialise engine start-ups on this shm directory (flock on the directory itself).

    Nothing is created for it, so nothing can leak; the kernel drops it when
    its holder dies, even by SIGKILL.
    """
    fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        lock_waiting(fd, fcntl.LOCK_EX, timeout=timeout, timed_out=lambda: RegionTimeoutError(
            f"waited {timeout:.0f} s for the start-up lock on {shm_dir}, held by "
            f"{_lock_holder_text(os.fstat(fd))}", path=os.fspath(shm_dir)))
        yield
    finally:
        os.close(fd)


def _lock_holder_text(st: os.stat_result) -> str:
    pids = [pid for pid, _ in flock_holders(FileId.of(st)) if pid > 0 and pid != os.getpid()]
    return ", ".join(f"pid {p} ({comm(p) or '?'})" for p in pids[:3]) or "an unseen process"


@dataclass(frozen=True)
class _Holders:
    ours: tuple[int, ...]
    foreign: tuple[tuple[int, str], ...]  # (pid, why)
    unknown: tuple[int, ...]  # cannot tell yet (not attached, environment unreadable)


def classify_holders(r: RegionInfo, token: str | None) -> _Holders:
    """Split a region's holders into this engine's, another engine's, and undecided.

    Proof of "ours", in order: this process; a live attachment in the manifest
    with our token; the manifest's live creator with our token; our token in
    the holder's environment. Without a token (a launcher) every holder is foreign.
    """
    me = os.getpid()
    m = r.manifest
    attached: dict[int, str | None] = {}
    creator_ours = False
    if m is not None:
        for a in m.attachments:
            if ProcessRef(a.pid, a.start_ticks).alive():
                attached[a.pid] = a.engine_token
        creator_ours = (token is not None and m.engine_token == token
                        and ProcessRef(m.creator_pid, m.creator_start_ticks).alive())
    ours: list[int] = []
    foreign: list[tuple[int, str]] = []
    unknown: list[int] = []
    for h in r.holders:
        if token is None:
            foreign.append((h.pid, "holds it"))
        elif h.pid == me:
            ours.append(h.pid)
        elif h.pid in attached:
            if attached[h.pid] == token:
                ours.append(h.pid)
            else:
                foreign.append((h.pid, "is attached to it for another engine"))
        elif creator_ours and m is not None and h.pid == m.creator_pid:
            ours.append(h.pid)
        else:
            theirs = process_token(h.pid)
            if theirs == token:
                ours.append(h.pid)
            elif theirs is not None:
                foreign.append((h.pid, "belongs to another engine"))
            elif environ_readable(h.pid):
                foreign.append((h.pid, "was not started by this engine"))
            else:
                unknown.append(h.pid)
    return _Holders(tuple(ours), tuple(foreign), tuple(unknown))


def _collision(engine_id: str, path: str, pid: int, why: str) -> EngineIdCollisionError:
    return EngineIdCollisionError(
        f"engine_id {engine_id!r} is in use: pid {pid} ({comm(pid) or '?'}) {why} "
        f"({path}); two engines with one engine_id would share KV bytes. Stop that "
        "engine or pick another engine_id", path=path, engine_id=engine_id, pid=pid,
    )


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
    path = str(region_path(shm_dir, engine_id))
    deadline = time.monotonic() + grace
    reclaimed_paths: list[str] = []
    reclaimed_bytes = 0
    first_state: str | None = None
    for _ in range(100):
        inv = discover(shm_dir, engine_ids=[engine_id], measure_residency=False)
        if identity:
            _refuse_released_by_another_engine(inv.regions, token, engine_id)
        named = [r for r in inv.regions if r.linked]
        if not named:
            return _fits(engine_id, path, CREATE if not reclaimed_paths else RECLAIMED,
                         first_state, tuple(reclaimed_paths), reclaimed_bytes, size_bytes,
                         shm_dir, dry_run)
        r = named[0]
        first_state = first_state or r.state
        held = bool(r.holders) or r.locked
        if held:
            who = classify_holders(r, token) if identity else _Holders(
                tuple(h.pid for h in r.holders), (), ())
            if who.foreign:
                raise _collision(engine_id, path, *who.foreign[0])
            if who.unknown or not r.holders:  # undecided, or only a lock we cannot place
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                if who.unknown:
                    raise _collision(engine_id, path, who.unknown[0],
                                     "holds it and cannot be told apart from another engine")
                raise EngineIdCollisionError(
                    f"{path} stays locked by a process this user cannot see (another pid "
                    "namespace?); refusing to share it", path=path, engine_id=engine_id)
            refuse_held_other_shape(r, want, path, who.ours)
            return ClaimResult(engine_id, path, JOIN, first_state, who.ours,
                               tuple(reclaimed_paths), reclaimed_bytes, 0)
        if r.state == PERSISTENT:
            refuse_persistent_other_shape(r, want, path, shm_dir)
            return ClaimResult(engine_id, path, JOIN, first_state, (), tuple(reclaimed_paths),
                               reclaimed_bytes, 0, notes=("pre-provisioned by "
                                                          "`vllm-offload create`",))
        if r.state != STALE:
            why = f" ({r.problems[-1].message})" if r.problems else ""
            raise UnsafeRegionError(
                f"{path} is {r.state}: nothing proves it unused{why}, so it is neither joined "
                "nor removed; `vllm-offload inspect` shows why", path=path,
                engine_id=engine_id, code="region_not_stale")
        if dry_run:
            other = None if want is None else mismatch(r, want)
            return ClaimResult(engine_id, path, WOULD_RECLAIM, first_state, (), tuple(r.paths),
                               sum(s.size_bytes for s in r.segments), 0, free_bytes=None,
                               notes=() if other is None else (f"another shape: {other}",))
        report = reclaim(inv, gc_report.GcOptions(dry_run=False, min_age=0.0),
                         engine_ids=[engine_id])
        audit.record_removals(report.removed)  # "what deleted my region?": this start-up
        for removed in report.removed:
            reclaimed_paths += removed.paths
            reclaimed_bytes += removed.freed_bytes
        for kept in report.kept:
            if kept.code in _UNSAFE_KEPT:
                raise UnsafeRegionError(f"cannot reclaim the leftover {path}: {kept.reason}",
                                        path=path, engine_id=engine_id, code=kept.code)
        if report.errors:
            raise OperationFailedError(report.errors[0].message, path=path,
                                       engine_id=engine_id)
    raise OperationFailedError(f"{path} kept changing while starting; is something "
                               "recreating it?", path=path, engine_id=engine_id)


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
            raise _collision(engine_id, r.paths[0] + " (deleted)", pid, why)


def _fits(engine_id: str, path: str, action: str, state: str | None,
          reclaimed: tuple[str, ...], reclaimed_bytes: int, size_bytes: int | None,
          shm_dir: str | os.PathLike[str], dry_run: bool) -> ClaimResult:
    free = None
    if size_bytes is not None:
        cap = capacity.measure(Path(shm_dir))
        capacity.check_fits(size_bytes, cap, shm_dir=Path(shm_dir), engine_id=engine_id)
        free = min(x for x in (cap.shm.free_bytes, cap.cgroup_free_bytes,
                               cap.mem_available_bytes) if x is not None)
    return ClaimResult(engine_id, path, action, state, (), reclaimed, reclaimed_bytes,
                       size_bytes or 0, free_bytes=free)
