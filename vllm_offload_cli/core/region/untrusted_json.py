"""Reading JSON that anyone could have written (a manifest steers what root deletes):
bounded in size and depth (checked before parsing, without recursion), finite, short
numbers, and every value's type and range checked; any refusal is UntrustedJsonError."""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

from vllm_offload_cli.core.base.units import is_int

MAX_DEPTH = 8
MAX_STRING = 255
_MAX_NUMBER_CHARS = 32  # 2**64 has 20 digits; a float repr needs at most 24

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")


class UntrustedJsonError(ValueError):
    """The document is not one we would have written."""


def loads(data: bytes, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """Parse `data` as JSON within the limits; UntrustedJsonError otherwise."""
    if len(data) > max_bytes:
        raise UntrustedJsonError(f"longer than {max_bytes} bytes")
    if nesting_depth(data) > max_depth:
        raise UntrustedJsonError(f"nested deeper than {max_depth} levels")
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant,
                          parse_int=_bounded_int, parse_float=_finite_float)
    except UntrustedJsonError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise UntrustedJsonError(f"not valid JSON ({exc})") from None


def nesting_depth(data: bytes) -> int:
    """Deepest bracket nesting outside strings, without recursion: strings (escapes and
    an unterminated one included) are cut out, then the brackets left are counted."""
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKET)
    return max(accumulate((1 if c in b"[{" else -1 for c in brackets), initial=0))


def _no_constant(name: str) -> Any:
    raise UntrustedJsonError(f"{name} is not a finite number")


def _bounded_int(text: str) -> int:
    if len(text) > _MAX_NUMBER_CHARS:
        raise UntrustedJsonError(f"a number of {len(text)} digits")
    return int(text)


def _finite_float(text: str) -> float:
    if len(text) > _MAX_NUMBER_CHARS:
        raise UntrustedJsonError(f"a number of {len(text)} characters")
    if not math.isfinite(value := float(text)):
        raise UntrustedJsonError(f"{text} is not a finite number")
    return value


# field readers: each names the field it refuses
def obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UntrustedJsonError(f"{where} must be an object")
    return value


def field(doc: dict[str, Any], key: str, where: str) -> Any:
    if key not in doc:
        raise UntrustedJsonError(f"{where}.{key} is missing")
    return doc[key]


def integer(value: Any, where: str, lo: int, hi: int) -> int:
    if not is_int(value):
        raise UntrustedJsonError(f"{where} must be an integer")
    if not lo <= value <= hi:
        raise UntrustedJsonError(f"{where} must be in [{lo}, {hi}], got {value}")
    return value


def opt_integer(value: Any, where: str, lo: int, hi: int) -> int | None:
    return None if value is None else integer(value, where, lo, hi)


def number(value: Any, where: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UntrustedJsonError(f"{where} must be a number")
    result = float(value)  # an int here has at most _MAX_NUMBER_CHARS digits
    if not (math.isfinite(result) and lo <= result <= hi):
        raise UntrustedJsonError(f"{where} must be in [{lo:g}, {hi:g}], got {result:g}")
    return result


def string(value: Any, where: str, max_len: int = MAX_STRING) -> str:
    if not isinstance(value, str):
        raise UntrustedJsonError(f"{where} must be a string")
    if len(value) > max_len:
        raise UntrustedJsonError(f"{where} is longer than {max_len} characters")
    return value


def opt_string(value: Any, where: str, max_len: int = MAX_STRING) -> str | None:
    return None if value is None else string(value, where, max_len)


def boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise UntrustedJsonError(f"{where} must be true or false")
    return value


def array(value: Any, where: str, max_len: int) -> list[Any]:
    if not isinstance(value, list):
        raise UntrustedJsonError(f"{where} must be an array")
    if len(value) > max_len:
        raise UntrustedJsonError(f"{where} has more than {max_len} entries")
    return value
