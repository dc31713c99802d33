"""One record for every finding (a problem, layout flaw, blind spot, kept region, failed
removal): a stable code, a sentence for people, what it is about (JSON: what it has)."""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass
from typing import Any


@dataclass(frozen=True)
class WorkerRef:
    """Worker `worker` (its rank) of data-parallel replica `replica`."""

    replica: int
    worker: int


@dataclass(frozen=True)
class Problem:
    code: str
    message: str
    _: KW_ONLY
    workers: tuple[WorkerRef, ...] = ()
    replicas: tuple[int, ...] = ()
    ranks: tuple[int, ...] = ()
    pids: tuple[int, ...] = ()
    slot: int | None = None
    path: str | None = None
    engine_id: str | None = None
    device: str | None = None
    paths: tuple[str, ...] = ()
    pid: int | None = None
    linked: bool | None = None  # a kept region: is its name still there
    blind_spot: str | None = None  # a region kept as "unknown": what may hide a holder
    uid: int | None = None  # a kept region's owner: gc sums other owners' past a bound

    def to_dict(self, *always: str) -> dict[str, Any]:
        """code, message and the details it has, plus those in `always` even when empty."""
        return {k: v for k, v in jsonable(self).items()
                if k in always or (v is not None and v != [])}


def jsonable(record: Any) -> Any:
    """A record (dataclass, tuple, dict) as JSON; numeric keys (NUMA nodes) as strings, in order."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {f.name: jsonable(getattr(record, f.name)) for f in dataclasses.fields(record)}
    if isinstance(record, (tuple, list)):
        return [jsonable(v) for v in record]
    if isinstance(record, dict):
        numeric = all(isinstance(k, int) for k in record)
        return {str(k): jsonable(v)
                for k, v in (sorted(record.items()) if numeric else record.items())}
    return record
