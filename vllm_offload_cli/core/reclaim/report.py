"""What a garbage collection did: frozen results the CLI renders and scripts read. A kept
region, and a refused removal (exit FAILED), is a `Problem` with a stable `code`."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.base.problems import Problem, jsonable
from vllm_offload_cli.core.host.discovery import Tally
from vllm_offload_cli.core.region import fsguard

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
UNKNOWN = "unknown"  # a holder could be hidden (visibility.py): kept, the run exits UNSAFE
KEPT_CODES = (LIVE, BUSY, PERSISTENT, TOO_YOUNG, FOREIGN_OWNER, SYMLINK, NOT_REGULAR,
              LINK_COUNT, OTHER_FILESYSTEM, CHANGED, UNREADABLE, UNKNOWN, CREATION_RUNNING)


@dataclass(frozen=True, kw_only=True)
class GcOptions:
    dry_run: bool = False
    min_age: float = DEFAULT_MIN_AGE
    include_persistent: bool = False
    all_users: bool = False
    shm_private_to_namespace: bool = False  # waives the pid_namespace blind spot only

    def __post_init__(self) -> None:  # options that exist can be acted on
        if not self.min_age >= 0:  # also refuses NaN
            raise InvalidInputError(f"--min-age must be >= 0 seconds, got {self.min_age}",
                                    code="invalid_min_age")
        if self.all_users and os.geteuid() != 0:
            raise InvalidInputError(
                "--all-users needs root: only root may remove other users' regions; run it as "
                "root, or without --all-users to collect your own", code="not_root",
            )

    @property
    def owners(self) -> fsguard.AllowedUids:  # whose files this run may remove
        return fsguard.EVERY_UID if self.all_users else frozenset({os.geteuid()})


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
    hidden_pids: tuple[int, ...] = ()  # uninspectable, cleared by the kernel's lease alone

    def to_dict(self) -> dict[str, object]:
        return {**jsonable(self), "age_seconds": round(self.age_seconds, 3)}


REMOVE_FAILED = "remove_failed"  # the code of a removal the system refused


@dataclass(frozen=True, kw_only=True)
class GcReport:
    shm_dir: str
    options: GcOptions
    removed: tuple[RemovedRegion, ...]
    kept: tuple[Problem, ...]
    orphan_manifests_removed: tuple[str, ...]
    temp_files_removed: tuple[str, ...]
    vanished: tuple[str, ...]  # engine_ids whose files disappeared while we looked
    not_found: tuple[str, ...]  # named engine_ids with nothing to collect
    errors: tuple[Problem, ...]  # removals the system refused: the run exits FAILED
    regions_seen: int
    uninspectable_processes: int
    started_at: float
    duration_seconds: float
    # host-wide blind spots that stopped this run from removing anything
    blind_spots: tuple[Problem, ...] = ()
    uninspectable_pids: tuple[int, ...] = ()
    not_judged: tuple[Tally, ...] = ()  # removable files not judged in time: exit PARTIAL
    # files of owners this run may not remove, counted per owner past the first few
    counted: tuple[Tally, ...] = ()
    listed_all: bool = True  # False: time ran out before the directory was even listed

    @property
    def not_judged_files(self) -> int:
        return sum(t.files for t in self.not_judged)

    @property
    def partial(self) -> bool:
        """Not everything was judged in time: the run exits PARTIAL."""
        return bool(self.not_judged) or not self.listed_all

    @property
    def freed_bytes(self) -> int:
        return sum(r.freed_bytes for r in self.removed)

    @property
    def refused(self) -> tuple[Problem, ...]:
        """Regions kept only because a holder could be hidden: the run exits UNSAFE."""
        return tuple(k for k in self.kept if k.code == UNKNOWN)

    def kept_by_code(self) -> dict[str, int]:
        return {**dict.fromkeys(KEPT_CODES, 0), **Counter(k.code for k in self.kept)}
