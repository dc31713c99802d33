"""Which pages of a region are resident (allocated, not swapped out), via mincore on a
read-only mapping: mapping without touching allocates nothing."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterator

from vllm_offload_cli.core.region.geometry import PAGESIZE
from vllm_offload_cli.core.system import libc

_WINDOW = 1 << 30  # map and measure at most this much at once
_LOW_BIT = bytes(b & 1 for b in range(256))  # only the low bit of mincore's answer is defined


def _windows(fd: int, pos: int, end: int) -> Iterator[bytes]:
    """One byte per page (1 resident) of [pos, end), a window at a time; each vector
    only as long as its window (a small file costs a small one)."""
    while pos < end:
        size = min(_WINDOW, end - pos)
        vec = (ctypes.c_ubyte * -(-size // PAGESIZE))()
        addr = libc.map_readonly(fd, size, pos)
        try:
            libc.mincore(addr, size, vec)
        finally:
            libc.unmap(addr, size)
        yield bytes(vec).translate(_LOW_BIT)
        pos += size


def page_map(fd: int, length: int | None = None) -> bytes:
    """One byte per page of the first `length` bytes (default: all): 1 resident, 0 not."""
    return b"".join(_windows(fd, 0, os.fstat(fd).st_size if length is None else length))


def resident_bytes(fd: int, st: os.stat_result | None = None) -> int:
    """Bytes of the file resident in memory (`st`: its fstat, if the caller has it). Only
    its data extents are measured: the cost follows what it holds, not its apparent size."""
    st = os.fstat(fd) if st is None else st
    if st.st_size == 0 or st.st_blocks == 0:
        return 0
    total = sum(w.count(1) for start, end in _data_extents(fd, st.st_size)
                for w in _windows(fd, start - start % PAGESIZE, end))
    return min(total * PAGESIZE, st.st_size)


def _data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """[start, end) of each run of allocated data; the whole file where the
    filesystem cannot say (SEEK_DATA unsupported)."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return  # only a hole from here on
            if exc.errno != errno.EINVAL or pos:
                raise
            yield 0, size
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if end <= start:
            return
        yield start, end
        pos = end


# A seccomp filter (SystemCallFilter=, a container's profile) answers EPERM; EACCES is a
# policy too; ENOSYS is a kernel without the call. A refusal is said, never left blank.
REFUSED_HINT = ("a seccomp filter or security policy refused the system call; the shipped "
                "systemd units allow it (SystemCallFilter= in contrib/systemd)")


def refused(exc: OSError) -> bool:
    """The system call was refused (not: this file cannot be measured)."""
    return exc.errno in (errno.EPERM, errno.EACCES)
