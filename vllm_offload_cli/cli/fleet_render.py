"""Human output of a fleet answer: inspect's own table with a NODE column, and lists.

Works on the nodes' JSON data, exactly what `--json` carries; every string in it is
another host's, escaped (`printable`) as the node-local command escapes its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_offload_cli.cli.common import text_table
from vllm_offload_cli.cli.inspect import (
    TABLE_HEADERS,
    TABLE_RIGHT,
    cell_text,
    dict_items,
    footer,
    owner_row,
    region_notes,
    region_row,
)
from vllm_offload_cli.core.base.units import format_bytes, is_int
from vllm_offload_cli.fleet.result import (
    ABSENT,
    ANSWERED,
    OK,
    REFUSED,
    TIMED_OUT,
    FleetResult,
    NodeResult,
    no_node_has,
)

if TYPE_CHECKING:
    from vllm_offload_cli.cli.common import Out


def _bytes(value: Any) -> str:
    return format_bytes(value) if is_int(value) else "-"


def _answered(result: FleetResult) -> list[tuple[str, NodeResult, dict[str, Any]]]:
    """(label, node, data) of each node that answered with data."""
    rows = []
    for n in result.nodes:
        data = (n.envelope or {}).get("data") if n.outcome == ANSWERED else None
        if isinstance(data, dict) and data:
            rows.append((result.label(n), n, data))
    return rows


def render_nodes(out: Out, result: FleetResult) -> None:
    """One line per node that did not simply succeed, then the verdict."""
    for n in result.nodes:
        label = result.label(n)
        status = n.status
        if status in (OK, ABSENT):
            continue
        if n.outcome != ANSWERED:
            what = "TIMED OUT" if n.outcome == TIMED_OUT else "FAILED"
            out.print(f"node {label}: {what}: {n.reason} (its regions are not shown)")
            continue
        what = "REFUSED" if status == REFUSED else f"exit {n.exit_code}"
        for e in dict_items((n.envelope or {}).get("errors")) or [{"message": "(no message)"}]:
            out.print(f"node {label}: {what}: {e.get('message', '')}")
    nowhere = result.on_no_node()
    if nowhere is not None:
        out.print(no_node_has(nowhere))
    answered = len(result.nodes) - len(result.missing)
    interrupted = sum(n.interrupted for n in result.nodes)
    short = ([f"{len(result.missing)} node(s) did not"] if result.missing else []) + (
        [f"{interrupted} node(s) were interrupted"] if interrupted else [])
    verdict = (f"{answered} of {len(result.nodes)} node(s) answered"
               + (f"; PARTIAL: {', '.join(short)}" if short else ""))
    out.print(f"Fleet {result.address}: {verdict}; exit {int(result.exit_code)}.")


def render_inspect(out: Out, result: FleetResult, *, wide: bool = False) -> None:
    """inspect's table over every node's regions, NODE first; owners as numbers (a user
    name is per host), then each node's footer."""
    rows, notes = [], []
    for label, _, data in _answered(result):
        regions = dict_items(data.get("regions"))
        refused = "residency" in (data.get("measurement_errors") or {})
        rows += [[cell_text(label), *region_row(r, wide=wide, refused=refused, owner=_uid)]
                 for r in regions]
        rows += [[cell_text(label), *owner_row(a, owner=_uid)]
                 for a in dict_items(data.get("aggregated"))]
        notes += region_notes(regions, prefix=f"{label} ")
    if rows:
        out.print(text_table(["NODE", *TABLE_HEADERS], rows,
                             right=tuple(i + 1 for i in TABLE_RIGHT)))
    else:
        out.print("No offload regions on any node that answered.")
    for note in notes:
        out.print(note)
    for label, _, data in _answered(result):
        out.print(f"{label}: {footer(data)}")
    render_nodes(out, result)


def _uid(uid: int | None) -> str:
    return "-" if uid is None else str(uid)


def render_gc(out: Out, result: FleetResult, *, quiet: bool) -> None:
    freed = removed = 0
    dry = False
    for label, _, data in _answered(result):
        dry = bool(data.get("dry_run"))
        verb = "Would remove" if dry else "Removed"
        for r in dict_items(data.get("removed")):
            removed += 1
            got = r.get("freed_bytes")
            freed += got if is_int(got) else 0
            out.print(f"{label}: {verb} {r.get('engine_id')}: {_bytes(got)} of memory, "
                      f"{_bytes(r.get('bytes'))} file size")
        if not quiet:
            for k in dict_items(data.get("kept")):
                out.print(f"{label}: Kept {k.get('engine_id')}: {k.get('reason')}")
        for path in data.get("orphan_manifests_removed") or []:
            out.print(f"{label}: {verb} orphaned manifest {path}")
        for path in data.get("temp_files_removed") or []:
            out.print(f"{label}: {verb} leftover temporary file {path}")
    head = "Would free" if dry else "Freed"
    tail = " (dry run: nothing was changed)" if dry else ""
    out.print(f"{head} {format_bytes(freed)} from {removed} region(s) across the fleet{tail}.")
    render_nodes(out, result)


def render_verify(out: Out, result: FleetResult) -> None:
    for label, n, data in _answered(result):
        if n.status == ABSENT:
            continue
        problems = dict_items(data.get("problems"))
        what = data.get("path") or f"plan of {data.get('dp_size', '?')} replica(s)"
        verdict = "OK" if not problems and n.status == OK else f"FAIL: {len(problems)} problem(s)"
        out.print(f"{label}: {what}: {verdict}")
        for p in problems:
            out.print(f"  - {p.get('message')}")
    render_nodes(out, result)
