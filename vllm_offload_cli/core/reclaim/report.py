"""What a garbage collection did: frozen results the CLI renders and scripts read.

Every kept region carries a stable `code` (for metrics labels and scripts)
and a `reason` sentence for people.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_offload_cli.core.host.visibility import BlindSpot

DEFAULT_MIN_AGE = 60.0

# Why a region was kept: stable codes for scripts and metrics labels.
LIVE = "live"
BUSY = "busy"
PERSISTENT = "persistent"
TOO_YOUNG = "too_young"
FOREIGN_OWNER = "foreign_owner"
SYMLINK = "symlink"
NOT_REGULAR = "not_regular_file"
LINK_COUNT = "link_count"
OTHER_FILESYSTEM = "other_filesystem"
CHANGED = "changed"
UNREADABLE = "unreadable"
CREATION_RUNNING = "creating"  # its creator is alive and not finished
# a holder could be hidden from us (visibility.py): never removed, the run exits 6
UNKNOWN = "unknown"
KEPT_CODES = (LIVE, BUSY, PERSISTENT, TOO_YOUNG, FOREIGN_OWNER, SYMLINK, NOT_REGULAR,
              LINK_COUNT, OTHER_FILESYSTEM, CHANGED, UNREADABLE, UNKNOWN, CREATION_RUNNING)


@dataclass(frozen=True, kw_only=True)
class GcOptions:
    dry_run: bool = False
    min_age: float = DEFAULT_MIN_AGE
    include_persistent: bool = False
    all_users: bool = False
    shm_private_to_namespace: bool = False  # waives the pid_namespace blind spot only


@dataclass(frozen=True, kw_only=True)
class RemovedRegion:
    """A region that was removed (or, in a dry run, would be)."""

    engine_id: str
    paths: tuple[str, ...]
    bytes: int  # apparent size of its files
    freed_bytes: int  # tmpfs memory its files held (st_blocks): what removal gives back
    manifest: str | None
    age_seconds: float
    uid: int | None = None  # the owner of its files
    reason: str = ""  # why it was judged stale: the system log's record says it
    # processes that could not be inspected and could have opened it: the kernel's
    # lease alone proved that none of them had (the run warns, naming them)
    hidden_pids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, object]:
        return {"engine_id": self.engine_id, "paths": list(self.paths), "bytes": self.bytes,
                "freed_bytes": self.freed_bytes, "manifest": self.manifest,
                "age_seconds": round(self.age_seconds, 3), "uid": self.uid,
                "reason": self.reason, "hidden_pids": list(self.hidden_pids)}


@dataclass(frozen=True, kw_only=True)
class KeptRegion:
    """A region left in place, and why."""

    engine_id: str
    code: str
    reason: str
    paths: tuple[str, ...]
    pid: int | None = None
    linked: bool = True
    blind_spot: str | None = None  # with code "unknown": what may hide a holder

    def to_dict(self) -> dict[str, object]:
        return {"engine_id": self.engine_id, "code": self.code, "reason": self.reason,
                "paths": list(self.paths), "pid": self.pid, "linked": self.linked,
                "blind_spot": self.blind_spot}


@dataclass(frozen=True, kw_only=True)
class GcFailure:
    """A removal the system refused: the run exits 1."""

    path: str
    message: str
    engine_id: str | None = None
    code: str = "remove_failed"

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code, "message": self.message, "path": self.path,
                "engine_id": self.engine_id}


@dataclass(frozen=True, kw_only=True)
class GcReport:
    shm_dir: str
    options: GcOptions
    removed: tuple[RemovedRegion, ...]
    kept: tuple[KeptRegion, ...]
    orphan_manifests_removed: tuple[str, ...]
    temp_files_removed: tuple[str, ...]
    vanished: tuple[str, ...]  # engine_ids whose files disappeared while we looked
    not_found: tuple[str, ...]  # named engine_ids with nothing to collect
    errors: tuple[GcFailure, ...]
    regions_seen: int
    uninspectable_processes: int
    started_at: float
    duration_seconds: float
    # host-wide blind spots that stopped this run from removing anything
    blind_spots: tuple[BlindSpot, ...] = ()
    uninspectable_pids: tuple[int, ...] = ()

    @property
    def dry_run(self) -> bool:
        return self.options.dry_run

    @property
    def freed_bytes(self) -> int:
        return sum(r.freed_bytes for r in self.removed)

    @property
    def refused(self) -> tuple[KeptRegion, ...]:
        """Regions kept only because a holder could be hidden: the run exits 6."""
        return tuple(k for k in self.kept if k.code == UNKNOWN)

    def kept_by_code(self) -> dict[str, int]:
        counts = dict.fromkeys(KEPT_CODES, 0)
        for k in self.kept:
            counts[k.code] = counts.get(k.code, 0) + 1
        return counts
