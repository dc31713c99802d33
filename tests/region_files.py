"""Region files as engines leave them behind, shared by the gc tests."""

from __future__ import annotations

import os
from pathlib import Path

SLOT = 4096
# holder.py geometry: 4 rows, 2 slots of 4 KiB
GEOMETRY = ("4", "0", str(2 * SLOT), str(SLOT), "2")
SIZE = 4 * 2 * SLOT


def region_file(shm_dir: Path, engine_id: str, *, segment: int = 0, size: int = SIZE,
                mode: int = 0o600, fill: bool = True) -> Path:
    """A region file as vLLM leaves it behind: no manifest, nobody holding it."""
    name = f"vllm_offload_{engine_id}.mmap" + (f".{segment}" if segment else "")
    path = shm_dir / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        if fill and size:
            os.pwrite(fd, b"\x01" * size, 0)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return path
