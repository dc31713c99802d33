"""vLLM 0.33's segmented region: files `.mmap`, `.mmap.1`, ... pre-faulted in parallel.

Part of the on-disk format, reproduced exactly: at most 32 files, none under 1 GiB,
`cdiv(num_blocks, n)` consecutive rows each, mapped back to back. Every other vLLM
release and spec makes one file, which all of them join.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.base.units import is_int

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
    """The files of a region of `segments` (already effective) parts, as vLLM lays them
    out: `cdiv(num_blocks, segments)` rows a file, so there may be fewer files."""
    if segments < 1:
        raise InvalidInputError(f"segments must be >= 1, got {segments}",
                                code="invalid_segments")
    rows = max(1, -(-num_blocks // segments))
    return tuple(
        Segment(i, row * row_stride, min(rows, num_blocks - row) * row_stride)
        for i, row in enumerate(range(0, max(num_blocks, 1), rows))
    )
