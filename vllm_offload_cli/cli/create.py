"""`vllm-offload create`: make a region exactly as vLLM lays it out, pre-faulted."""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import TYPE_CHECKING, Any

import click

from vllm_offload_cli.cli import common
from vllm_offload_cli.cli.common import Invocation, Out, Outcome, Size, shm_dir_checked, subcommand
from vllm_offload_cli.core.base.errors import InvalidInputError, RegionBusyError, UnsafeRegionError
from vllm_offload_cli.core.base.exit_status import ExitStatus, with_statuses
from vllm_offload_cli.core.base.problems import jsonable
from vllm_offload_cli.core.base.text import shortened
from vllm_offload_cli.core.base.units import format_bytes, int_problem
from vllm_offload_cli.core.region import geometry as geo
from vllm_offload_cli.core.region.geometry import MIN_SEGMENT_BYTES, VLLM_CPU_SEGMENTS, Geometry
from vllm_offload_cli.core.region.naming import with_dp_rank
from vllm_offload_cli.core.system.memory import parse_cpulist

if TYPE_CHECKING:
    from vllm_offload_cli.core.region.shared_region import SharedOffloadRegion


def _layout(choice: str, segments: int | None, geometry: Geometry
            ) -> tuple[int, int, str, str | None, str | None]:
    """(files asked for, vLLM's smallest file, basis, vLLM version, warning): `auto` reads the
    vLLM installed here, else takes the newest release's layout and warns for older ones."""
    if segments is not None and choice != "auto":
        raise InvalidInputError("give one of --segments and --vllm-layout", code="usage")
    if segments is not None:
        return _segments(segments, geometry), MIN_SEGMENT_BYTES, "requested", None, None
    if choice != "auto":
        files = VLLM_CPU_SEGMENTS if choice == "segmented" else 1
        return files, MIN_SEGMENT_BYTES, "requested", None, None
    from vllm_offload_cli.engine.vllm_rules import UnsupportedVllm, read_rules, vllm_root

    if (root := vllm_root()) is None:
        files = geo.effective_segments(VLLM_CPU_SEGMENTS, geometry.size_bytes)
        warning = None if files == 1 else (
            "no vLLM is installed here, so the region has the newest release's layout "
            f"(vLLM 0.33's CPU spec: {files} files); an engine on vLLM 0.31 or 0.32, or on "
            "a tiering spec, needs --vllm-layout single-file")
        return VLLM_CPU_SEGMENTS, MIN_SEGMENT_BYTES, "newest", None, warning
    try:
        rules = read_rules(root)
    except UnsupportedVllm as exc:
        raise InvalidInputError(f"cannot tell which layout the vLLM here makes ({exc}); "
                                "pass --vllm-layout segmented or single-file",
                                code="unknown_vllm") from None
    return rules.cpu_worker.segments, rules.min_segment_bytes, "vllm", rules.version, None


def _nodes(spec: str | None) -> tuple[int, ...] | None:
    if spec is None:
        return None
    try:
        nodes = parse_cpulist(spec)
    except ValueError:
        nodes = frozenset()
    if not nodes:
        raise InvalidInputError(f"--numa-node {spec!r} is not a node number or list (e.g. 0, "
                                "0,1 or 0-3)", code="invalid_numa_node")
    return tuple(sorted(nodes))


def _segments(requested: int, geometry: Geometry) -> int:
    """Exactly the file count asked for: one vLLM cannot make (no file under 1 GiB, each
    `cdiv(num_blocks, n)` rows) is refused with the counts that can be, never lowered."""
    def files(n: int) -> int:
        return len(geo.split(geometry.num_blocks, geometry.row_stride, n))

    cap = max(1, geometry.size_bytes // MIN_SEGMENT_BYTES)
    if requested <= cap and files(requested) == requested:
        return requested
    possible = [n for n in range(1, min(cap, 64) + 1) if files(n) == n]
    why = (f"no file may be under {format_bytes(MIN_SEGMENT_BYTES)}" if requested > cap else
           f"{geometry.num_blocks} rows split {requested} ways as vLLM splits them make "
           f"{files(requested)} files")
    raise InvalidInputError(
        f"--segments {requested} cannot be made for {format_bytes(geometry.size_bytes)} "
        f"({why}); possible: {shortened(possible, 8)}", code="invalid_segments")


def _busy_with_holders(exc: RegionBusyError, shm_dir: str, engine_id: str) -> RegionBusyError:
    """A taken name that a live process holds: say which, not only how to remove it."""
    from vllm_offload_cli.core.host.discovery import discover

    found = discover(shm_dir, engine_ids=[engine_id], measure_residency=False).find(engine_id)
    holders = [h for r in found for h in r.holders]
    if not holders or any(r.state == "creating" for r in found):
        return exc  # nobody, or its creator, which the core's message names already
    first = holders[0]
    more = f" and {len(holders) - 1} other process(es)" if len(holders) > 1 else ""
    return RegionBusyError(
        f"{exc.path or engine_id} already exists and is in use by pid {first.pid} "
        f"({first.name or '?'}){more}; pick another engine_id, or stop what holds it",
        path=exc.path, engine_id=engine_id, pid=first.pid, code=exc.code)


def _geometry(world_size: int, page: int, num_blocks: int | None,
              total: int | None, inv: Invocation) -> Geometry:
    if (num_blocks is None) == (total is None):
        raise InvalidInputError("give exactly one of --num-blocks and --size",
                                code="invalid_geometry")
    for flag, value in (("--world-size", world_size), ("--cpu-page-size", page),
                        ("--num-blocks", num_blocks), ("--size", total)):
        if value is not None and (problem := int_problem(flag, value)) is not None:
            raise InvalidInputError(problem, code="invalid_geometry")
    if num_blocks is not None:
        return Geometry.for_workers(num_blocks=num_blocks, world_size=world_size,
                                    cpu_page_size=page)
    assert total is not None
    geometry, rest = geo.geometry_from_size(total, world_size=world_size, cpu_page_size=page)
    if rest:
        inv.warn("size_rounded", f"--size of {total} bytes is not a whole number of rows; using "
                 f"{geometry.num_blocks} rows ({format_bytes(geometry.size_bytes)}), "
                 f"{rest} bytes unused")
    return geometry


@subcommand("create")
@click.argument("engine_id")
@click.option("--world-size", type=int, required=True, metavar="N",
              help="Workers per replica (one slot each in every row).")
@click.option("--cpu-page-size", type=Size(), required=True, help="Bytes per worker slot, "
              "e.g. 64KiB (K, M, G and KiB, MiB, GiB are powers of 1024; KB, MB, GB powers of "
              "1000).")
@click.option("--dp-rank", type=int, metavar="N", help="Append _dp{N} to the engine id, as "
              "vLLM does.")
@click.option("--num-blocks", type=int, metavar="N", help="Rows (KV blocks).")
@click.option("--size", type=Size(), help="Total size, e.g. 4GiB or 4G; rounded down to whole "
              "rows (the size made is printed).")
@click.option("--no-populate", is_flag=True, help="Do not pre-fault; memory is then allocated "
              "on first use.")
@click.option("--hold", is_flag=True, help="Hold the region until SIGINT/SIGTERM, then remove it.")
@click.option("--threads", type=click.IntRange(min=1), metavar="N",
              show_default="min(8, CPUs)", help="Pre-fault threads.")
@click.option("--numa-node", metavar="NODES", help="Place the region's pages on this NUMA node "
              "(or list, e.g. 0-1 for interleave) before pre-fault.")
@click.option("--numa-policy", type=click.Choice(["bind", "interleave", "preferred"]),
              show_default="bind with --numa-node", help="bind: only these nodes; interleave: "
              "round-robin over them (default: all nodes); preferred: this node first.")
@click.option("--huge-pages", type=click.Choice(["never", "auto", "always"]), default="never",
              help=with_statuses("Transparent huge pages: always (error, exit {NO_SPACE}, "
                                 "where the kernel refuses), auto (warn and continue), never."))
@click.option("--segments", type=click.IntRange(min=1), metavar="N",
              show_default="as --vllm-layout makes them",
              help="Split into exactly this many files .mmap, .mmap.1, ... as vLLM does (1 for "
              "the tiering spec); a count vLLM could not make at this size (a file under 1 GiB) "
              "is refused.")
@click.option("--owner", metavar="USER[:GROUP]", help="Give the region's files and manifest "
              "to this user (and group), as `install -o -g` does: root pre-creates a region "
              "that an engine running as that user joins. Names or numbers; root only, unless "
              "it is yourself.")
@click.option("--mode", default="0600", metavar="MODE", help="The region files' permission "
              "bits, octal (as `install -m`): the owner's read and write, no group or other "
              "bits (an engine refuses to join a region others can open).")
@click.option("--vllm-layout", type=click.Choice(["auto", "segmented", "single-file"]),
              default="auto",
              help="Files as the joining vLLM makes them: segmented (.mmap, .mmap.1, ...: "
              "min(32, size // 1GiB) files, vLLM 0.33's CPU spec), single-file (vLLM 0.31 and "
              "0.32, every tiering spec), or auto: what the CPU spec of the vLLM installed here "
              "makes (segmented when none is found).")
def create(inv: Invocation, engine_id: str, world_size: int, cpu_page_size: int,
           dp_rank: int | None, num_blocks: int | None, size: int | None, no_populate: bool,
           hold: bool, threads: int | None, numa_node: str | None,
           numa_policy: str | None, huge_pages: str, segments: int | None,
           owner: str | None, mode: str, vllm_layout: str) -> Outcome:
    """Create a region as vLLM lays it out, pre-fault it and describe it in a manifest.

    ENGINE_ID is the region's name (the base id when --dp-rank is given).

    Without --hold the region stays and is marked persistent, pre-provisioned for
    an engine to join (with --owner, one running as another user, like a tmpfiles.d
    `f` line); `gc` keeps it unless given --include-persistent.
    --hold ends on SIGINT (exit {INTERRUPTED}) or SIGTERM (exit {SUCCESS}), removing the region.
    """
    from vllm_offload_cli.core.region.shared_region import SharedOffloadRegion  # not for --help

    full_id = with_dp_rank(engine_id, dp_rank)
    geometry = _geometry(world_size, cpu_page_size, num_blocks, size, inv)
    shm_dir = shm_dir_checked(inv)
    new_owner = None if owner is None else parse_owner(owner)
    file_mode = parse_mode(mode)
    nodes = _nodes(numa_node)
    files, min_segment_bytes, basis, version, layout_warning = _layout(vllm_layout, segments,
                                                                       geometry)
    with inv.progress("pre-faulting", geometry.size_bytes) as progress:
        try:
            region = SharedOffloadRegion(
                full_id, geometry.num_blocks, None, geometry.row_stride,
                geometry.cpu_page_size, shm_dir=shm_dir, world_size=geometry.world_size,
                create_only=True, persistent=not hold, populate_pages=not no_populate,
                populate_threads=common.prefault_threads(threads), progress=progress,
                numa_node=nodes, numa_policy=numa_policy, huge_pages=huge_pages,
                num_segments=files, min_segment_bytes=min_segment_bytes, vllm_layout_basis=basis,
            )
        except RegionBusyError as exc:
            if exc.code != "name_taken":
                raise
            raise _busy_with_holders(exc, shm_dir, full_id) from exc
    if layout_warning is not None:  # said once the region exists, not before a refusal
        inv.warn("vllm_not_found", layout_warning)
    data = _created(region, geometry, hold, basis, version)
    if huge_pages == "always" and data["populated"] and not region.huge_page_bytes:
        inv.warn("no_huge_pages", "--huge-pages always: the kernel allows huge pages here but "
                 "mapped none (fragmented memory, or the region is smaller than 2 MiB)")
    if new_owner is not None or file_mode != 0o600:
        uid, gid = new_owner or (os.geteuid(), os.getegid())
        data["owner"] = {"uid": uid, "gid": gid, "mode": f"{file_mode:04o}"}
    if not hold:
        region.cleanup()  # persistent: closes without unlinking
    if "owner" in data:  # after the last write of ours: a join then finds it theirs
        hand_over([*region.segment_paths, region.manifest_path], region.manifest_path,
                  data["owner"]["uid"], data["owner"]["gid"], file_mode)
    if not hold:
        return Outcome(data=data, render=lambda out: _render(out, data))
    return _held(inv, region, data)


def _created(region: SharedOffloadRegion, geometry: Geometry, hold: bool, basis: str,
             version: str | None) -> dict[str, Any]:
    """What `create` made: the JSON data, also what the text says."""
    stats = region.populate_stats
    return {
        "engine_id": region.engine_id,
        "path": region.mmap_path,
        "paths": region.segment_paths,
        "manifest": region.manifest_path,
        "size_bytes": geometry.size_bytes,
        "geometry": jsonable(geometry),
        "populated": stats is not None,
        "populate_seconds": None if stats is None else round(stats.seconds, 6),
        "populate_gbps": None if stats is None else round(stats.gbps, 3),
        "populate_threads": None if stats is None else stats.threads,
        "persistent": not hold,
        "held": hold,
        "vllm_layout": {"name": geo.layout_of(len(region.segments)), "basis": basis,
                        "vllm_version": version},
        "placement": {**region.placement.to_record(),
                      "huge_page_bytes": region.huge_page_bytes},
    }


def _held(inv: Invocation, region: SharedOffloadRegion, data: dict[str, Any]) -> Outcome:
    """--hold: keep the region mapped until SIGINT or SIGTERM, then remove it."""
    previous: dict[int, Any] = {}

    def release(signum: int, frame: FrameType | None) -> None:
        data["released_by"] = signal.Signals(signum).name
        raise KeyboardInterrupt

    try:
        previous = {s: signal.signal(s, release) for s in (signal.SIGINT, signal.SIGTERM)}
        if not inv.json_output:
            _render(inv.out, data)
            inv.out.print("Holding the region; press Ctrl-C (or send SIGTERM) to remove it.")
        while True:
            signal.pause()
    except KeyboardInterrupt:
        data.setdefault("released_by", "SIGINT")
    finally:
        try:
            region.cleanup()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    data["removed"] = not os.path.exists(region.mmap_path)
    # Ctrl-C is an interruption (130, as a shell expects); SIGTERM is the asked-for stop
    code = ExitStatus.INTERRUPTED if data["released_by"] == "SIGINT" else ExitStatus.SUCCESS
    return Outcome(data=data, exit_code=code, render=lambda out: out.print(
        f"Removed {region.mmap_path} ({data['released_by']})."))


def parse_owner(text: str) -> tuple[int, int]:
    """USER[:GROUP] (names or numbers) as (uid, gid); the user's own group by default."""
    import grp
    import pwd

    user, sep, group = text.partition(":")
    try:
        entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
        uid, gid = entry.pw_uid, entry.pw_gid
    except (KeyError, OverflowError):
        if not user.isdigit():
            raise InvalidInputError(f"--owner {text!r}: no user {user!r}",
                                    code="invalid_owner") from None
        uid, gid = int(user), int(user)
    if sep:
        try:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        except KeyError:
            raise InvalidInputError(f"--owner {text!r}: no group {group!r}",
                                    code="invalid_owner") from None
    if uid != os.geteuid() and os.geteuid() != 0:
        raise InvalidInputError(f"--owner {text!r}: only root can give a region to another "
                                "user", code="invalid_owner")
    return uid, gid


def parse_mode(text: str) -> int:
    """Octal bits a joining engine accepts: owner read+write, no group, other or special."""
    try:
        value = int(text, 8)
    except ValueError:
        raise InvalidInputError(f"--mode {text!r} is not an octal mode such as 0600",
                                code="invalid_mode") from None
    if value & ~0o777 or value & 0o600 != 0o600 or value & 0o077:
        raise InvalidInputError(
            f"--mode {text!r}: a region must be readable and writable by its owner and by "
            "nobody else (an engine refuses to join a region with group or other bits: "
            "another user could read or change its KV cache); use 0600 (or 0700), and "
            "--owner to say who joins", code="invalid_mode")
    return value


def hand_over(paths: list[str], manifest_path: str, uid: int, gid: int, mode: int) -> None:
    """chown (and chmod the region files) through descriptors opened without following:
    what is changed is the file this create made, never something put in its place."""
    from vllm_offload_cli.core.region import fsguard

    me = os.geteuid()
    for path in paths:
        fd = fsguard.open_existing(path, os.O_RDONLY)
        try:
            if (st := os.fstat(fd)).st_uid != me or st.st_nlink != 1:  # not the file we made
                raise UnsafeRegionError(f"{path} changed under create (owner {st.st_uid}, "
                                        f"{st.st_nlink} links); not handing it over",
                                        path=path, code="changed")
            os.fchown(fd, uid, gid)
            if path != manifest_path:
                os.fchmod(fd, mode)
        finally:
            os.close(fd)


def _render(out: Out, data: dict[str, Any]) -> None:
    g = data["geometry"]
    out.print(f"Created {data['path']}")
    if len(data["paths"]) > 1:
        out.print(f"  segments  {len(data['paths'])} files ({data['path']}.1 ...)")
    out.print(f"  size      {format_bytes(data['size_bytes'])} ({data['size_bytes']} bytes)")
    out.print(f"  geometry  {g['num_blocks']} rows x {g['row_stride']} bytes; "
              f"{g['world_size']} slot(s) of {g['cpu_page_size']} bytes")
    layout = data["vllm_layout"]
    why = {"vllm": f"read from the vLLM {layout['vllm_version'] or ''} installed here",
           "newest": "the newest vLLM's: none is installed here",
           "requested": "as asked"}[layout["basis"]]
    out.print(f"  layout    {layout['name']} ({why.replace('  ', ' ')})")
    if data["populated"]:
        out.print(f"  pre-fault {data['populate_seconds']:.3f} s "
                  f"({data['populate_gbps']:.2f} GB/s, {data['populate_threads']} thread(s))")
    else:
        out.print("  pre-fault skipped (--no-populate)")
    p = data["placement"]
    if p["numa_policy"] is not None:
        out.print(f"  numa      {p['numa_policy']} node(s) "
                  f"{','.join(str(n) for n in p['numa_nodes'])}")
    if p["huge_pages"] != "never":
        got = p["huge_page_bytes"]
        out.print(f"  huge pages {p['huge_pages']}: " + (
            "not available (normal pages)" if not p["huge_pages_advised"] else
            f"{format_bytes(got)} mapped with 2 MiB pages" if got is not None else "advised"))
    if "owner" in data:
        o = data["owner"]
        out.print(f"  owner     uid {o['uid']}, gid {o['gid']}, mode {o['mode']}")
    if data["persistent"]:
        out.print("  persistent: kept until removed with `vllm-offload gc --include-persistent`")
