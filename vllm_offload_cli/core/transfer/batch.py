"""A batched copy: a whole list of (source, destination, length) pieces per call, GIL released.

torch has no CPU operation that copies rows with both a source and a
destination index list, so a job scattered on both sides was either one torch
call per block (about as costly as copying 64 KiB) or two passes through a
staging buffer. This module copies such a list without a compiler, through
the C library that is already loaded, by one of these mechanisms:

* ucontext - libc's memcpy for every piece from one call: a chain of contexts,
             each calling memcpy and switching to the next (see transfer.chain); no
             Python and no GIL between pieces, so two copy threads never wait for
             each other. Probed in a child process first: it leans on libc's layout.
* cffi     - libc's memcpy once per piece, called through cffi's ABI mode: no
             compiler, the GIL dropped around every call like ctypes, but a
             call costs about 0.4 us against ctypes' 1 us (measured here); at
             64 KiB pieces on two threads, 0.89x of memcpy against 0.77x
             (see transfer.cffi_libc for how it is declared).
* memcpy   - the same through ctypes (where cffi is not installed).
* vm-readv - process_vm_readv(2) on our own pid: up to IOV_MAX pieces on both
             sides per system call; the iovec arrays (two 64-bit words each) are
             built with the array module, so a piece costs next to no Python. A
             sandbox may refuse it (seccomp, YAMA, ENOSYS); the probe finds out.
* memmove  - ctypes' own binding of the C library's memmove: present wherever
             ctypes is, the fallback when libc cannot be opened by name.

Which of them work here is probed once per process, each on a small scattered
copy whose bytes are checked; a refusal is logged and the mechanism dropped.
Where none works, the CPU path keeps its pure torch methods. Which one is
fastest is not decided here but measured (transfer.costs).

Pieces are checked before any byte moves: lengths positive, destinations
disjoint from each other and from every source (sources may repeat).
"""

from __future__ import annotations

import array
import collections
import ctypes
import ctypes.util
import errno
import functools
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from vllm_offload_cli.core.base.errors import InvalidInputError, OperationFailedError
from vllm_offload_cli.core.base.torch_import import import_torch
from vllm_offload_cli.core.transfer import chain
from vllm_offload_cli.core.transfer.cffi_libc import cffi_libc

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

    Addresses = npt.NDArray[np.int64]

logger = logging.getLogger(__name__)

IOV_MAX = 1024  # Linux's UIO_MAXIOV: iovecs per process_vm_readv call
MECHANISMS = ("ucontext", "cffi", "memcpy", "vm-readv", "memmove")  # preferred first


@dataclass(frozen=True, eq=False)
class Pieces:
    """Validated pieces: copy length[i] bytes from src[i] to dst[i] (int64 numpy arrays)."""

    dst: Addresses
    src: Addresses
    length: Addresses

    @property
    def count(self) -> int:
        return int(self.dst.size)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum()) if self.count else 0

    def chunks(self, shares: int) -> list[Chunk]:
        """At most `shares` consecutive parts of about equal bytes."""
        total = self.nbytes
        return self.chunks_at([total * k // shares for k in range(1, max(1, shares))])

    def chunks_at(self, cuts: list[int]) -> list[Chunk]:
        """Consecutive parts, a new one starting at the first piece that ends past each
        byte offset of `cuts` (ascending); parts are views of the arrays, so cutting costs
        a few numpy calls, and a copy thread turns its own part into what its mechanism
        takes."""
        import numpy as np

        n = self.count
        if n == 0:
            return []
        if not cuts or n == 1:
            return [Chunk(self.dst, self.src, self.length, self.nbytes)]
        ends = np.cumsum(self.length)
        at = np.searchsorted(ends, np.asarray(cuts, dtype=np.int64), side="right").tolist()
        bounds = sorted({0, *(min(n, c) for c in at), n})
        upto = ends[[b - 1 for b in bounds[1:]]].tolist()  # bytes up to each part's end
        return [Chunk(self.dst[a:b], self.src[a:b], self.length[a:b], end - start)
                for (a, b), start, end in zip(itertools.pairwise(bounds), [0, *upto[:-1]], upto,
                                              strict=True)]


class Chunk(NamedTuple):
    """Part of a validated list of pieces (int64 numpy arrays, views of the Pieces'), and
    its bytes."""

    dst: Addresses
    src: Addresses
    length: Addresses
    nbytes: int


def _addresses(values: Any) -> Addresses | None:
    """A 1-D int64 CPU tensor or numpy array as a C-contiguous numpy array (shared where it
    already is one: the context chain reads it as raw words); None if not one."""
    import numpy as np

    torch = import_torch()
    if isinstance(values, torch.Tensor):
        if values.dtype != torch.int64 or values.dim() != 1 or values.device.type != "cpu":
            return None
        values = values.detach().numpy()
    if not isinstance(values, np.ndarray) or values.dtype != np.int64 or values.ndim != 1:
        return None
    contiguous: Addresses = np.ascontiguousarray(values)
    return contiguous


def make_pieces(dst: Any, src: Any, length: Any, *, check_overlap: bool = True) -> Pieces:
    """Check a list of pieces (addresses as 1-D int64 tensors or numpy arrays; `length` may
    be one int for all); raises InvalidInputError.

    `check_overlap=False` is for callers that built the addresses from
    distinct destination rows of tensors already known not to alias.
    """
    import numpy as np

    d, s = _addresses(dst), _addresses(src)
    lengths = (np.full(d.shape, length, dtype=np.int64)
               if isinstance(length, int) and d is not None else _addresses(length))
    if d is None or s is None or lengths is None:
        raise InvalidInputError("pieces must be 1-D int64 CPU tensors (or numpy arrays) of "
                                "addresses and lengths", code="invalid_pieces")
    if not d.size == s.size == lengths.size:
        raise InvalidInputError(f"{d.size} destinations, {s.size} sources and "
                                f"{lengths.size} lengths: they must pair up",
                                code="invalid_pieces")
    if d.size == 0:
        return Pieces(d, s, lengths)
    if int(lengths.min()) <= 0:
        raise InvalidInputError("every piece must have a positive length",
                                code="invalid_pieces")
    if min(int(d.min()), int(s.min())) <= 0:
        raise InvalidInputError("a piece has a null or negative address",
                                code="invalid_pieces")
    if check_overlap:
        _refuse_overlap(d, s, lengths)
    return Pieces(d, s, lengths)


def _refuse_overlap(dst: Addresses, src: Addresses, length: Addresses) -> None:
    """Destinations must not overlap each other or any source (sources may share bytes)."""
    import numpy as np

    order = np.argsort(dst, kind="stable")
    d_start = dst[order]
    d_end = d_start + length[order]
    if d_start.size > 1 and bool((d_start[1:] < d_end[:-1]).any()):
        raise InvalidInputError("two pieces write overlapping destination bytes",
                                code="overlapping_pieces")
    s_order = np.argsort(src, kind="stable")
    s_start = src[s_order]
    s_end_max = np.maximum.accumulate(s_start + length[s_order])
    # sources starting before a destination ends; do any of them end after it starts?
    before = np.searchsorted(s_start, d_end, side="left")
    has = before > 0
    reach = s_end_max[np.maximum(before - 1, 0)]
    if bool((has & (reach > d_start)).any()):
        raise InvalidInputError("a piece's destination overlaps a piece's source",
                                code="overlapping_pieces")


# -- the C library -----------------------------------------------------------------------------

@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.memcpy.restype = None
        lib.process_vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                                         ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
        lib.process_vm_readv.restype = ctypes.c_ssize_t
    except (OSError, AttributeError) as exc:
        logger.debug("the C library cannot be opened by name: %s", exc)
        return None
    return lib


def _cffi_memcpy() -> Callable[[int, int, int], None] | None:
    """libc's memcpy through cffi (ABI mode: nothing compiled), or None without cffi."""
    loaded = cffi_libc()
    if loaded is None:
        return None
    fn: Callable[[int, int, int], None] = loaded[1].memcpy
    return fn


def process_vm_readv(local: int, local_count: int, remote: int, remote_count: int) -> int:
    """process_vm_readv(getpid(), ...): bytes copied; raises OSError (the syscall wrapper
    that tests replace to simulate a kernel or sandbox that refuses it)."""
    lib = _libc()
    if lib is None:
        raise OSError(errno.ENOSYS, "no C library")
    got = int(lib.process_vm_readv(os.getpid(), local, local_count, remote, remote_count, 0))
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"process_vm_readv: {os.strerror(err)}")
    return got


def _iovecs(addresses: list[int], length: list[int]) -> array.array[int]:
    """struct iovec[] {void *base; size_t len;}, interleaved in one array of 64-bit words."""
    words = array.array("Q", bytes(16 * len(addresses)))
    words[0::2] = array.array("Q", addresses)
    words[1::2] = array.array("Q", length)
    return words


def _copy_vm_readv(c: Chunk) -> None:
    dst, src, length = c.dst.tolist(), c.src.tolist(), c.length.tolist()
    for a in range(0, len(dst), IOV_MAX):
        b = min(len(dst), a + IOV_MAX)
        local = _iovecs(dst[a:b], length[a:b])
        remote = _iovecs(src[a:b], length[a:b])
        want = sum(length[a:b])
        got = process_vm_readv(local.buffer_info()[0], b - a, remote.buffer_info()[0], b - a)
        if got != want:
            raise OperationFailedError(f"process_vm_readv copied {got} of {want} bytes")


def _chained(c: Chunk) -> None:
    chain.copy_arrays(c.dst, c.src, c.length)


def _per_piece(fn: Callable[..., object]) -> Callable[[Chunk], None]:
    def copy(c: Chunk) -> None:
        # the loop runs in C (deque drains map): between two calls this thread holds
        # the GIL as briefly as possible, so the other copy thread rarely waits for it
        collections.deque(map(fn, c.dst.tolist(), c.src.tolist(), c.length.tolist()),
                          maxlen=0)
    return copy


def _copier(mechanism: str) -> Callable[[Chunk], None]:
    if mechanism == "vm-readv":
        return _copy_vm_readv
    if mechanism == "ucontext":
        why = chain.usable()
        if why is not None:
            raise OperationFailedError(f"context chains do not work here: {why}")
        return _chained
    if mechanism == "cffi":
        fn = _cffi_memcpy()
        if fn is None:
            raise OperationFailedError("cffi is not installed, or cannot open the C library")
        return _per_piece(fn)
    if mechanism == "memcpy":
        lib = _libc()
        if lib is None:
            raise OperationFailedError("memcpy: the C library cannot be opened")
        return _per_piece(lib.memcpy)
    if mechanism == "memmove":
        return _per_piece(ctypes.memmove)
    raise ValueError(f"unknown batched copy mechanism {mechanism!r}")


def copy_pieces(pieces: Pieces, mechanism: str) -> None:
    """Copy every piece on the calling thread by `mechanism` (the GIL is released while
    bytes move)."""
    for chunk in pieces.chunks(1):
        copy_chunk(chunk, mechanism)


def copy_chunk(chunk: Chunk, mechanism: str) -> None:
    """Copy one chunk of validated pieces on the calling thread by `mechanism`."""
    if chunk.dst.size:
        _copier(mechanism)(chunk)


# -- which mechanisms work here ----------------------------------------------------------------

def _probe(mechanism: str) -> str | None:
    """None if `mechanism` copies a small scattered list exactly here, else why not."""
    torch = import_torch()
    src = torch.arange(64 * 1024, dtype=torch.int32).view(torch.int8)  # 256 KiB
    dst = torch.zeros_like(src)
    sizes = torch.tensor([4096, 1, 8191, 65536, 3], dtype=torch.int64)
    src_off = torch.tensor([8192, 77, 100_000, 131_072, 5], dtype=torch.int64)
    dst_off = torch.tensor([200_000, 9, 16_384, 32_768, 0], dtype=torch.int64)
    pieces = make_pieces(dst.data_ptr() + dst_off, src.data_ptr() + src_off, sizes)
    try:
        copy_pieces(pieces, mechanism)
    except (OSError, OperationFailedError, AttributeError, TypeError, OverflowError,
            ctypes.ArgumentError) as exc:
        return f"{type(exc).__name__}: {exc}"
    expected = torch.zeros_like(src)
    for d, s, n in zip(dst_off.tolist(), src_off.tolist(), sizes.tolist(), strict=True):
        expected[d:d + n] = src[s:s + n]
    if not torch.equal(dst, expected):
        return "copied bytes differ from the source"
    return None


@functools.cache
def available_mechanisms() -> tuple[str, ...]:
    """Mechanisms that proved to copy exactly in this process (probed once)."""
    usable = []
    for mechanism in MECHANISMS:
        why = _probe(mechanism)
        if why is None:
            usable.append(mechanism)
        else:
            logger.info("batched copy by %s is not available here: %s", mechanism, why)
    return tuple(usable)


def row_addresses(rows: torch.Tensor, ids: Addresses) -> Addresses:
    """Start address of each row `ids` (numpy int64) of a 2-D tensor whose rows are
    contiguous."""
    stride = rows.stride(0) * rows.element_size()
    addresses: Addresses = rows.data_ptr() + ids * stride
    return addresses
