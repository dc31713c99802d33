"""Sizes as coreutils reads them (a lone `b` refused, not guessed), durations as systemd does."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import TypeGuard

from vllm_offload_cli.core.base.errors import InvalidInputError

# bytes per unit: K, KiB (and lower-case letters) are powers of 1024, KB powers of 1000
_MULTIPLES: dict[str, int] = {"": 1, "B": 1} | {
    letter + suffix: base**power
    for power, lower in enumerate("kmgt", 1)
    for letter in (lower, lower.upper())
    for suffix, base in (("", 1024), ("iB", 1024), ("B", 1000))
}
_SIZE_RE = re.compile(r"\s*(?P<num>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[A-Za-z]*)\s*")
_MAX_DIGITS = 30  # more than any real size; bounds the arithmetic on what we are given
SIZE_HELP = ("bytes, or a suffix: K, M, G, T and KiB, MiB, GiB, TiB (powers of 1024); KB, MB, "
             "GB, TB (powers of 1000)")


def parse_size(text: str, *, what: str = "size") -> int:
    """Exact bytes (no float rounding); a fraction only where it comes to whole bytes."""
    if (match := _SIZE_RE.fullmatch(text)) is None or len(match["num"]) > _MAX_DIGITS:
        raise InvalidInputError(f"{what} {text!r} is not a size; use {SIZE_HELP}",
                                code="invalid_size")
    unit = match["unit"]
    if (multiple := _MULTIPLES.get(unit)) is None:
        hint = ("; 'b' means 512-byte blocks to coreutils, write B for bytes"
                if unit == "b" else "")
        raise InvalidInputError(
            f"{what} {text!r} has unknown unit {unit!r}; use {SIZE_HELP}{hint}",
            code="invalid_size",
        )
    value = Fraction(match["num"]) * multiple
    if value.denominator != 1:
        raise InvalidInputError(f"{what} {text!r} is not a whole number of bytes",
                                code="invalid_size")
    return int(value)


_DURATION_UNITS = {"ms": Fraction(1, 1000), "s": Fraction(1), "m": Fraction(60),
                   "h": Fraction(3600), "d": Fraction(86400), "w": Fraction(7 * 86400)}
_PART_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|d|w)?")
_DURATION_RE = re.compile(rf"\s*(?:{_PART_RE.pattern}\s*)+")
DURATION_HELP = "seconds, or a number with ms, s, m, h, d or w (90, 90s, 5m, 2h, 1d, 1h30m)"


def parse_duration(text: str, *, what: str = "duration") -> float:
    text = text.strip()
    if not text or len(text) > 64 or _DURATION_RE.fullmatch(text) is None:
        raise InvalidInputError(f"{what} {text!r} is not a duration; use {DURATION_HELP}",
                                code="invalid_duration")
    total = Fraction(0)
    for number, unit in _PART_RE.findall(text):
        total += Fraction(number) * _DURATION_UNITS[unit or "s"]
    return float(total)


def format_age(seconds: object) -> str:
    """As ps and kubectl print an age (45s, 11m, 3h12m, 2d3h, 9d); '-' when unknown."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        return "-"
    whole = int(seconds)
    days, hours, minutes = whole // 86400, whole % 86400 // 3600, whole % 3600 // 60
    if days:
        return f"{days}d{hours}h" if days < 7 and hours else f"{days}d"
    if hours:
        return f"{hours}h{minutes}m" if minutes else f"{hours}h"
    return f"{minutes}m" if minutes else f"{whole}s"


def format_bytes(n: int | float | None) -> str:
    """1536 -> '1.5KiB', None -> '-': one field for awk; parse_size reads it back when whole."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{int(value)}B" if unit == "B" else f"{f'{value:.1f}'.removesuffix('.0')}{unit}"


def is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool (Python and JSON both let True pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_problem(name: str, value: object, minimum: int = 1) -> str | None:
    """Why `value` is not an integer of at least `minimum`, or None."""
    if not is_int(value):
        return f"{name} must be an integer, got {value!r}"
    if value < minimum:
        return f"{name} must be greater than {minimum - 1}, got {value}"
    return None
