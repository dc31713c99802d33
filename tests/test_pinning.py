"""Pinning arithmetic and its failure handling, against a stand-in for the CUDA runtime,
and the region's pinning state and close callbacks.

The runtime is the one thing that cannot exist here (no GPU), so a fake that
records calls stands in; the real thing runs in tests/test_transfer_cuda.py.
"""

from __future__ import annotations

import itertools
import logging
import threading
from pathlib import Path

import pytest

from vllm_offload_cli.core.region import SharedOffloadRegion
from vllm_offload_cli.core.transfer.worker import MAX_PIN_CHUNK, PinState, pin, pin_chunks, unpin

GiB = 1024**3


class FakeCudart:
    """Records cudaHostRegister/Unregister; fails the register call number `fail_at`."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []
        self.threads: set[str] = set()

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.threads.add(threading.current_thread().name)
        self.calls.append(("register", ptr, size))
        assert flags == 0  # cudaHostRegisterDefault, as vLLM
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr, 0))
        return 0 if self.registered.pop(ptr, None) is not None else 1

    def cudaGetErrorString(self, rc: int) -> str:  # noqa: N802
        return {2: "out of memory", 1: "invalid value"}[rc]


def test_chunks_end_on_row_boundaries_and_cover_everything() -> None:
    row = 3 * 1024**2 + 4096  # 3 MiB + a page: 64 GiB is not a multiple of it
    total = 150 * GiB // row * row
    chunks = pin_chunks(total, row)
    assert chunks[0][0] == 0
    assert sum(length for _, length in chunks) == total
    for (offset, length), (next_offset, _) in itertools.pairwise(chunks):
        assert offset + length == next_offset
    for offset, length in chunks:
        assert offset % row == 0 and length <= MAX_PIN_CHUNK
        assert length % row == 0
    assert len(chunks) == 3


def test_small_regions_and_huge_rows() -> None:
    assert pin_chunks(0, 4096) == []
    assert pin_chunks(8192, 4096) == [(0, 8192)]
    # a row larger than the limit still pins whole rows, one per call
    assert pin_chunks(3 * 100, 100, limit=50) == [(0, 100), (100, 100), (200, 100)]


def test_pin_registers_every_chunk_off_the_callers_thread() -> None:
    rt = FakeCudart()
    state = pin(1 << 40, 10 * 4096, 4096, device_index=None, cudart=rt, limit=3 * 4096)
    assert state.pinned and state.warning is None
    assert [c[2] for c in rt.calls] == [3 * 4096, 3 * 4096, 3 * 4096, 4096]
    assert threading.current_thread().name not in rt.threads  # a CUDA error stays there
    assert unpin(state, cudart=rt) == []
    assert rt.registered == {}


def test_a_failed_chunk_undoes_the_others_and_explains() -> None:
    rt = FakeCudart(fail_at=3)
    state = pin(1 << 40, 10 * 4096, 4096, device_index=None, cudart=rt, limit=3 * 4096)
    assert not state.pinned and state.chunks == ()
    assert rt.registered == {}, "chunks registered before the failure must be released"
    assert state.warning is not None
    assert "out of memory (cudaError 2)" in state.warning
    assert "pageable" in state.warning and "RLIMIT_MEMLOCK" in state.warning
    assert unpin(state, cudart=rt) == []  # nothing to undo


def test_unpin_reports_problems_without_raising() -> None:
    rt = FakeCudart()
    state = PinState(pinned=True, ptr=1 << 40, chunks=((0, 4096), (4096, 4096)), device_index=None)
    problems = unpin(state, cudart=rt)
    assert len(problems) == 2 and "invalid value" in problems[0]


def test_the_region_says_who_pinned_it_and_calls_back_before_unmapping(
        shm_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The public region API a copy worker uses: pinning state and close callbacks, the
    newest first; one that raises is logged and the mapping is still released."""
    region = SharedOffloadRegion("pins", 4, 0, 4096, 4096, shm_dir=shm_dir, world_size=1)
    calls: list[str] = []

    def broken() -> None:
        calls.append("broken")
        raise RuntimeError("cannot drain")

    def gone() -> None:
        calls.append("removed")

    region.add_close_callback(lambda: calls.append(f"first, pinned={region.is_pinned}"))
    region.add_close_callback(broken)
    region.add_close_callback(gone)
    region.remove_close_callback(gone)
    region.remove_close_callback(gone)  # removing twice is harmless
    assert not region.is_pinned
    region.is_pinned = True
    with caplog.at_level(logging.ERROR, logger="vllm_offload_cli"):
        region.cleanup()
    assert calls == ["broken", "first, pinned=True"]
    assert "a close callback failed" in caplog.text
    assert not region.is_pinned and region.mmap_obj is None
    assert list(shm_dir.iterdir()) == []
