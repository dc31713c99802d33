"""Byte rows and word rows: how a KV tensor's blocks become something we can copy.

A block is one row of a device tensor, viewed as int8 (copies move bytes, never
values), then as the widest word its alignment allows: indexed kernels move one
element per step. A copy only loads and stores words, so a complex or float word
carries any bit pattern unchanged; each process proves that once on its own torch
build before it uses 16-byte words (`complex_copies_exact`).
"""

from __future__ import annotations

import functools
import struct
from typing import TYPE_CHECKING

from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.base.torch_import import import_torch

if TYPE_CHECKING:
    import torch
    from torch import Tensor

# (bytes, torch dtype name), widest first
_WORDS = ((16, "complex128"), (8, "int64"), (4, "int32"), (2, "int16"))


def byte_rows(tensor: torch.Tensor, *, what: str) -> torch.Tensor:
    """(num_blocks, row_bytes) int8 view of `tensor`, without copying; refuses sparse rows."""
    torch = import_torch()
    if not isinstance(tensor, torch.Tensor):
        raise InvalidInputError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}",
                                code="invalid_tensor")
    if tensor.dim() == 0 or tensor.shape[0] == 0 or tensor.numel() == 0:
        raise InvalidInputError(f"{what} must have shape (num_blocks, ...) with at least one "
                                f"block and one element per block, got {tuple(tensor.shape)}",
                                code="invalid_tensor")
    n = tensor.shape[0]
    try:
        rows = tensor.view(n, -1)
        if rows.shape[1] > 1 and rows.stride(1) != 1:
            raise RuntimeError("elements inside a block are not adjacent")
        raw: Tensor = rows.view(torch.int8)
    except RuntimeError as exc:
        raise InvalidInputError(
            f"{what}: each block (one row along dim 0) must be one contiguous range of bytes "
            f"(shape {tuple(tensor.shape)}, strides {tensor.stride()}): {exc}",
            code="invalid_tensor") from exc
    if n > 1 and raw.stride(0) < raw.shape[1]:
        raise InvalidInputError(f"{what}: blocks overlap in memory (row stride "
                                f"{raw.stride(0)} bytes < block size {raw.shape[1]} bytes)",
                                code="invalid_tensor")
    return raw


@functools.cache
def complex_copies_exact() -> bool:
    """Do this build's copy kernels (every one the rules use) move complex128 elements bit
    for bit? A float path that quiets a signalling NaN would corrupt KV bytes silently."""
    torch = import_torch()
    patterns = (0x7FF0000000000001, 0xFFF0000000000001, 0x7FF8000000000123,
                0x7FF4000000000000, 0x0000000000000001, 0x8000000000000000,
                0x7FF0000000000000, 0xFFFFFFFFFFFFFFFF)
    row = b"".join(struct.pack("<Q", p) for p in patterns) * 1024  # 64 KiB per row
    data = bytearray(b"".join(bytes([i]) + row[1:] for i in range(8)))
    src = torch.frombuffer(data, dtype=torch.int8).clone().view(8, len(row))
    perm = torch.tensor([3, 1, 0, 2, 7, 5, 4, 6])
    words = src.view(torch.complex128)
    copied = torch.empty_like(words).copy_(words)
    scattered = torch.empty_like(words).index_copy_(0, perm, words)
    gathered = torch.index_select(words, 0, perm)
    return bool(torch.equal(copied.view(torch.int8), src)
                and torch.equal(scattered.view(torch.int8)[perm], src)
                and torch.equal(gathered.view(torch.int8), src[perm]))


def word_width(*rows: torch.Tensor) -> int:
    """Widest element size (bytes) every row view can be reinterpreted as."""
    page = rows[0].shape[1]
    for width, name in _WORDS:
        if page % width or (name == "complex128" and not complex_copies_exact()):
            continue
        if all(r.stride(0) % width == 0 and r.storage_offset() % width == 0
               and r.data_ptr() % width == 0 for r in rows):
            return width
    return 1


def as_words(rows: torch.Tensor, width: int) -> torch.Tensor:
    """Reinterpret int8 rows as `width`-byte elements (a view; no copy)."""
    if width == 1:
        return rows
    torch = import_torch()
    name = next(n for w, n in _WORDS if w == width)
    words: Tensor = rows.view(getattr(torch, name))
    return words
