"""`vllm-offload fleet inspect|gc|verify-rank-layout`: each node runs the subcommand's body
in-process in a Ray task pinned to it and ships back the envelope `<command> --json` would
print there (`common.envelope_of`): no interpreter start, no guess at the node's PATH."""

from __future__ import annotations

import inspect
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from vllm_offload_cli import __version__, fleet
from vllm_offload_cli.cli import common, gc, verify
from vllm_offload_cli.cli import inspect as inspect_cli
from vllm_offload_cli.cli.common import Invocation, Out, Outcome, Subcommand
from vllm_offload_cli.cli.inspect import bytes_text, cell_text, dict_items
from vllm_offload_cli.core.base import deadline, errors, exit_status
from vllm_offload_cli.core.base.units import format_bytes, is_int
from vllm_offload_cli.core.region.naming import DEFAULT_SHM_DIR
from vllm_offload_cli.fleet import FleetResult, NodeResult, no_node_has, run_on_every_node

DEFAULT_TIMEOUT = 60.0
_EXIT = ("Exit status: the most important node status (see EXIT STATUS); {PARTIAL} when a "
         "node failed, was interrupted or did not answer and no node reported worse.")

# The node-local subcommands a fleet command may run, by name.
LOCAL: dict[str, Subcommand] = {str(s.name): s for s in (
    inspect_cli.inspect_cmd, gc.garbage_collect, verify.verify_rank_layout)}


def node_task(command: str, options: dict[str, Any], shm_dir: str | None) -> dict[str, Any]:
    """On one node: the command's envelope and who answered (default: the node's shm dir)."""
    where = Path(shm_dir or os.environ.get(common.SHM_DIR_ENV) or DEFAULT_SHM_DIR)
    return {**common.envelope_of(LOCAL[command], options, shm_dir=where),
            "node": {"hostname": socket.gethostname(), "pid": os.getpid(),
                     "version": __version__, "shm_dir": str(where)}}


def _fleet_params() -> list[click.Parameter]:
    return [
        click.Option(["--address"], metavar="ADDR", show_default=False,
                     help="Ray cluster to use, as for ray.init (e.g. head:6379 or "
                     "ray://head:10001); default $RAY_ADDRESS, else 'auto' (the cluster this "
                     "host belongs to)."),
        click.Option(["--timeout"], type=common.Duration(), default=f"{DEFAULT_TIMEOUT:g}s",
                     help=exit_status.with_statuses(
                         "Report a node that has not answered by then as timed out; the others' "
                         "results are still shown (exit {PARTIAL}). Seconds, or 90s, 5m, 1h.")),
        click.Option(["--shm-dir", "shm_dir"], type=click.Path(file_okay=False, path_type=Path),
                     metavar="DIR", show_default=False,
                     help="Directory that holds the regions on every node (default: each "
                     f"node's own ${common.SHM_DIR_ENV}, else /dev/shm)."),
        *common.output_params(),
    ]


def run_fleet(command: str, options: dict[str, Any], *, shm_dir: Path | None,
              address: str | None, timeout: float) -> FleetResult:
    """Run the node-local `command` on every alive node and collect the answers."""
    where, nodes = run_on_every_node(
        node_task, (command, options, None if shm_dir is None else os.fspath(shm_dir)),
        address=address, timeout=timeout)
    if not nodes:
        raise errors.OperationFailedError(f"the Ray cluster at {where!r} has no alive node",
                                          code="no_nodes")
    return FleetResult(address=where, nodes=tuple(nodes), timeout=timeout)


def _fleet_command(local: Subcommand, fixed: dict[str, Any], doc: str,
                   render: Callable[[Out, FleetResult, Invocation, dict[str, Any]], None]
                   ) -> click.Command:
    """A fleet command with the node-local command's own options (less `fixed` ones);
    `render(out, result, the run, its options)` prints the answer for people."""
    own = [p for p in local.params if p.name not in fixed and p.name not in common.COMMON]
    local_name = str(local.name)

    def run(**values: Any) -> None:
        address, timeout = values.pop("address"), values.pop("timeout")

        def body(inv: Invocation, shm_dir: Path | None) -> Outcome:
            if shm_dir is not None and not shm_dir.is_absolute():
                raise errors.InvalidInputError(f"--shm-dir {shm_dir} must be an absolute path: "
                                               "it is used on every node", code="usage")
            result = run_fleet(local_name, {**values, **fixed}, shm_dir=shm_dir,
                               address=address, timeout=timeout)
            for w in result.warnings(__version__):
                inv.warn(w["code"], w["message"])
            return Outcome(data=result.data(), exit_code=result.exit_code,
                           errors=result.errors(),
                           render=lambda out: render(out, result, inv, values))

        common.run_command(f"fleet {local_name}", values, body)

    doc = inspect.cleandoc(doc) + "\n\n" + _EXIT
    return click.Command(local_name, callback=run, params=[*own, *_fleet_params()],
                         help=exit_status.with_statuses(doc), short_help=doc.split("\n")[0])


# output for people, from the nodes' JSON data: another host's strings escaped as our own

def _answered(result: FleetResult) -> list[tuple[str, NodeResult, dict[str, Any]]]:
    """(label, node, data) of each node that answered with data."""
    return [(result.label(n), n, data) for n in result.nodes if n.outcome == fleet.ANSWERED
            and isinstance(data := (n.envelope or {}).get("data"), dict) and data]


def render_nodes(out: Out, result: FleetResult) -> None:
    """One line per node that did not simply succeed, then the verdict."""
    for n in result.nodes:
        label = result.label(n)
        if n.status in (fleet.OK, fleet.ABSENT):
            continue
        if n.outcome != fleet.ANSWERED:
            what = "TIMED OUT" if n.outcome == fleet.TIMED_OUT else "FAILED"
            out.print(f"node {label}: {what}: {n.reason} (its regions are not shown)")
            continue
        what = "REFUSED" if n.status == fleet.REFUSED else f"exit {n.exit_code}"
        for e in dict_items((n.envelope or {}).get("errors")) or [{"message": "(no message)"}]:
            out.print(f"node {label}: {what}: {e.get('message', '')}")
    if (nowhere := result.on_no_node()) is not None:
        out.print(no_node_has(nowhere))
    answered = len(result.nodes) - len(result.missing)
    interrupted = sum(n.interrupted for n in result.nodes)
    short = ([f"{len(result.missing)} node(s) did not"] if result.missing else []) + (
        [f"{interrupted} node(s) were interrupted"] if interrupted else [])
    verdict = (f"{answered} of {len(result.nodes)} node(s) answered"
               + (f"; PARTIAL: {', '.join(short)}" if short else ""))
    out.print(f"Fleet {result.address}: {verdict}; exit {int(result.exit_code)}.")


def render_inspect(out: Out, result: FleetResult, *, wide: bool = False) -> None:
    """inspect's table over every node, NODE first, owners as uids (names are per host)."""
    rows, notes = [], []
    for label, _, data in _answered(result):
        rows += [[cell_text(label), *row]
                 for row in inspect_cli.table_rows(data, wide=wide, owner=_uid)]
        notes += inspect_cli.region_notes(dict_items(data.get("regions")), prefix=f"{label} ")
    if rows:
        out.print(common.text_table(["NODE", *inspect_cli.TABLE_HEADERS], rows,
                                    right=tuple(i + 1 for i in inspect_cli.TABLE_RIGHT)))
    else:
        out.print("No offload regions on any node that answered.")
    for note in notes:
        out.print(note)
    for label, _, data in _answered(result):
        out.print(f"{label}: {inspect_cli.footer(data)}")
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
            out.print(f"{label}: {verb} {r.get('engine_id')}: {bytes_text(got)} of memory, "
                      f"{bytes_text(r.get('bytes'))} file size")
        if not quiet:
            for k in dict_items(data.get("kept")):
                out.print(f"{label}: Kept {k.get('engine_id')}: {k.get('reason')}")
            for a in dict_items(data.get("kept_aggregated")):  # other owners' past the bound
                out.print(f"{label}: Kept {a.get('regions')} more region(s) of uid {a.get('uid')}")
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
        if n.status == fleet.ABSENT:
            continue
        problems = dict_items(data.get("problems"))
        what = data.get("path") or f"plan of {data.get('dp_size', '?')} replica(s)"
        verdict = ("OK" if not problems and n.status == fleet.OK
                   else f"FAIL: {len(problems)} problem(s)")
        out.print(f"{label}: {what}: {verdict}")
        for p in problems:
            out.print(f"  - {p.get('message')}")
    render_nodes(out, result)


fleet_app = common.Group(
    "fleet", no_args_is_help=True,
    help="Run inspect, gc or verify-rank-layout on every node of a Ray cluster at once (needs "
    "the ray extra).")

fleet_app.add_command(_fleet_command(
    inspect_cli.inspect_cmd, {"fmt": "table", "output": None,
                              "timeout": deadline.DEFAULT_TIMEOUT},
    """inspect on every node: one table with a NODE column.

    Runs `vllm-offload inspect --json` on each alive node of the Ray cluster
    (one task pinned per node) and merges the answers. A node that fails or
    does not answer within --timeout is listed as such; nodes without a named
    region are skipped (exit {USAGE} only when no node has it).
    """, lambda out, result, _, values: render_inspect(out, result, wide=values["wide"])))

fleet_app.add_command(_fleet_command(
    gc.garbage_collect, {"prometheus": None, "timeout": deadline.DEFAULT_TIMEOUT},
    """garbage-collect on every node; --dry-run shows the plan (alias: gc).

    It is node-local garbage-collect, run on each node: every safety rule
    holds there, and a node that refuses (exit {UNSAFE}, e.g. it cannot see all of
    its host's processes) is reported as refused. Use --dry-run first: it shows
    the whole plan, node by node, and changes nothing.
    """, lambda out, result, inv, _: render_gc(out, result, quiet=inv.verbosity < 0)))

fleet_app.add_command(_fleet_command(
    verify.verify_rank_layout, {}, """verify-rank-layout on every node.

    Live mode (ENGINE_ID) checks the region on the node(s) that have it; nodes
    without it are skipped (exit {USAGE} only when no node has it). Plan mode runs
    the plan on every node (useful with --devices env, which reads each node's
    CUDA_VISIBLE_DEVICES).
    """, lambda out, result, *_: render_verify(out, result)))
