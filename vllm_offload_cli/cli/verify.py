"""`vllm-offload verify-rank-layout`: prove that no two workers share bytes, planned or live."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from vllm_offload_cli.cli import common
from vllm_offload_cli.cli.common import Invocation, Outcome, shm_dir_checked, subcommand, text_table
from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.base.exit_status import ExitStatus
from vllm_offload_cli.core.base.text import printable
from vllm_offload_cli.core.base.units import format_bytes
from vllm_offload_cli.core.region.ranks import DEVICE_MODULO, RANK_SOURCES, parse_rank_source

if TYPE_CHECKING:  # the planner and checker load only when the command runs
    from vllm_offload_cli.core.layout.check import LiveCheck
    from vllm_offload_cli.core.layout.plan import LayoutPlan, WorkerPlan

_SOURCES_HELP = "; ".join(f"{s.name}: {s.description}" for s in RANK_SOURCES.values())


@subcommand("verify-rank-layout",
            help="Prove that no two workers share bytes: plan a layout, or check a live region.")
@click.argument("engine_id", required=False)
@click.option("--world-size", type=int, metavar="N", help="Workers per replica (required to "
              "plan; for a region without a manifest, with --cpu-page-size).")
@click.option("--dp-size", type=int, metavar="N", show_default="1, or the number of --devices "
              "groups", help="Plan: data-parallel replicas.")
@click.option("--devices", metavar="SPEC", show_default="contiguous",
              help="Plan: device index each worker's process sees, e.g. '0,2;1,3' (';' between "
              "replicas, ',' between workers); or 'contiguous' (replica k on "
              "k*W..k*W+W-1), 'env' (split CUDA_VISIBLE_DEVICES into replicas; each worker "
              "sees its position in the list), 'per-process' (each worker process sees only "
              "its own GPU, index 0).")
@click.option("--rank-source", type=common.ParsedChoice(
                  list(RANK_SOURCES), lambda v: parse_rank_source(v).name),
              metavar="NAME", show_default=DEVICE_MODULO.name,
              help=f"Plan: how a worker picks its slot. {_SOURCES_HELP}.")
@click.option("--no-dp-suffix", is_flag=True, help="Plan: replicas get no _dp{k} engine_id "
              "suffix (the multiprocessing path before vLLM PR 47987).")
@click.option("--cpu-page-size", type=common.Size(), help="Live: bytes per worker slot, for a "
              "region without a manifest (e.g. 64KiB).")
def verify_rank_layout(inv: Invocation, engine_id: str | None, world_size: int | None,
                       dp_size: int | None, devices: str | None, rank_source: str | None,
                       no_dp_suffix: bool, cpu_page_size: int | None) -> Outcome:
    """Prove that no two workers share bytes.

    Plan mode (no ENGINE_ID) computes every replica's engine_id and every
    worker's device and slot, and reports slot collisions, slots outside
    [0, W), shared engine_ids and shared devices. Live mode checks an existing
    region: size against geometry, attached ranks (each in range, each once,
    none missing) and which slots were ever populated. Exit {PROBLEMS_FOUND} when
    anything is wrong.
    """
    if engine_id is None:
        _refuse("live", ("--cpu-page-size", cpu_page_size is not None))
        return _plan(inv, world_size, dp_size, devices, rank_source, no_dp_suffix)
    _refuse("plan", ("--dp-size", dp_size is not None), ("--devices", devices is not None),
            ("--rank-source", rank_source is not None), ("--no-dp-suffix", no_dp_suffix))
    return _live(inv, engine_id, world_size, cpu_page_size)


def _refuse(mode: str, *given: tuple[str, bool]) -> None:
    if wrong := [name for name, present in given if present]:
        other = "an ENGINE_ID (live mode)" if mode == "live" else "no ENGINE_ID (plan mode)"
        raise InvalidInputError(f"{', '.join(wrong)} only applies with {other}", code="usage")


def _outcome(mode: str, found: LayoutPlan | LiveCheck, lines: Callable[[], list[str]],
             good: str, **extra: Any) -> Outcome:
    """The data, the exit status and the text (made only when shown): `lines()`, verdict."""
    problems = [p.to_dict() for p in found.problems]
    data = {"mode": mode, "ok": found.ok, "problems": problems, **found.to_dict(), **extra}
    verdict = [*(f"  - {p['message']}" for p in problems),
               f"FAIL: {len(problems)} problem(s)" if problems else f"OK: {good}"]
    return Outcome(data=data,
                   exit_code=ExitStatus.PROBLEMS_FOUND if problems else ExitStatus.SUCCESS,
                   errors=[{"code": p["code"], "message": p["message"]} for p in problems],
                   render=lambda out: out.print("\n".join(lines() + verdict)))


def _plan(inv: Invocation, world_size: int | None, dp_size: int | None, devices: str | None,
          rank_source: str | None, no_dp_suffix: bool) -> Outcome:
    if world_size is None:
        raise InvalidInputError("plan mode needs --world-size (or give an ENGINE_ID to check "
                                "a live region)", code="usage")
    source = DEVICE_MODULO if rank_source is None else parse_rank_source(rank_source)
    from vllm_offload_cli.core.layout.plan import parse_devices, plan_layout

    layout = parse_devices(devices, environ=os.environ)
    plan = plan_layout(world_size, source, dp_size=dp_size, devices=layout,
                       dp_suffix=not no_dp_suffix)
    if plan.unused_devices:
        inv.warn("unused_devices", f"{len(plan.unused_devices)} visible device(s) are not "
                 f"used by any replica: {', '.join(plan.unused_devices)}")
    return _outcome("plan", plan, lambda: _plan_lines(plan),
                    "every worker has its own slot in its replica's region")


def _device_text(plan: LayoutPlan, w: WorkerPlan) -> str:
    from vllm_offload_cli.core.layout.plan import ENV, PER_PROCESS

    if plan.devices.kind == PER_PROCESS:
        return f"{w.device.index} (own GPU)"
    if plan.devices.kind == ENV:
        label = w.device.label or ""
        return f"{w.device.index} ({'GPU ' if label.isdigit() else ''}{label})"
    return str(w.device.index)


def _status(codes: tuple[str, ...]) -> str:
    return ",".join(codes) or "ok"


def _plan_lines(plan: LayoutPlan) -> list[str]:
    suffix = "" if plan.dp_suffix else ", no _dp suffix"
    lines = [f"Plan: {plan.dp_size} replica(s) x {plan.world_size} worker(s); rank source "
             f"{plan.rank_source.name} ({plan.rank_source.description}); devices "
             f"{plan.devices.kind}{suffix}"]
    rows = [[str(r.replica), printable(r.engine_id), str(w.worker),
             printable(_device_text(plan, w)), str(w.slot), _status(w.problems)]
            for r in plan.replicas for w in r.workers]
    lines.append(text_table(["REPLICA", "ENGINE ID", "WORKER", "DEVICE", "SLOT", "STATUS"],
                            rows, right=(0, 2, 4)))
    return lines


def _live(inv: Invocation, engine_id: str, world_size: int | None, page: int | None
          ) -> Outcome:
    shm_dir = shm_dir_checked(inv)
    from vllm_offload_cli.core.layout.check import check_region

    check = check_region(shm_dir, engine_id, world_size=world_size, cpu_page_size=page)
    for note in check.notes:
        inv.warn(note.code, note.message)
    return _outcome("live", check, lambda: _live_lines(check),
                    "sizes, ranks and slots are consistent", joined=_joined(check))


def _live_lines(check: LiveCheck) -> list[str]:
    lines = [f"Region {check.path} ({format_bytes(check.size_bytes)})"]
    if (g := check.geometry) is not None:
        origin = ("manifest" if check.geometry_source == "manifest"
                  else "--world-size/--cpu-page-size")
        lines.append(f"  geometry  {g.num_blocks} rows x {g.row_stride} bytes; "
                     f"{g.world_size} slot(s) of {g.cpu_page_size} bytes (from the {origin})")
    if check.rank_source is not None:
        lines.append(f"  rank source {check.rank_source}")
    if (joined := _joined(check)) is False:
        lines.append("  no worker has joined yet: which slots are populated says nothing "
                     "until one does (create pre-faults every slot)")
    if check.slots:
        rows = []
        for s in check.slots:
            populated = "not joined yet" if joined is False else (
                "-" if (fraction := s.populated_fraction) is None else f"{fraction:.0%}")
            status = ("unmeasurable" if s.status == ("unmeasurable",) else
                      _status(tuple(c for c in s.status if c != "unmeasurable")))
            rows.append([str(s.slot), f"{s.start}..{s.end}", _workers_text(s.workers),
                         populated, status])
        width = g.world_size if g is not None and g.world_size is not None else 0
        for w in check.workers:
            if not 0 <= w.rank < width:
                rows.append([str(w.rank), "outside the row", _workers_text((w,)), "-",
                             _status(("rank_out_of_range",))])
        lines.append(text_table(["SLOT", "BYTES", "WORKERS", "POPULATED", "STATUS"], rows,
                                right=(0,)))
    return lines


def _joined(check: LiveCheck) -> bool | None:
    """Whether any worker attached; None without a manifest to tell."""
    return None if check.manifest is None else bool(check.workers)


def _workers_text(workers: Any) -> str:
    return ", ".join(f"pid {w.pid}" + ("" if w.device_index is None else
                                       f" dev {w.device_index}") for w in workers) or "-"
