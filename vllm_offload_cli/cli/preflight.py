"""`vllm-offload preflight`: the engine hook's start-up checks, for `ExecStartPre=` or init."""

from __future__ import annotations

from typing import Any

import click

from vllm_offload_cli.cli.common import Invocation, Out, Outcome, Size, shm_dir_checked, subcommand
from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.base.problems import jsonable
from vllm_offload_cli.core.base.units import format_bytes, int_problem
from vllm_offload_cli.core.region import capacity
from vllm_offload_cli.core.region.naming import validate_engine_id, with_dp_rank


@subcommand("preflight", help="Check (and clear) what an engine's start-up needs: a free "
            "engine_id and room for its region.")
@click.argument("engine_id")
@click.option("--size", type=Size(), required=True, help="Bytes each replica's region maps, "
              "e.g. 64GiB (vLLM's cpu_bytes_to_use).")
@click.option("--dp-size", type=click.IntRange(min=1), default=1, metavar="N",
              help="Data-parallel replicas: checks ENGINE_ID_dp0 .. _dp{N-1}.")
@click.option("--dry-run", "-n", is_flag=True,
              help="Say what would be reclaimed; remove nothing.")
@click.option("--segments", type=click.IntRange(min=1), metavar="N", help="Segment files per "
              "region the engine expects (vLLM 0.33's CPU spec: min(32, size // 1GiB); "
              "0.31's and 0.32's CPU spec, and every release's tiering spec: 1). Default: "
              "not compared.")
@click.option("--reclaim-for-room/--no-reclaim-for-room", default=True,
              help="When the regions do not fit, first remove this user's stale leftovers of "
              "other engine_ids (a crashed engine's, as gc would), oldest first, only as many "
              "as needed. Off also with VLLM_OFFLOAD_RECLAIM_FOR_ROOM=0.")
def preflight(inv: Invocation, engine_id: str, size: int, dp_size: int, dry_run: bool,
              segments: int | None, reclaim_for_room: bool) -> Outcome:
    """Refuse an engine_id held by a live process, reclaim a provably stale leftover
    region of it, and check that the regions (all replicas at once) fit in the shm
    directory, the memory cgroup and available memory. Run it before `vllm serve`, with
    the ENGINE_ID the engine will be given (the base id when --dp-size > 1).

    An existing region is "ready" only with the size (and, with --segments, the
    segment count) the engine will map: a stale one of another shape is reclaimed.
    Exit status: {SUCCESS} ready; {USAGE} bad input; {BUSY} in use; {NO_SPACE} too
    little room; {UNSAFE} a leftover that is not safe to touch, or a pre-provisioned
    region of another shape (the message gives the command that removes it).
    """
    from vllm_offload_cli.engine import claim as claims  # not needed by --help

    validate_engine_id(engine_id)
    if (problem := int_problem("--size", size)) is not None:
        raise InvalidInputError(problem, code="invalid_size")
    ids = [engine_id] if dp_size == 1 else [with_dp_rank(engine_id, k) for k in range(dp_size)]
    shm_dir = shm_dir_checked(inv)
    shape = claims.RegionShape(size_bytes=size, num_segments=segments)
    with claims.startup_lock(shm_dir, timeout=30.0):
        # capacity for all replicas together is checked below, once
        results = [claims.claim(eid, shm_dir=shm_dir, token=None, dry_run=dry_run, shape=shape)
                   for eid in ids]
        needed = size * sum(1 for r in results if r.action != "join")
        # a dry run has not freed the leftovers yet: count them as room
        reclaimable = sum(r.reclaimed_bytes for r in results if r.action == "would_reclaim")
        made = claims.make_room(shm_dir, max(needed - reclaimable, 0), dry_run=dry_run) \
            if reclaim_for_room else ()
        reclaimable += sum(r.freed_bytes for r in made) if dry_run else 0
        cap = capacity.measure(shm_dir)
        capacity.check_fits(max(needed - reclaimable, 0), cap, shm_dir=shm_dir,
                            engine_id=engine_id)
    data: dict[str, Any] = {
        "engine_id": engine_id,
        "dp_size": dp_size,
        "size_bytes": size,
        "needed_bytes": needed,
        "free_bytes": cap.shm.free_bytes,
        "dry_run": dry_run,
        "replicas": jsonable(results),
        # other engine_ids' stale leftovers removed (dry run: to be removed) to make room
        "reclaimed_for_room": jsonable(made),
    }
    return Outcome(data=data, render=lambda out: _render(out, data))


_SAYS = {
    "create": "free; the engine will create it",
    "reclaimed": "a stale leftover was removed; the engine will create it afresh",
    "would_reclaim": "a stale leftover would be removed (dry run)",
    "join": "exists and is not in use by another engine; the engine will join it",
}


def _render(out: Out, data: dict[str, Any]) -> None:
    for r in data["replicas"]:
        line = f"{r['engine_id']}: {_SAYS.get(r['action'], r['action'])}"
        if r["reclaimed_bytes"]:
            line += f" ({format_bytes(r['reclaimed_bytes'])})"
        if r["notes"]:
            line += f"; {'; '.join(r['notes'])}"
        out.print(line)
    for r in data["reclaimed_for_room"]:
        out.print(f"{r['engine_id']}: a stale leftover of another engine_id "
                  f"{'would be' if data['dry_run'] else 'was'} removed to make room "
                  f"({format_bytes(r['freed_bytes'])})")
    out.print(f"Ready: {format_bytes(data['needed_bytes'])} needed, "
              f"{format_bytes(data['free_bytes'])} free in the shm directory.")
