"""The C library through cffi's ABI mode: what the batched copies call, declared once.

Nothing is compiled (cffi ships binary wheels). memcpy is declared with
uintptr_t arguments so Python ints pass without building pointer objects: on
every Linux ABI a pointer and a uintptr_t travel in the same register, and
every mechanism built on it is probed with a byte check before use.
"""

from __future__ import annotations

import ctypes.util
import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)

_CDEF = """
typedef struct { void *ss_sp; int ss_flags; size_t ss_size; } vo_stack_t;
typedef struct { unsigned long uc_flags; void *uc_link; vo_stack_t uc_stack; } vo_uctx;
void memcpy(uintptr_t dst, uintptr_t src, size_t n);
int getcontext(void *ucp);
void makecontext(void *ucp, void (*func)(void), int argc, ...);
int swapcontext(void *oucp, const void *ucp);
"""


@functools.cache
def cffi_libc() -> tuple[Any, Any] | None:
    """(ffi, lib), or None where cffi or the C library cannot be loaded. Cached, so both
    objects live as long as the process (a dropped library object may be dlclose'd)."""
    try:
        import cffi

        ffi = cffi.FFI()
        ffi.cdef(_CDEF)
    except Exception as exc:  # not installed, or a broken install: ctypes does the job
        logger.debug("cffi is not usable here: %s", exc)
        return None
    for name in (None, ctypes.util.find_library("c")):
        try:
            return ffi, ffi.dlopen(name)
        except OSError as exc:
            logger.debug("cffi cannot open the C library %r: %s", name, exc)
    return None
