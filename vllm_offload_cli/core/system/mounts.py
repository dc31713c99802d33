"""/proc/self/mountinfo: which filesystem holds a path, and with which options."""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_offload_cli.core.system.procfs import PROC

_OCTAL = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    """One mountinfo line: where, what filesystem, and its superblock options."""

    point: str  # decoded: the kernel writes a space as \040
    fstype: str
    options: dict[str, str]  # super options; a flag without value maps to ""


def _decode(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """Mounts in mountinfo order (a later mount at the same point is on top)."""
    out = []
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, super_fields = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(super_fields) < 1:
            continue
        options: dict[str, str] = {}
        for opt in (super_fields[2] if len(super_fields) > 2 else "").split(","):
            if opt:
                key, _, value = opt.partition("=")
                options[key] = value
        out.append(Mount(_decode(fields[4]), super_fields[0], options))
    return out


def mounts() -> list[Mount]:
    """This process's mounts; empty when mountinfo cannot be read."""
    try:
        with open(f"{PROC}/self/mountinfo", encoding="utf-8", errors="replace") as f:
            return parse_mountinfo(f.read())
    except OSError:
        return []


def top_mount_at(point: str, table: list[Mount]) -> Mount | None:
    """The mount that path lookups see at exactly `point` (the last one there)."""
    found = None
    for m in table:
        if m.point == point:
            found = m
    return found


def mount_of(path: str, table: list[Mount]) -> Mount | None:
    """The mount holding the absolute, resolved `path` (longest matching point, last wins)."""
    best: Mount | None = None
    for m in table:
        inside = path == m.point or path.startswith(m.point.rstrip("/") + "/")
        if inside and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best
