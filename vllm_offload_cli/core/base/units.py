"""Byte sizes with IEC suffixes, parsed strictly and printed readably."""

from __future__ import annotations

import re
from fractions import Fraction

from vllm_offload_cli.core.base.errors import InvalidInputError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"\s*(?P<num>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[A-Za-z]*)\s*")
_MAX_DIGITS = 30  # more than any real size; bounds the arithmetic on what we are given


def parse_size(text: str, *, what: str = "size") -> int:
    """Parse `4096`, `64KiB`, `2MiB`, `1GiB` (also `1G`); reject SI `kB`/`MB`.

    SI suffixes are refused rather than guessed: a region sized 10**9 instead
    of 2**30 would silently differ from what the engine computes.
    """
    match = _SIZE_RE.fullmatch(text)
    if match is None or len(match["num"]) > _MAX_DIGITS:
        raise InvalidInputError(
            f"{what} {text!r} is not a size; use bytes or an IEC suffix such as 64KiB, 2MiB, 1GiB",
            code="invalid_size",
        )
    unit = match["unit"].lower()
    if unit not in _UNITS:
        raise InvalidInputError(
            f"{what} {text!r} has unknown unit {match['unit']!r}; use B, KiB, MiB, GiB or TiB",
            code="invalid_size",
        )
    value = Fraction(match["num"]) * _UNITS[unit]  # exact: no float rounding or overflow
    if value.denominator != 1:
        raise InvalidInputError(f"{what} {text!r} is not a whole number of bytes",
                                code="invalid_size")
    return int(value)


def format_bytes(n: int | float | None) -> str:
    """1536 -> '1.5 KiB'; None -> '-'."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
