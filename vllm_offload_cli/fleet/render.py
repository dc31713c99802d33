"""Human output of a fleet answer: one table or list across nodes, a NODE column first.

Works on the nodes' JSON data (what travelled back from each node), never on
core objects, so it shows exactly what `--json` carries.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vllm_offload_cli.core.base.units import format_age, format_bytes
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

_STATE_STYLE = {"live": "green", "persistent": "cyan", "stale": "bold red",
                "unknown": "yellow", "creating": "blue"}


def _say(out: Console, text: str) -> None:
    out.print(text, highlight=False, markup=False, soft_wrap=True)


def _bytes(value: Any) -> str:
    return format_bytes(value) if isinstance(value, int) else "-"


def _holders(region: dict[str, Any]) -> str:
    parts = []
    for h in region.get("holders") or []:
        rank = "" if h.get("rank") is None else f" r{h['rank']}"
        parts.append(f"{h.get('pid')} {h.get('name') or '?'}{rank}")
    return ", ".join(parts) or "-"


def _answered(result: FleetResult) -> list[tuple[str, NodeResult, dict[str, Any]]]:
    """(label, node, data) of each node that answered with data."""
    rows = []
    for n in result.nodes:
        data = (n.envelope or {}).get("data") if n.outcome == ANSWERED else None
        if data:
            rows.append((result.label(n), n, data))
    return rows


def render_nodes(out: Console, result: FleetResult) -> None:
    """One line per node that did not simply succeed, then the verdict."""
    for n in result.nodes:
        label = result.label(n)
        status = n.status
        if status in (OK, ABSENT):
            continue
        if n.outcome != ANSWERED:
            what = "TIMED OUT" if n.outcome == TIMED_OUT else "FAILED"
            _say(out, f"node {label}: {what}: {n.reason} (its regions are not shown)")
            continue
        errors = (n.envelope or {}).get("errors") or []
        what = "REFUSED" if status == REFUSED else f"exit {n.exit_code}"
        for e in errors or [{"message": "(no message)"}]:
            _say(out, f"node {label}: {what}: {e.get('message', '')}")
    nowhere = result.on_no_node()
    if nowhere is not None:
        _say(out, no_node_has(nowhere))
    answered = len(result.nodes) - len(result.missing)
    interrupted = sum(n.interrupted for n in result.nodes)
    short = ([f"{len(result.missing)} node(s) did not"] if result.missing else []) + (
        [f"{interrupted} node(s) were interrupted"] if interrupted else [])
    verdict = (f"{answered} of {len(result.nodes)} node(s) answered"
               + (f"; PARTIAL: {', '.join(short)}" if short else ""))
    _say(out, f"Fleet {result.address}: {verdict}; exit {int(result.exit_code)}.")


def render_inspect(out: Console, result: FleetResult) -> None:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("NODE", "ENGINE ID", "DP", "STATE", "SIZE", "RESIDENT", "AGE", "HOLDERS",
                "PROBLEMS"):
        table.add_column(col, no_wrap=col not in ("HOLDERS", "PROBLEMS"))
    count = 0
    notes: list[str] = []
    for label, _, data in _answered(result):
        for r in data.get("regions") or []:
            count += 1
            name = str(r.get("engine_id"))
            name = name if r.get("linked") else f"{name} (unlinked)"
            state = str(r.get("state"))
            problems = r.get("problems") or []
            table.add_row(escape(label), escape(name),
                          "-" if r.get("dp_rank") is None else str(r["dp_rank"]),
                          f"[{_STATE_STYLE.get(state, '')}]{escape(state)}[/]",
                          _bytes(r.get("size_bytes")), _bytes(r.get("resident_bytes")),
                          format_age(r.get("age_seconds")), escape(_holders(r)),
                          escape("; ".join(str(p.get("code")) for p in problems) or "-"))
            notes += [f"  {label} {r.get('engine_id')}: {p.get('message')}" for p in problems]
    if count:
        out.print(table)
    else:
        _say(out, "No offload regions on any node that answered.")
    for note in notes:
        _say(out, note)
    for label, _, data in _answered(result):
        shm = data.get("shm") or {}
        regions = data.get("regions") or []
        stale = sum(r.get("state") == "stale" for r in regions)
        _say(out, f"{label}: {data.get('shm_dir')}: {_bytes(shm.get('free_bytes'))} free of "
             f"{_bytes(shm.get('total_bytes'))}; {len(regions)} region(s), {stale} stale")
    render_nodes(out, result)


def render_gc(out: Console, result: FleetResult, *, quiet: bool) -> None:
    freed = removed = 0
    dry = False
    for label, _, data in _answered(result):
        dry = bool(data.get("dry_run"))
        verb = "Would remove" if dry else "Removed"
        for r in data.get("removed") or []:
            removed += 1
            freed += int(r.get("freed_bytes") or 0)
            _say(out, f"{label}: {verb} {r.get('engine_id')}: {_bytes(r.get('freed_bytes'))} "
                 f"of memory, {_bytes(r.get('bytes'))} file size")
        if not quiet:
            for k in data.get("kept") or []:
                _say(out, f"{label}: Kept {k.get('engine_id')}: {k.get('reason')}")
        for path in data.get("orphan_manifests_removed") or []:
            _say(out, f"{label}: {verb} orphaned manifest {path}")
        for path in data.get("temp_files_removed") or []:
            _say(out, f"{label}: {verb} leftover temporary file {path}")
    head = "Would free" if dry else "Freed"
    tail = " (dry run: nothing was changed)" if dry else ""
    _say(out, f"{head} {format_bytes(freed)} from {removed} region(s) across the fleet{tail}.")
    render_nodes(out, result)


def render_verify(out: Console, result: FleetResult) -> None:
    for label, n, data in _answered(result):
        if n.status == ABSENT:
            continue
        problems = data.get("problems") or []
        what = data.get("path") or f"plan of {data.get('dp_size', '?')} replica(s)"
        verdict = "OK" if not problems and n.status == OK else f"FAIL: {len(problems)} problem(s)"
        _say(out, f"{label}: {what}: {verdict}")
        for p in problems:
            _say(out, f"  - {p.get('message')}")
    render_nodes(out, result)

