"""`vllm-offload garbage-collect` (alias `gc`): reclaim leaked regions, safe from cron."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import click

from vllm_offload_cli.cli import common, metrics
from vllm_offload_cli.cli.common import Invocation, Out, Outcome
from vllm_offload_cli.core.base import deadline, testhook
from vllm_offload_cli.core.base.errors import OffloadError, RegionNotFoundError
from vllm_offload_cli.core.base.exit_status import ExitStatus, most_important, with_statuses
from vllm_offload_cli.core.base.problems import Problem, jsonable
from vllm_offload_cli.core.base.text import printable, shortened
from vllm_offload_cli.core.base.units import format_bytes
from vllm_offload_cli.core.reclaim.report import DEFAULT_MIN_AGE, GcOptions, GcReport

# The part of --timeout spent judging regions; the rest is for removing what
# was proven stale (locks, leases, a /proc pass for the users of those files).
JUDGE_SHARE = 0.6


def report_data(report: GcReport) -> dict[str, Any]:
    o = report.options
    kept, summed = kept_listed(report)
    return {
        "shm_dir": report.shm_dir,
        "dry_run": o.dry_run,
        "min_age_seconds": o.min_age,
        "include_persistent": o.include_persistent,
        "all_users": o.all_users,
        "removed": [r.to_dict() for r in report.removed],
        "kept": [_kept_dict(k) for k in kept],
        "kept_aggregated": summed,
        "freed_bytes": report.freed_bytes,
        **{key: list(getattr(report, key)) for key in (
            "orphan_manifests_removed", "temp_files_removed", "vanished", "not_found")},
        "failures": [e.to_dict("path", "engine_id") for e in report.errors],
        "regions_seen": report.regions_seen,
        "not_judged": jsonable(report.not_judged),
        "not_judged_files": report.not_judged_files,
        "listed_all": report.listed_all,
        "others_counted": jsonable(report.counted),
        "uninspectable_processes": report.uninspectable_processes,
        "visibility": {
            "blind_spots": [b.to_dict() for b in report.blind_spots],
            "shm_private_to_namespace": o.shm_private_to_namespace,
            "uninspectable_pids": list(report.uninspectable_pids),
            "refused": [k.engine_id for k in report.refused],
        },
        "started_at": round(report.started_at, 3),
        "duration_seconds": round(report.duration_seconds, 6),
    }


def kept_listed(report: GcReport) -> tuple[list[Problem], list[dict[str, Any]]]:
    """The kept regions to list, and other owners' past the bound as {uid, regions, codes}."""
    kept, rest = metrics.per_owner(report.kept, lambda k: k.uid)
    return kept, [{"uid": uid, "regions": len(ks), "codes": dict(Counter(k.code for k in ks))}
                  for uid, ks in rest.items()]


def _kept_dict(k: Problem) -> dict[str, object]:
    """A kept region's sentence is its `reason`, and every key is there even when empty."""
    doc = k.to_dict("paths", "pid", "linked", "blind_spot")
    return {"engine_id": k.engine_id, **{"reason" if key == "message" else key: value
                                         for key, value in doc.items()}}


@common.subcommand("garbage-collect",
                   help="Remove provably stale regions and orphaned manifests (alias: gc).")
@click.argument("engine_ids", nargs=-1, metavar="[ENGINE_ID]...")
@click.option("--dry-run", "-n", is_flag=True,
              help="Show what would be removed and why; change nothing.")
@click.option("--min-age", type=common.Duration(), default=f"{DEFAULT_MIN_AGE:g}s",
              help="Keep regions changed or created less than this long ago (covers a creator "
              "between O_EXCL and ftruncate): seconds, or 90s, 5m, 2h, 1d.")
@click.option("--include-persistent", is_flag=True,
              help="Also remove unused regions pre-provisioned by `create`.")
@click.option("--all-users", is_flag=True,
              help="Root only: also remove other users' stale regions.")
@click.option("--prometheus", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Write node_exporter textfile metrics of this run to FILE, atomically.")
@click.option("--shm-private-to-namespace", is_flag=True, help="The shm directory is used "
              "only inside this PID namespace (a container's own /dev/shm): trust this "
              "namespace's /proc. Waives only the PID-namespace refusal, never hidepid.")
@click.option("--no-syslog", is_flag=True, help="Do not record removals in the system log (by "
              "default one line per removed region, identifier vllm-offload; socket /dev/log, "
              "env VLLM_OFFLOAD_SYSLOG_SOCKET).")
@click.option("--timeout", type=common.Duration(), default=f"{deadline.DEFAULT_TIMEOUT:g}s",
              help=with_statuses("The run's budget: judging stops after part of it (your own "
                                 "regions, then the largest, first; other users' files are "
                                 "classified from lstat before anything is opened), what was "
                                 "proven stale is removed in the rest, what is left is reported "
                                 "as not judged (a later run looks at it) and the run exits "
                                 "{PARTIAL}: seconds, or 90s, 5m, 2h; 0: already up."))
def garbage_collect(inv: Invocation, engine_ids: tuple[str, ...], dry_run: bool,
                    min_age: float, include_persistent: bool, all_users: bool,
                    prometheus: Path | None, shm_private_to_namespace: bool, no_syslog: bool,
                    timeout: float) -> Outcome:
    """Remove provably stale regions and orphaned manifests; safe to run from cron.

    A region goes only when no process maps it or holds it open (unlinked
    mappings included), its exclusive lock can be taken, it is older than
    --min-age, owned by you, a regular file matching the region naming, and not
    persistent. Every kept region is listed with the reason; every removed one
    is also recorded in the system log (identifier vllm-offload). Where a holder
    could be hidden (a PID namespace that is not the host's, hidepid, processes
    it may not inspect and no lease proof), it removes nothing it cannot prove unused.
    The --prometheus file is checked first: an unwritable one is exit {USAGE} with
    nothing removed. Exit status: {SUCCESS} when nothing failed (kept regions are
    not failures), {FAILED} when a removal failed, {USAGE} for bad usage or a named
    ENGINE_ID that matches no region or manifest (the others are still collected),
    {UNSAFE} when it refused to judge because a holder could be hidden, {PARTIAL}
    (partial) when it removed regions but could not write --prometheus afterwards
    (the removals are still reported in full) or when --timeout came before every
    region was judged, {NO_SPACE} when nothing was removed and --prometheus could not
    be written for lack of space ({FAILED} for another write error).
    """
    shm_dir = common.shm_dir_checked(inv)
    from vllm_offload_cli.core.reclaim.collector import collect  # loads discovery: when run

    options = GcOptions(dry_run=dry_run, min_age=min_age, include_persistent=include_persistent,
                        all_users=all_users, shm_private_to_namespace=shm_private_to_namespace)
    if prometheus is not None:  # before anything is removed: every removal gets reported
        metrics.check_writable(prometheus)
    with deadline.within(timeout):
        report = collect(shm_dir, options, engine_ids=engine_ids or None,
                         judge_seconds=timeout * JUDGE_SHARE)
    data = report_data(report)
    unrecorded = False  # the system log missed lines: -q then lists the removals too
    if not (dry_run or no_syslog) and (report.removed or report.partial):
        from vllm_offload_cli.core.reclaim import audit

        logged = audit.record_removals(report.removed, summary=_summary(report))
        data["syslog"] = jsonable(logged)
        if logged.problem is not None:
            unrecorded = logged.dropped > 0
            _say_audit_dropped(inv, logged.dropped, logged.socket, logged.problem)
    common.warn_useless_waiver(inv, shm_private_to_namespace)
    _warn_lease_only(inv, report)
    errors = [{"code": e.code, "message": e.message} for e in report.errors]
    refusals = refusal_errors(report)
    # a named id that matches nothing is said, as `inspect` says it: a typo must not pass
    missing = [{"code": RegionNotFoundError.code, "message": f"no region or manifest named "
                f"{engine_id} in {report.shm_dir}; `vllm-offload inspect` lists them all"}
               for engine_id in report.not_found]
    output: list[dict[str, str]] = []
    changed = not dry_run and bool(report.removed or report.orphan_manifests_removed
                                   or report.temp_files_removed)
    code = most_important(status for status, present in (
        (ExitStatus.FAILED, errors), (ExitStatus.UNSAFE, refusals), (ExitStatus.USAGE, missing),
        (ExitStatus.PARTIAL, report.partial)) if present)
    if prometheus is not None:
        testhook.pause_at("gc_before_outputs")  # tests break the output here, after the removals
        try:
            metrics.emit(_registry(report, code, metrics.previous_totals(prometheus, TOTALS)),
                          prometheus)
            data["prometheus"] = str(prometheus)
        except OffloadError as exc:  # after removals: report them all, and say so
            output.append({"code": "output_failed", "message": exc.message + (
                "; the removals above were made" if changed else "")})
            # the textfile cannot carry this status; with nothing removed, the write's own
            # status (NO_SPACE on a full filesystem), not FAILED, which says a removal failed
            code = most_important((code, ExitStatus.PARTIAL if changed else exc.exit_status))
    said = errors + output + refusals + missing
    return Outcome(data=data, exit_code=code, errors=said,
                   render=lambda out: _render(inv, out, report, said, unrecorded))


def _say_audit_dropped(inv: Invocation, dropped: int, socket: str, problem: str) -> None:
    """A warning in JSON; in text mode a line on stderr even with -q (which then lists the
    removals too), silenced by -qq: the audit record never drops silently."""
    message = (f"system log: {dropped} record(s) not written ({socket}: {problem}); "
               "the lines above are the only record")
    inv.warnings.append({"code": "syslog_dropped", "message": message})
    if not inv.json_output and inv.verbosity > -2:
        sys.stderr.write(f"Warning: {printable(message)}\n")


def _warn_lease_only(inv: Invocation, report: GcReport) -> None:
    """Uninspectable processes matter only where they changed a decision: say which."""
    if not (leased := [r for r in report.removed if r.hidden_pids]):
        return
    shown = shortened(sorted({p for r in leased for p in r.hidden_pids}), 5, " ...")
    names = shortened([r.engine_id for r in leased], 3)
    verb = "would be" if report.options.dry_run else "was"
    inv.warn("removed_on_lease_proof",
             f"{names} {verb} removed on the kernel's lease proof alone: pid(s) {shown} could "
             "not be inspected (permission denied) and could have had it open")


def refusal_errors(report: GcReport) -> list[dict[str, str]]:
    """One error per reason this run refused to judge regions (ExitStatus.UNSAFE)."""
    from vllm_offload_cli.core.host.visibility import HIDDEN_HOLDERS, advice

    out = []
    if report.blind_spots:
        what = (f"{len(report.refused)} region(s) not proven unused were kept"
                if report.refused else "nothing could be proven unused")
        out.append({"code": report.blind_spots[0].code, "message": (
            f"refusing to remove anything: {report.blind_spots[0].message}; {what}. To fix: "
            f"{advice(report.blind_spots)}")})
    if hidden := [k for k in report.refused if k.blind_spot == HIDDEN_HOLDERS]:
        pids = report.uninspectable_pids
        who = (f"pid(s) {shortened(pids, 5, ' ...')}" if pids
               else "processes this run cannot inspect")
        out.append({"code": HIDDEN_HOLDERS, "message": (
            f"kept {len(hidden)} region(s) that {who}, not inspectable, could hold "
            f"({shortened([k.engine_id for k in hidden], 3)})"
            "; run gc as root (with CAP_SYS_PTRACE and CAP_LEASE) to prove them unused")})
    return out


def _render(inv: Invocation, out: Out, report: GcReport, errors: list[dict[str, str]],
            unrecorded: bool = False) -> None:
    """Every decision; with -q one summary line when something happened (quiet cron mail),
    the removals listed only when the system log missed them."""
    quiet = inv.verbosity < 0
    verb = "Would remove" if report.options.dry_run else "Removed"
    for e in errors:
        inv.err.print(f"Error: {e['message']}")
    if not quiet or unrecorded:  # the output is then the only record of the removals
        for r in report.removed:
            extra = [f"{len(r.paths) - 1} segment(s)"] if len(r.paths) > 1 else []
            extra += ["manifest"] if r.manifest else []
            more = f" (+ {', '.join(extra)})" if extra else ""
            out.print(f"{verb} {r.engine_id}{more}: {format_bytes(r.freed_bytes)} of memory, "
                      f"{format_bytes(r.bytes)} file size")
    if not quiet:
        for line in _kept_lines(report, verb):
            out.print(line)
    # -q: the summary only when something happened (cron mails what it prints)
    if not quiet or (report.removed or report.orphan_manifests_removed
                     or report.temp_files_removed or report.partial):
        out.print(_summary(report))


def _kept_lines(report: GcReport, verb: str) -> list[str]:
    """Every other decision: kept and why, leftovers removed, what a later run looks at."""
    from vllm_offload_cli.core.region.fsguard import user_text

    kept, summed = kept_listed(report)
    return [
        *(f"Kept {k.engine_id}: {k.message}" for k in kept),
        *(f"Kept {a['regions']} more region(s) of "
          f"{'an unknown owner' if a['uid'] is None else user_text(a['uid'])}: "
          + ", ".join(f"{n} {code}" for code, n in a["codes"].items()) for a in summed),
        *(f"Kept {t.files} more region file(s) of {user_text(t.uid)}: not this user's to "
          f"remove ({format_bytes(t.allocated_bytes)} of memory), counted, not listed"
          for t in report.counted),
        *(f"{verb} orphaned manifest {path}" for path in report.orphan_manifests_removed),
        *(f"{verb} leftover temporary file {path}" for path in report.temp_files_removed),
        *(f"Not judged in time: {t.files} region file(s) of {user_text(t.uid)} "
          f"({format_bytes(t.allocated_bytes)} of memory); a later run looks at them"
          for t in report.not_judged),
    ]


def _summary(report: GcReport) -> str:
    """The run in one line: the quiet output, and the system log's record of the run."""
    freed = format_bytes(report.freed_bytes)
    head = f"Would free {freed}" if report.options.dry_run else f"Freed {freed}"
    failed = f"; {len(report.errors)} removal(s) failed" if report.errors else ""
    late = (f"; {report.not_judged_files} region file(s) not judged in time "
            f"(exit {int(ExitStatus.PARTIAL)})" if report.not_judged else "")
    if not report.listed_all:
        late += ("; the deadline came before every name was listed "
                 f"(exit {int(ExitStatus.PARTIAL)})")
    dry = " (dry run: nothing was changed)" if report.options.dry_run else ""
    counted = sum(t.files for t in report.counted)
    return (f"{head} from {len(report.removed)} region(s) in {report.shm_dir}; kept "
            f"{len(report.kept) + counted} of {report.regions_seen + counted} seen"
            f"{failed}{late}{dry}.")


TOTALS = {
    "vllm_offload_gc_runs_total": "Garbage collections that wrote this textfile.",
    "vllm_offload_gc_removals_total": "Regions removed (dry runs remove none).",
    "vllm_offload_gc_freed_bytes_total": "tmpfs memory given back by removals.",
    "vllm_offload_gc_refusals_total": "Regions kept because a holder could be hidden (a "
    "blind spot), summed over runs.",
    "vllm_offload_gc_failures_total": "Removals that failed, summed over runs.",
}


def _registry(report: GcReport, code: ExitStatus, previous: dict[str, float]) -> Any:
    """Gauges of this run and its exit `code` (an unwritable textfile keeps the previous one,
    its timestamp ageing), and `*_total` counters carried on from the `previous` values."""
    from prometheus_client import CollectorRegistry, Gauge

    registry = CollectorRegistry()
    real = not report.options.dry_run
    this_run = (1, len(report.removed) if real else 0, report.freed_bytes if real else 0,
                len(report.refused), len(report.errors))  # in the order of TOTALS
    metrics.add_totals(registry, {
        name: (doc, previous.get(name, 0) + n)
        for (name, doc), n in zip(TOTALS.items(), this_run, strict=True)})

    for name, doc, value in (
            ("last_run_timestamp_seconds", "When the last garbage collection started (Unix "
             "time).", report.started_at),
            ("exit_code", with_statuses(
                "Exit status of the last run ({SUCCESS} ok, {FAILED} a removal failed, {USAGE} "
                "bad usage, {UNSAFE} refused: a holder could be hidden, {PARTIAL} partial: not "
                "every region was judged in time)."), int(code)),
            ("files_not_judged", "Region files the last run could have removed but did not "
             "judge in its --timeout (a later run looks at them).", report.not_judged_files),
            ("duration_seconds", "How long the last run took.", report.duration_seconds),
            ("dry_run", "1 if the last run was a dry run (nothing removed).",
             1 if report.options.dry_run else 0),
            ("regions_seen", "Regions the last run examined.", report.regions_seen),
            ("regions_removed", "Regions the last run removed (would remove, in a dry run).",
             len(report.removed)),
            ("freed_bytes", "tmpfs memory the last run gave back.", report.freed_bytes),
            ("orphan_manifests_removed", "Orphaned manifests the last run removed.",
             len(report.orphan_manifests_removed)),
            ("errors", "Removals that failed in the last run.", len(report.errors)),
            ("blind_spots", "Host-wide blind spots that made the last run refuse to remove "
             "anything (PID namespace, hidepid): fix the deployment.", len(report.blind_spots)),
            ("uninspectable_processes", "Processes whose /proc entries the last run could not "
             "read.", report.uninspectable_processes)):
        Gauge(f"vllm_offload_gc_{name}", doc, registry=registry).set(value)
    kept = Gauge("vllm_offload_gc_regions_kept", "Regions the last run kept, by reason.",
                 ["reason"], registry=registry)
    for reason, count in report.kept_by_code().items():
        kept.labels(reason).set(count)
    return registry
