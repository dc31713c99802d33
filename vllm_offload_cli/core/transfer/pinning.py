"""Page-lock a region for the GPU's copy engines with cudaHostRegister, as vLLM does (in
row-aligned chunks of at most 64 GiB; on failure, pageable with a warning). Each call runs
on a short-lived thread: a failed runtime call leaves a per-thread "last error" that torch
would raise later from an unrelated kernel launch on the engine's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from vllm_offload_cli.core.base.extras import import_torch

MAX_PIN_CHUNK = 64 * 1024**3  # bytes per cudaHostRegister call, as vLLM
CUDA_HOST_REGISTER_DEFAULT = 0
T = TypeVar("T")


def pin_chunks(total: int, row_stride: int, limit: int = MAX_PIN_CHUNK) -> list[tuple[int, int]]:
    """(offset, length) chunks covering [0, total), each <= limit and ending on a row."""
    if total <= 0:
        return []
    step = max(1, limit // row_stride) * row_stride
    return [(offset, min(step, total - offset)) for offset in range(0, total, step)]


@dataclass(frozen=True, kw_only=True)
class PinState:
    """What pinning achieved: the registered chunks, or why there are none."""

    pinned: bool
    ptr: int
    chunks: tuple[tuple[int, int], ...]
    device_index: int | None
    warning: str | None = None


def _code(rc: Any) -> int:
    return int(getattr(rc, "value", rc))


def _describe(cudart: Any, rc: Any) -> str:
    try:
        return f"{cudart.cudaGetErrorString(rc)} (cudaError {_code(rc)})"
    except Exception:  # the description is a nicety: it never costs the warning
        return f"cudaError {_code(rc)}"


def _off_thread(fn: Callable[[Any], T], device_index: int | None, cudart: Any) -> T:
    """fn(runtime) on a short-lived thread, on `device_index` (the real runtime only)."""

    def run() -> T:
        if cudart is not None:
            return fn(cudart)
        torch = import_torch()
        if device_index is not None:
            torch.cuda.set_device(device_index)
        return fn(torch.cuda.cudart())

    with ThreadPoolExecutor(1, thread_name_prefix="vllm-offload-pin") as thread:
        return thread.submit(run).result()


def pin(ptr: int, total: int, row_stride: int, *, device_index: int | None,
        cudart: Any = None, limit: int = MAX_PIN_CHUNK) -> PinState:
    """Register [ptr, ptr+total); on any failure undo what was registered and say why."""

    def register(rt: Any) -> PinState:
        done: list[tuple[int, int]] = []
        for offset, length in pin_chunks(total, row_stride, limit):
            rc = rt.cudaHostRegister(ptr + offset, length, CUDA_HOST_REGISTER_DEFAULT)
            if _code(rc) != 0:
                for d_offset, _ in done:
                    rt.cudaHostUnregister(ptr + d_offset)
                return PinState(pinned=False, ptr=ptr, chunks=(), device_index=device_index,
                                warning=(
                    f"cudaHostRegister of {length} bytes at offset {offset} failed: "
                    f"{_describe(rt, rc)}; copies run from pageable memory, much slower "
                    "(check `ulimit -l` / RLIMIT_MEMLOCK and the container's locked-memory "
                    "limit)"))
            done.append((offset, length))
        return PinState(pinned=True, ptr=ptr, chunks=tuple(done), device_index=device_index)

    return _off_thread(register, device_index, cudart)


def unpin(state: PinState, *, cudart: Any = None) -> list[str]:
    """Unregister every chunk of `state`; returns problems (never raises for one chunk)."""
    if not state.pinned:
        return []

    def unregister(rt: Any) -> list[str]:
        return [f"cudaHostUnregister at offset {offset}: {_describe(rt, rc)}"
                for offset, _ in state.chunks
                if _code(rc := rt.cudaHostUnregister(state.ptr + offset)) != 0]

    return _off_thread(unregister, state.device_index, cudart)
