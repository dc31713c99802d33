"""SharedOffloadRegion as a drop-in for vLLM's class: its signatures, attributes, barrier.

vLLM's own tests of its class run against ours in CI (tests/vllm_conformance); these
are the same promises in the fast suite, on real files in a private tmpfs folder.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_offload_cli.core.base.errors import InvalidInputError, SlotOverflowError
from vllm_offload_cli.core.region import SharedOffloadRegion
from vllm_offload_cli.core.region import manifest as manifest_io
from vllm_offload_cli.core.region.geometry import PAGESIZE

P = PAGESIZE


def vllm_033(shm_dir: Path, engine_id: str = "dropin", *, rank: int | None = 0,
             num_chunks: int = 4, workers: int = 1, page: int = P, **kw: Any
             ) -> SharedOffloadRegion:
    """The call vLLM 0.33's specs and tests make, all by keyword (plus our shm_dir)."""
    return SharedOffloadRegion(engine_id=engine_id, num_chunks=num_chunks, rank=rank,
                               kv_bytes_per_chunk=workers * page, cpu_page_size=page,
                               shm_dir=shm_dir, **kw)


class Barrier:
    """A barrier stand-in that records whether the region's name existed at each call."""

    def __init__(self, path: Path, fail: BaseException | None = None) -> None:
        self.path, self.fail, self.seen = path, fail, list[bool]()

    def __call__(self) -> None:
        self.seen.append(self.path.exists())
        if self.fail is not None:
            raise self.fail


def test_vllm_033_keywords_and_attributes(shm_dir: Path) -> None:
    assert SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT == P  # read by vLLM's specs at import
    region = vllm_033(shm_dir, rank=1, num_chunks=3, workers=2, page=2 * P)
    try:
        assert (region.num_chunks, region.cpu_page_size, region.page_size) == (3, 2 * P, P)
        assert region.total_size_bytes == 3 * 4 * P and region._row_stride == 4 * P
        assert region.mmap_path == str(shm_dir / "vllm_offload_dropin.mmap")
        assert region._creator and region.fd is not None and region.mmap_obj is not None
        assert region.base_tensor.numel() == region.total_size_bytes
        # vLLM's gpu_worker.pin_mmap_region registers from region._base (0.31-0.33)
        assert region._base.data_ptr() == region.base_tensor.data_ptr()
        assert region.pinned_addresses == [] and region.is_pinned is False
    finally:
        region.cleanup()
    with pytest.raises(Exception, match="closed"):
        region.base_tensor  # noqa: B018 - a released region has no tensor
    assert os.listdir(shm_dir) == []


def test_barrier_drops_the_names_once_every_worker_mapped(shm_dir: Path) -> None:
    """vLLM 0.32+: the name exists at the rendezvous and is gone right after (file and
    manifest), so no exit path can leak it; the mapping stays valid."""
    path = shm_dir / "vllm_offload_dropin.mmap"
    barrier = Barrier(path)
    region = SharedOffloadRegion("dropin", 4, 0, P, P, barrier, shm_dir=shm_dir)  # positional
    try:
        assert barrier.seen == [True]
        assert os.listdir(shm_dir) == [], "file and manifest go after the barrier"
        assert region._creator is False, "nothing is left for cleanup() to unlink"
        view = region.create_next_worker_view(P)
        view[:, :] = 7
        assert region.mmap_obj is not None and region.mmap_obj[0] == 7
        del view
    finally:
        region.cleanup()
    assert os.listdir(shm_dir) == []


def test_workers_meet_at_a_real_barrier_on_one_inode(shm_dir: Path) -> None:
    """Two workers (threads) with a real barrier: one creator, one joiner, one inode, and
    each sees the other's writes after the names are gone."""
    rendezvous = threading.Barrier(2, timeout=30)
    regions: list[SharedOffloadRegion | None] = [None, None]
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            regions[rank] = vllm_033(shm_dir, rank=rank, workers=2,
                                     barrier=rendezvous.wait)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    a, b = regions
    assert a is not None and b is not None
    try:
        assert a.identity == b.identity
        assert sorted([a.creator, b.creator]) == [False, False], "names released"
        assert os.listdir(shm_dir) == []
        a.create_next_worker_view(P).fill_(1)
        b.create_next_worker_view(P).fill_(2)
        rows = a.base_tensor.view(4, 2, P)
        assert bool((rows[:, 0] == 1).all()) and bool((rows[:, 1] == 2).all())
        del rows
    finally:
        a.cleanup()
        b.cleanup()


@pytest.mark.parametrize(("shard", "expected"), [((0, 2), [(0, 3 * P)]),
                                                  ((1, 2), [(3 * P, 3 * P)]),
                                                  ((3, 4), [])])
def test_populate_shard_prefaults_one_share_between_two_barriers(
        shm_dir: Path, shard: tuple[int, int], expected: list[tuple[int, int]]) -> None:
    """vLLM 0.33's replicated layout: each worker pre-faults one page-rounded share of
    the whole file after the first barrier, and the second barrier waits for all."""
    barrier = Barrier(shm_dir / "vllm_offload_dropin.mmap")
    region = vllm_033(shm_dir, num_chunks=3, workers=2, barrier=barrier, populate_shard=shard)
    try:
        assert barrier.seen == [True, False]
        assert region._shard_range(shard) == expected
        stats = region.populate_stats
        assert (0 if stats is None else stats.bytes) == sum(n for _, n in expected)
    finally:
        region.cleanup()


def test_populate_only_on_creator_of_vllm_032(shm_dir: Path) -> None:
    """vLLM 0.31/0.32: the creator pre-faults everything before the barrier, joiners
    nothing; without a barrier the call is refused and nothing is created."""
    with pytest.raises(ValueError, match="needs a barrier"):
        vllm_033(shm_dir, populate_only_on_creator=True)
    assert os.listdir(shm_dir) == []
    rendezvous = threading.Barrier(2, timeout=30)
    regions: dict[int, SharedOffloadRegion] = {}

    def worker(rank: int) -> None:
        regions[rank] = vllm_033(shm_dir, rank=rank, workers=2, barrier=rendezvous.wait,
                                 populate_only_on_creator=True)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        stats = {r.creator or r.populate_stats is not None: r.populate_stats
                 for r in regions.values()}
        assert set(stats) == {True, False}, "one populated, one did not"
        populated = stats[True]
        assert populated is not None and populated.bytes == 4 * 2 * P
    finally:
        for r in regions.values():
            r.cleanup()


def test_creator_memory_check_runs_only_for_the_creator(shm_dir: Path) -> None:
    checked: list[int] = []
    creator = vllm_033(shm_dir, creator_memory_check=checked.append)
    try:
        vllm_033(shm_dir, creator_memory_check=checked.append).cleanup()
        assert checked == [4 * P]
    finally:
        creator.cleanup()


@pytest.mark.parametrize("shard", [None, (0, 1)])
def test_a_failed_worker_still_releases_its_peers(shm_dir: Path,
                                                  shard: tuple[int, int] | None) -> None:
    """A creator that fails before the rendezvous removes its files first, then arrives
    at every barrier it owes, so peers fail on their own errors instead of hanging."""
    barrier = Barrier(shm_dir / "vllm_offload_dropin.mmap")

    def refuse(size: int) -> None:
        raise MemoryError(f"no room for {size} bytes")

    with pytest.raises(MemoryError, match="no room"):
        vllm_033(shm_dir, barrier=barrier, creator_memory_check=refuse, populate_shard=shard)
    assert barrier.seen == [False] * (1 if shard is None else 2)
    assert os.listdir(shm_dir) == []


@pytest.mark.parametrize("shard", [None, (0, 1)])
def test_a_failed_rendezvous_unlinks_and_keeps_its_error(shm_dir: Path,
                                                         shard: tuple[int, int] | None) -> None:
    barrier = Barrier(shm_dir / "vllm_offload_dropin.mmap", fail=RuntimeError("peer died"))
    with pytest.raises(RuntimeError, match="peer died"):
        vllm_033(shm_dir, barrier=barrier, populate_shard=shard)
    assert barrier.seen[0] is True and len(barrier.seen) == (1 if shard is None else 2)
    assert os.listdir(shm_dir) == [], "no stub left for the next start to wait on"


def test_worker_slot_ranges_as_vllm_033(shm_dir: Path) -> None:
    """Rank 1's 1.5-page slot in 4-page rows: pages [1, 3) of each row; with several
    files each worker starts on a different one (vLLM's pinning walks these)."""
    region = SharedOffloadRegion("slots", 3, 1, 4 * P, P + P // 2, shm_dir=shm_dir)
    try:
        assert list(region.iter_worker_slot_ranges()) == [
            ((1 + row * 4) * P, 2 * P) for row in range(3)]
    finally:
        region.cleanup()
    regions = [vllm_033(shm_dir, "segs", rank=r, num_chunks=5, workers=2, num_segments=3,
                        min_segment_bytes=P) for r in range(2)]
    try:
        assert [seg.length // P for seg in regions[0].segments] == [4, 4, 2]
        for rank, region in enumerate(regions):
            ranges = list(region.iter_worker_slot_ranges())
            assert ranges[0] == (((rank * 5 // 2) * 2 + rank) * P, P)
            assert sorted(ranges) == [((row * 2 + rank) * P, P) for row in range(5)]
    finally:
        for region in regions:
            region.cleanup()
    assert os.listdir(shm_dir) == []


def test_cleanup_unregisters_vllms_pins_newest_first(shm_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's worker sets `is_pinned` and fills `pinned_addresses`; cleanup undoes them
    through the unregister function of vLLM's region module (a GPU call, stood in for)."""
    undone: list[int] = []
    monkeypatch.setitem(sys.modules, "vllm.v1.kv_offload.cpu.shared_offload_region",
                        SimpleNamespace(host_unregister=undone.append))
    region = vllm_033(shm_dir)
    region.pinned_addresses.extend([0x1000, 0x2000, 0x3000])
    region.is_pinned = True
    region.cleanup()
    assert undone == [0x3000, 0x2000, 0x1000]
    assert not region.is_pinned and region.pinned_addresses == []
    region.cleanup()  # idempotent: nothing is unregistered twice
    assert undone == [0x3000, 0x2000, 0x1000]


def test_overflow_is_vllms_assertion_and_our_error(shm_dir: Path) -> None:
    region = vllm_033(shm_dir, page=2 * P)
    try:
        region.create_next_worker_view(2 * P)
        with pytest.raises(AssertionError, match="exceeds worker area end") as caught:
            region.create_next_worker_view(1)
        assert isinstance(caught.value, SlotOverflowError)
        assert isinstance(caught.value, InvalidInputError)
        assert region._worker_offset == 2 * P, "a refused view leaves the cursor alone"
    finally:
        region.cleanup()


def test_cleanup_keeps_a_mapping_a_native_user_still_exports(shm_dir: Path) -> None:
    """Unmapping under a native user's buffer would let it write into reused address
    space: the mapping stays, the descriptor and the names still go."""
    region = vllm_033(shm_dir)
    export = ctypes.c_char.from_buffer(region.mmap_obj)  # type: ignore[arg-type]
    try:
        region.cleanup()
        assert region.mmap_obj is not None and not region.mmap_obj.closed
        assert region.fd is None and os.listdir(shm_dir) == []
        assert region.mmap_obj[0:1] == b"\x00"
    finally:
        del export
        assert region.mmap_obj is not None
        region.mmap_obj.close()


def test_repr_of_a_region_whose_init_failed(shm_dir: Path) -> None:
    assert "SharedOffloadRegion" in repr(SharedOffloadRegion.__new__(SharedOffloadRegion))
    with pytest.raises(InvalidInputError):
        vllm_033(shm_dir, "bad/id")
    assert os.listdir(shm_dir) == []


def test_a_joiner_with_a_barrier_keeps_the_hardening(shm_dir: Path) -> None:
    """The barrier changes nothing about joining: a joiner with another geometry is
    refused, still arrives at its barrier, and the creator's region is untouched."""
    creator = vllm_033(shm_dir, workers=2)
    barrier = Barrier(shm_dir / "vllm_offload_dropin.mmap")
    try:
        with pytest.raises(Exception, match="geometry"):
            vllm_033(shm_dir, rank=1, num_chunks=2, workers=2, page=2 * P,
                     barrier=barrier)
        assert barrier.seen == [True]
        assert manifest_io.read(creator.manifest_path).engine_id == "dropin"
    finally:
        creator.cleanup()


def _hold_behind_barrier(shm_dir: str, rank: int, barrier: Any, out: Any) -> None:
    """A worker process: map the region through a real cross-process barrier, say what
    it sees, then hold the mapping until killed (no cleanup ever runs)."""
    region = SharedOffloadRegion("killed", 2, rank, 2 * P, P, lambda: barrier.wait(30),
                                 shm_dir=shm_dir)
    assert region.fd is not None and region.mmap_obj is not None
    for row in range(2):  # this worker's slot of each row
        start = row * 2 * P + rank * P
        region.mmap_obj[start:start + P] = bytes([rank + 1]) * P
    barrier.wait(30)
    out.put((rank, os.fstat(region.fd).st_ino, sorted(os.listdir(shm_dir)),
             bytes(region.mmap_obj or b"")[::P]))
    threading.Event().wait(60)


def test_sigkilled_workers_leak_nothing(shm_dir: Path) -> None:
    """vLLM's promise with a real barrier between processes: one inode, no name while
    the workers run, so SIGKILL leaves nothing behind and a restart creates anew."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_hold_behind_barrier, args=(str(shm_dir), r, barrier, out))
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        seen = [out.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=10)
    assert len({ino for _, ino, _, _ in seen}) == 1, "both workers map one inode"
    assert all(names == [] for _, _, names, _ in seen), "no name while they run"
    assert all(data == b"\x01\x02\x01\x02" for _, _, _, data in seen)
    assert os.listdir(shm_dir) == [], "SIGKILL leaks nothing"
    with vllm_033(shm_dir, "killed") as restarted:
        assert restarted.creator
