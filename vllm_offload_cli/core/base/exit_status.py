"""Exit statuses and what each means: one table, a contract with scripts that never changes."""

from __future__ import annotations

import enum
from collections.abc import Iterable


class ExitStatus(enum.IntEnum):
    """A process exit status; `meaning` is its one-line documentation."""

    meaning: str

    def __new__(cls, value: int, meaning: str = "") -> ExitStatus:
        member = int.__new__(cls, value)
        member._value_ = value
        member.meaning = meaning
        return member

    SUCCESS = 0, "success"
    FAILED = 1, "the operation failed"
    USAGE = 2, ("bad usage or invalid input (engine_id, sizes, options), or a named region "
                "that does not exist")
    PROBLEMS_FOUND = 3, "verification found problems"
    BUSY = 4, "region busy, or its name is taken by a live region"
    NO_SPACE = 5, ("not enough space or memory (tmpfs, cgroup limit, host memory; no GPU for "
                   "--device cuda)")
    UNSAFE = 6, ("refused as unsafe (ownership, mode, symlink, link count, wrong size, corrupt "
                 "manifest, a holder that could be hidden)")
    PARTIAL = 7, ("partial: fleet, a node failed, was interrupted or did not answer in time "
                  "(the others are shown); garbage-collect, not every region was judged within "
                  "--timeout (what was proven stale was removed; the rest is reported as not "
                  "judged), or regions were removed (all reported) but --prometheus could not "
                  "be written")
    INTERRUPTED = 130, "interrupted"


# Which status wins when one answer merges several (fleet nodes, one command's outcomes):
# what the operator must act on first. A run that did not finish; a file or host that
# needs a human; a wrong command line or node setting; workers sharing bytes (silent KV
# corruption, worse than a loud refusal); a name conflict; a sizing problem; a failed,
# often transient, operation; last an incomplete answer whose every word is true.
PRECEDENCE: tuple[ExitStatus, ...] = (
    ExitStatus.INTERRUPTED,
    ExitStatus.UNSAFE,
    ExitStatus.USAGE,
    ExitStatus.PROBLEMS_FOUND,
    ExitStatus.BUSY,
    ExitStatus.NO_SPACE,
    ExitStatus.FAILED,
    ExitStatus.PARTIAL,
    ExitStatus.SUCCESS,
)


def as_status(code: object) -> ExitStatus:
    """`code` as an ExitStatus; anything else (none, or a newer node's) is FAILED."""
    if isinstance(code, int) and not isinstance(code, bool) and code in set(ExitStatus):
        return ExitStatus(code)
    return ExitStatus.FAILED


def most_important(codes: Iterable[object]) -> ExitStatus:
    """The status among `codes` that comes first in PRECEDENCE; SUCCESS for none."""
    statuses = {as_status(c) for c in codes}
    return next((s for s in PRECEDENCE if s in statuses), ExitStatus.SUCCESS)


def with_statuses(text: str) -> str:
    """Help text with `{BUSY}`-style names as their numbers (a literal brace is `{{`)."""
    return text.format_map({s.name: int(s) for s in ExitStatus})

