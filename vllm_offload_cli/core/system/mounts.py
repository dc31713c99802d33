"""Which filesystem holds a path, and with which options (/proc/self/mounts)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_offload_cli.core.system.procfs import PROC


@dataclass(frozen=True)
class Mount:
    """One mount: where, what filesystem, and its options."""

    point: str
    fstype: str
    options: dict[str, str]  # a flag without value maps to ""


def parse_options(text: str) -> dict[str, str]:
    """'rw,hidepid=2' -> {'rw': '', 'hidepid': '2'}."""
    return {key: value for key, _, value in (o.partition("=") for o in text.split(",") if o)}


def mounts() -> list[Mount]:
    """This process's mounts in mount order (a later one at the same point is on top);
    empty when the table cannot be read."""
    try:
        with open(f"{PROC}/self/mounts", "rb") as f:
            lines = f.read().decode(errors="surrogateescape").splitlines()
    except OSError:
        return []
    # fields are separated by spaces; one inside a field is written \040 (octal)
    fields = [[re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), x) for x in line.split()]
              for line in lines]
    return [Mount(f[1], f[2], parse_options(f[3])) for f in fields if len(f) >= 4]


def top_mount_at(point: str, table: list[Mount]) -> Mount | None:
    """The mount that path lookups see at exactly `point` (the last one there)."""
    return next((m for m in reversed(table) if m.point == point), None)


def mount_of(path: str, table: list[Mount]) -> Mount | None:
    """The mount holding the absolute, resolved `path` (longest matching point, last wins)."""
    best: Mount | None = None
    for m in table:
        inside = path == m.point or path.startswith(m.point.rstrip("/") + "/")
        if inside and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best
