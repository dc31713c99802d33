"""Region geometry, the only key to vLLM's headerless bytes: rows of `row_stride` bytes,
one `cpu_page_size` slot per worker, in files as vLLM splits them. Pure arithmetic."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.base.problems import Problem
from vllm_offload_cli.core.base.units import int_problem, is_int

PAGESIZE = mmap.PAGESIZE


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def default_row_stride(world_size: int, cpu_page_size: int) -> int:
    """vLLM's kv_bytes_per_block: all slots of a row, rounded up to a page."""
    return round_up(world_size * cpu_page_size, PAGESIZE)


@dataclass(frozen=True, kw_only=True)
class Geometry:
    """The shape of a region; `world_size` is None when nobody recorded it."""

    num_blocks: int
    row_stride: int
    cpu_page_size: int
    world_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_blocks", "row_stride", "cpu_page_size"):
            _require_positive(name, getattr(self, name))
        if self.world_size is not None:
            _require_positive("world_size", self.world_size)
        if problems := stride_problems(self.row_stride, self.cpu_page_size, self.world_size):
            raise InvalidInputError(problems[0].message, code="invalid_geometry")

    @classmethod
    def for_workers(cls, *, num_blocks: int, world_size: int, cpu_page_size: int) -> Geometry:
        """The geometry vLLM lays out for `world_size` workers."""
        _require_positive("world_size", world_size)
        _require_positive("cpu_page_size", cpu_page_size)
        return cls(
            num_blocks=num_blocks,
            row_stride=default_row_stride(world_size, cpu_page_size),
            cpu_page_size=cpu_page_size,
            world_size=world_size,
        )

    @property
    def size_bytes(self) -> int:
        return self.num_blocks * self.row_stride

    @property
    def max_slots(self) -> int:
        """How many whole slots fit in one row."""
        return self.row_stride // self.cpu_page_size

    def slot(self, rank: int) -> range:
        """Byte range of worker `rank` inside every row."""
        check_rank(self, rank)
        return range(rank * self.cpu_page_size, (rank + 1) * self.cpu_page_size)


def _require_positive(name: str, value: int) -> None:
    if (problem := int_problem(name, value)) is not None:
        raise InvalidInputError(problem, code="invalid_geometry")


def stride_problems(row_stride: int, cpu_page_size: int, world_size: int | None
                    ) -> list[Problem]:
    """The one stride check: rows are whole pages, and every worker's slot fits in a row."""
    problems = []
    if row_stride % PAGESIZE:
        problems.append(Problem(
            "row_stride_unaligned", f"row stride {row_stride} is not a multiple of the page "
            f"size {PAGESIZE}; vLLM rounds it up to {round_up(row_stride, PAGESIZE)}"))
    if world_size is None and cpu_page_size > row_stride:
        problems.append(Problem(
            "row_stride_too_small",
            f"cpu_page_size {cpu_page_size} does not fit in a row of {row_stride} bytes"))
    elif world_size is not None and world_size * cpu_page_size > row_stride:
        problems.append(Problem(
            "row_stride_too_small",
            f"{world_size} slots of {cpu_page_size} bytes need {world_size * cpu_page_size} "
            f"bytes per row, more than the row stride {row_stride}; the last slots would "
            "spill into the next row"))
    return problems


def mismatches(have: Geometry, *, num_blocks: int | None = None, row_stride: int | None = None,
               cpu_page_size: int | None = None, world_size: int | None = None) -> list[str]:
    """The one rule for "does this region fit an opener": every field both sides know
    (None: not known, e.g. the world size of a vLLM-made region) must be equal."""
    return [f"its {name} is {mine}, the engine's is {theirs}"
            for name, mine, theirs in (("num_blocks", have.num_blocks, num_blocks),
                                       ("row_stride", have.row_stride, row_stride),
                                       ("cpu_page_size", have.cpu_page_size, cpu_page_size),
                                       ("world_size", have.world_size, world_size))
            if mine is not None and theirs is not None and mine != theirs]


def check_rank(g: Geometry, rank: int) -> None:
    """Refuse a rank whose slot would fall outside the row (or the world)."""
    if not is_int(rank) or rank < 0:
        raise InvalidInputError(f"rank must be an integer >= 0, got {rank!r}",
                                code="rank_out_of_range")
    limit = g.world_size if g.world_size is not None else g.max_slots
    if rank >= limit:
        what = "world_size" if g.world_size is not None else "slots per row"
        raise InvalidInputError(
            f"rank {rank} is outside [0, {limit}) ({what} = {limit})", code="rank_out_of_range"
        )


def geometry_from_size(
    size_bytes: int, *, world_size: int, cpu_page_size: int
) -> tuple[Geometry, int]:
    """Fit as many whole rows as `size_bytes` allows; also return the unused remainder."""
    _require_positive("size", size_bytes)
    row_stride = default_row_stride(world_size, cpu_page_size)
    if (num_blocks := size_bytes // row_stride) == 0:
        raise InvalidInputError(
            f"size {size_bytes} is smaller than one row ({row_stride} bytes for {world_size} "
            f"slot(s) of {cpu_page_size} bytes)",
            code="invalid_geometry",
        )
    g = Geometry(num_blocks=num_blocks, row_stride=row_stride, cpu_page_size=cpu_page_size,
                 world_size=world_size)
    return g, size_bytes - g.size_bytes


# -- vLLM 0.33's segmented region: files `.mmap`, `.mmap.1`, ... pre-faulted in parallel.
# Part of the on-disk format, reproduced exactly: at most 32 files, none under 1 GiB,
# `cdiv(num_blocks, n)` consecutive rows each, mapped back to back. Every other vLLM
# release and spec makes one file, which all of them join. -----------------------------

VLLM_CPU_SEGMENTS = 32  # what vLLM 0.33's CPUOffloadingSpec asks for (the newest rule)
MIN_SEGMENT_BYTES = 1 << 30  # vLLM does not make a file for less

# The two layouts vLLM's releases make, by the files on disk.
SEGMENTED = "segmented"  # `.mmap`, `.mmap.1`, ...: only vLLM 0.33's CPU spec joins it
SINGLE_FILE = "single-file"  # one `.mmap`: every release's tiering spec, 0.31/0.32's CPU spec


def layout_of(files: int) -> str:
    """The vLLM layout a region of `files` files has."""
    return SEGMENTED if files > 1 else SINGLE_FILE


@dataclass(frozen=True)
class Segment:
    """One file of a region: its number (0 = the bare name) and its byte range."""

    index: int
    offset: int
    length: int

    def path(self, bare_path: str) -> str:
        return f"{bare_path}.{self.index}" if self.index else bare_path


def effective_segments(requested: int, size_bytes: int, *,
                       min_bytes: int = MIN_SEGMENT_BYTES) -> int:
    """vLLM's rule: the requested count, capped so no file is under `min_bytes` (>= 1)."""
    if not is_int(requested) or requested < 1:
        raise InvalidInputError(f"segments must be an integer >= 1, got {requested!r}",
                                code="invalid_segments")
    if not is_int(min_bytes) or min_bytes < 1:
        raise InvalidInputError(f"the smallest segment must be >= 1 byte, got {min_bytes!r}",
                                code="invalid_segments")
    return max(1, min(requested, size_bytes // min_bytes))


def split(num_blocks: int, row_stride: int, segments: int) -> tuple[Segment, ...]:
    """The files of a region of `segments` (>= 1, already effective) parts, as vLLM lays them
    out: `cdiv(num_blocks, segments)` rows a file, so there may be fewer files."""
    rows = max(1, -(-num_blocks // segments))
    return tuple(
        Segment(i, row * row_stride, min(rows, num_blocks - row) * row_stride)
        for i, row in enumerate(range(0, max(num_blocks, 1), rows))
    )
