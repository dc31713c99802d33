"""The few system calls Python's stdlib does not expose in a usable form (`mincore`, a
read-only mapping); ctypes calls release the GIL, so pre-fault runs on several threads."""

from __future__ import annotations

import ctypes
import os
import platform
from functools import cache

# The system calls made here on behalf of the read-only commands (inspect, gc and
# verify-rank-layout measure residency and NUMA placement). The shipped systemd units
# must allow each (tests/test_seccomp_units.py runs the commands under their filter);
# mbind is made only by `create` and engines, which no unit runs.
PROBE_CALLS = ("mmap", "munmap", "madvise", "mincore", "move_pages")
WRITE_CALLS = ("mbind",)

MADV_POPULATE_READ = 22  # Linux >= 5.14
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11's mmap module lacks the name
MADV_HUGEPAGE = 14
PROT_READ = 0x1
PROT_WRITE = 0x2
MAP_SHARED = 0x01
MAP_FIXED = 0x10
MAP_FAILED = ctypes.c_void_p(-1).value


@cache
def _libc() -> ctypes.CDLL:
    # the process's own symbols include libc; find_library("c") would run ldconfig -p
    lib = ctypes.CDLL(None, use_errno=True)
    ptr, size, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    for name, args, result in (("madvise", [ptr, size, i], i), ("mincore", [ptr, size, ptr], i),
                               ("mmap", [ptr, size, i, i, i, ctypes.c_long], ptr),
                               ("munmap", [ptr, size], i)):
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = result
    lib.syscall.restype = ctypes.c_long
    return lib


# NUMA system calls have no libc wrapper (libnuma may be absent); numbers per machine.
_NUMA_SYSCALLS = {"x86_64": (237, 279), "aarch64": (235, 239), "arm64": (235, 239),
                  "riscv64": (235, 239)}  # machine: (mbind, move_pages)


def numa_syscalls_available() -> bool:
    return platform.machine() in _NUMA_SYSCALLS


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _numa_syscall(which: int, name: str) -> ctypes.c_long:
    number = _NUMA_SYSCALLS.get(platform.machine())
    if number is None:
        raise OSError(38, f"{name}: not supported on {platform.machine()}")  # ENOSYS
    return ctypes.c_long(number[which])


def madvise(addr: int, length: int, advice: int) -> None:
    _check(_libc().madvise(addr, length, advice), "madvise")


def mincore(addr: int, length: int, vec: ctypes.Array[ctypes.c_ubyte]) -> None:
    _check(_libc().mincore(addr, length, vec), "mincore")


def mbind(addr: int, length: int, mode: int, nodemask: ctypes.Array[ctypes.c_ulong],
          flags: int = 0) -> None:
    """mbind(2): set the memory policy of [addr, addr+length); shmem keeps it per file."""
    maxnode = len(nodemask) * 8 * ctypes.sizeof(ctypes.c_ulong)
    rc = _libc().syscall(_numa_syscall(0, "mbind"), ctypes.c_void_p(addr),
                         ctypes.c_ulong(length), ctypes.c_ulong(mode), nodemask,
                         ctypes.c_ulong(maxnode + 1), ctypes.c_uint(flags))
    _check(int(rc), "mbind")


def page_nodes(addrs: list[int]) -> list[int]:
    """move_pages(2) with nodes=NULL: the node of each page (negative errno if none)."""
    number = _numa_syscall(1, "move_pages")
    count = len(addrs)
    pages = (ctypes.c_void_p * count)(*addrs)
    status = (ctypes.c_int * count)()
    rc = _libc().syscall(number, ctypes.c_int(0), ctypes.c_ulong(count),
                         pages, None, status, ctypes.c_int(0))
    _check(int(rc), "move_pages")
    return list(status)


def map_readonly(fd: int, length: int, offset: int = 0) -> int:
    """mmap(PROT_READ, MAP_SHARED); a read-only fd cannot back a writable mmap.mmap."""
    addr = _libc().mmap(None, length, PROT_READ, MAP_SHARED, fd, offset)
    _check(int(addr is None or addr == MAP_FAILED), "mmap")
    return int(addr)


def unmap(addr: int, length: int) -> None:
    _check(_libc().munmap(addr, length), "munmap")


def map_shared_fixed(addr: int, length: int, fd: int) -> None:
    """Map `fd` read-write over [addr, addr+length) of a range this process reserved
    (how one address range is backed by several files: vLLM's segmented region)."""
    got = _libc().mmap(addr, length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0)
    _check(int(got != addr), "mmap")
