"""Geometry arithmetic and size parsing."""

from __future__ import annotations

import mmap

import pytest

from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.base.units import format_bytes, parse_size
from vllm_offload_cli.core.region.geometry import Geometry, default_row_stride, geometry_from_size

P = mmap.PAGESIZE


def test_vllm_row_stride_rounds_slots_up_to_a_page() -> None:
    assert default_row_stride(2, 65536) == 131072
    assert default_row_stride(3, 1000) == P  # 3000 bytes -> one page
    assert default_row_stride(5, 1000) == 2 * P


def test_slot_ranges_and_offsets() -> None:
    g = Geometry.for_workers(num_blocks=10, world_size=3, cpu_page_size=1000)
    assert g.row_stride == P and g.size_bytes == 10 * P
    assert [(s.start, s.stop) for s in map(g.slot, range(3))] == [(0, 1000), (1000, 2000),
                                                                (2000, 3000)]
    with pytest.raises(InvalidInputError, match="outside"):
        g.slot(3)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_blocks": 0, "row_stride": P, "cpu_page_size": 1}, "num_blocks must be greater"),
    ({"num_blocks": -1, "row_stride": P, "cpu_page_size": 1}, "num_blocks must be greater"),
    ({"num_blocks": 1, "row_stride": P + 1, "cpu_page_size": 1}, "not a multiple of the page"),
    ({"num_blocks": 1, "row_stride": P, "cpu_page_size": P + 1}, "does not fit"),
    ({"num_blocks": 1, "row_stride": P, "cpu_page_size": P, "world_size": 2},
     "more than the row stride"),
    ({"num_blocks": 1, "row_stride": P, "cpu_page_size": 8, "world_size": 0},
     "world_size must be greater"),
])
def test_bad_geometry_is_explained(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        Geometry(**kwargs)


def test_rankless_geometry_allows_every_whole_slot() -> None:
    g = Geometry(num_blocks=2, row_stride=P, cpu_page_size=P // 4)
    assert g.max_slots == 4
    g.slot(3)
    with pytest.raises(InvalidInputError):
        g.slot(4)


def test_geometry_from_size_keeps_whole_rows() -> None:
    g, rest = geometry_from_size(10 * 131072 + 5, world_size=2, cpu_page_size=65536)
    assert (g.num_blocks, rest) == (10, 5)
    with pytest.raises(InvalidInputError, match="smaller than one row"):
        geometry_from_size(100, world_size=2, cpu_page_size=65536)


@pytest.mark.parametrize(("text", "value"), [
    ("4096", 4096), ("64KiB", 65536), ("2MiB", 2 << 20), ("1GiB", 1 << 30), ("1g", 1 << 30),
    ("1.5KiB", 1536), (" 7 B ", 7), ("0", 0), ("64M", 64 << 20), ("64MB", 64_000_000),
    ("64kB", 64_000), ("64KB", 64_000), ("2k", 2048), ("1t", 1 << 40),
])
def test_sizes_parse(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "-1", "1kb", "1KIB", "1Kib", "7b", "abc", "1.3B",
                                  "2 MiB MiB"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        parse_size(text, what="--size")
    assert "--size" in info.value.message


def test_format_bytes() -> None:
    """One format everywhere: tables, messages and footers alike."""
    assert [format_bytes(n) for n in (512, 1536, 64 << 20, 3 << 30, (1 << 30) + (1 << 29),
                                      None)] == [
        "512B", "1.5KiB", "64MiB", "3GiB", "1.5GiB", "-"]
