"""SharedOffloadRegion: vLLM's protocol and layout, plus the hardening rules."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_offload_cli.core.base.errors import (
    InsufficientSpaceError,
    InvalidInputError,
    OperationFailedError,
    RegionBusyError,
    RegionTimeoutError,
    UnsafeRegionError,
)
from vllm_offload_cli.core.base.extras import import_torch
from vllm_offload_cli.core.base.problems import jsonable
from vllm_offload_cli.core.host import residency
from vllm_offload_cli.core.region import SharedOffloadRegion, fsguard
from vllm_offload_cli.core.region import manifest as manifest_io
from vllm_offload_cli.core.region.geometry import PAGESIZE

ROW = 4 * PAGESIZE  # world 2 x 2 pages


def make(shm_dir: Path, rank: int | None = 0, *, engine_id: str = "eng", num_blocks: int = 8,
         row: int = ROW, page: int = 2 * PAGESIZE, **kw: Any) -> SharedOffloadRegion:
    return SharedOffloadRegion(engine_id, num_blocks, rank, row, page, shm_dir=shm_dir, **kw)


def listing(shm_dir: Path) -> list[str]:
    return sorted(os.listdir(shm_dir))


def test_creator_then_joiner_share_one_file(shm_dir: Path) -> None:
    a = make(shm_dir, 0, world_size=2)
    b = make(shm_dir, 1, world_size=2)
    try:
        assert a.creator and not b.creator
        assert a.identity == b.identity
        assert os.path.getsize(a.mmap_path) == 8 * ROW
        st = os.stat(a.mmap_path)
        assert (st.st_mode & 0o777, st.st_nlink) == (0o600, 1)
        m = manifest_io.read(a.manifest_path)
        assert jsonable(m.geometry) == {"num_blocks": 8, "row_stride": ROW,
                                        "cpu_page_size": 2 * PAGESIZE, "world_size": 2}
        assert sorted(x.rank for x in m.attachments) == [0, 1]
        assert {x.pid for x in m.attachments} == {os.getpid()}
    finally:
        b.cleanup()
        assert os.path.exists(a.mmap_path), "a joiner never unlinks"
        assert [x.rank for x in manifest_io.read(a.manifest_path).attachments] == [0]
        a.cleanup()
    assert listing(shm_dir) == []


def test_byte_layout_matches_independent_offsets(shm_dir: Path) -> None:
    """Each tensor's page follows the previous one inside the worker's slot."""
    page, world, blocks = 3000, 3, 5  # cpu_page_size not page aligned, as vLLM allows
    row = -(-world * page // PAGESIZE) * PAGESIZE
    sizes = [1000, 1500, 500]
    regions = [make(shm_dir, r, num_blocks=blocks, row=row, page=page, world_size=world)
               for r in range(world)]
    try:
        for r, region in enumerate(regions):
            views = [region.create_next_worker_view(s) for s in sizes]
            for t, v in enumerate(views):
                assert v.shape == (blocks, sizes[t]) and v.stride() == (row, 1)
                for b in range(blocks):
                    v[b].fill_(1 + r * 50 + t * 10 + b)
        fd = os.open(regions[0].mmap_path, os.O_RDONLY)
        try:
            for r in range(world):
                for b in range(blocks):
                    cursor = b * row + r * page  # computed without the class
                    for t, size in enumerate(sizes):
                        got = os.pread(fd, size, cursor)
                        assert got == bytes([1 + r * 50 + t * 10 + b]) * size, (r, b, t)
                        cursor += size
        finally:
            os.close(fd)
        with pytest.raises(InvalidInputError, match="overflows rank 0's slot"):
            regions[0].create_next_worker_view(1)
    finally:
        for region in reversed(regions):
            region.cleanup()


def test_canonical_views_and_kv_memoryview(shm_dir: Path) -> None:
    with make(shm_dir, None) as region:
        t0 = region.create_next_canonical_view(100)
        t1 = region.create_next_canonical_view(200)
        t1[2].fill_(7)
        mv = region.create_kv_memoryview()
        assert mv.shape == (8, ROW)
        assert (mv[2, 100], mv[2, 299], mv[2, 300], mv[1, 100]) == (7, 7, 0, 0)
        mv.release()
        assert t0.stride() == (ROW, 1)
        with pytest.raises(InvalidInputError, match="more than the row stride"):
            region.create_next_canonical_view(ROW)
        with pytest.raises(InvalidInputError, match="rank-less"):
            region.create_next_worker_view(10)
        del t0, t1


def test_ranked_opener_prefaults_only_its_slot(shm_dir: Path) -> None:
    with make(shm_dir, 1, world_size=2) as region:
        assert region.fd is not None
        pages = residency.page_map(region.fd)
        per_row = ROW // PAGESIZE
        for b in range(8):
            row = pages[b * per_row:(b + 1) * per_row]
            assert row == b"\x00\x00\x01\x01", b  # rank 1 owns the second half
        assert region.populate_stats is not None
        assert region.populate_stats.bytes == 8 * 2 * PAGESIZE


def test_rankless_opener_prefaults_everything(shm_dir: Path) -> None:
    with make(shm_dir, None, populate_threads=2) as region:
        assert region.fd is not None
        assert residency.resident_bytes(region.fd) == 8 * ROW


def test_shared_flock_is_held_for_life(shm_dir: Path) -> None:
    region = make(shm_dir, 0, persistent=True)
    fd = os.open(region.mmap_path, os.O_RDONLY)
    try:
        assert not fsguard.try_lock(fd)
        region.cleanup()
        assert fsguard.try_lock(fd)
    finally:
        os.close(fd)
    assert os.path.exists(region.mmap_path), "persistent regions survive their creator"
    assert manifest_io.read(region.manifest_path).persistent


def test_create_only_refuses_an_existing_name(shm_dir: Path) -> None:
    with make(shm_dir, 0), pytest.raises(RegionBusyError, match="already exists"):
        make(shm_dir, None, create_only=True)


# -- hardening: nothing unsafe is joined, nothing is left behind ----------------------


def _existing(shm_dir: Path, size: int = 8 * ROW, mode: int = 0o600) -> Path:
    path = shm_dir / "vllm_offload_eng.mmap"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
    os.ftruncate(fd, size)
    os.fchmod(fd, mode)
    os.close(fd)
    return path


def _snapshot(shm_dir: Path) -> dict[str, tuple[int, int, int]]:
    out = {}
    for name in os.listdir(shm_dir):
        st = os.stat(shm_dir / name, follow_symlinks=False)
        out[name] = (st.st_ino, st.st_size, st.st_mode)
    return out


@pytest.mark.parametrize(("setup", "code"), [
    ("symlink", "symlink"),
    ("foreign", "foreign_owner"),
    ("mode", "unsafe_mode"),
    ("hardlink", "link_count"),
    ("size", "size_mismatch"),
    ("directory", "not_regular_file"),
])
def test_unsafe_existing_files_are_refused_untouched(shm_dir: Path, setup: str,
                                                     code: str) -> None:
    target = shm_dir / "target"
    target.write_bytes(b"precious")
    path = shm_dir / "vllm_offload_eng.mmap"
    if setup == "symlink":
        path.symlink_to(target)
    elif setup == "foreign":
        os.chown(_existing(shm_dir), 12345, 12345)
    elif setup == "mode":
        _existing(shm_dir, mode=0o644)
    elif setup == "hardlink":
        os.link(_existing(shm_dir), shm_dir / "other-name")
    elif setup == "size":
        _existing(shm_dir, size=3 * ROW)
    elif setup == "directory":
        path.mkdir()
    before = _snapshot(shm_dir)
    with pytest.raises(UnsafeRegionError) as info:
        make(shm_dir, 0, join_timeout=1)
    assert info.value.code == code
    assert str(path) in info.value.message
    assert _snapshot(shm_dir) == before
    assert target.read_bytes() == b"precious"


def test_joiner_gives_up_on_a_stub_nobody_sizes(shm_dir: Path) -> None:
    _existing(shm_dir, size=0)
    with pytest.raises(RegionTimeoutError, match="never sized it"):
        make(shm_dir, 0, join_timeout=0.3)
    assert listing(shm_dir) == ["vllm_offload_eng.mmap"]


def test_manifest_updates_give_up_on_a_stopped_lock_holder(shm_dir: Path) -> None:
    """A gc stopped while it holds a manifest's lock fails an attach, never stalls it."""
    with make(shm_dir, 0, world_size=2) as region:
        path = region.manifest_path
        holder = subprocess.Popen([sys.executable, "-c", (
            "import fcntl, os, signal, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); "
            "os.kill(os.getpid(), signal.SIGSTOP)"), path], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
            before = Path(path).read_bytes()
            with pytest.raises(RegionTimeoutError, match="kept it locked"):
                manifest_io.update(path, lambda m: m, timeout=0.2)
            with pytest.raises(RegionTimeoutError, match="kept it locked"):
                manifest_io.remove(path, timeout=0.2)
            assert Path(path).read_bytes() == before  # nothing half-done
        finally:
            holder.kill()
            holder.wait(timeout=10)
            if holder.stdout is not None:
                holder.stdout.close()
        # the holder's death dropped its lock: the same calls now go through
        assert manifest_io.detach(path, os.getpid(), 0).attachments == ()


def test_joiner_refuses_another_geometry_of_the_same_size(shm_dir: Path) -> None:
    with make(shm_dir, 0, world_size=2):
        with pytest.raises(UnsafeRegionError, match="geometry") as info:
            # same bytes in total, but slots of one page instead of two
            make(shm_dir, 0, page=PAGESIZE, world_size=4)
        assert info.value.code == "geometry_mismatch"


def test_failed_preflight_leaves_nothing(shm_dir: Path) -> None:
    free = os.statvfs(shm_dir).f_bavail * os.statvfs(shm_dir).f_frsize
    with pytest.raises(InsufficientSpaceError, match="free"):
        make(shm_dir, 0, num_blocks=free // ROW + 1024)
    assert listing(shm_dir) == []


def test_failed_manifest_write_removes_the_region(shm_dir: Path) -> None:
    (shm_dir / "vllm_offload_eng.manifest.json").mkdir()  # rename onto it must fail
    with pytest.raises((OperationFailedError, OSError)):
        make(shm_dir, 0)
    assert listing(shm_dir) == ["vllm_offload_eng.manifest.json"]


def test_corrupt_manifest_blocks_explicit_create_only(shm_dir: Path) -> None:
    m = shm_dir / "vllm_offload_eng.manifest.json"
    fd = os.open(m, os.O_CREAT | os.O_WRONLY, 0o600)
    os.write(fd, b"{not json")
    os.close(fd)
    with pytest.raises(UnsafeRegionError, match="invalid"):
        make(shm_dir, None, create_only=True)
    assert listing(shm_dir) == ["vllm_offload_eng.manifest.json"]
    assert m.read_bytes() == b"{not json"


def test_bad_arguments_are_input_errors(shm_dir: Path) -> None:
    with pytest.raises(InvalidInputError, match="page size"):
        make(shm_dir, 0, row=ROW + 1)
    with pytest.raises(InvalidInputError, match="rank 2"):
        make(shm_dir, 2, world_size=2)
    with pytest.raises(InvalidInputError, match="engine_id"):
        make(shm_dir, 0, engine_id="../etc")
    with pytest.raises(InvalidInputError, match="does not exist"):
        make(shm_dir / "missing", 0)
    assert listing(shm_dir) == []


# -- compatibility with vLLM's own class (emulated by the holder helper) -------------


def test_joins_a_region_made_by_vllm(shm_dir: Path, holders: Any) -> None:
    h = holders("vllm", str(shm_dir), "eng", "8", "0", str(ROW), str(2 * PAGESIZE))
    assert h.info["creator"]
    with make(shm_dir, 1, world_size=2) as region:
        assert not region.creator
        assert region.identity.ino == h.info["ino"]
        h.send("write 3 77")
        assert h.proc.stdout.readline().strip() == "ok"
        mv = region.create_kv_memoryview()
        assert mv[3, 0] == 77 and mv[3, 2 * PAGESIZE] == 0
        mv.release()
    assert h.stop() == 0


def test_vllm_joins_a_region_made_by_us(shm_dir: Path, holders: Any) -> None:
    with make(shm_dir, 0, world_size=2) as region:
        h = holders("vllm", str(shm_dir), "eng", "8", "1", str(ROW), str(2 * PAGESIZE))
        assert not h.info["creator"] and h.info["ino"] == region.identity.ino
        h.send("write 5 9")
        assert h.proc.stdout.readline().strip() == "ok"
        view = region.create_kv_memoryview()
        assert view[5, 2 * PAGESIZE] == 9
        view.release()
        assert h.stop() == 0


# -- the creator/joiner race with real processes --------------------------------------

WORLD = 32  # racers for one engine_id: exactly one creates, all share one inode


def _mark(rank: int, block: int) -> int:
    """What rank writes into its slot of a row: distinct per neighbour, fits int8."""
    return (rank * 16 + block) % 128


def _race_worker(shm_dir: str, rank: int, start: Any, written: Any, out: Any) -> None:
    start.wait()
    region = SharedOffloadRegion("race", 16, rank, WORLD * PAGESIZE, PAGESIZE,
                                 shm_dir=shm_dir, world_size=WORLD)
    view = region.create_next_worker_view(PAGESIZE)
    for b in range(16):
        view[b].fill_(_mark(rank, b))
    written.wait()
    mv = region.create_kv_memoryview()
    seen = [[mv[b, r * PAGESIZE + PAGESIZE - 1] for r in range(WORLD)] for b in range(16)]
    mv.release()
    out.put((rank, region.creator, region.identity.ino, seen))
    written.wait()  # nobody unlinks before everyone read
    del view
    region.cleanup()


def test_many_processes_race_one_creator_one_inode(shm_dir: Path) -> None:
    import_torch()  # once, before forking: 32 children importing it would take a minute
    ctx = mp.get_context("fork")
    start, written, out = ctx.Barrier(WORLD), ctx.Barrier(WORLD), ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(str(shm_dir), r, start, written, out))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sum(creator for _, creator, _, _ in results) == 1
    assert len({ino for _, _, ino, _ in results}) == 1
    expected = [[_mark(r, b) for r in range(WORLD)] for b in range(16)]
    for rank, _, _, seen in results:
        assert seen == expected, f"rank {rank} saw other slots wrong"
    assert listing(shm_dir) == []
