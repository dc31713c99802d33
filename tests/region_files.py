"""Region files as engines leave them behind, and the private tmpfs directory they go in."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SLOT = 4096
# holder.py geometry: 4 rows, 2 slots of 4 KiB
GEOMETRY = ("4", "0", str(2 * SLOT), str(SLOT), "2")
SIZE = 4 * 2 * SLOT


@contextmanager
def private_shm_dir() -> Iterator[Path]:
    """A private directory on /dev/shm (real tmpfs), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="vllm-offload-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


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
