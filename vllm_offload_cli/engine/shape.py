"""Does the region under a name have the shape an engine asks for? A joiner of another
size hangs, of another geometry reads its neighbours' KV bytes, of another segment
count finds no files."""

from __future__ import annotations

import os
from dataclasses import dataclass

from vllm_offload_cli.core.base.errors import RegionBusyError, UnsafeRegionError
from vllm_offload_cli.core.base.text import pids_text
from vllm_offload_cli.core.base.units import format_bytes
from vllm_offload_cli.core.host.discovery import RegionInfo
from vllm_offload_cli.core.region.geometry import mismatches
from vllm_offload_cli.core.region.naming import gc_command
from vllm_offload_cli.core.system.processes import comm


@dataclass(frozen=True, kw_only=True)
class RegionShape:
    """What the engine will map; None fields are not compared."""

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


def _code(r: RegionInfo, want: RegionShape | None) -> str:
    """The codes the core's own joiner uses for the same conditions."""
    return "size_mismatch" if want is None or r.size_bytes != want.size_bytes \
        else "geometry_mismatch"


def refuse_held_other_shape(r: RegionInfo, want: RegionShape | None, path: str,
                             ours: tuple[int, ...]) -> None:
    """Joining a live region of another shape would hang (size) or corrupt (geometry)."""
    why = mismatch(r, want)
    if why is None:
        return
    pids = ours or tuple(h.pid for h in r.holders)
    who = pids_text(pids, 3, comm) or "a process"
    raise RegionBusyError(
        f"{path} is in use by {who} with another shape than this engine asks for ({why}); "
        "it cannot be joined. Start every rank with the same configuration, or stop "
        f"{'that process' if len(pids) == 1 else 'those processes'} first",
        path=path, engine_id=r.engine_id, pid=pids[0] if pids else None,
        code=_code(r, want))


def refuse_persistent_other_shape(r: RegionInfo, want: RegionShape | None, path: str,
                                   shm_dir: str | os.PathLike[str]) -> None:
    """A pre-provisioned region is never removed for an engine: say how to remove it."""
    why = mismatch(r, want)
    if why is None:
        return
    command = gc_command(shm_dir, r.engine_id, include_persistent=True,
                         all_users=r.uid is not None and r.uid != os.geteuid())
    raise UnsafeRegionError(
        f"{path} was pre-provisioned (`vllm-offload create`) with another shape than this "
        f"engine asks for ({why}); it is neither joined nor removed. Remove it with "
        f"`{command}`, or pre-provision it again with the engine's shape",
        path=path, engine_id=r.engine_id, code=_code(r, want))
