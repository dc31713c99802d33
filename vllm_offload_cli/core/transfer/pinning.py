"""Page-lock a region for the GPU's copy engines with cudaHostRegister, as vLLM does.

Pinned memory lets cudaMemcpyAsync run on the copy engines at full PCIe speed
and truly asynchronously; pageable memory is staged through a driver buffer
at a fraction of that speed. Like vLLM we register in chunks of at most
64 GiB that end on row boundaries, and when registration fails we carry on
pageable with a warning rather than refuse to run.

Each call runs on a short-lived helper thread: a failed CUDA runtime call
leaves a per-thread "last error" behind, and torch would otherwise raise it
later from an unrelated kernel launch on the engine's own thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_offload_cli.core.base.torch_import import import_torch

MAX_PIN_CHUNK = 64 * 1024**3  # bytes per cudaHostRegister call, as vLLM
CUDA_HOST_REGISTER_DEFAULT = 0


def pin_chunks(total: int, row_stride: int, limit: int = MAX_PIN_CHUNK) -> list[tuple[int, int]]:
    """(offset, length) chunks covering [0, total), each <= limit and ending on a row."""
    if total <= 0:
        return []
    rows = max(1, limit // row_stride)
    step = rows * row_stride
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


def _on_helper_thread(fn: Callable[[], Any]) -> Any:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="vllm-offload-pin", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _cudart() -> Any:
    return import_torch().cuda.cudart()


def _describe(cudart: Any, rc: Any) -> str:
    try:
        return f"{cudart.cudaGetErrorString(rc)} (cudaError {_code(rc)})"
    except Exception:  # the fake runtime of tests, or an old torch
        return f"cudaError {_code(rc)}"


def pin(ptr: int, total: int, row_stride: int, *, device_index: int | None,
        cudart: Any = None, limit: int = MAX_PIN_CHUNK) -> PinState:
    """Register [ptr, ptr+total); on any failure undo what was registered and say why."""
    rt = cudart if cudart is not None else _cudart()

    def register() -> PinState:
        if device_index is not None and cudart is None:
            import_torch().cuda.set_device(device_index)
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

    state: PinState = _on_helper_thread(register)
    return state


def unpin(state: PinState, *, cudart: Any = None) -> list[str]:
    """Unregister every chunk of `state`; returns problems (never raises for one chunk)."""
    if not state.pinned:
        return []
    rt = cudart if cudart is not None else _cudart()

    def unregister() -> list[str]:
        if state.device_index is not None and cudart is None:
            import_torch().cuda.set_device(state.device_index)
        problems = []
        for offset, _ in state.chunks:
            rc = rt.cudaHostUnregister(state.ptr + offset)
            if _code(rc) != 0:
                problems.append(f"cudaHostUnregister at offset {offset}: {_describe(rt, rc)}")
        return problems

    problems: list[str] = _on_helper_thread(unregister)
    return problems
