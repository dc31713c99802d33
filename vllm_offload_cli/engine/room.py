"""Room for a new region: a crashed engine's leftovers give way, a live one's never do.

In a pod-sized tmpfs (a Kubernetes emptyDir with `medium: Memory`, which
outlives container restarts) an engine that crashed leaves its region behind,
and the restarted engine gets a fresh engine_id (vLLM's are UUIDs): the
leftover is not under its name, so the claim never reclaims it, the capacity
check refuses (exit 5), and the pod restarts into the same refusal for ever.
So before that refusal the start-up (the hook and `preflight`) removes this
user's leftovers that gc itself would remove: state `stale` (every holder
proven gone: /proc, locks and the kernel's lease), never persistent, never
`creating` or `unknown`, never another user's; oldest first, and only as many
as the new region lacks. Each goes through the collector's own removal (it
re-checks everything under its lock) and is audit-logged. A live or unknown
region is never touched: then the refusal stands.
`VLLM_OFFLOAD_RECLAIM_FOR_ROOM=0` (or `preflight --no-reclaim-for-room`)
turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace

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


def shortfall(size_bytes: int, cap: capacity.Capacity) -> int:
    """Bytes the tightest limit lacks for `size_bytes` (0 when it fits)."""
    free = [x for x in (cap.shm.free_bytes, cap.cgroup_free_bytes, cap.mem_available_bytes)
            if x is not None]
    return max(0, size_bytes - min(free)) if free else 0


def make_room(shm_dir: str | os.PathLike[str], size_bytes: int, *,
              dry_run: bool = False) -> tuple[RemovedRegion, ...]:
    """Remove (or, dry, name) the oldest stale leftovers of this user until `size_bytes`
    fit; what was removed. Nothing when it fits already or nothing may give way."""
    short = shortfall(size_bytes, capacity.measure(os.fspath(shm_dir)))
    if short <= 0:
        return ()
    me = os.geteuid()
    # this user's files only, and the processes that could have opened them: the
    # collector re-checks each removal against every process and the kernel's lease
    inv = discover(shm_dir, measure_residency=False, judge_uids=[me],
                   only=visibility.MayOpen(me, 0o600))
    picked: list[RegionInfo] = []
    freed = 0
    for r in sorted(filter(_may_give_way, inv.regions),
                    key=lambda r: -(r.age_seconds or 0.0)):
        if freed >= short:
            break
        picked.append(r)
        freed += r.allocated_bytes
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

