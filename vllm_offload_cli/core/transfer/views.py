"""Byte rows and word rows: how a KV tensor's blocks become something we can copy.

A block of a device tensor is one row of it (everything after dim 0). Copies
move bytes, never values, so each tensor is first viewed as int8 rows. The
indexed copy kernels move one element per step, so rows are viewed again as
the widest word their alignment allows: 16 bytes (complex128, the widest
dtype torch has) where rows and addresses align, else 8, 4 or 2 bytes as
integers. A copy only loads and stores words, never computes with them, so a
complex or float word carries any bit pattern unchanged, NaN payloads
included (tests copy signalling-NaN patterns through every rule); the views
never carry a conjugate bit, the one flag under which torch's copy would
change bits.
"""

from __future__ import annotations

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


def word_width(*rows: torch.Tensor) -> int:
    """Widest element size (bytes) every row view can be reinterpreted as."""
    page = rows[0].shape[1]
    for width, _ in _WORDS:
        if page % width:
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
