"""CopyWorker on CPU tensors: real regions on tmpfs, real threads, raw file bytes.

The copy rules are also run as the CUDA path runs them (pairs whose sides are on two
devices), on CPU tensors: only the GPU itself is missing.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import wait_until

from vllm_offload_cli.core.base.errors import InvalidInputError, OperationFailedError
from vllm_offload_cli.core.base.extras import import_torch
from vllm_offload_cli.core.region import SharedOffloadRegion
from vllm_offload_cli.core.region.geometry import default_row_stride
from vllm_offload_cli.core.transfer import CopyWorker, Direction, TransferResult, copies
from vllm_offload_cli.core.transfer.copies import (
    TensorPair,
    as_words,
    copy_job,
    make_job,
    word_width,
)

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


RULE_CASES: dict[str, tuple[list[int], list[int]]] = {
    "contiguous": (list(range(4, 14)), list(range(30, 40))),
    "random": ([37, 2, 19, 8, 33, 0, 12, 25, 6, 30, 14, 21], [5, 44, 17, 29, 1, 38, 9, 23,
                                                              48, 11, 35, 2]),
    "runs": ([4, 5, 6, 7, 20, 21, 0, 30, 31, 32], [10, 11, 12, 13, 40, 41, 2, 44, 45, 46]),
    "repeated_sources": ([3, 3, 3, 9, 10, 3], [0, 1, 2, 7, 8, 49]),
    "one": ([39], [0]),
    "dst_run": ([9, 2, 17, 4, 30], [10, 11, 12, 13, 14]),
    "src_run": ([4, 5, 6, 7, 8], [30, 2, 19, 8, 44]),
}
# the rule each case gets, for a store, on one device (CPU) and across two (CUDA)
RULE_OF = {"contiguous": ("slice", "slice"), "random": ("batched", "batched"),
           "runs": ("batched", "batched"), "repeated_sources": ("batched", "batched"),
           "one": ("slice", "slice"), "dst_run": ("gather", "batched"),
           "src_run": ("scatter", "batched")}


@pytest.mark.parametrize("case", sorted(RULE_CASES))
@pytest.mark.parametrize("one_device", [True, False], ids=["cpu", "cuda-path"])
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "strided"])
@pytest.mark.parametrize("split", [False, True], ids=["one-thread", "two-threads"])
def test_every_rule_is_exact(case: str, one_device: bool, dense: bool, split: bool,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rule, on CPU tensors as the CPU path and as the CUDA path issues it, against a
    reference built with plain indexing; strided rows must keep the bytes around them, and
    a split job copies what a whole one does. Odd row widths fall back to narrow words."""
    if split:  # and rows copied in parts, the last one shorter (23 words: 5+5+5+5+3)
        monkeypatch.setattr(copies, "SPLIT_MIN_BYTES", 1)
        monkeypatch.setattr(copies, "PART_MAX_ELEMENTS", 5)
    src, dst = (torch.tensor(ids) for ids in RULE_CASES[case])
    n_dev, n_reg, width = 40, 50, 46  # 46 bytes: 2-byte words
    g = torch.Generator().manual_seed(11)
    stride = width if dense else 64
    base = torch.zeros(n_reg * stride + 8, dtype=torch.int8)
    region_rows = base.as_strided((n_reg, width), (stride, 1), 0 if dense else 8)
    device_rows = torch.randint(-128, 128, (n_dev, width), dtype=torch.int8, generator=g)
    w = word_width(device_rows, region_rows)
    assert w == 2

    def pair(dev: torch.Tensor) -> TensorPair:
        return TensorPair(device=as_words(dev, w), region=as_words(region_rows, w),
                          row_bytes=width, one_device=one_device)

    with ThreadPoolExecutor(1) as helper:
        job = make_job(1, Direction.STORE, src, dst, device_blocks=n_dev, region_blocks=n_reg)
        rule = copy_job([pair(device_rows)], job, helper=helper)
        expected = torch.zeros(n_reg, width, dtype=torch.int8)
        expected[dst] = device_rows[src]
        assert torch.equal(region_rows, expected)
        outside = torch.ones_like(base, dtype=torch.bool)
        outside[torch.arange(n_reg)[:, None] * stride + (0 if dense else 8)
                + torch.arange(width)] = False
        assert not base[outside].any()
        want = RULE_OF[case][0 if one_device else 1]
        if want == "slice" and not one_device and not dense:
            want = "batched"  # a strided run is not one span of bytes: one copy per row
        assert rule.partition("/")[0] == want
        # split: even one block is five parts, shared by the two threads
        assert rule.endswith("/2") == (split and want == "batched")

        back = torch.zeros_like(device_rows)
        if case == "repeated_sources":  # a load may not repeat destinations: one of each
            keep = [0, 3, 4]
            src, dst = src[keep], dst[keep]
        load = make_job(2, Direction.LOAD, dst, src, device_blocks=n_dev, region_blocks=n_reg)
        copy_job([pair(back)], load, helper=helper)
    assert torch.equal(back[src], device_rows[src])
    untouched = torch.ones(n_dev, dtype=torch.bool)
    untouched[src] = False
    assert not back[untouched].any()


def test_rows_of_the_gather_limit_or_more_are_batched(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job into one run of destinations gathers small rows and batches large ones,
    by a fixed row size; both copy the same bytes."""
    src, dst = (torch.tensor(ids) for ids in RULE_CASES["dst_run"])
    device_rows = torch.randint(-128, 128, (40, 64), dtype=torch.int8,
                                generator=torch.Generator().manual_seed(5))
    for limit, want in ((65, "gather"), (64, "batched")):
        monkeypatch.setattr(copies, "GATHER_MAX_ROW_BYTES", limit)
        region_rows = torch.zeros(50, 64, dtype=torch.int8)
        w = word_width(device_rows, region_rows)
        pair = TensorPair(device=as_words(device_rows, w), region=as_words(region_rows, w),
                          row_bytes=64, one_device=True)
        job = make_job(1, Direction.STORE, src, dst, device_blocks=40, region_blocks=50)
        assert copy_job([pair], job) == want
        assert torch.equal(region_rows[dst], device_rows[src])


@pytest.mark.parametrize("case", sorted(RULE_CASES))
def test_nan_patterns_cross_every_rule_unchanged(case: str) -> None:
    """16-byte words are complex128 elements: a copy must carry signalling and quiet NaN
    payloads, infinities and negative zeros bit for bit, whichever rule moves them."""
    import numpy as np

    n_dev, n_reg, width = 40, 50, 64
    words = np.array([0x7FF0000000000001, 0x7FF8000000000123, 0xFFF4000000000000,
                      0x7FF0000000000000, 0x8000000000000000, 0xFFFFFFFFFFFFFFFF,
                      0x7FF7FFFFFFFFFFFF, 0x0000000000000001], dtype=np.uint64)
    device_rows = torch.from_numpy(np.resize(words, n_dev * width // 8).view(np.int8)
                                   ).view(n_dev, width)
    region_rows = torch.zeros(n_reg, width, dtype=torch.int8)
    assert word_width(device_rows, region_rows) == 16
    pair = TensorPair(device=as_words(device_rows, 16), region=as_words(region_rows, 16),
                      row_bytes=width, one_device=True)
    src, dst = (torch.tensor(ids) for ids in RULE_CASES[case])
    if case == "repeated_sources":
        src, dst = src[[0, 3, 4]], dst[[0, 3, 4]]
    store = make_job(1, Direction.STORE, src, dst, device_blocks=n_dev, region_blocks=n_reg)
    copy_job([pair], store)
    assert torch.equal(region_rows[dst], device_rows[src])
    back = torch.zeros_like(device_rows)
    pair = TensorPair(device=as_words(back, 16), region=as_words(region_rows, 16),
                      row_bytes=width, one_device=True)
    load = make_job(2, Direction.LOAD, dst, src, device_blocks=n_dev, region_blocks=n_reg)
    copy_job([pair], load)
    assert torch.equal(back[src], device_rows[src])


def test_one_batched_call_carries_every_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scattered on both sides, a job of three tensors is one call, however many blocks."""
    calls: list[int] = []
    real = copies._copy_many

    def count(dsts: list[Any], srcs: list[Any], non_blocking: bool) -> None:
        calls.append(len(dsts))
        real(dsts, srcs, non_blocking)

    monkeypatch.setattr(copies, "_copy_many", count)
    tensors = random_tensors(20)
    regions = [torch.zeros(30, t[0].numel() * t.element_size(), dtype=torch.int8)
               for t in tensors]
    pairs = [TensorPair(device=t.view(20, -1).view(torch.int8), region=r, row_bytes=r.shape[1],
                        one_device=True)
             for t, r in zip(tensors, regions, strict=True)]
    job = make_job(1, Direction.STORE, [3, 17, 9, 0], [28, 1, 14, 7], device_blocks=20,
                   region_blocks=30)
    assert copy_job(pairs, job) == "batched"
    assert calls == [3 * 4]
    for t, r in zip(tensors, regions, strict=True):
        assert torch.equal(r[[28, 1, 14, 7]], t.view(20, -1).view(torch.int8)[[3, 17, 9, 0]])


@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
def test_a_batched_job_walks_the_region_upwards(direction: Direction,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces are issued in ascending order of the region's blocks, whichever side the
    region is on (walking it upwards copies faster); the bytes are those of the pairs."""
    seen: list[list[int]] = []
    real = copies._copy_many

    def record(dsts: list[Any], srcs: list[Any], non_blocking: bool) -> None:
        region_side = dsts if direction is Direction.STORE else srcs
        seen.append([t.data_ptr() for t in region_side])
        real(dsts, srcs, non_blocking)

    monkeypatch.setattr(copies, "_copy_many", record)
    device_rows = torch.randint(-128, 128, (40, 64), dtype=torch.int8,
                                generator=torch.Generator().manual_seed(8))
    region_rows = torch.randint(-128, 128, (50, 64), dtype=torch.int8,
                                generator=torch.Generator().manual_seed(9))
    expected_region, expected_device = region_rows.clone(), device_rows.clone()
    pair = TensorPair(device=as_words(device_rows, 16), region=as_words(region_rows, 16),
                      row_bytes=64, one_device=True)
    dev_ids, reg_ids = [37, 2, 19, 8, 33, 0, 12], [5, 44, 17, 29, 1, 38, 9]
    src, dst = (dev_ids, reg_ids) if direction is Direction.STORE else (reg_ids, dev_ids)
    job = make_job(1, direction, src, dst, device_blocks=40, region_blocks=50)
    assert copy_job([pair], job) == "batched"
    assert seen and seen[0] == sorted(seen[0])
    if direction is Direction.STORE:
        expected_region[reg_ids] = device_rows[dev_ids]
    else:
        expected_device[dev_ids] = region_rows[reg_ids]
    assert torch.equal(region_rows, expected_region)
    assert torch.equal(device_rows, expected_device)


def test_word_views_are_as_wide_as_alignment_allows() -> None:
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


def test_unknown_layout_is_refused(regions: Factory) -> None:
    region = regions()
    with pytest.raises(InvalidInputError, match="layout"):
        CopyWorker(region, [torch.zeros(4, 16)], layout="diagonal")


# -- failures and shutdown --------------------------------------------------------------------


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


def test_cancelled_jobs_are_reported_in_order_after_the_running_one(
        regions: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job being copied finishes; every job queued behind it, in each direction, is
    reported cancelled, in submission order."""
    from vllm_offload_cli.core.transfer import worker as worker_module

    release = threading.Event()
    started = threading.Event()
    real = worker_module.copy_job

    def held(pairs: Any, job: Any, **kw: Any) -> str:
        if job.job_id == 0:
            started.set()
            assert release.wait(30)
        return real(pairs, job, **kw)

    monkeypatch.setattr(worker_module, "copy_job", held)
    region = regions(num_blocks=8, cpu_page_size=4096)
    worker = CopyWorker(region, [torch.full((8, 4096), 7, dtype=torch.uint8)])
    for job in range(10):
        submit = worker.submit_store if job % 2 == 0 else worker.submit_load
        submit(job, [job % 8], [job % 8])
    assert started.wait(30)
    closing = threading.Thread(target=worker.shutdown, kwargs={"cancel_pending": True})
    closing.start()
    assert wait_until(lambda: worker._lanes[Direction.STORE]._cancel)
    release.set()
    closing.join(30)
    results = worker.get_finished()
    stores = [r for r in results if r.direction is Direction.STORE]
    assert [r.job_id for r in stores] == [0, 2, 4, 6, 8]
    assert stores[0].success
    assert all(not r.success and (r.error or "").startswith("cancelled") for r in stores[1:])
    loads = [r.job_id for r in results if r.direction is Direction.LOAD]
    assert loads == [1, 3, 5, 7, 9]  # copied or cancelled, still in order


def test_region_cleanup_drains_the_worker_first(regions: Factory, shm_dir: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    region = regions(num_blocks=64, cpu_page_size=256 * 1024)
    worker = _busy_worker(region, 20)
    with caplog.at_level(logging.WARNING, logger="vllm_offload_cli"):
        region.cleanup()  # the hook shuts the worker down before the mapping goes
    with pytest.raises(OperationFailedError, match="shut down"):
        worker.submit_store(99, [0], [0])
    assert region.mmap_obj is None, "views held by the worker must not keep the mapping"
    assert "still referenced" not in caplog.text
    assert sorted(r.job_id for r in worker.get_finished()) == list(range(20))
    assert list(shm_dir.iterdir()) == []


def test_big_scattered_rows_are_split_over_two_threads(regions: Factory) -> None:
    """Big scattered rows: one batched call, half of it on the lane's helper thread."""
    region = regions(num_blocks=40, cpu_page_size=1 << 20)
    g = torch.Generator().manual_seed(9)
    device = torch.randint(-128, 128, (30, 1 << 20), dtype=torch.int8, generator=g)
    src = torch.randperm(30, generator=g)[:12]
    dst = torch.randperm(40, generator=g)[:12]
    with CopyWorker(region, [device]) as worker:
        worker.submit_store(1, src, dst)
        (stored,) = finish(worker, [1])
        assert stored.success and stored.method == "batched/2"
        assert torch.equal(worker.region_views[0][dst], device[src])
        back = torch.zeros_like(device)
        with CopyWorker(region, [back], region_views=worker.region_views) as loader:
            loader.submit_load(2, dst, src)
            (loaded,) = finish(loader, [2])
    assert loaded.success and torch.equal(back[src], device[src])
    untouched = torch.ones(30, dtype=torch.bool)
    untouched[src] = False
    assert not back[untouched].any()
