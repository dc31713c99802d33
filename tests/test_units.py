"""Sizes and durations are read as Linux tools read them, and printed back readably."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.base.units import (
    format_age,
    format_bytes,
    parse_duration,
    parse_size,
)

LETTERS = {"K": 1, "M": 2, "G": 3, "T": 4}


@given(st.integers(0, 1 << 40), st.sampled_from(sorted(LETTERS)), st.booleans())
def test_letters_are_powers_of_1024_and_b_after_them_powers_of_1000(
        n: int, letter: str, lower: bool) -> None:
    """As coreutils: 64M and 64MiB are 64 * 2**20, 64MB is 64 * 10**6, any letter case."""
    power = LETTERS[letter]
    letter = letter.lower() if lower else letter
    assert parse_size(f"{n}{letter}") == n * 1024**power
    assert parse_size(f"{n}{letter}iB") == n * 1024**power
    assert parse_size(f"{n}{letter}B") == n * 1000**power


@pytest.mark.parametrize("text", ["1kb", "1KIB", "1Kib", "7b", "1Mb", "1x", "1KiBB"])
def test_what_coreutils_refuses_is_refused(text: str) -> None:
    with pytest.raises(InvalidInputError, match="KiB, MiB, GiB, TiB"):
        parse_size(text, what="--size")


def test_a_lone_b_says_why() -> None:
    with pytest.raises(InvalidInputError, match="512-byte blocks"):
        parse_size("7b")


@given(st.integers(0, 1 << 50))
def test_compact_sizes_read_back_when_whole(n: int) -> None:
    text = format_bytes(n)
    assert " " not in text
    if "." not in text:
        assert parse_size(text) == pytest.approx(n, rel=0.05)


@pytest.mark.parametrize(("text", "seconds"), [
    ("90", 90), ("90s", 90), ("5m", 300), ("2h", 7200), ("1d", 86400), ("1h30m", 5400),
    ("1.5h", 5400), ("250ms", 0.25), (" 2 h ", 7200), ("0", 0), ("1w", 604800),
])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "m", "-1", "5x", "1h-", "5 minutes", "1e3", "nan"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(InvalidInputError, match=r"--min-age .* is not a duration; use seconds"):
        parse_duration(text, what="--min-age")


@given(st.text(max_size=40))
def test_any_duration_text_is_a_duration_or_invalid_input(text: str) -> None:
    try:
        value = parse_duration(text)
    except InvalidInputError:
        return
    assert value >= 0


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (45, "45s"), (45.9, "45s"), (60, "1m"), (11 * 60 + 5, "11m"), (3600, "1h"),
    (3 * 3600 + 12 * 60 + 9, "3h12m"), (2 * 86400, "2d"), (2 * 86400 + 3 * 3600, "2d3h"),
    (9 * 86400 + 5 * 3600, "9d"), (None, "-"), (-1, "-")])
def test_ages_print_like_ps_and_kubectl(seconds: float | None, text: str) -> None:
    assert format_age(seconds) == text
