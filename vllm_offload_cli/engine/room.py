"""Room for a new region: this user's stale leftovers of other engine_ids give way, oldest
first and only as many as needed, by gc's own verdict and removal; a live one's never do.
A restarted engine has a fresh engine_id: without this, its predecessor's leftover would
refuse it (exit 5) for ever. `VLLM_OFFLOAD_RECLAIM_FOR_ROOM=0` turns it off."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from itertools import accumulate

from vllm_offload_cli.core.host import visibility
from vllm_offload_cli.core.host.discovery import STALE, RegionInfo, discover
from vllm_offload_cli.core.reclaim import audit
from vllm_offload_cli.core.reclaim.collector import reclaim
from vllm_offload_cli.core.reclaim.report import GcOptions, RemovedRegion
from vllm_offload_cli.core.region import capacity

RECLAIM_FOR_ROOM_ENV = "VLLM_OFFLOAD_RECLAIM_FOR_ROOM"
_OFF = ("0", "false", "no", "off")


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether leftovers of other engine_ids may give way (on unless the setting says 0)."""
    env = os.environ if environ is None else environ
    return env.get(RECLAIM_FOR_ROOM_ENV, "1").strip().lower() not in _OFF


def tightest(cap: capacity.Capacity) -> int:
    """The free bytes of the tightest limit: tmpfs, memory cgroup or available memory."""
    return min(x for x in (cap.shm.free_bytes, cap.cgroup_free_bytes, cap.mem_available_bytes)
               if x is not None)


def make_room(shm_dir: str | os.PathLike[str], size_bytes: int, *,
              dry_run: bool = False) -> tuple[RemovedRegion, ...]:
    """Remove (or, dry, name) the oldest stale leftovers of this user until `size_bytes`
    fit; what was removed. Nothing when it fits already or nothing may give way."""
    short = size_bytes - tightest(capacity.measure(os.fspath(shm_dir)))
    if short <= 0:
        return ()
    me = os.geteuid()
    # this user's files, and the processes that could open them: the collector
    # re-checks each removal against every process and the kernel's lease
    inv = discover(shm_dir, measure_residency=False, judge_uids=[me],
                   only=visibility.MayOpen(me, 0o600))
    oldest = sorted(filter(_may_give_way, inv.regions), key=lambda r: -(r.age_seconds or 0.0))
    freed_before = accumulate((r.allocated_bytes for r in oldest), initial=0)
    picked = [r for r, freed in zip(oldest, freed_before, strict=False) if freed < short]
    if not picked:
        return ()
    report = reclaim(replace(inv, regions=tuple(picked), orphan_manifests=()),
                     GcOptions(dry_run=dry_run, min_age=0.0),
                     engine_ids=[r.engine_id for r in picked])
    if not dry_run:
        audit.record_removals(report.removed)
    return report.removed


def _may_give_way(r: RegionInfo) -> bool:
    """gc's own verdict, and this user's: a linked `stale` region (so not persistent,
    creating or unknown) whose every file we own."""
    me = os.geteuid()
    return (r.linked and r.state == STALE and not r.persistent
            and all(s.uid == me for s in r.segments))

