"""CopyWorker on a real GPU: pinned and pageable, every copy rule, stream ordering.

Skipped where torch sees no GPU (CI). Run on a GPU host with
`python -m pytest -m cuda tests/test_transfer_cuda.py` or `benchmarks/gpu_check.sh`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_offload_cli.core.base.errors import OperationFailedError
from vllm_offload_cli.core.base.extras import import_torch
from vllm_offload_cli.core.region import SharedOffloadRegion
from vllm_offload_cli.core.region.geometry import default_row_stride
from vllm_offload_cli.core.transfer import CopyWorker, Direction

torch = import_torch()

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.fixture
def region(shm_dir: Path) -> Iterator[SharedOffloadRegion]:
    page = 3 * 64 * 1024 + 4096  # three tensors of 64 KiB plus one of 4 KiB
    r = SharedOffloadRegion("gpu", 256, 1, default_row_stride(2, page), page,
                            shm_dir=shm_dir, world_size=2)
    yield r
    r.cleanup()


def kv_tensors(num_blocks: int = 128) -> list[Any]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return [
        torch.randn((num_blocks, 16, 1024), device="cuda", dtype=torch.float32, generator=g),
        torch.randint(-128, 127, (num_blocks, 65536), device="cuda", dtype=torch.int8,
                      generator=g),
        torch.randn((num_blocks, 32768), device="cuda", generator=g).to(torch.bfloat16),
        torch.randint(0, 255, (num_blocks, 4096), device="cuda", dtype=torch.uint8,
                      generator=g),
    ]


def finish(worker: CopyWorker, job_ids: list[int]) -> list[Any]:
    assert worker.wait(job_ids, timeout=120)
    results = worker.get_finished()
    assert sorted(r.job_id for r in results) == sorted(job_ids)
    assert all(r.success for r in results), [r.error for r in results]
    return results


CASES = {  # one run; scattered; runs; one destination run; one source run
    "contiguous": (list(range(0, 40)), list(range(100, 140))),
    "dst_run": ([5, 90, 3, 77], [40, 41, 42, 43]),
    "src_run": ([60, 61, 62, 63], [9, 250, 3, 120]),
    "scattered": ([5, 90, 3, 77, 12, 64, 127], [250, 0, 31, 32, 200, 7, 99]),
    "runs": ([0, 1, 2, 50, 51, 9], [10, 11, 12, 60, 61, 3]),
}


@pytest.mark.parametrize("pin", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip(region: SharedOffloadRegion, pin: bool, case: str) -> None:
    src, dst = CASES[case]
    original = kv_tensors()
    with CopyWorker(region, original, pin=pin) as worker:
        assert worker.pinned is pin, worker.pin_warning
        assert region.is_pinned is pin
        worker.submit_store(1, src, dst)
        finish(worker, [1])
        views = worker.region_views
        for t, view in zip(original, views, strict=True):
            expected = t[src].view(torch.int8).reshape(len(src), -1).cpu()
            assert torch.equal(view[dst], expected)
        restored = [torch.zeros_like(t) for t in original]
        with CopyWorker(region, restored, region_views=views, pin=False) as loader:
            loader.submit_load(2, dst, src)
            (loaded,) = finish(loader, [2])
            assert loaded.direction is Direction.LOAD and loaded.seconds > 0
        for before, after in zip(original, restored, strict=True):
            assert torch.equal(after[src], before[src])
    assert region.is_pinned is False  # unregistered at shutdown


def test_store_waits_for_kernels_already_queued(region: SharedOffloadRegion) -> None:
    """A store submitted right after a kernel writes the blocks sees the kernel's result."""
    t = torch.zeros((64, 65536), device="cuda", dtype=torch.int8)
    with CopyWorker(region, [t]) as worker:
        torch.cuda._sleep(200_000_000)  # keep the compute stream busy for a while
        t.fill_(42)  # queued behind the sleep
        worker.submit_store(1, list(range(64)), list(range(64)))
        finish(worker, [1])
        assert bool((worker.region_views[0][:64] == 42).all())


def test_fifo_per_direction_on_streams(region: SharedOffloadRegion) -> None:
    t = torch.arange(128, device="cuda", dtype=torch.int8).repeat_interleave(65536).view(
        128, 65536)
    with CopyWorker(region, [t]) as worker:
        for job in range(30):
            worker.submit_store(job, [job], [5])
        results = finish(worker, list(range(30)))
        assert [r.job_id for r in results] == list(range(30))
        assert bool((worker.region_views[0][5] == 29).all())


def test_cleanup_unpins_and_unmaps(shm_dir: Path) -> None:
    r = SharedOffloadRegion("gpu2", 16, 0, 65536, 65536, shm_dir=shm_dir, world_size=1)
    worker = CopyWorker(r, [torch.ones((16, 65536), device="cuda", dtype=torch.int8)])
    assert worker.pinned and r.is_pinned
    worker.submit_store(1, list(range(16)), list(range(16)))
    r.cleanup()  # drains, unregisters, then unmaps
    assert not r.is_pinned and r.mmap_obj is None
    with pytest.raises(OperationFailedError, match="shut down"):
        worker.submit_store(2, [0], [0])
    assert [x.job_id for x in worker.get_finished()] == [1]


def test_benchmark_on_the_gpu(cli: Any, shm_dir: Path) -> None:
    result = cli("benchmark", "--device", "cuda", "--json", "--shm-dir", str(shm_dir),
                 "--size", "64MiB", "--cpu-page-size", "64KiB,2MiB", "--repeat", "2")
    assert result.exit_code == 0, result.stdout + result.stderr
    data = result.json["data"]
    assert data["pinned"] is True and data["removed"] is True
    assert {r["mode"] for r in data["rows"]} == {"pinned", "pageable"}
    assert all(r["verified"] for r in data["rows"])
    assert list(shm_dir.iterdir()) == []
