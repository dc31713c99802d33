"""Strings from outside (file and process names, manifests) shown safely: any local user
can name a file or process, so human output shows control characters as `\\xNN` (no escape
sequence reaches root's terminal). JSON keeps them (its encoder escapes them), but bytes that
were not UTF-8 (lone surrogates, which no encoder writes) become `\\xNN` in both."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

# C0, DEL, C1, line/paragraph separators and bidi overrides; a backslash stays (a name
# can only look like an escaped control character that way, not be one)
_CONTROL_RE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:  # one byte that was not UTF-8 (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """`text` with control characters and non-UTF-8 bytes as `\\xNN`: terminal-safe, encodable."""
    return _CONTROL_RE.sub(_escape, text)


def valid_unicode(text: str) -> str:
    """`text` with its lone surrogates (bytes that were not UTF-8) written as `\\xNN`."""
    return _SURROGATE_RE.sub(_escape, text)


def json_safe(value: Any) -> Any:
    """A JSON document (dicts, lists, strings) with every string `valid_unicode`."""
    if isinstance(value, str):
        return valid_unicode(value)
    if isinstance(value, dict):
        return {json_safe(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def joined(items: Iterable[object], last: str = "and") -> str:
    """A list inside a sentence: 'a', 'a and b', 'a, b and c' (or `last` instead of and)."""
    words = [str(i) for i in items]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + f" {last} " + words[-1]


def shortened(items: Sequence[object], most: int, more: str = ", ...") -> str:
    """The first `most` items, comma-separated, and `more` when some were left out."""
    return ", ".join(map(str, items[:most])) + (more if len(items) > most else "")


def pids_text(pids: Sequence[int], most: int = 5,
              name: Callable[[int], str | None] | None = None) -> str:
    """'pid 1, pid 2 and 3 more'; with `name`, 'pid 1 (python), pid 2 (?) and 3 more'."""
    shown = ", ".join(f"pid {p}" if name is None else f"pid {p} ({name(p) or '?'})"
                      for p in pids[:most])
    return shown + (f" and {len(pids) - most} more" if len(pids) > most else "")
