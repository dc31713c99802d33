"""Plan mode of `verify-rank-layout`: which bytes would every worker write?

From the world size, the data-parallel size, the devices and a rank source: every
replica's engine_id and every worker's slot, and each pair of workers that would share
bytes (one engine_id and one slot, or a slot outside [0, W)). Pure computation.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.base.problems import Problem, WorkerRef, jsonable
from vllm_offload_cli.core.base.text import joined
from vllm_offload_cli.core.base.units import is_int
from vllm_offload_cli.core.region.ranks import RankSource, WorkerPlace

MAX_WORKERS = 65536  # a plan bigger than any host is a typo, not a layout

CONTIGUOUS, EXPLICIT, ENV, PER_PROCESS = "contiguous", "explicit", "env", "per-process"
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
_KEYWORDS = {
    "contiguous": CONTIGUOUS,
    "env": ENV,
    "cuda-visible-devices": ENV,
    "per-process": PER_PROCESS,
    "one-device-per-process": PER_PROCESS,
}
_VISIBLE_ENTRY_RE = re.compile(r"[0-9]+|(?:GPU|MIG)-[A-Za-z0-9/_-]+")


@dataclass(frozen=True)
class Device:
    """The index a worker's process sees; `label` names the physical device (one label,
    one GPU), None where each process sees only its own GPU."""

    index: int
    label: str | None


@dataclass(frozen=True)
class DeviceLayout:
    """Where the workers run; `groups` holds explicit or environment device lists."""

    kind: str
    groups: tuple[tuple[Device, ...], ...] = ()
    spec: str | None = None

    def assign(self, world_size: int, dp_size: int) -> tuple[tuple[Device, ...], ...]:
        """Every replica's devices, in worker order: replica k takes positions k*W .. k*W+W-1
        of the visible list, as vLLM slices it."""
        need = world_size * dp_size
        if self.kind == EXPLICIT:
            if len(self.groups) != dp_size:
                raise InvalidInputError(
                    f"--devices {self.spec!r} gives {len(self.groups)} replica group(s) but "
                    f"--dp-size is {dp_size}", code="invalid_devices")
            for k, group in enumerate(self.groups):
                if len(group) != world_size:
                    raise InvalidInputError(
                        f"--devices {self.spec!r}: replica {k} has {len(group)} device(s); "
                        f"--world-size is {world_size}", code="invalid_devices")
            return self.groups
        if self.kind == CONTIGUOUS:
            visible = tuple(Device(i, str(i)) for i in range(need))
        elif self.kind == PER_PROCESS:
            visible = (Device(0, None),) * need
        elif len(self.groups[0]) < need:
            raise InvalidInputError(
                f"{VISIBLE_DEVICES_ENV}={self.spec!r} lists {len(self.groups[0])} device(s); "
                f"{dp_size} replica(s) of {world_size} worker(s) need {need}",
                code="invalid_devices")
        else:
            visible = self.groups[0]
        return tuple(visible[k * world_size:(k + 1) * world_size] for k in range(dp_size))


def parse_devices(spec: str | None, *, environ: Mapping[str, str] | None = None
                  ) -> DeviceLayout:
    """A keyword, or `0,2;1,3` (`;` between replicas, `,` between workers): indices each
    worker's process sees (`current_device_index()`), so also the device's identity."""
    if spec is None:
        return DeviceLayout(CONTIGUOUS)
    text = spec.strip()
    kind = _KEYWORDS.get(text.lower())
    if kind == ENV:
        return _from_environment(environ or {})
    if kind is not None:
        return DeviceLayout(kind, spec=text)
    return DeviceLayout(EXPLICIT, _explicit_groups(spec), spec=spec)


def _explicit_groups(spec: str) -> tuple[tuple[Device, ...], ...]:
    hint = (f"; expected device indices like '0,1;2,3' (';' between replicas, ',' between "
            f"workers) or one of: {', '.join(sorted({CONTIGUOUS, ENV, PER_PROCESS}))}")
    if not spec.strip():
        raise InvalidInputError(f"--devices is empty{hint}", code="invalid_devices")
    groups = []
    for k, part in enumerate(spec.split(";")):
        items = [item.strip() for item in part.split(",")]
        if items == [""]:
            raise InvalidInputError(f"--devices {spec!r}: replica {k} has no devices{hint}",
                                    code="invalid_devices")
        for item in items:
            if not item.isdigit() or not item.isascii():
                raise InvalidInputError(
                    f"--devices {spec!r}: {item!r} is not a device index (an integer >= 0)"
                    f"{hint}", code="invalid_devices")
        groups.append(tuple(Device(int(item), str(int(item))) for item in items))
    return tuple(groups)


def _from_environment(environ: Mapping[str, str]) -> DeviceLayout:
    """The visible list; each worker sees its position in it, not the physical id."""
    raw = environ.get(VISIBLE_DEVICES_ENV)
    if raw is None:
        raise InvalidInputError(
            f"--devices env: {VISIBLE_DEVICES_ENV} is not set; every device is visible, "
            "which is the default contiguous layout", code="invalid_devices")
    entries = [e.strip() for e in raw.split(",")]
    if entries == [""]:
        raise InvalidInputError(f"--devices env: {VISIBLE_DEVICES_ENV} is empty; no device "
                                "is visible", code="invalid_devices")
    for entry in entries:
        if not _VISIBLE_ENTRY_RE.fullmatch(entry):
            raise InvalidInputError(
                f"--devices env: {VISIBLE_DEVICES_ENV}={raw!r} has entry {entry!r}; expected "
                "device ordinals or GPU-/MIG- UUIDs (CUDA ignores everything after an invalid "
                "entry)", code="invalid_devices")
    visible = tuple(Device(i, entry) for i, entry in enumerate(entries))
    return DeviceLayout(ENV, (visible,), spec=raw)


@dataclass(frozen=True, kw_only=True)
class WorkerPlan:
    worker: int  # its logical rank within the replica
    device: Device
    slot: int
    problems: tuple[str, ...]  # codes of the problems that involve this worker

    def to_dict(self) -> dict[str, Any]:
        return {"worker": self.worker, "rank": self.worker, "device_index": self.device.index,
                "device": self.device.label, "slot": self.slot,
                "status": ",".join(self.problems) or "ok"}


@dataclass(frozen=True, kw_only=True)
class ReplicaPlan:
    replica: int
    engine_id: str
    engine_id_suffix: str
    workers: tuple[WorkerPlan, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**jsonable(self), "workers": [w.to_dict() for w in self.workers]}


@dataclass(frozen=True, kw_only=True)
class LayoutPlan:
    world_size: int
    dp_size: int
    rank_source: RankSource
    devices: DeviceLayout
    dp_suffix: bool
    replicas: tuple[ReplicaPlan, ...]
    problems: tuple[Problem, ...]
    unused_devices: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size, "dp_size": self.dp_size,
            "rank_source": self.rank_source.name, "devices": self.devices.kind,
            "devices_spec": self.devices.spec, "dp_suffix": self.dp_suffix,
            "unused_devices": list(self.unused_devices),
            "replicas": [r.to_dict() for r in self.replicas],
        }


def engine_id_suffix(dp_rank: int, dp_size: int, *, dp_suffix: bool = True) -> str:
    """vLLM appends `_dp{rank}` only when DP size > 1 (and, before PR 47987, not on every path)."""
    return f"_dp{dp_rank}" if dp_suffix and dp_size > 1 else ""


def plan_layout(
    world_size: int,
    rank_source: RankSource,
    *,
    dp_size: int | None = None,
    devices: DeviceLayout | None = None,
    dp_suffix: bool = True,
) -> LayoutPlan:
    """Every replica's engine_id and every worker's device and slot, with every collision."""
    layout = devices or DeviceLayout(CONTIGUOUS)
    _require_count("--world-size", world_size)
    if dp_size is None:
        dp_size = len(layout.groups) if layout.kind == EXPLICIT else 1
    _require_count("--dp-size", dp_size)
    if world_size * dp_size > MAX_WORKERS:
        raise InvalidInputError(
            f"{dp_size} replica(s) of {world_size} worker(s) is more than {MAX_WORKERS} "
            "workers; check --world-size and --dp-size", code="invalid_layout")
    assigned = layout.assign(world_size, dp_size)
    unused = layout.groups[0][world_size * dp_size:] if layout.kind == ENV else ()
    device_of = {WorkerRef(k, w): d for k, g in enumerate(assigned) for w, d in enumerate(g)}
    slots = {ref: rank_source.slot(WorkerPlace(ref.worker, device.index, world_size))
             for ref, device in device_of.items()}
    suffixes = [engine_id_suffix(k, dp_size, dp_suffix=dp_suffix) for k in range(dp_size)]
    engine_ids = [f"<engine_id>{suffix}" for suffix in suffixes]
    problems = [
        *_engine_id_collisions(engine_ids, dp_suffix),
        *_slot_collisions(slots, engine_ids, device_of, rank_source),
        *_out_of_range(slots, world_size, engine_ids, device_of, rank_source),
        *_shared_devices(device_of),
    ]
    involved: dict[WorkerRef, dict[str, None]] = defaultdict(dict)
    for p in problems:
        for ref in p.workers or tuple(r for r in slots if r.replica in p.replicas):
            involved[ref][p.code] = None
    replicas = tuple(
        ReplicaPlan(replica=k, engine_id=engine_ids[k], engine_id_suffix=suffixes[k],
                    workers=tuple(WorkerPlan(worker=w, device=device, slot=slots[WorkerRef(k, w)],
                                             problems=tuple(involved[WorkerRef(k, w)]))
                                  for w, device in enumerate(group)))
        for k, group in enumerate(assigned)
    )
    return LayoutPlan(world_size=world_size, dp_size=dp_size, rank_source=rank_source,
                      devices=layout, dp_suffix=dp_suffix, replicas=replicas,
                      problems=tuple(problems),
                      unused_devices=tuple(d.label or str(d.index) for d in unused))


def _require_count(option: str, value: int) -> None:
    if not is_int(value) or value <= 0:
        raise InvalidInputError(f"{option} must be an integer greater than 0, got {value!r}",
                                code="invalid_layout")


def _engine_id_collisions(engine_ids: Sequence[str], dp_suffix: bool) -> list[Problem]:
    by_id: dict[str, list[int]] = defaultdict(list)
    for k, engine_id in enumerate(engine_ids):
        by_id[engine_id].append(k)
    why = "" if dp_suffix else " (no _dp suffix: the multiprocessing path before vLLM PR 47987)"
    return [Problem(
        "engine_id_collision", f"replicas {joined(replicas)} would all use engine_id "
        f"{engine_id}{why}: one region file for all of them, so their workers write into each "
        "other's rows", replicas=tuple(replicas), engine_id=engine_id)
        for engine_id, replicas in by_id.items() if len(replicas) > 1]


def _why(source: RankSource, ref: WorkerRef, device: Device) -> str:
    return f"device {device.index}" if source.device_based else f"rank {ref.worker}"


def _slot_collisions(slots: Mapping[WorkerRef, int], engine_ids: Sequence[str],
                     device_of: Mapping[WorkerRef, Device], source: RankSource
                     ) -> list[Problem]:
    """Workers of one region file that compute one slot."""
    by_slot: dict[tuple[str, int], list[WorkerRef]] = defaultdict(list)
    for ref, slot in slots.items():
        by_slot[(engine_ids[ref.replica], slot)].append(ref)
    problems = []
    for (engine_id, slot), refs in sorted(by_slot.items(), key=lambda kv: kv[1][0].replica):
        if len(refs) < 2:
            continue
        reasons = list(dict.fromkeys(f"{_why(source, r, device_of[r])} -> {slot}"
                                     for r in refs))
        via = reasons[0] + " for each" if len(reasons) == 1 else ", ".join(reasons)
        problems.append(Problem(
            "slot_collision", f"{_name_workers(refs)} {_both(refs)} -> slot {slot} of "
            f"{engine_id} ({source.name}: {via}); they would overwrite each other's KV blocks",
            workers=tuple(refs), slot=slot, engine_id=engine_id))
    return problems


def _out_of_range(slots: Mapping[WorkerRef, int], world_size: int, engine_ids: Sequence[str],
                  device_of: Mapping[WorkerRef, Device], source: RankSource
                  ) -> list[Problem]:
    return [Problem(
        "slot_out_of_range", f"{_name_workers([ref])} -> slot {slot}, outside [0, {world_size}) "
        f"({source.name}: {_why(source, ref, device_of[ref])} -> {slot}); its bytes fall past "
        "the row's slots, into another worker's slot of the next row (or past the end of the "
        "file)", workers=(ref,), slot=slot, engine_id=engine_ids[ref.replica])
        for ref, slot in slots.items() if not 0 <= slot < world_size]


def _shared_devices(device_of: Mapping[WorkerRef, Device]) -> list[Problem]:
    """Two workers on one physical device: a typo in the layout, whatever the rank source."""
    by_label: dict[str, list[WorkerRef]] = defaultdict(list)
    for ref, device in device_of.items():
        if device.label is not None:
            by_label[device.label].append(ref)
    return [
        Problem("device_shared", f"{_name_workers(refs)} are {_both(refs)} on device {label}",
                workers=tuple(refs), device=label)
        for label, refs in by_label.items() if len(refs) > 1
    ]


def _both(items: Sequence[object]) -> str:
    return "both" if len(items) == 2 else "all"


def _name_workers(refs: Sequence[WorkerRef]) -> str:
    """'replica 0 workers 0 and 1', or 'replica 0 worker 0 and replica 1 worker 0'."""
    replicas = sorted({r.replica for r in refs})
    if len(replicas) == 1:
        noun = "worker" if len(refs) == 1 else "workers"
        return f"replica {replicas[0]} {noun} {joined(r.worker for r in refs)}"
    return joined(f"replica {r.replica} worker {r.worker}" for r in refs)
