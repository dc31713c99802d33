"""Live mode of `verify-rank-layout`: does an existing region hold what it claims (size,
row stride, the manifest's live workers, populated slots; a remote NUMA node is a note, as
it is only slow)? The file is opened read-only without following links, and residency is
read on a mapping never touched, so checking faults nothing in."""

from __future__ import annotations

import os
import stat
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from vllm_offload_cli.core.base import errors
from vllm_offload_cli.core.base.problems import Problem, jsonable
from vllm_offload_cli.core.base.text import joined
from vllm_offload_cli.core.host import observed_placement, residency
from vllm_offload_cli.core.host.discovery import RegionInfo, open_released
from vllm_offload_cli.core.region import fsguard, geometry
from vllm_offload_cli.core.region import manifest as manifest_io
from vllm_offload_cli.core.region.geometry import PAGESIZE, Geometry
from vllm_offload_cli.core.region.naming import manifest_path, region_path, validate_engine_id
from vllm_offload_cli.core.region.ranks import RANK_SOURCES
from vllm_offload_cli.core.system import libc, memory, processes
from vllm_offload_cli.core.system.files import FileId


@dataclass(frozen=True, kw_only=True)
class AttachedWorker:
    """A live ranked opener recorded in the manifest."""

    pid: int
    rank: int
    device_index: int | None
    rank_source: str | None
    host: str | None


@dataclass(frozen=True, kw_only=True)
class WorkerPlacement:
    """One attached worker: the nodes of its CPUs and where its slot's pages are."""

    pid: int
    rank: int
    cpu_nodes: tuple[int, ...] | None  # None: affinity unreadable (process gone, denied)
    slot_numa_nodes: dict[int, int] | None  # node -> resident bytes of the slot; None: unknown
    remote: bool  # some of its slot's pages are on a node its CPUs are not


@dataclass(frozen=True, kw_only=True)
class SlotReport:
    """One slot across all rows; residency counts its own pages and shared ones apart."""

    slot: int
    start: int
    end: int
    workers: tuple[AttachedWorker, ...]
    pages: int
    resident_pages: int
    shared_pages: int
    shared_resident_pages: int
    status: tuple[str, ...] = ()

    @property
    def populated_fraction(self) -> float | None:
        return None if self.pages == 0 else self.resident_pages / self.pages

    def to_dict(self) -> dict[str, Any]:
        fraction = self.populated_fraction
        return {**jsonable(self), "status": ",".join(self.status) or "ok",
                "populated_fraction": None if fraction is None else round(fraction, 6)}


@dataclass(frozen=True, kw_only=True)
class LiveCheck:
    engine_id: str
    path: str
    manifest: str | None  # its path; None when the region has no usable manifest
    size_bytes: int
    geometry: Geometry | None  # the geometry the checks used; None when unknown
    geometry_source: str | None  # "manifest" or "arguments"
    rank_source: str | None  # what the creator recorded
    workers: tuple[AttachedWorker, ...]
    rankless_openers: int
    stale_attachments: int
    slots: tuple[SlotReport, ...]
    problems: tuple[Problem, ...]
    notes: tuple[Problem, ...] = field(default_factory=tuple)
    numa: tuple[WorkerPlacement, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """Every field but the problems, which the caller's envelope carries."""
        data = {k: v for k, v in jsonable(self).items() if k != "problems"}
        return data | {"slots": [s.to_dict() for s in self.slots],
                       "notes": [n.to_dict() for n in self.notes]}


def check_region(
    shm_dir: str | os.PathLike[str],
    engine_id: str,
    *,
    world_size: int | None = None,
    cpu_page_size: int | None = None,
) -> LiveCheck:
    """Check one region; raise only for bad input or a file that is not a region at all."""
    validate_engine_id(engine_id)
    for option, value in (("--world-size", world_size), ("--cpu-page-size", cpu_page_size)):
        if value is not None and value <= 0:
            raise errors.InvalidInputError(f"{option} must be greater than 0, got {value}",
                                           code="invalid_geometry")
    allowed_uids = fsguard.inspection_uids()
    path = str(region_path(shm_dir, engine_id))
    mpath = str(manifest_path(shm_dir, engine_id))
    released: RegionInfo | None = None
    try:
        fd = fsguard.open_existing(path, os.O_RDONLY, engine_id=engine_id)
    except errors.RegionNotFoundError:
        # an engine started through the hook released the name: its processes still
        # hold the region, and carry its manifest (core.region.carried)
        found = open_released(shm_dir, engine_id)
        if found is None:
            raise errors.RegionNotFoundError(
                f"no region named {engine_id} in {shm_dir} ({path} does not exist, and no "
                "process holds one whose name was released); `vllm-offload inspect` lists "
                "them", path=path, engine_id=engine_id) from None
        fd, released = found
    try:
        return _check_open(fd, path, mpath, engine_id, world_size, cpu_page_size,
                           allowed_uids, released)
    finally:
        os.close(fd)


def _check_open(fd: int, path: str, mpath: str, engine_id: str, world_size: int | None,
                cpu_page_size: int | None, allowed_uids: fsguard.AllowedUids,
                released: RegionInfo | None = None) -> LiveCheck:
    """`released`: the file's name is gone; its manifest is the one its holders carry."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise errors.UnsafeRegionError(f"{path} is not a regular file; it is no region",
                                       path=path, engine_id=engine_id, code="not_regular_file")
    if released is not None:
        path = f"{path} (deleted)"
    problems = [Problem(p.code, f"{path} {p.message}")
                for p in fsguard.stat_problems(st, allowed_uids=allowed_uids,
                                               expect_linked=released is None)]
    manifest, mproblem = (released.manifest, None) if released is not None else (
        manifest_io.read_matching(mpath, FileId.of(st), allowed_uids=allowed_uids,
                                  owner_uid=st.st_uid))
    problems += [] if mproblem is None else [mproblem]
    g, rows, gproblems, source = _geometry_for(
        manifest, mproblem, st.st_size, world_size, cpu_page_size, path, mpath, engine_id)
    problems += gproblems
    live = () if manifest is None else manifest.live_attachments()
    workers = [AttachedWorker(pid=a.pid, rank=a.rank, device_index=a.device_index,
                              rank_source=a.rank_source, host=a.host)
               for a in live if a.rank is not None]
    slots: list[SlotReport] = []
    placed: list[WorkerPlacement] = []
    notes: list[Problem] = []
    if g is not None and g.world_size is not None:
        _worker_checks(workers, g.world_size, manifest is not None,
                       len(live) - len(workers), problems, notes)
        if rows > 0:
            slots, placed = _slot_checks(fd, g, rows, workers, problems, notes)
    return LiveCheck(
        engine_id=engine_id, path=path,
        manifest=mpath if manifest is not None and released is None else None,
        size_bytes=st.st_size, geometry=g, geometry_source=source,
        rank_source=None if manifest is None else manifest.rank_source,
        workers=tuple(workers), rankless_openers=len(live) - len(workers),
        stale_attachments=0 if manifest is None else len(manifest.attachments) - len(live),
        slots=tuple(slots), problems=tuple(problems), notes=tuple(notes), numa=tuple(placed),
    )


def _geometry_for(manifest: manifest_io.Manifest | None, mproblem: Problem | None, size: int,
                  world_size: int | None, cpu_page_size: int | None, path: str, mpath: str,
                  engine_id: str) -> tuple[Geometry | None, int, list[Problem], str | None]:
    """The geometry the checks use, the rows the file holds, its problems and its source."""
    if manifest is not None:
        found = _geometry_from_manifest(manifest, size, world_size, cpu_page_size, mpath)
        return *found, "manifest"
    if world_size is None or cpu_page_size is None:
        if mproblem is None:
            raise errors.InvalidInputError(
                f"{path} has no manifest (made by vLLM?), so its geometry is unknown; pass "
                "--world-size and --cpu-page-size", path=path, engine_id=engine_id,
                code="geometry_unknown")
        return None, 0, [Problem("geometry_unknown", "without a usable manifest the geometry "
                                 "is unknown; pass --world-size and --cpu-page-size")], None
    return *_geometry_from_arguments(size, world_size, cpu_page_size, path), "arguments"


def _geometry_from_manifest(m: manifest_io.Manifest, size: int, world_size: int | None,
                            cpu_page_size: int | None, mpath: str
                            ) -> tuple[Geometry | None, int, list[Problem]]:
    """The manifest's geometry, and how many of its rows the file really holds."""
    g = m.geometry
    problems = [Problem("geometry_mismatch", f"the manifest records {name} {recorded}, "
                        f"{option} says {given}")
                for name, option, recorded, given in (
                    ("world size", "--world-size", g.world_size, world_size),
                    ("cpu_page_size", "--cpu-page-size", g.cpu_page_size, cpu_page_size))
                if given is not None and recorded is not None and given != recorded]
    world = g.world_size if g.world_size is not None else world_size
    if world is None:
        raise errors.InvalidInputError(
            f"manifest {mpath} does not record the world size; pass --world-size",
            path=mpath, code="geometry_unknown")
    if size != g.size_bytes:
        problems.append(Problem(
            "size_mismatch", f"the file is {size} bytes but its manifest geometry needs "
            f"{g.size_bytes} ({g.num_blocks} rows of {g.row_stride} bytes)"))
    bad_stride = geometry.stride_problems(g.row_stride, g.cpu_page_size, world)
    if bad_stride:
        return None, 0, problems + bad_stride
    return replace(g, world_size=world), min(g.num_blocks, size // g.row_stride), problems


def _geometry_from_arguments(size: int, world_size: int, cpu_page_size: int, path: str
                             ) -> tuple[Geometry | None, int, list[Problem]]:
    """vLLM's layout for these arguments: row_stride = round_up(W * slot, PAGESIZE)."""
    row_stride = geometry.default_row_stride(world_size, cpu_page_size)
    rows, rest = divmod(size, row_stride)
    hint = "wrong --world-size or --cpu-page-size?"
    if size == 0:
        return None, 0, [Problem("size_mismatch", f"{path} is empty; its creator never sized "
                                 "it (crashed between open and ftruncate?)")]
    if rows == 0:
        return None, 0, [Problem(
            "size_mismatch", f"{path} is {size} bytes, smaller than one row of {row_stride} "
            f"bytes ({world_size} slot(s) of {cpu_page_size}); {hint}")]
    problems = [] if not rest else [Problem(
        "size_mismatch", f"{path} is {size} bytes, not a whole number of rows of {row_stride} "
        f"bytes ({world_size} slot(s) of {cpu_page_size}, rounded up to a page): {rows} rows "
        f"and {rest} bytes over; {hint}")]
    return Geometry(num_blocks=rows, row_stride=row_stride, cpu_page_size=cpu_page_size,
                    world_size=world_size), rows, problems


def _worker_checks(workers: Sequence[AttachedWorker], world_size: int, has_manifest: bool,
                   rankless: int, problems: list[Problem], notes: list[Problem]) -> None:
    """Add the problems and notes about the workers the manifest records."""
    if not has_manifest:
        notes.append(Problem("no_manifest", "no manifest records who attached (a region made "
                             "by vLLM); only size and residency are checked"))
        return
    if workers:
        _rank_checks(workers, world_size, problems, notes)
    else:
        notes.append(Problem("no_workers", "no live worker is attached (pre-provisioned, or "
                             "the engine is down); only size and residency are checked"))
    if rankless:
        notes.append(Problem(
            "rankless_opener", f"{rankless} rank-less opener(s) (the scheduler, or `create`) "
            "hold the region; they pre-fault every slot, so residency cannot show which "
            "workers wrote"))


def _rank_checks(workers: Sequence[AttachedWorker], world_size: int, problems: list[Problem],
                 notes: list[Problem]) -> None:
    """Each rank in range, each rank once, all ranks present, no two on one device."""
    problems += [Problem(
        "rank_out_of_range", f"pid {w.pid} is attached as rank {w.rank}, outside [0, "
        f"{world_size}) ({_origin(w)}); it writes past the row's slots, into another worker's "
        "slot of the next row", ranks=(w.rank,), pids=(w.pid,))
        for w in workers if not 0 <= w.rank < world_size]
    by_rank: dict[int, list[AttachedWorker]] = defaultdict(list)
    for w in workers:
        by_rank[w.rank].append(w)
    problems += [Problem(
        "rank_duplicate", f"rank {rank} is attached {len(same)} times: pids "
        f"{joined(w.pid for w in same)} ({'; '.join(_origin(w) for w in same)}); they write "
        "the same bytes", ranks=(rank,), pids=tuple(w.pid for w in same), slot=rank)
        for rank, same in sorted(by_rank.items()) if len(same) > 1]
    missing = [r for r in range(world_size) if r not in by_rank]
    if missing:
        problems.append(Problem(
            "rank_missing", f"no live worker is attached as rank {joined(missing, 'or')} of "
            f"{world_size}; a worker never attached, or computed another rank",
            ranks=tuple(missing)))
    _device_checks(workers, problems, notes)
    sources = sorted({w.rank_source for w in workers if w.rank_source is not None})
    if len(sources) > 1:
        problems.append(Problem(
            "mixed_rank_sources", "live workers computed their ranks with different sources "
            f"({', '.join(sources)}); their slots need not be disjoint",
            pids=tuple(w.pid for w in workers if w.rank_source is not None)))


def _device_checks(workers: Sequence[AttachedWorker], problems: list[Problem],
                   notes: list[Problem]) -> None:
    """One device index for two workers proves a shared slot only for device-based rank
    sources: where each worker process sees only its own GPU, all are on index 0."""
    by_device: dict[int, list[AttachedWorker]] = defaultdict(list)
    for w in workers:
        if w.device_index is not None:
            by_device[w.device_index].append(w)
    for device, same in sorted(by_device.items()):
        pids = tuple(w.pid for w in same)
        if len(set(pids)) < 2:
            continue
        ranks = tuple(w.rank for w in same)
        sources = [RANK_SOURCES.get(w.rank_source or "") for w in same]
        if all(source is not None and source.device_based for source in sources):
            problems.append(Problem(
                "device_shared", f"pids {joined(pids)} all report device index {device} and "
                "derive their rank from it, so they compute the same slot", ranks=ranks,
                pids=pids))
        else:
            notes.append(Problem(
                "device_index_shared", f"pids {joined(pids)} all report device index {device}; "
                "fine when each worker process sees only its own GPU, a shared GPU otherwise",
                ranks=ranks, pids=pids))


def _slot_checks(fd: int, g: Geometry, rows: int, workers: list[AttachedWorker],
                 problems: list[Problem], notes: list[Problem]
                 ) -> tuple[list[SlotReport], list[WorkerPlacement]]:
    """Who wrote which slot (residency), and whose slot sits on a remote NUMA node; a
    refused residency or NUMA measurement is a note."""
    try:
        pages = residency.page_map(fd, rows * g.row_stride)
    except OSError as exc:
        notes.append(_refused(exc, "slots not checked: their residency was not measured"))
        return [], []
    slots = _slot_reports(g, rows, pages, workers, problems, notes)
    try:  # one mincore of the whole region serves both checks
        placed = check_workers(fd, g, rows, [
            (w.pid, w.rank) for w in workers if 0 <= w.rank < len(slots)], resident=pages)
    except OSError as exc:
        placed = []
        notes.append(_refused(exc, "NUMA placement not checked"))
    notes += [Problem("numa_remote", remote_message(w), ranks=(w.rank,),
                      pids=(w.pid,)) for w in placed if w.remote]
    return slots, placed


def _slot_reports(g: Geometry, rows: int, pages: bytes, workers: Sequence[AttachedWorker],
                  problems: list[Problem], notes: list[Problem]) -> list[SlotReport]:
    """Residency per slot over the `rows` rows the file holds (`pages`: its page map); its
    status: the codes of the problems about it."""
    per_row = g.row_stride // PAGESIZE
    resident_in_column = [pages[j::per_row].count(1) for j in range(per_row)]
    own, shared = _page_columns(g)
    reports = []
    for slot in range(g.world_size or g.max_slots):  # the slots _page_columns knows
        rng = g.slot(slot)
        claim = tuple(w for w in workers if w.rank == slot)
        report = SlotReport(
            slot=slot, start=rng.start, end=rng.stop, workers=claim,
            pages=len(own[slot]) * rows,
            resident_pages=sum(resident_in_column[j] for j in own[slot]),
            shared_pages=len(shared[slot]) * rows,
            shared_resident_pages=sum(resident_in_column[j] for j in shared[slot]),
        )
        where = f"bytes {rng.start}..{rng.stop} of each of {rows} rows"
        if report.pages == 0:
            notes.append(Problem(
                "slot_unmeasurable", f"slot {slot} ({where}) shares every page with a "
                f"neighbouring slot (cpu_page_size {g.cpu_page_size} is not page aligned), so "
                "residency cannot tell whether it was populated", slot=slot))
        elif report.resident_pages == 0:
            who = (f"rank {slot} is attached (pid {joined(w.pid for w in claim)}) but never "
                   "wrote there" if claim else
                   "no live worker claims it; a worker never attached, or wrote elsewhere")
            problems.append(Problem(
                "slot_unpopulated", f"slot {slot} ({where}) was never populated: none of its "
                f"{report.pages} page(s) is resident; {who}", slot=slot,
                pids=tuple(w.pid for w in claim)))
        codes = tuple(dict.fromkeys(p.code for p in problems if slot in (p.slot, *p.ranks)))
        reports.append(replace(report, status=codes or (
            ("unmeasurable",) if report.pages == 0 else ())))
    return reports


def _page_columns(g: Geometry) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Per slot, the pages of a row (every row has the same pattern) that hold its bytes
    alone, and those it shares with a neighbour, which cannot say which of the two wrote."""
    slots = g.world_size or g.max_slots
    own: dict[int, list[int]] = defaultdict(list)
    shared: dict[int, list[int]] = defaultdict(list)
    for j in range(g.row_stride // PAGESIZE):
        first = j * PAGESIZE // g.cpu_page_size
        last = min(((j + 1) * PAGESIZE - 1) // g.cpu_page_size, slots - 1)
        for slot in range(first, last + 1):
            (own if first == last else shared)[slot].append(j)
    return own, shared


def _slot_nodes(fd: int, g: Geometry, rows: int, cols: list[int], resident: bytes,
                topo: memory.Topology) -> dict[int, int] | None:
    """Resident bytes per node of a slot's own page columns `cols`; sampled if need be."""
    per_row = g.row_stride // PAGESIZE
    total = sum(resident[j::per_row][:rows].count(1) for j in cols) * PAGESIZE
    if topo.single_node:
        return {topo.nodes[0]: total} if total else {}
    if not total or not libc.numa_syscalls_available():
        return {} if not total else None
    step = max(1, rows * len(cols) // observed_placement.SAMPLE_PAGES)
    picked = [row * per_row + j for row in range(0, rows, step) for j in cols
              if resident[row * per_row + j]]
    try:
        seen = observed_placement.sample_pages(fd, rows * g.row_stride, picked).nodes
    except OSError as exc:
        if residency.refused(exc):  # said by the caller, not a silent "unknown"
            raise
        return None
    whole = sum(seen.values())
    return {n: total * b // whole for n, b in seen.items()} if whole else {}


def check_workers(fd: int, g: Geometry, rows: int, workers: Sequence[tuple[int, int]], *,
                  topo: memory.Topology | None = None, resident: bytes | None = None
                  ) -> list[WorkerPlacement]:
    """Affinity of each (pid, rank) against its slot's resident pages (`resident`: the
    region's page map, when the caller already has it)."""
    if not workers or rows <= 0:
        return []
    topo = topo or memory.topology()
    if resident is None:
        resident = residency.page_map(fd, rows * g.row_stride)
    own = _page_columns(g)[0]
    out = []
    for pid, rank in workers:
        cpus = processes.allowed_cpus(pid)
        cpu_nodes = None if cpus is None else tuple(sorted(topo.nodes_of_cpus(cpus)))
        nodes = _slot_nodes(fd, g, rows, own[rank], resident, topo)
        remote = bool(cpu_nodes and nodes and any(
            n not in cpu_nodes for n, b in nodes.items() if b))
        out.append(WorkerPlacement(pid=pid, rank=rank, cpu_nodes=cpu_nodes, slot_numa_nodes=nodes,
                                   remote=remote))
    return out


def remote_message(w: WorkerPlacement) -> str:
    far = sorted(n for n, b in (w.slot_numa_nodes or {}).items()
                 if b and n not in (w.cpu_nodes or ()))
    nodes = ",".join(str(n) for n in w.cpu_nodes or ())
    return (f"rank {w.rank} (pid {w.pid}) runs on CPUs of NUMA node(s) {nodes} but its slot's "
            f"pages are (partly) on node(s) {','.join(str(n) for n in far)}: every copy crosses "
            "the socket link; bind the region (`create --numa-node`) or pin the worker near it")


def _refused(exc: OSError, what: str) -> Problem:
    """A measurement a seccomp filter or policy refused is a note; any other error a bug."""
    if not residency.refused(exc):
        raise exc
    return Problem("measurement_refused", f"{what}: {exc.strerror} ({residency.REFUSED_HINT})")


def _origin(w: AttachedWorker) -> str:
    device = "device ?" if w.device_index is None else f"device {w.device_index}"
    return f"{device}, rank source {w.rank_source or 'unrecorded'}"
