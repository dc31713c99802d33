"""`vllm-offload inspect`: every region in the shm directory, live or leaked."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from itertools import chain
from pathlib import Path
from typing import Any

import click

from vllm_offload_cli.cli import common, metrics
from vllm_offload_cli.cli.common import Invocation, Out, Outcome, shm_dir_checked, subcommand
from vllm_offload_cli.core.base import deadline, errors
from vllm_offload_cli.core.base.exit_status import ExitStatus, most_important, with_statuses
from vllm_offload_cli.core.base.problems import jsonable
from vllm_offload_cli.core.base.text import printable
from vllm_offload_cli.core.base.units import format_age, format_bytes, is_int
from vllm_offload_cli.core.host import residency
from vllm_offload_cli.core.host.discovery import Inventory, RegionInfo, discover
from vllm_offload_cli.core.host.observed_placement import Placement, observe_all
from vllm_offload_cli.core.region import fsguard
from vllm_offload_cli.core.region.geometry import SEGMENTED, SINGLE_FILE
from vllm_offload_cli.core.system.processes import ProcessRef

STATES = ("live", "creating", "persistent", "stale", "unknown")  # a region's, as --state takes


def inventory_data(inv: Inventory, placed: dict[str, Placement] | None = None,
                   rest: dict[int | None, list[RegionInfo]] | None = None) -> dict[str, Any]:
    """inspect's JSON data: `inv.regions` listed, the regions in `rest` summed per owner."""
    now = time.time()
    return {
        "shm_dir": inv.shm_dir,
        "regions": [_region_dict(r, placed, now) for r in inv.regions],
        "aggregated": owner_totals(rest or {}),
        "orphan_manifests": [o.path for o in inv.orphan_manifests],
        "shm": {"total_bytes": inv.shm.total_bytes, "free_bytes": inv.shm.free_bytes},
        "uninspectable_processes": inv.uninspectable_processes,
        "visibility": inv.visibility.to_dict(),
        "gc_would_free_bytes": sum(r.allocated_bytes for r in chain(inv.regions, *(
            rest or {}).values()) if r.state == "stale"),  # st_blocks, as gc counts
        # what this run counted instead of listing: its cost is bounded by what exists
        "not_judged": jsonable(inv.not_judged),
        "others_counted": jsonable(inv.counted),
        "held_unlisted": [{"pid": pid, "files": n} for pid, n in inv.unnamed_held],
    }


def owner_totals(rest: dict[int | None, list[RegionInfo]]) -> list[dict[str, Any]]:
    """Per owner, what its regions past the first LISTED_PER_OWNER add up to."""
    out = []
    for uid, regions in sorted(rest.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        measured = [r.resident_bytes for r in regions if r.resident_bytes is not None]
        states = Counter(r.state for r in regions)
        out.append({"uid": uid, "regions": len(regions),
                    "size_bytes": sum(r.size_bytes for r in regions),
                    "allocated_bytes": sum(r.allocated_bytes for r in regions),
                    "resident_bytes": sum(measured) if measured else None,
                    "states": {s: states[s] for s in STATES},
                    "problems": dict(Counter(p.code for r in regions for p in r.problems)),
                    "holders": len({h.pid for r in regions for h in r.holders})})
    return out


def _region_dict(r: RegionInfo, placed: dict[str, Placement] | None, now: float
                 ) -> dict[str, Any]:
    # the vLLM layout that joins it: the manifest's, else the files' (None: a bare file)
    layout = r.manifest.vllm_layout if r.manifest is not None else SEGMENTED if any(
        s.segment > 0 for s in r.segments) else SINGLE_FILE if r.linked else None
    doc = {**r.to_dict(), "vllm_layout": layout, "evidence": evidence(r, now)}
    if placed is None:  # --no-residency: placement was not observed
        return {**doc, "numa_nodes": None, "huge_page_bytes": None, "placement": None}
    if (p := placed.get(r.paths[0])) is not None:
        pd = jsonable(p)
        del pd["error"]  # said once for all regions, in measurement_errors
        doc.update(numa_nodes=pd.pop("numa_nodes"), huge_page_bytes=pd.pop("huge_page_bytes"),
                   placement={**pd, "requested": r.manifest and r.manifest.placement})
    return doc


@subcommand("inspect")
@click.argument("engine_ids", nargs=-1, metavar="[ENGINE_ID]...")
@click.option("--format", "-f", "fmt", type=click.Choice(["table", "json", "prometheus"]),
              default="table", help="Output format.")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path),
              help="With --format prometheus: write this node_exporter textfile atomically.")
@click.option("--prometheus", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="--format prometheus --output FILE, as gc has it: checked first, silent.")
@click.option("--no-residency", is_flag=True, help="Skip what costs time per region: the "
              "mincore residency scan and the holders' NUMA and huge-page placement (RESIDENT, "
              "NUMA and their JSON fields are then null).")
@click.option("--wide", "-w", is_flag=True, help="Table: every holder (pid, name, rank) "
              "instead of the count and the first pid.")
@click.option("--all", "-a", "everything", is_flag=True, help=f"List every region: by default "
              f"those of another owner past its first {metrics.LISTED_PER_OWNER} are summed "
              "(one row, one JSON `aggregated` entry, per-owner series).")
@click.option("--shm-private-to-namespace", is_flag=True, help="The shm directory is used "
              "only inside this PID namespace: trust this namespace's /proc (regions are not "
              "shown `unknown` for it).")
@click.option("--timeout", type=common.Duration(), default=f"{deadline.DEFAULT_TIMEOUT:g}s",
              help=with_statuses("Give up after this long (exit {FAILED}): seconds, or 90s, "
                                 "5m, 2h."))
@click.option("--state", "-s", "states", type=click.Choice(STATES), multiple=True, help="Only "
              "regions in this state (repeatable); the table, JSON and --check see only those.")
@click.option("--check", is_flag=True, help=with_statuses(
    "Exit {PROBLEMS_FOUND} when a region shown is stale or has a problem, {SUCCESS} "
    "otherwise, like `fuser -s`; with -q nothing is printed on stdout."))
def inspect_cmd(inv: Invocation, engine_ids: tuple[str, ...], fmt: str,
                output: Path | None, prometheus: Path | None, no_residency: bool, wide: bool,
                everything: bool, shm_private_to_namespace: bool, timeout: float,
                states: tuple[str, ...], check: bool) -> Outcome:
    """List every region: named files and unlinked ones still mapped, with segments grouped.

    A region is `live` when a process maps it, holds it open or holds its lock;
    `creating` while its creator is alive and not done; else `persistent` if
    `create` pre-provisioned it, `unknown` when a holder could be hidden from this
    run (another PID namespace, hidepid, processes it may not inspect), else `stale`.
    Names are shown with control characters escaped (\\xNN); --json keeps them raw.
    A named ENGINE_ID that matches no region is an error (exit {USAGE}), the others
    are still shown. Your own regions are always listed; of every other owner the
    first 32 (largest first), the rest summed in one row (--all lists them all).
    With -v the table says why each stale or unknown region is so (its creator, the
    recorded holders, its last activity) and what gc would free. Exit {FAILED} when
    --timeout passes first; with --check, {PROBLEMS_FOUND} when a region shown is
    stale or has a problem.
    """
    fmt, output = _output_options(inv, fmt, output, prometheus, filtered=bool(states) or check)
    with deadline.within(timeout):  # placement is measured only for the regions listed
        found = discover(shm_dir_checked(inv), engine_ids=engine_ids or None,
                         measure_residency=not no_residency,
                         shm_private_to_namespace=shm_private_to_namespace)
        missing = [e for e in dict.fromkeys(engine_ids or ()) if not found.find(e)]
        found, unsafe = split_unsafe(found, set(states))
        listed, rest = metrics.per_owner(found.regions, lambda r: r.uid, everything)
        placed = None if no_residency else observe_all(listed)
    common.warn_useless_waiver(inv, shm_private_to_namespace)
    shown = dataclasses.replace(found, regions=tuple(listed))
    data = {**inventory_data(shown, placed, rest),
            "measurement_errors": _warn_unseen(inv, found, placed), "not_found": missing,
            "unsafe_entries": [{"engine_id": r.engine_id, "paths": r.paths,
                                "problems": jsonable(r.problems)} for r in unsafe]}
    flagged, code = _checked(listed, unsafe, rest, missing, check)
    if check:
        data["check"] = {"flagged": flagged}  # the aggregated say theirs in their states
    if fmt == "prometheus":
        metrics.emit(_registry(shown, rest, placed, data), output)
        if output is not None:
            data["output"] = str(output)
    elif fmt == "json":
        inv.json_output = True
    table = fmt != "prometheus" and bool(found.regions or not missing) \
        and not (check and inv.verbosity < 0)
    wrote = output if prometheus is None else None  # --prometheus is quiet
    not_found = [{"code": errors.RegionNotFoundError.code, "message": f"no region named "
                  f"{engine_id} in {found.shm_dir}; `vllm-offload inspect` lists them all"}
                 for engine_id in missing]

    def render(out: Out) -> None:
        if table:
            render_table(out, data, wide=wide, why=inv.verbosity > 0)
        elif wrote is not None:
            out.print(f"Wrote {wrote}")
        for e in not_found:
            inv.err.print(f"Error: {e['message']}")

    return Outcome(data=data, exit_code=code, errors=not_found, render=render)


def _checked(listed: list[RegionInfo], unsafe: list[RegionInfo],
             rest: dict[int | None, list[RegionInfo]], missing: list[str], check: bool
             ) -> tuple[list[str], ExitStatus]:
    """--check's flagged ids, and the exit status (which counts the summed regions too)."""
    def flags(r: RegionInfo) -> bool:
        return r.state == "stale" or bool(r.problems)

    flagged = [r.engine_id for r in listed if flags(r)] + [r.engine_id for r in unsafe]
    unlisted = any(flags(r) for r in chain(*rest.values()))
    return flagged, most_important([
        ExitStatus.USAGE if missing else ExitStatus.SUCCESS,
        ExitStatus.PROBLEMS_FOUND if check and (flagged or unlisted) else ExitStatus.SUCCESS])


def _output_options(inv: Invocation, fmt: str, output: Path | None,
                    prometheus: Path | None, *, filtered: bool) -> tuple[str, Path | None]:
    """(format, textfile): what cannot mean one thing is refused before anything is read."""
    if prometheus is not None:  # one way to write a textfile, as gc writes its own
        if output is not None or fmt != "table":
            raise errors.InvalidInputError("--prometheus FILE is --format prometheus --output "
                                           "FILE: give one of them", code="usage")
        fmt, output = "prometheus", prometheus
        metrics.check_writable(output)
    textfile = fmt == "prometheus"
    for refused, message in (
            (output is not None and not textfile, "--output goes with --format prometheus"),
            (textfile and inv.json_output and output is None,
             "--json with --format prometheus needs --output FILE"),
            (textfile and filtered, "--state and --check go with the table and JSON; the "
             "textfile always has every region")):
        if refused:
            raise errors.InvalidInputError(message, code="usage")
    return fmt, output


def _warn_unseen(inv: Invocation, found: Inventory, placed: dict[str, Placement] | None
                 ) -> dict[str, dict[str, Any]]:
    """Say what this run could not see; returns what seccomp left unmeasured, per measurement."""
    counted = sum(t.files for t in (*found.not_judged, *found.counted))
    held = sum(n for _, n in found.unnamed_held)
    unmade = {"residency": [e for e in (r.resident_error for r in found.regions) if e is not None],
              "numa": [p.error for p in (placed or {}).values() if p.error is not None]}
    refusals = {what: {"regions": len(m), "message": m[0]} for what, m in unmade.items() if m}
    for code, n, message in (
            *((spot.code, 1, f"{spot.message}: regions nobody visibly holds are shown "
               "`unknown`, not `stale`") for spot in found.visibility.effective),
            ("uninspectable_processes", found.uninspectable_processes,
             f"{found.uninspectable_processes} process(es) could not be inspected (permission "
             "denied); regions they use may show fewer holders"),
            ("counted_not_listed", counted, f"{counted} region file(s) of other users were "
             "counted per owner, not looked at one by one (JSON: not_judged, others_counted)"),
            ("held_not_listed", held, f"{held} file(s) on the shm filesystem held by "
             f"{len(found.unnamed_held)} process(es) were counted, not looked up (JSON: "
             "held_unlisted)"),
            *(("measurement_refused", 1, f"{what} of {e['regions']} region(s) not measured: "
               f"{e['message']} ({residency.REFUSED_HINT})") for what, e in refusals.items())):
        if n:
            inv.warn(code, message)
    return refusals


def _unsafe(r: RegionInfo) -> bool:
    return r.linked and all(s.file_id is None for s in r.segments)


def split_unsafe(found: Inventory, states: Collection[str] = ()
                 ) -> tuple[Inventory, list[RegionInfo]]:
    """(regions in `states`, names whose files are none regular: never stale, never gc'd)."""
    return dataclasses.replace(found, regions=tuple(
        r for r in found.regions if not _unsafe(r) and (not states or r.state in states))), [
        r for r in found.regions if _unsafe(r)]


def evidence(r: RegionInfo, now: float) -> dict[str, Any]:
    """Why the region is in its state: its creator, recorded holders, last activity."""
    m = r.manifest
    attached = [] if m is None else [
        {"pid": a.pid, "rank": a.rank, "alive": ProcessRef(a.pid, a.start_ticks).alive()}
        for a in m.attachments]
    last = _last_activity(r)
    alive = None if m is None else m.creator_alive()
    gone = [a for a in attached if not a["alive"]]
    parts = [f"held by pid {', '.join(str(h.pid) for h in r.holders[:5])}" if r.holders
             else "no process maps it, has it open or holds its lock",
             "no manifest (made by vLLM itself?): its creator is not recorded" if m is None
             else f"creator pid {m.creator_pid} {'is alive' if alive else 'exited'}"]
    if attached:
        parts.append(f"{len(gone)} of {len(attached)} recorded holder(s) exited" + (
            f" (pid {', '.join(str(a['pid']) for a in gone[:5])})" if gone else ""))
    if last is not None:
        parts.append(f"last activity {format_age(now - last)} ago")
    return {"creator_pid": None if m is None else m.creator_pid, "creator_alive": alive,
            "recorded_holders": attached,
            "last_activity_at": None if last is None else round(last, 3),
            "summary": "; ".join(parts)}


def _last_activity(r: RegionInfo) -> float | None:
    m = r.manifest
    times = [s.mtime for s in r.segments if s.mtime is not None]
    if m is not None:
        times += [m.created_at, *(a.attached_at for a in m.attachments if a.attached_at)]
    return max(times, default=None)


def owner_name(uid: int | None) -> str:
    """The user name of `uid` as `ls -l` shows it; the number when it has none."""
    name = None if uid is None else fsguard.user_name(uid)
    return printable(name) if name is not None else "-" if uid is None else str(uid)


TABLE_HEADERS = ["ENGINE ID", "DP", "STATE", "OWNER", "SIZE", "RESIDENT", "LAYOUT", "NUMA",
                 "AGE", "HOLDERS", "PROBLEMS"]
TABLE_RIGHT = (4, 5, 8)  # numbers: aligned right


def cell_text(value: object) -> str:
    """A value from an envelope as a table shows it: control characters escaped."""
    return printable(str(value))


def _number(value: object) -> int | float | None:
    """A count or size from a JSON dict; None for anything else (a bool, a string)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def dict_items(value: object) -> list[dict[str, Any]]:
    """The objects of a JSON list (a node's answer is untrusted: anything else is dropped)."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _holders_text(r: dict[str, Any], wide: bool) -> str:
    """Narrow: the count and the first pid ('3 (4242,...)'); wide: every holder."""
    if not (holders := dict_items(r.get("holders"))):
        return "-"
    if not wide:
        more = ",..." if len(holders) > 1 else ""
        return f"{len(holders)} ({cell_text(holders[0].get('pid'))}{more})"
    return ", ".join(f"{cell_text(h.get('pid'))} {cell_text(h.get('name') or '?')}"
                     + ("" if h.get("rank") is None else f" r{cell_text(h['rank'])}")
                     for h in holders)


def _layout_text(r: dict[str, Any]) -> str:
    """`segmented/3` (files), `single-file`, or `-` where it cannot be told."""
    layout = r.get("vllm_layout")
    return f"{layout}/{len(r.get('paths') or ())}" if layout == SEGMENTED else (
        "-" if layout is None else cell_text(layout))


def _numa_text(r: dict[str, Any]) -> str:
    """Resident share per node, then the huge-page share if any: 'n0:62%,n1:38%,thp:100%'."""
    nodes = r.get("numa_nodes")
    shares = {str(n): _number(b) or 0 for n, b in nodes.items()} if isinstance(nodes, dict) else {}
    if not (total := sum(shares.values())):
        return "-"
    parts = [f"n{cell_text(n)}:{b * 100 / total:.0f}%"
             for n, b in sorted(shares.items(), key=lambda nb: (len(nb[0]), nb[0]))]
    if huge := _number(r.get("huge_page_bytes")):
        parts.append(f"thp:{min(100.0, huge * 100 / total):.0f}%")
    return ",".join(parts)


def bytes_text(value: object) -> str:
    return format_bytes(_number(value))  # None: '-'


def region_row(r: dict[str, Any], *, wide: bool = False, refused: bool = False,
               owner: Callable[[int | None], str] = owner_name) -> list[str]:
    """A region's JSON dict as a row; `refused` residency shows `?`, not `-`."""
    name = cell_text(r.get("engine_id"))
    uid = r.get("uid") if is_int(r.get("uid")) else None
    resident = r.get("resident_bytes")
    return [name if r.get("linked") else f"{name} (unlinked)",
            "-" if r.get("dp_rank") is None else cell_text(r.get("dp_rank")),
            cell_text(r.get("state")), owner(uid), bytes_text(r.get("size_bytes")),
            "?" if refused and resident is None else bytes_text(resident), _layout_text(r),
            _numa_text(r), format_age(r.get("age_seconds")), _holders_text(r, wide),
            ",".join(cell_text(p.get("code")) for p in dict_items(r.get("problems"))) or "-"]


def _counts_text(value: object) -> str:
    """{'live': 38, 'stale': 2, 'creating': 0} as 'live:38,stale:2'."""
    counts = value if isinstance(value, dict) else {}
    return ",".join(f"{cell_text(k)}:{cell_text(n)}" for k, n in counts.items() if n) or "-"


def owner_row(a: dict[str, Any], *, owner: Callable[[int | None], str] = owner_name
              ) -> list[str]:
    """One table row of an owner's regions summed (a JSON `aggregated` entry)."""
    uid = a.get("uid")
    return [f"({cell_text(a.get('regions'))} more)", "-", _counts_text(a.get("states")),
            owner(uid if is_int(uid) else None), bytes_text(a.get("size_bytes")),
            bytes_text(a.get("resident_bytes")), "-", "-", "-",
            cell_text(a.get("holders") or "-"), _counts_text(a.get("problems"))]


def table_rows(data: dict[str, Any], *, wide: bool = False,
               owner: Callable[[int | None], str] = owner_name) -> list[list[str]]:
    """One answer's rows: its regions (`?` for refused residency), then the owners' sums."""
    refused = "residency" in (data.get("measurement_errors") or {})
    return [*(region_row(r, wide=wide, refused=refused, owner=owner)
              for r in dict_items(data.get("regions"))),
            *(owner_row(a, owner=owner) for a in dict_items(data.get("aggregated")))]


def region_notes(regions: list[dict[str, Any]], *, why: bool = False, prefix: str = ""
                 ) -> list[str]:
    """Each problem's sentence (a dp_collision's once), with `why` the stale and unknown's."""
    lines = list(dict.fromkeys(f"  {prefix}{cell_text(r.get('engine_id'))}: "
                               f"{cell_text(p.get('message'))}"
                               for r in regions for p in dict_items(r.get("problems"))))
    if why:
        lines += [f"  {prefix}{cell_text(r.get('engine_id'))}: {cell_text(r.get('state'))}: "
                  f"{cell_text((r.get('evidence') or {}).get('summary'))}"
                  for r in regions if r.get("state") in ("stale", "unknown")
                  and isinstance(r.get("evidence"), dict)]
    return lines


def footer(data: dict[str, Any]) -> str:
    """'/dev/shm: 55.0 GiB free of 64.0 GiB; 3 region(s), 1 stale; gc would free 1.0 GiB'."""
    regions = dict_items(data.get("regions"))
    summed = dict_items(data.get("aggregated"))  # owners' regions past those listed
    count: Counter[Any] = Counter(r.get("state") for r in regions)
    for states in (a.get("states") for a in summed):
        if isinstance(states, dict):
            count.update({s: _number(n) or 0 for s, n in states.items()})
    total = len(regions) + sum(_number(a.get("regions")) or 0 for a in summed)
    stale, unknown = count["stale"], count["unknown"]
    shm = data["shm"] if isinstance(data.get("shm"), dict) else {}
    free = _number(data.get("gc_would_free_bytes"))
    return (f"{cell_text(data.get('shm_dir'))}: {format_bytes(_number(shm.get('free_bytes')))} "
            f"free of {format_bytes(_number(shm.get('total_bytes')))}; {total} "
            f"region(s), {stale} stale"
            f"{f', {unknown} unknown (a holder could be hidden)' if unknown else ''}"
            f"{f'; gc would free {format_bytes(free)}' if stale and free is not None else ''}")


def render_table(out: Out, data: dict[str, Any], *, wide: bool = False,
                 why: bool = False) -> None:
    """inspect's table from its JSON data (so a fleet's nodes show alike)."""
    regions = dict_items(data.get("regions"))
    summed = dict_items(data.get("aggregated"))
    lines = []
    if not regions:
        lines.append(f"No offload regions in {cell_text(data.get('shm_dir'))}.")
    else:
        lines.append(common.text_table(TABLE_HEADERS, table_rows(data, wide=wide),
                                       right=TABLE_RIGHT))
        lines += region_notes(regions, why=why)
    if summed:
        lines.append(f"  (N more): other owners' regions past the first "
                     f"{metrics.LISTED_PER_OWNER} each, summed per owner; --all lists them")
    lines.append(footer(data))
    lines += [f"  orphaned manifest: {cell_text(o)}" for o in data.get("orphan_manifests") or ()]
    lines += [f"  not a region ({cell_text(p.get('code'))}): {cell_text(p.get('message'))}; "
              "gc leaves it, remove it by hand after checking it"
              for e in dict_items(data.get("unsafe_entries"))
              for p in dict_items(e.get("problems"))]
    out.print("\n".join(lines))


def region_inode(r: RegionInfo) -> str:
    """The inode of the region's first file: its identity among regions of one name."""
    fid = next((s.file_id for s in r.segments if s.file_id is not None), None)
    return "0" if fid is None else str(fid.ino)


_KEY = ("engine_id", "base_engine_id", "inode")  # inode: two regions of one engine_id
# a listed region's gauges: (name, help, its value; None: no sample)
_REGION_GAUGES: tuple[tuple[str, str, Callable[[RegionInfo, Placement | None], Any]], ...] = (
    ("size_bytes", "Bytes of the region's files.", lambda r, _: r.size_bytes),
    ("resident_bytes", "Resident bytes (mincore).", lambda r, _: r.resident_bytes),
    ("holders", "Processes mapping or holding the region.", lambda r, _: len(r.holders)),
    ("created_timestamp_seconds", "When the region was created (Unix time; its manifest's, "
     "else the oldest file modification time).", lambda r, _: r.manifest.created_at
     if r.manifest else min((s.mtime for s in r.segments if s.mtime is not None), default=None)),
    ("dp_rank", "The region's data-parallel rank (the _dpN suffix of its engine_id); absent "
     "for a region without one.", lambda r, _: r.dp_rank),
    ("problems", "Problems found in the region.", lambda r, _: len(r.problems)),
    ("linked", "1 if the region still has a name.", lambda r, _: int(r.linked)),
    ("huge_page_bytes", "Bytes mapped with huge pages.",
     lambda _, p: None if p is None else p.huge_page_bytes),
)


def _registry(found: Inventory, rest: dict[int | None, list[RegionInfo]],
              placed: dict[str, Placement] | None, data: dict[str, Any]) -> Any:
    """Gauges that stay true in a textfile rewritten every minute: no ages, no empty labels."""
    from prometheus_client import CollectorRegistry, Gauge

    registry = CollectorRegistry()

    def gauge(name: str, doc: str, labels: tuple[str, ...] = _KEY) -> Any:
        return Gauge(f"vllm_offload_{name}", doc, labels, registry=registry)

    _region_series(found.regions, placed or {}, gauge)
    _owner_series(data["aggregated"], gauge)
    count = gauge("regions", "Regions by state.", ("state",))
    summed = [*found.regions, *chain(*rest.values())]
    for s in STATES:
        count.labels(s).set(sum(r.state == s for r in summed))
    unmade = gauge("measurement_errors", "Regions whose measurement (residency: mincore; "
                   "numa: move_pages) a refused system call left unmade: a seccomp filter or "
                   "policy.", ("what",))
    for what in ("residency", "numa"):
        unmade.labels(what).set(data["measurement_errors"].get(what, {}).get("regions", 0))
    for name, doc, value in (
            ("shm_total_bytes", "Size of the shm filesystem.", found.shm.total_bytes),
            ("shm_free_bytes", "Free bytes of the shm filesystem.", found.shm.free_bytes),
            ("uninspectable_processes", "Processes whose /proc could not be read.",
             found.uninspectable_processes),
            ("unsafe_entries", "Names like a region's that are no regular file (a symlink, "
             "a FIFO): never removed by gc, to be checked by hand.",
             len(data["unsafe_entries"])),
            ("orphan_manifests", "Manifests whose region is gone.", len(found.orphan_manifests))):
        gauge(name, doc, ()).set(value)
    return registry


def _region_series(regions: Sequence[RegionInfo], placed: dict[str, Placement],
                   gauge: Callable[..., Any]) -> None:
    keyed = [((r.engine_id, r.base_engine_id, region_inode(r)), r, placed.get(r.paths[0]))
             for r in regions]
    for name, doc, value in _REGION_GAUGES:
        g = gauge(f"region_{name}", doc)
        for key, r, p in keyed:
            if (v := value(r, p)) is not None:
                g.labels(*key).set(v)
    state = gauge("region_state", "1 for the region's current state.", (*_KEY, "state"))
    numa = gauge("region_numa_bytes", "Resident bytes on each NUMA node.", (*_KEY, "node"))
    for key, r, p in keyed:
        for s in STATES:
            state.labels(*key, s).set(1 if r.state == s else 0)
        for node, b in ((p and p.numa_nodes) or {}).items():
            numa.labels(*key, str(node)).set(b)


def _owner_series(totals: list[dict[str, Any]], gauge: Callable[..., Any]) -> None:
    """Per owner (uid, `unknown` when unreadable), its regions past the listed ones."""
    past = f"of this owner past the first {metrics.LISTED_PER_OWNER}, not listed as regions"
    regions = gauge("owner_regions", f"Regions {past}, by state.", ("uid", "state"))
    size = gauge("owner_size_bytes", f"Bytes of the regions {past}.", ("uid",))
    resident = gauge("owner_resident_bytes", f"Resident bytes of the regions {past}.", ("uid",))
    problems = gauge("owner_problems", f"Problems of the regions {past}.", ("uid",))
    for t in totals:
        uid = "unknown" if t["uid"] is None else str(t["uid"])
        for s, n in t["states"].items():
            regions.labels(uid, s).set(n)
        size.labels(uid).set(t["size_bytes"])
        if t["resident_bytes"] is not None:
            resident.labels(uid).set(t["resident_bytes"])
        problems.labels(uid).set(sum(t["problems"].values()))
