"""CopyWorker on the CPU path: real regions on tmpfs, real threads, raw file bytes."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vllm_offload_cli.core.base.errors import InvalidInputError, OperationFailedError
from vllm_offload_cli.core.base.torch_import import import_torch
from vllm_offload_cli.core.region import SharedOffloadRegion
from vllm_offload_cli.core.region.geometry import default_row_stride
from vllm_offload_cli.core.transfer import CopyWorker, Direction, TransferResult
from vllm_offload_cli.core.transfer.batch import MECHANISMS, available_mechanisms
from vllm_offload_cli.core.transfer.costs import (
    CopyCosts,
    Cost,
    calibrate,
    choose_method,
    job_costs,
)
from vllm_offload_cli.core.transfer.cpu import METHODS, RowPair, Staging, copy_rows
from vllm_offload_cli.core.transfer.plan import plan_transfer
from vllm_offload_cli.core.transfer.views import as_words, complex_copies_exact, word_width

torch = import_torch()

HELPERS = Path(__file__).parent / "helpers"
sys.path.insert(0, str(HELPERS))
from copy_rank import fill_byte  # noqa: E402

Factory = Callable[..., SharedOffloadRegion]


@pytest.fixture
def regions(shm_dir: Path) -> Iterator[Factory]:
    """Open regions in the private shm dir; every one is cleaned up."""
    opened: list[SharedOffloadRegion] = []

    def open_region(engine_id: str = "kv", *, num_blocks: int = 16, rank: int | None = 0,
                    cpu_page_size: int = 8192, world_size: int = 1,
                    **kw: Any) -> SharedOffloadRegion:
        region = SharedOffloadRegion(
            engine_id, num_blocks, rank, default_row_stride(world_size, cpu_page_size),
            cpu_page_size, shm_dir=shm_dir, world_size=world_size, **kw)
        opened.append(region)
        return region

    yield open_region
    for region in reversed(opened):
        region.cleanup()


def random_tensors(num_blocks: int, seed: int = 0) -> list[torch.Tensor]:
    """Three KV tensors of different dtypes and page sizes (4096, 100 and 42 bytes)."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn((num_blocks, 16, 64), generator=g),  # float32, 4096 B per block
        torch.randint(0, 256, (num_blocks, 100), dtype=torch.uint8, generator=g),  # 100 B
        torch.randn((num_blocks, 3, 7), generator=g).to(torch.bfloat16),  # 42 B
    ]


def finish(worker: CopyWorker, job_ids: list[int]) -> list[TransferResult]:
    assert worker.wait(job_ids, timeout=60)
    results = worker.get_finished()
    assert sorted(r.job_id for r in results) == sorted(job_ids)
    return results


def as_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(-1).view(torch.uint8).tolist())


def raw_page(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


# -- round trips -----------------------------------------------------------------------

PATTERNS = {
    "contiguous": ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]),
    "partial": ([3], [12]),
    "non_contiguous": ([9, 2, 7, 0, 5], [1, 14, 3, 8, 6]),
    "runs": ([0, 1, 2, 8, 9, 4], [10, 11, 12, 2, 3, 0]),
    "reversed": ([5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5]),
    "empty": ([], []),
}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_store_then_load_round_trips_every_tensor(regions: Factory, pattern: str) -> None:
    src, dst = PATTERNS[pattern]
    region = regions(num_blocks=16, cpu_page_size=8192)
    original = random_tensors(12)
    storer = CopyWorker(region, original)
    storer.submit_store(1, src, dst)
    (stored,) = finish(storer, [1])
    assert stored.success and stored.direction is Direction.STORE
    assert stored.bytes == len(src) * (4096 + 100 + 42)

    restored = [torch.zeros_like(t) for t in original]
    loader = CopyWorker(region, restored, region_views=storer.region_views)
    loader.submit_load(2, dst, src)
    (loaded,) = finish(loader, [2])
    assert loaded.success and loaded.direction is Direction.LOAD
    moved = torch.tensor(src, dtype=torch.long)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[moved] = False
    for before, after in zip(original, restored, strict=True):
        assert torch.equal(after[moved].view(torch.uint8), before[moved].view(torch.uint8))
        assert not after[untouched].view(torch.uint8).any()
    loader.shutdown()
    storer.shutdown()


def test_store_lands_at_vllm_offsets_in_the_file(regions: Factory) -> None:
    """Each tensor's page follows the previous one inside the worker's slot of each row."""
    region = regions(num_blocks=8, cpu_page_size=8192)
    tensors = random_tensors(4)
    with CopyWorker(region, tensors) as worker:
        worker.submit_store(7, [0, 3], [5, 1])
        finish(worker, [7])
    row = region.geometry.row_stride
    for src, dst in ((0, 5), (3, 1)):
        cursor = 0
        for t in tensors:
            page = t[src].numel() * t.element_size()
            got = raw_page(region.mmap_path, dst * row + cursor, page)
            assert got == as_bytes(t[src])
            cursor += page
    # the rows nobody stored to are still zero
    assert raw_page(region.mmap_path, 0, row) == bytes(row)


def test_canonical_layout_uses_offset_zero_of_every_row(regions: Factory) -> None:
    region = regions(num_blocks=4, rank=None, cpu_page_size=4096, world_size=2)
    tensors = [torch.full((2, 512), 7, dtype=torch.uint8),
               torch.full((2, 256), 9, dtype=torch.uint8)]
    with CopyWorker(region, tensors, layout="canonical") as worker:
        worker.submit_store(1, [1], [3])
        finish(worker, [1])
    row = region.geometry.row_stride
    assert raw_page(region.mmap_path, 3 * row, 768) == bytes([7] * 512 + [9] * 256)
    assert raw_page(region.mmap_path, 3 * row + 768, row - 768) == bytes(row - 768)


def test_large_scattered_job_is_exact(regions: Factory) -> None:
    """Thousands of scattered blocks: the vectorised paths, checked block by block."""
    region = regions(num_blocks=3000, cpu_page_size=4096)
    g = torch.Generator().manual_seed(3)
    device = torch.randint(-128, 128, (2500, 4096), dtype=torch.int8, generator=g)
    src = torch.randperm(2500, generator=g)[:2000]
    dst = torch.randperm(3000, generator=g)[:2000]
    with CopyWorker(region, [device]) as worker:
        worker.submit_store(1, src, dst)
        (stored,) = finish(worker, [1])
        view = worker.region_views[0]
        assert stored.success and torch.equal(view[dst], device[src])
        back = torch.zeros(2000, 4096, dtype=torch.int8)
        with CopyWorker(region, [back], region_views=[view]) as loader:
            loader.submit_load(2, dst, torch.arange(2000))
            (loaded,) = finish(loader, [2])
    assert loaded.success and torch.equal(back, device[src])


@pytest.mark.parametrize("method", [m for m in METHODS if m != "batched"]
                         + [f"batched:{m}" for m in MECHANISMS])
@pytest.mark.parametrize("case", ["random", "runs", "repeated_sources", "one"])
@pytest.mark.parametrize("threads", [1, 3])
def test_every_copy_method_is_exact(method: str, case: str, threads: int) -> None:
    """Each method (the batched one by every mechanism), forced, against a reference built
    with plain indexing; whole, and cut into the units of 3 copy threads (down to one
    row per unit, so that cuts fall inside runs)."""
    method, _, mechanism = method.partition(":")
    if mechanism and mechanism not in available_mechanisms():
        pytest.skip(f"{mechanism} is refused on this host")
    g = torch.Generator().manual_seed(11)
    n_dev, n_reg, width = 40, 50, 48
    if case == "random":
        src = torch.randperm(n_dev, generator=g)[:25]
        dst = torch.randperm(n_reg, generator=g)[:25]
    elif case == "runs":
        src = torch.tensor([4, 5, 6, 7, 20, 21, 0, 30, 31, 32])
        dst = torch.tensor([10, 11, 12, 13, 40, 41, 2, 44, 45, 46])
    elif case == "repeated_sources":
        src = torch.tensor([3, 3, 3, 9, 10, 3])
        dst = torch.tensor([0, 1, 2, 7, 8, 49])
    else:
        src, dst = torch.tensor([39]), torch.tensor([0])
    base = torch.zeros(n_reg * 64, dtype=torch.int8)
    region_rows = base.as_strided((n_reg, width), (64, 1), 8)  # strided like a worker view
    device_rows = torch.randint(-128, 128, (n_dev, width), dtype=torch.int8, generator=g)
    w = word_width(device_rows, region_rows)
    pair = RowPair(as_words(device_rows, w), as_words(region_rows, w), width)
    plan = plan_transfer(1, Direction.STORE, src, dst, device_blocks=n_dev,
                         region_blocks=n_reg)
    copy_rows(pair, plan, method, Staging(), mechanism or None, threads, smallest=1)
    expected = torch.zeros(n_reg, width, dtype=torch.int8)
    expected[dst] = device_rows[src]
    assert torch.equal(region_rows, expected)
    assert not base.view(n_reg, 64)[:, :8].any() and not base.view(n_reg, 64)[:, 56:].any()

    back = torch.zeros_like(device_rows)
    pair = RowPair(as_words(back, w), as_words(region_rows, w), width)
    if case == "repeated_sources":  # a load may not repeat destinations: load one of each
        keep = [0, 3, 4]
        src, dst = src[keep], dst[keep]
    load = plan_transfer(2, Direction.LOAD, dst, src, device_blocks=n_dev, region_blocks=n_reg)
    copy_rows(pair, load, method, Staging(), mechanism or None, threads, smallest=1)
    assert torch.equal(back[src], device_rows[src])


def test_word_views_are_as_wide_as_alignment_allows() -> None:
    assert complex_copies_exact()
    rows = torch.zeros(4, 64, dtype=torch.int8)
    assert word_width(rows, rows) == 16
    odd = torch.zeros(4 * 64 + 8, dtype=torch.int8).as_strided((4, 48), (64, 1), 8)
    assert word_width(rows[:, :48], odd) == 8
    assert word_width(torch.zeros(4, 42, dtype=torch.int8)) == 2
    assert word_width(torch.zeros(4, 43, dtype=torch.int8)) == 1


# -- several ranks, several processes ------------------------------------------------------

def test_ranks_in_separate_processes_each_write_only_their_slot(shm_dir: Path) -> None:
    world, page, num_blocks = 3, 3000, 6  # slots not page-aligned; rows padded to 12288
    row = default_row_stride(world, page)
    blocks = {0: [0, 1, 2, 3], 1: [5, 1, 4], 2: [2, 3]}
    procs = [subprocess.Popen(
        [sys.executable, str(HELPERS / "copy_rank.py"), str(shm_dir), "ranks", str(num_blocks),
         str(row), str(page), str(world), str(rank), ",".join(map(str, blocks[rank]))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert json.loads(out)["success"], out
    data = (shm_dir / "vllm_offload_ranks.mmap").read_bytes()
    assert len(data) == num_blocks * row
    for block in range(num_blocks):
        for rank in range(world):
            slot = data[block * row + rank * page:block * row + (rank + 1) * page]
            if block in blocks[rank]:
                assert slot[:1000] == bytes([fill_byte(rank, 0, block)]) * 1000
                assert slot[1000:] == bytes([fill_byte(rank, 1, block)]) * (page - 1000)
            else:
                assert slot == bytes(page), f"rank {rank} block {block} should be untouched"
        padding = data[block * row + world * page:(block + 1) * row]
        assert padding == bytes(row - world * page)


# -- ordering ----------------------------------------------------------------------------------

def test_each_direction_completes_in_submission_order(regions: Factory) -> None:
    region = regions(num_blocks=64, cpu_page_size=64 * 1024)
    device = torch.randint(-128, 128, (64, 64 * 1024), dtype=torch.int8)
    with CopyWorker(region, [device]) as worker:
        order: dict[Direction, list[int]] = {Direction.STORE: [], Direction.LOAD: []}
        for job in range(40):  # big and small jobs interleaved, both directions
            n = 32 if job % 3 == 0 else 1
            if job % 2:
                worker.submit_store(job, list(range(n)), list(range(32, 32 + n)))
            else:
                worker.submit_load(job, list(range(32, 32 + n)), list(range(n, 2 * n)))
        assert worker.wait(range(40), timeout=60)
        for result in worker.get_finished():
            assert result.success
            order[result.direction].append(result.job_id)
    assert order[Direction.STORE] == [j for j in range(40) if j % 2]
    assert order[Direction.LOAD] == [j for j in range(40) if j % 2 == 0]


def test_later_store_to_the_same_block_wins(regions: Factory) -> None:
    """FIFO is about data too: the last job queued for a block is the one that stays."""
    region = regions(num_blocks=4, cpu_page_size=4096)
    device = torch.stack([torch.full((4096,), v, dtype=torch.uint8) for v in range(1, 21)])
    with CopyWorker(region, [device]) as worker:
        for job in range(20):
            worker.submit_store(job, [job], [2])
        finish(worker, list(range(20)))
    assert raw_page(region.mmap_path, 2 * region.geometry.row_stride, 4096) == bytes([20]) * 4096


def test_results_are_reported_exactly_once(regions: Factory) -> None:
    region = regions()
    with CopyWorker(region, [torch.ones(4, 8192, dtype=torch.uint8)]) as worker:
        worker.submit_store(1, [0], [0])
        assert worker.wait([1]) and worker.wait([1])  # finished ids return at once
        assert [r.job_id for r in worker.get_finished()] == [1]
        assert worker.get_finished() == []
        assert worker.wait([12345], timeout=0)  # never submitted: nothing to wait for
        worker.submit_store(1, [1], [1])  # collected, so the id may be reused
        assert [r.job_id for r in finish(worker, [1])] == [1]


# -- validation: before any byte moves ------------------------------------------------------

BAD_JOBS: dict[str, tuple[str, Any, Any, str]] = {
    "src_out_of_range": ("store", [0, 4], [0, 1], "source block id 4 (position 1) is out of "
                         "range: the device cache has 4 blocks"),
    "dst_out_of_range": ("store", [0, 1], [2, 16], "destination block id 16 (position 1) is "
                         "out of range: the region has 16 blocks"),
    "load_src_out_of_range": ("load", [16], [0], "source block id 16 (position 0) is out of "
                              "range: the region has 16 blocks"),
    "load_dst_out_of_range": ("load", [0], [9], "destination block id 9 (position 0) is out "
                              "of range: the device cache has 4 blocks"),
    "negative": ("store", [0, -1], [0, 1], "source block id -1 (position 1) is negative"),
    # ascending destinations are bounded by their ends; unsorted ones are searched
    "dst_negative_ascending": ("store", [0, 1], [-1, 2], "destination block id -1 "
                               "(position 0) is negative"),
    "dst_out_of_range_unsorted": ("store", [0, 1, 2], [16, 2, 1], "destination block id 16 "
                                  "(position 0) is out of range"),
    "two_dimensional_tensor": ("store", torch.zeros((1, 2), dtype=torch.int64), [0, 1],
                               "must be one-dimensional"),
    "length_mismatch": ("store", [0, 1, 2], [0, 1], "3 source blocks but 2 destination"),
    "duplicate_destination": ("store", [0, 1, 2], [5, 3, 5], "destination block 5 appears "
                              "more than once"),
    "load_duplicate_destination": ("load", [0, 1], [2, 2], "destination block 2 appears"),
    "float_ids": ("store", [0.0, 1.5], [0, 1], "must be integer block ids"),
    "bool_ids": ("store", [True], [0], "must be integer block ids"),
    "two_dimensional": ("store", [[0, 1]], [[0, 1]], "must be one-dimensional"),
    "not_a_sequence": ("store", 3, [0], "must be a sequence"),
    "string": ("store", "01", [0, 1], "must be a sequence"),
    "float_tensor": ("store", torch.tensor([0.0]), [0], "got dtype torch.float32"),
    "numpy_bool": ("store", np.array([True, False]), [0, 1], "got bool values"),
    "numpy_float": ("store", [0, 1], np.array([0.5, 1.0]), "got float64 values"),
    "mixed": ("store", [0, "1"], [0, 1], "must be integer block ids"),
    "huge": ("store", [2**64 - 1], [0], "must be integer block ids"),
}


@pytest.mark.parametrize("name", sorted(BAD_JOBS))
def test_invalid_jobs_are_refused_before_any_byte_moves(regions: Factory, name: str) -> None:
    direction, src, dst, message = BAD_JOBS[name]
    region = regions(num_blocks=16, cpu_page_size=4096)
    device = torch.full((4, 4096), 0xAB, dtype=torch.uint8)
    with CopyWorker(region, [device]) as worker:
        submit = worker.submit_store if direction == "store" else worker.submit_load
        with pytest.raises(InvalidInputError) as info:
            submit(3, src, dst)
        assert message in str(info.value)
        assert f"{direction} job 3" in str(info.value) or name in ("not_a_sequence", "string",
                                                                   "float_ids", "bool_ids",
                                                                   "two_dimensional",
                                                                   "float_tensor")
        assert worker.get_finished() == []  # a refused job is not a job
        worker.submit_store(4, [], [])  # the worker still works
        (empty,) = finish(worker, [4])
        assert empty.success and empty.bytes == 0
    assert (Path(region.mmap_path).read_bytes()) == bytes(region.total_size_bytes)
    assert torch.equal(device, torch.full((4, 4096), 0xAB, dtype=torch.uint8))


@pytest.mark.parametrize("kind", ["tensor", "strided_tensor", "int32_tensor", "numpy", "list",
                                  "range", "uint32"])
def test_block_ids_of_any_integer_kind_are_taken_and_copied_at_submit(
        regions: Factory, kind: str) -> None:
    """vLLM reuses its id buffers: changing them after submit must not change the job."""
    region = regions(num_blocks=16, cpu_page_size=4096)
    device = torch.stack([torch.full((4096,), i, dtype=torch.uint8) for i in range(8)])
    src_ids = [5, 1, 2]
    made: dict[str, Any] = {"tensor": torch.tensor(src_ids),
                            "strided_tensor": torch.tensor([5, -7, 1, -7, 2])[::2],
                            "int32_tensor": torch.tensor(src_ids, dtype=torch.int32),
                            "numpy": np.array(src_ids),
                            "list": list(src_ids), "range": range(5, 8),
                            "uint32": np.array(src_ids, dtype=np.uint32)}
    src = made[kind]
    want = [int(x) for x in src]
    dst = np.array([3, 4, 9])  # ascending: nothing would be sorted, so nothing copied
    with CopyWorker(region, [device]) as worker:
        worker.submit_store(1, src, dst)
        if kind != "range":
            src[0] = 0  # the caller reuses its buffers at once
        dst[:] = 15
        (done,) = finish(worker, [1])
        assert done.success
        view = worker.region_views[0]
        for block, source in zip([3, 4, 9], want, strict=True):
            assert torch.equal(view[block].view(torch.uint8), device[source])
        assert not view[15].any()


def test_job_ids_must_be_integers_and_unique_in_flight(regions: Factory) -> None:
    region = regions()
    with CopyWorker(region, [torch.ones(4, 8192, dtype=torch.uint8)]) as worker:
        with pytest.raises(InvalidInputError, match="job id must be an integer"):
            worker.submit_store("7", [0], [0])  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError, match="job id must be an integer"):
            worker.submit_store(True, [0], [0])
        worker.submit_store(1, [0], [0])
        with pytest.raises(InvalidInputError, match="job id 1 is still in flight"):
            worker.submit_load(1, [0], [0])
        finish(worker, [1])


def test_submit_after_shutdown_is_refused(regions: Factory) -> None:
    region = regions()
    worker = CopyWorker(region, [torch.ones(4, 8192, dtype=torch.uint8)])
    worker.shutdown()
    worker.shutdown()  # idempotent
    assert worker.closed
    with pytest.raises(OperationFailedError, match="shut down"):
        worker.submit_store(1, [0], [0])


BAD_TENSORS: dict[str, tuple[Callable[[], list[Any]], str]] = {
    "none": (lambda: [], "at least one device tensor"),
    "not_a_tensor": (lambda: [[1, 2, 3]], "must be a torch.Tensor"),
    "scalar": (lambda: [torch.tensor(1.0)], "shape (num_blocks, ...)"),
    "no_blocks": (lambda: [torch.zeros(0, 16)], "at least one block"),
    "sparse_rows": (lambda: [torch.zeros(4, 64)[:, ::2]], "one contiguous range of bytes"),
    "overlapping_rows": (lambda: [torch.zeros(1, 64).expand(4, 64)], "blocks overlap"),
    "block_counts_differ": (lambda: [torch.zeros(4, 16), torch.zeros(5, 16)],
                            "same number of blocks"),
    "devices_differ": (lambda: [torch.zeros(4, 16), torch.zeros(4, 16, device="meta")],
                       "one device"),
    "slot_overflow": (lambda: [torch.zeros(4, 8192, dtype=torch.uint8),
                               torch.zeros(4, 1, dtype=torch.uint8)], "overflows rank 0"),
}


@pytest.mark.parametrize("name", sorted(BAD_TENSORS))
def test_unusable_device_tensors_are_refused(regions: Factory, name: str) -> None:
    make, message = BAD_TENSORS[name]
    region = regions(cpu_page_size=8192)
    with pytest.raises(InvalidInputError) as info:
        CopyWorker(region, make())
    assert message in str(info.value)


def test_unknown_layout_and_strategy_are_refused(regions: Factory) -> None:
    region = regions()
    with pytest.raises(InvalidInputError, match="layout"):
        CopyWorker(region, [torch.zeros(4, 16)], layout="diagonal")
    with pytest.raises(InvalidInputError, match="cuda_strategy"):
        CopyWorker(region, [torch.zeros(4, 16)], cuda_strategy="magic")


# -- failures and shutdown --------------------------------------------------------------------

def test_planning_that_fails_at_submit_is_reported_as_the_job_result(
        regions: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Units are planned on the caller's thread; a failure there never escapes submit, the
    copy thread plans again and the job's result carries the error."""
    from vllm_offload_cli.core.transfer import cpu

    region = regions(num_blocks=8, cpu_page_size=4096)
    device = torch.full((4, 4096), 3, dtype=torch.uint8)
    calls: list[str] = []

    def broken(*args: Any, **kwargs: Any) -> list[Any]:
        calls.append(threading.current_thread().name)
        raise RuntimeError("no way to cut this job")

    with CopyWorker(region, [device]) as worker:
        monkeypatch.setattr(cpu, "units", broken)
        worker.submit_store(1, [0, 1], [4, 5])  # must not raise
        (failed,) = finish(worker, [1])
    assert not failed.success and "no way to cut this job" in (failed.error or "")
    assert calls[0] == threading.current_thread().name  # tried at submit first
    assert any(name.startswith("vllm-offload-store") for name in calls[1:])


def test_a_job_queued_behind_another_is_planned_at_submit(regions: Factory,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_offload_cli.core.transfer import cpu

    region = regions(num_blocks=8, cpu_page_size=4096)
    device = torch.full((4, 4096), 3, dtype=torch.uint8)
    planned_on: list[str] = []
    real_units = cpu.units

    def spy(*args: Any, **kwargs: Any) -> Any:
        planned_on.append(threading.current_thread().name)
        return real_units(*args, **kwargs)

    monkeypatch.setattr(cpu, "units", spy)
    with CopyWorker(region, [device]) as worker:
        worker.submit_store(1, [0, 1, 2, 3], [4, 5, 6, 7])  # one run: needs no costs
        (done,) = finish(worker, [1])
    assert done.success and planned_on == [threading.current_thread().name]
    assert raw_page(region.mmap_path, 5 * region.geometry.row_stride, 4096) == bytes([3]) * 4096


def test_a_failed_copy_is_reported_and_the_worker_carries_on(regions: Factory) -> None:
    """Free the device tensor's memory under the worker: that job fails, loudly, alone."""
    region = regions(num_blocks=8, cpu_page_size=4096)
    device = torch.full((4, 4096), 3, dtype=torch.uint8)
    storage = device.untyped_storage()
    nbytes = storage.nbytes()
    with CopyWorker(region, [device]) as worker:
        worker.submit_store(1, [0], [0])
        finish(worker, [1])
        storage.resize_(0)  # the memory behind every view of it is gone
        worker.submit_store(2, [1], [1])
        (failed,) = finish(worker, [2])
        assert not failed.success and failed.error and failed.bytes == 4096
        storage.resize_(nbytes)
        device.fill_(5)
        worker.submit_store(3, [2], [2])
        (ok,) = finish(worker, [3])
        assert ok.success
    assert raw_page(region.mmap_path, 2 * region.geometry.row_stride, 4096) == bytes([5]) * 4096


def _busy_worker(region: SharedOffloadRegion, jobs: int) -> CopyWorker:
    device = torch.randint(-128, 128, (64, 256 * 1024), dtype=torch.int8)
    worker = CopyWorker(region, [device])
    for job in range(jobs):
        if job % 2:
            worker.submit_store(job, torch.randperm(64)[:32], torch.randperm(64)[:32])
        else:
            worker.submit_load(job, torch.randperm(64)[:32], torch.randperm(64)[:32])
    return worker


def test_shutdown_with_jobs_in_flight_finishes_and_reports_them_all(regions: Factory) -> None:
    region = regions(num_blocks=64, cpu_page_size=256 * 1024)
    worker = _busy_worker(region, 30)
    worker.shutdown()
    results = worker.get_finished()
    assert sorted(r.job_id for r in results) == list(range(30))
    assert all(r.success for r in results)
    assert worker.region_views == []


def test_shutdown_can_cancel_what_has_not_started(regions: Factory) -> None:
    region = regions(num_blocks=64, cpu_page_size=256 * 1024)
    worker = _busy_worker(region, 30)
    worker.shutdown(cancel_pending=True)
    results = worker.get_finished()
    assert sorted(r.job_id for r in results) == list(range(30))  # none dropped
    for r in results:
        assert r.success or (r.error is not None and r.error.startswith("cancelled"))


def test_region_cleanup_drains_the_worker_first(regions: Factory, shm_dir: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    region = regions(num_blocks=64, cpu_page_size=256 * 1024)
    worker = _busy_worker(region, 20)
    with caplog.at_level(logging.WARNING, logger="vllm_offload_cli"):
        region.cleanup()  # the hook shuts the worker down before the mapping goes
    assert worker.closed
    assert region.mmap_obj is None, "views held by the worker must not keep the mapping"
    assert "still referenced" not in caplog.text
    assert sorted(r.job_id for r in worker.get_finished()) == list(range(20))
    assert list(shm_dir.iterdir()) == []


# -- the CUDA path's copy logic, which is device-agnostic -------------------------------------

@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("case", ["random", "runs", "one", "dst_run", "src_run"])
@pytest.mark.parametrize("how", ["engine", "kernel"])
def test_cuda_copy_plans_are_exact_on_cpu_tensors(dense: bool, case: str, how: str) -> None:
    """engine_copy / kernel_copy only slice and index: prove their plans on CPU tensors."""
    from vllm_offload_cli.core.transfer.cuda import CudaPair, engine_copy, kernel_copy

    g = torch.Generator().manual_seed(5)
    n_dev, n_reg, width = 30, 40, 64
    src, dst = {
        "random": (torch.randperm(n_dev, generator=g)[:12],
                   torch.randperm(n_reg, generator=g)[:12]),
        "runs": (torch.tensor([0, 1, 2, 9, 10, 4]), torch.tensor([20, 21, 22, 5, 6, 39])),
        "one": (torch.tensor([7]), torch.tensor([3])),
        "dst_run": (torch.tensor([9, 2, 17, 4]), torch.tensor([10, 11, 12, 13])),
        "src_run": (torch.tensor([4, 5, 6, 7]), torch.tensor([30, 2, 19, 8])),
    }[case]
    stride = width if dense else 96
    base = torch.zeros(n_reg * stride, dtype=torch.int8)
    host = base.as_strided((n_reg, width), (stride, 1), 0)
    device_rows = torch.randint(-128, 128, (n_dev, width), dtype=torch.int8, generator=g)
    w = word_width(device_rows, host, limit=8)

    def pair(dev: Any) -> CudaPair:
        return CudaPair(dev, host, width, as_words(dev, w), as_words(host, w))

    def run(p: CudaPair, plan: Any) -> None:
        if how == "engine":
            engine_copy([p], plan)
        else:
            kernel_copy([p], plan, torch.device("cpu"))

    assert pair(device_rows).dense is dense
    run(pair(device_rows), plan_transfer(1, Direction.STORE, src, dst, device_blocks=n_dev,
                                         region_blocks=n_reg))
    expected = torch.zeros(n_reg, width, dtype=torch.int8)
    expected[dst] = device_rows[src]
    assert torch.equal(host, expected)
    assert not dense or torch.equal(base.view(n_reg, width), expected)
    back = torch.zeros_like(device_rows)
    run(pair(back), plan_transfer(2, Direction.LOAD, dst, src, device_blocks=n_dev,
                                  region_blocks=n_reg))
    assert torch.equal(back[src], device_rows[src])


# Costs like those measured on a 2-core host: a torch call ~4 us, a batched piece ~1.5 us,
# an index op ~0.1 us per row, every primitive ~0.1 ns per byte (10 GB/s)
MEASURED = CopyCosts(copy=Cost(4e-6, 0.0, 1.0e-10), gather=Cost(5e-6, 1e-7, 1.0e-10),
                     scatter=Cost(5e-6, 1e-7, 1.1e-10), batched=Cost(1.5e-6, 0.0, 1.0e-10),
                     mechanism="memcpy", mechanisms=("memcpy",), seconds=0.1)
NO_BATCHED = dataclasses.replace(MEASURED, batched=None, mechanism=None, mechanisms=())


@pytest.mark.parametrize(("src", "dst", "row_bytes", "costs", "expected"), [
    (list(range(100)), list(range(200, 300)), 65536, MEASURED, "slices"),
    ("perm", list(range(100)), 65536, MEASURED, "gather"),  # vLLM's store into fresh blocks
    (list(range(100)), "perm", 65536, MEASURED, "scatter"),  # and the load back
    ("perm", "perm", 65536, MEASURED, "batched"),  # both sides scattered: one pass
    ("perm", "perm", 16384, NO_BATCHED, "staged"),  # no batched copy: two passes, few calls
    ([b for r in range(0, 200, 20) for b in range(r, r + 8)],
     [b for r in range(0, 400, 40) for b in range(r, r + 8)], 65536, MEASURED, "batched"),
    ([b for r in range(0, 200, 20) for b in range(r, r + 8)],  # runs: a piece or a slice each
     [b for r in range(0, 400, 40) for b in range(r, r + 8)], 65536, NO_BATCHED, "slices"),
])
def test_the_cost_model_picks_the_cheapest_method_for_given_costs(
        src: Any, dst: Any, row_bytes: int, costs: CopyCosts, expected: str) -> None:
    g = torch.Generator().manual_seed(1)
    n = len(dst) if src == "perm" and dst != "perm" else len(src) if src != "perm" else 100
    if src == "perm":
        src = torch.randperm(400, generator=g)[:n]
    if dst == "perm":
        dst = torch.randperm(400, generator=g)[:n]
    plan = plan_transfer(1, Direction.STORE, src, dst, device_blocks=400, region_blocks=400)
    assert choose_method(plan, row_bytes, True, costs) == expected
    priced = job_costs(plan, row_bytes, True, costs)
    assert priced[expected] == min(priced.values())


def test_the_cost_model_follows_the_measured_costs() -> None:
    """The same job flips method when the measured costs say so: nothing is a constant."""
    g = torch.Generator().manual_seed(2)
    plan = plan_transfer(1, Direction.STORE, torch.randperm(400, generator=g)[:100],
                         torch.randperm(400, generator=g)[:100], device_blocks=400,
                         region_blocks=400)
    slow_memcpy = dataclasses.replace(MEASURED, batched=Cost(1.5e-6, 0.0, 3e-10))
    assert choose_method(plan, 65536, True, MEASURED) == "batched"
    priced = job_costs(plan, 65536, True, slow_memcpy)
    assert priced["batched"] > min(priced.values())
    assert choose_method(plan, 65536, True, slow_memcpy) != "batched"


# A calibration measured on this VM (benchmark run, old code): a one-row-per-call gather
# came out at 1.3 us a call, a context chain's piece at 0.85 us
LOW_GATHER = CopyCosts(copy=Cost(3.1e-6, 0.0, 6.5e-11), gather=Cost(1.29e-6, 1.14e-7, 6.5e-11),
                       scatter=Cost(3.07e-6, 2.75e-7, 6.5e-11),
                       batched=Cost(8.48e-7, 0.0, 6.5e-11), mechanism="ucontext",
                       mechanisms=("ucontext",), seconds=0.2)


def test_torch_calls_are_priced_for_the_threads_that_share_a_job() -> None:
    """Each torch call holds the GIL for part of its time, so copy threads sharing a job
    take turns at it; a context chain copies all its pieces with the GIL released. With
    that calibration the model picked one gather per destination run for a scattered 64 KiB
    job (on one thread's terms the cheaper), and the job ran at half the speed of memcpy."""
    g = torch.Generator().manual_seed(5)
    plan = plan_transfer(1, Direction.STORE, torch.randperm(4096, generator=g)[:2048],
                         torch.randperm(4096, generator=g)[:2048], device_blocks=4096,
                         region_blocks=4096)
    assert choose_method(plan, 65536, True, LOW_GATHER) == "gather"  # one thread
    assert choose_method(plan, 65536, True, LOW_GATHER, threads=2) == "batched"
    one, two = (job_costs(plan, 65536, True, LOW_GATHER, threads=t) for t in (1, 2))
    assert two["batched"] == one["batched"]  # no GIL between a chain's pieces
    assert two["gather"] > one["gather"]
    # a job of one call is no dearer however many threads share it
    whole = plan_transfer(2, Direction.STORE, torch.arange(2048), torch.arange(2048),
                          device_blocks=4096, region_blocks=4096)
    assert job_costs(whole, 65536, True, LOW_GATHER, threads=2) == job_costs(
        whole, 65536, True, LOW_GATHER)


def test_calibration_measures_every_primitive_once_per_process() -> None:
    costs = calibrate()
    assert calibrate() is costs  # cached
    for cost in (costs.copy, costs.gather, costs.scatter):
        assert all(math.isfinite(v) and v >= 0 for v in dataclasses.astuple(cost))
        assert cost.per_byte > 0
    assert costs.mechanisms == available_mechanisms()
    assert (costs.batched is None) == (costs.mechanism is None)
    assert costs.mechanism is None or costs.mechanism in costs.mechanisms
    doc = costs.to_dict()
    assert json.loads(json.dumps(doc)) == doc and doc["mechanism"] == costs.mechanism


# -- copy threads -------------------------------------------------------------------------------

def test_copy_threads_run_torch_single_threaded_and_leave_others_alone() -> None:
    import threading

    from vllm_offload_cli.core.transfer.openmp import single_threaded_torch

    before = torch.get_num_threads()
    seen: dict[str, Any] = {}

    def probe() -> None:
        seen["limited"] = single_threaded_torch()
        seen["threads"] = torch.get_num_threads()

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    assert seen["limited"] is True and seen["threads"] == 1
    assert torch.get_num_threads() == before
    later: list[int] = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert later == [before], "threads started later keep torch's default"


@pytest.mark.parametrize(("n", "threads", "smallest"),
                         [(2048, 2, 4), (2048, 4, 1), (10, 2, 4), (1, 2, 1), (100, 1, 1),
                          (4096, 16, 64)])
def test_units_shrink_from_a_third_of_the_job_to_the_smallest(n: int, threads: int,
                                                              smallest: int) -> None:
    from vllm_offload_cli.core.transfer.cpu import unit_cuts

    cuts = unit_cuts(n, threads, smallest)
    sizes = [b - a for a, b in itertools.pairwise([0, *cuts, n])]
    assert sum(sizes) == n and all(s > 0 for s in sizes)
    if threads == 1:
        assert cuts == ()
        return
    assert sizes[0] == max(smallest, -(-n // (threads + 1)))  # big units first
    assert all(a >= b for a, b in itertools.pairwise(sizes[:-1]))  # then smaller
    assert all(s >= smallest for s in sizes[:-1])  # none under the floor but the last
    assert len(sizes) <= 2 * (threads + 1) * max(1, n.bit_length())  # few trips to Python
    if n >= 4 * smallest * (threads + 1):
        assert sizes[-1] <= smallest  # threads finish within a small unit of each other


def test_scattered_rows_are_shared_by_the_copy_threads(regions: Factory) -> None:
    """Big scattered rows: one copy per row (more calls than threads), dealt to the pool."""
    region = regions(num_blocks=40, cpu_page_size=1 << 20)
    g = torch.Generator().manual_seed(9)
    device = torch.randint(-128, 128, (30, 1 << 20), dtype=torch.int8, generator=g)
    src = torch.randperm(30, generator=g)[:12]
    dst = torch.randperm(40, generator=g)[:12]
    with CopyWorker(region, [device]) as worker:
        worker.submit_store(1, src, dst)
        (stored,) = finish(worker, [1])
        assert stored.success and stored.method.partition(":")[0] in METHODS
        assert torch.equal(worker.region_views[0][dst], device[src])
        back = torch.zeros_like(device)
        with CopyWorker(region, [back], region_views=worker.region_views) as loader:
            loader.submit_load(2, dst, src)
            (loaded,) = finish(loader, [2])
    assert loaded.success and torch.equal(back[src], device[src])
    untouched = torch.ones(30, dtype=torch.bool)
    untouched[src] = False
    assert not back[untouched].any()
