"""Which filesystem holds a path, and with which options (psutil's mount table)."""

from __future__ import annotations

from dataclasses import dataclass

import psutil


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
        table = psutil.disk_partitions(all=True)
    except (OSError, psutil.Error):
        return []
    return [Mount(p.mountpoint, p.fstype, parse_options(p.opts)) for p in table]


def top_mount_at(point: str, table: list[Mount]) -> Mount | None:
    """The mount that path lookups see at exactly `point` (the last one there)."""
    return next((m for m in reversed(table) if m.point == point), None)


def mount_of(path: str, table: list[Mount]) -> Mount | None:
    """The mount holding the absolute, resolved `path` (longest matching point, last wins)."""
    inside = [m for m in table if path == m.point or path.startswith(m.point.rstrip("/") + "/")]
    return max(reversed(inside), key=lambda m: len(m.point), default=None)
