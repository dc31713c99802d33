"""SharedOffloadRegion: vLLM's mmap-backed KV offload region, hardened and byte-compatible
with vLLM's class, so either side can create a region and the other join it. Joiners never
O_CREAT or follow a link, the descriptor is judged by fstat, every opener holds a shared
flock, the creator checks capacity and writes a manifest that says `creating` until the
file is sized and pre-faulted, and a failure removes what this opener created. torch is
imported only when a tensor view is asked for."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_offload_cli.core.base import errors
from vllm_offload_cli.core.base.deadline import poll_until
from vllm_offload_cli.core.base.extras import import_torch
from vllm_offload_cli.core.base.problems import jsonable
from vllm_offload_cli.core.base.testhook import pause_at
from vllm_offload_cli.core.region import capacity, fsguard, geometry, naming, page_policy
from vllm_offload_cli.core.region import manifest as manifest_io
from vllm_offload_cli.core.region.geometry import PAGESIZE
from vllm_offload_cli.core.region.naming import manifest_path
from vllm_offload_cli.core.region.prefault import PopulateStats, Progress, populate, slot_ranges
from vllm_offload_cli.core.region.ranks import RankSource, parse_rank_source
from vllm_offload_cli.core.system import libc
from vllm_offload_cli.core.system.files import FileId
from vllm_offload_cli.core.system.processes import ProcessRef

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_RETRIES = 8  # restarts of the open protocol when a name changes under us


class SharedOffloadRegion:
    """One mmap'd file shared by every worker of one engine (one DP replica); a drop-in
    for vLLM's class: 0.33's signature (and 0.31/0.32's `populate_only_on_creator`),
    attributes and barrier protocol. Keyword-only arguments after vLLM's are ours;
    `rank=None` is the scheduler's rank-less view.
    """

    # vLLM's spec modules read this when they load (row strides are rounded up to it)
    BLOCK_SIZE_ALIGNMENT: int = PAGESIZE

    def __init__(
        self,
        engine_id: str,
        num_chunks: int,
        rank: int | None,
        kv_bytes_per_chunk: int,
        cpu_page_size: int,
        barrier: Callable[[], object] | None = None,
        *,
        creator_memory_check: Callable[[int], object] | None = None,
        populate_shard: tuple[int, int] | None = None,
        populate_only_on_creator: bool = False,
        num_segments: int = 1,
        shm_dir: str | os.PathLike[str] = naming.DEFAULT_SHM_DIR,
        world_size: int | None = None,
        rank_source: str | RankSource | None = None,
        device_index: int | None = None,
        layout: str = "worker",
        create_only: bool = False,
        persistent: bool = False,
        populate_pages: bool = True,
        populate_threads: int = 1,
        join_timeout: float = 30.0,
        preflight: bool = True,
        allowed_uids: fsguard.AllowedUids = None,
        progress: Progress | None = None,
        numa_node: int | Sequence[int] | None = None,
        numa_policy: str | None = None,
        huge_pages: str = "never",
        min_segment_bytes: int = geometry.MIN_SEGMENT_BYTES,
        vllm_layout_basis: str | None = None,
        engine_token: str | None = None,
    ) -> None:
        # what cleanup(), __repr__ and the failure path read, set before anything can fail
        self.engine_id = engine_id
        self.rank = rank
        self.persistent = persistent
        self.engine_token = engine_token
        self.page_size = PAGESIZE
        self.fd: int | None = None
        self.mmap_obj: mmap.mmap | None = None
        self.populate_stats: PopulateStats | None = None
        self.huge_page_bytes: int | None = None  # PMD-mapped bytes after pre-fault
        self.is_pinned = False  # set by whoever page-locks the mapping (vLLM's worker, ours)
        self.pinned_addresses: list[int] = []  # vLLM's registrations, unregistered at cleanup
        self._allowed_uids = allowed_uids
        self._device_index = device_index
        self._layout = layout
        self._vllm_layout_basis = vllm_layout_basis
        self._creator_memory_check = creator_memory_check
        self._creator = False
        self._manifest_written = False
        self._attached = False
        self._closed = False
        self._segment_fds: list[int] = []  # open (and shared-locked) `.mmap.N`, N >= 1
        self._views: list[torch.Tensor] = []
        self._base_tensor: torch.Tensor | None = None
        self._close_callbacks: list[Callable[[], None]] = []
        # vLLM's barrier protocol: one rendezvous, a second after a sharded pre-fault
        barriers_owed = 1 + (populate_shard is not None)
        try:
            if populate_only_on_creator and barrier is None:
                raise errors.InvalidInputError("populate_only_on_creator needs a barrier: joiners "
                                               "must not use pages the creator has not populated")
            # validated and computed before any file is touched
            # recorded in the manifest by its registered name, so `verify-rank-layout` can judge it
            self._rank_source = None if rank_source is None else parse_rank_source(rank_source).name
            self.geometry = geometry.Geometry(num_blocks=num_chunks, row_stride=kv_bytes_per_chunk,
                                              cpu_page_size=cpu_page_size, world_size=world_size)
            if self.rank is not None:
                geometry.check_rank(self.geometry, self.rank)
                self._worker_offset = self.rank * cpu_page_size
                self._worker_area_end = (self.rank + 1) * cpu_page_size
            self._canonical_offset = 0
            self.num_chunks = num_chunks
            self.cpu_page_size = cpu_page_size
            self._row_stride = kv_bytes_per_chunk
            self.total_size_bytes = self.geometry.size_bytes
            self.mmap_path = str(naming.region_path(shm_dir, self.engine_id))  # checks the id
            self.manifest_path = str(manifest_path(shm_dir, self.engine_id))
            self.shm_dir = Path(shm_dir)
            # validated before the file exists: a request the host cannot meet creates nothing
            self.placement = page_policy.choose(shm_dir, numa_nodes=numa_node,
                                                numa_policy=numa_policy, huge_pages=huge_pages)
            # vLLM's rule and split: files `.mmap`, `.mmap.1`, ... mapped back to back
            self.segments: tuple[geometry.Segment, ...] = geometry.split(
                num_chunks, kv_bytes_per_chunk,
                geometry.effective_segments(num_segments, self.total_size_bytes,
                                            min_bytes=min_segment_bytes))
            self.segment_paths = [seg.path(self.mmap_path) for seg in self.segments]
            self._me = ProcessRef.current()
            fd = self._open(create_only=create_only, join_timeout=join_timeout,
                            preflight=preflight)
            self.mmap_obj = mm = self._map(fd)
            if self._creator:  # the file's NUMA policy is shared: only its creator sets it
                page_policy.apply(mm, self.total_size_bytes, self.placement)

            def prefault(ranges: list[tuple[int, int]]) -> None:
                if populate_pages and ranges:
                    self.populate_stats = populate(mm, ranges,
                                                   threads=populate_threads,
                                                   progress=progress)

            if populate_only_on_creator and self._creator:  # vLLM 0.31/0.32
                prefault([(0, self.total_size_bytes)])
            if barrier is not None:
                self._attach()  # recorded while the manifest still has its name
                barriers_owed -= 1
                barrier()
                # every worker has mapped the file: no exit path may leak it by name
                if self._creator and not self.persistent:
                    self.release_names()
                    logger.info("released the names of %s: every worker mapped it",
                                self.mmap_path)
            if populate_shard is not None:
                prefault(self._shard_range(populate_shard))
                if barrier is not None:
                    barriers_owed -= 1
                    barrier()  # every share is pre-faulted
            elif not populate_only_on_creator:
                prefault(slot_ranges(self.geometry, rank))
            if populate_pages:
                self.huge_page_bytes = self._huge_bytes(mm)
            if barrier is None:
                self._attach()
        except BaseException as exc:
            self._abandon()
            if isinstance(exc, Exception) and barrier is not None:
                self._release_peers(barrier, barriers_owed)
            raise

    def _huge_bytes(self, mm: mmap.mmap) -> int | None:
        """PMD-mapped bytes after pre-fault, from our own smaps; None where none were asked for."""
        if not self.placement.advise_huge:
            return None
        return page_policy.pmd_mapped(os.getpid(), ctypes.addressof(ctypes.c_char.from_buffer(mm)))

    def _release_peers(self, barrier: Callable[[], object], owed: int) -> None:
        """A failing worker still arrives at the barriers it owes, so its peers do not
        hang; the error raised stays its own."""
        for _ in range(owed):
            try:
                barrier()
            except Exception:
                logger.warning("failed to release the peers waiting at the barrier of %s",
                               getattr(self, "mmap_path", self.engine_id), exc_info=True)

    def _shard_range(self, shard: tuple[int, int]) -> list[tuple[int, int]]:
        """vLLM's `populate_shard=(index, count)`: one contiguous, page-rounded share of
        the whole file (a trailing share may be empty), for workers that map the same bytes."""
        index, count = shard
        if count <= 0 or not 0 <= index < count:
            raise errors.InvalidInputError(f"populate_shard {shard!r} needs 0 <= index < count")
        total = self.total_size_bytes
        share = geometry.round_up(-(-total // count), PAGESIZE)
        start = index * share
        return [(start, min(share, total - start))] if start < total else []

    def _map(self, fd: int) -> mmap.mmap:
        """One mapping of the whole region; segment files are laid over it back to back."""
        if len(self.segments) == 1:
            return mmap.mmap(fd, self.total_size_bytes, flags=mmap.MAP_SHARED,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        reserved = mmap.mmap(-1, self.total_size_bytes, flags=mmap.MAP_PRIVATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            base = ctypes.addressof(ctypes.c_char.from_buffer(reserved))
            for seg, seg_fd in zip(self.segments, [fd, *self._segment_fds], strict=True):
                libc.map_shared_fixed(base + seg.offset, seg.length, seg_fd)
        except BaseException:
            reserved.close()
            raise
        return reserved

    def _open(self, *, create_only: bool, join_timeout: float, preflight: bool) -> int:
        if not self.shm_dir.is_dir():
            raise errors.InvalidInputError(
                f"shm directory {self.shm_dir} does not exist or is not a directory",
                path=str(self.shm_dir), engine_id=self.engine_id, code="bad_shm_dir",
            )
        if create_only:  # an explicit create changes nothing where a damaged manifest is
            with contextlib.suppress(errors.RegionNotFoundError):
                manifest_io.read(self.manifest_path, allowed_uids=self._allowed_uids)
        for _ in range(_RETRIES):
            try:
                fd = self.fd = fsguard.create_exclusive(self.mmap_path, engine_id=self.engine_id)
            except FileExistsError:
                if create_only:
                    raise self._name_taken() from None
                if (joined := self._join(join_timeout)) is not None:
                    return joined
                continue  # the name changed under us: start over
            self._creator = True
            self._create(fd, preflight)
            return fd
        raise errors.OperationFailedError(
            f"{self.mmap_path} kept changing while opening it; is something deleting it?",
            path=self.mmap_path, engine_id=self.engine_id,
        )

    def _create(self, fd: int, preflight: bool) -> None:
        """We won O_EXCL on `fd`: lock, check room, describe, then size the file."""
        fsguard.lock_shared(fd, timeout=10.0, path=self.mmap_path)
        if self._creator_memory_check is not None:  # vLLM's hook, e.g. HiSparse's host RAM
            self._creator_memory_check(self.total_size_bytes)
        if preflight:
            capacity.check_fits(self.total_size_bytes, capacity.measure(self.shm_dir),
                                shm_dir=self.shm_dir, engine_id=self.engine_id)
        st = os.fstat(fd)
        # written before ftruncate, so every joiner that saw the full size finds it
        manifest_io.write(self.manifest_path, manifest_io.Manifest(
            engine_id=self.engine_id, geometry=self.geometry,
            region_dev=st.st_dev, region_ino=st.st_ino,
            creator_pid=self._me.pid, creator_start_ticks=self._me.start_ticks,
            creator_host=socket.gethostname(), created_at=time.time(), layout=self._layout,
            rank_source=self._rank_source, persistent=self.persistent,
            placement=None if self.placement.is_default else self.placement.to_record(),
            state=manifest_io.CREATING,  # `ready` once sized and pre-faulted (_attach)
            segments=len(self.segments), engine_token=self.engine_token,
            vllm_layout_basis=self._vllm_layout_basis,
        ))
        self._manifest_written = True
        pause_at("after_manifest")
        for seg, path in zip(self.segments[1:], self.segment_paths[1:], strict=True):
            self._create_segment(seg, path)
        # joiners wait for the bare file, so it is sized last (as vLLM does)
        self._size(fd, self.mmap_path, self.segments[0].length)
        pause_at("after_ftruncate")
        logger.info("created %s (%d bytes)", self.mmap_path, self.total_size_bytes)

    def _create_segment(self, seg: geometry.Segment, path: str) -> None:
        try:
            fd = fsguard.create_exclusive(path, engine_id=self.engine_id)
        except FileExistsError:
            raise errors.RegionBusyError(
                f"{path} already exists without its region; a leftover of an earlier region? "
                f"`{naming.gc_command(self.shm_dir, self.engine_id)}` removes it once nothing "
                "uses it",
                path=path, engine_id=self.engine_id, code="name_taken",
            ) from None
        self._segment_fds.append(fd)
        fsguard.lock_shared(fd, timeout=10.0, path=path)
        self._size(fd, path, seg.length)

    def _size(self, fd: int, path: str, length: int) -> None:
        try:
            os.ftruncate(fd, length)
        except OSError as exc:
            raise errors.OperationFailedError(
                f"cannot size {path} to {length} bytes: {exc.strerror}",
                path=path, engine_id=self.engine_id,
            ) from exc

    def _join(self, timeout: float) -> int | None:
        """Join an existing region; None when the name vanished or was replaced."""
        try:
            fd = fsguard.open_existing(self.mmap_path, os.O_RDWR, engine_id=self.engine_id)
        except errors.RegionNotFoundError:
            return None
        self.fd = fd
        st = os.fstat(fd)
        fsguard.raise_if_unsafe(st, self.mmap_path, engine_id=self.engine_id,
                                allowed_uids=self._allowed_uids)
        fsguard.lock_shared(fd, timeout=timeout, path=self.mmap_path)
        expected = self.segments[0].length

        def sized() -> bool | None:
            """True once the creator sized it; False when unlinked or replaced."""
            if not fsguard.same_file_at(self.mmap_path, fd):
                return False
            if (st := os.fstat(fd)).st_size == expected:
                return True
            if st.st_size != 0:
                fsguard.raise_if_unsafe(st, self.mmap_path, engine_id=self.engine_id,
                                        allowed_uids=self._allowed_uids, expected_size=expected)
            return None
        if (found := poll_until(sized, timeout, backoff=(0.005, 0.005))) is None:
            raise errors.RegionTimeoutError(
                f"{self.mmap_path} is still {os.fstat(fd).st_size} bytes after {timeout:.0f} s; "
                "its creator never sized it (crashed?). `vllm-offload inspect` shows who holds it",
                path=self.mmap_path, engine_id=self.engine_id,
            )
        if not found:
            os.close(fd)  # unlinked (failed creator, gc) or replaced: retry
            self.fd = None
            return None
        self._check_manifest_geometry(st.st_uid)
        # `.mmap.N` as the bare file: no O_CREAT, judged by fstat, exact size
        for seg, path in zip(self.segments[1:], self.segment_paths[1:], strict=True):
            seg_fd = fsguard.open_existing(path, os.O_RDWR, engine_id=self.engine_id)
            self._segment_fds.append(seg_fd)
            fsguard.raise_if_unsafe(os.fstat(seg_fd), path, engine_id=self.engine_id,
                                    allowed_uids=self._allowed_uids, expected_size=seg.length)
            fsguard.lock_shared(seg_fd, timeout=timeout, path=path)
        logger.info("joined %s", self.mmap_path)
        return fd

    def _check_manifest_geometry(self, owner_uid: int) -> None:
        """Same size but another slot size would still corrupt data: compare geometry."""
        try:
            m = manifest_io.read(self.manifest_path, allowed_uids=self._allowed_uids,
                                 owner_uid=owner_uid)
        except errors.RegionNotFoundError:
            return  # made by vLLM: nothing more to compare
        except manifest_io.ManifestError as exc:
            logger.warning("ignoring manifest: %s", exc)
            return
        mine, theirs, path = self.geometry, m.geometry, self.mmap_path
        differs = geometry.mismatches(theirs, **asdict(mine))
        workers = theirs.world_size if mine.world_size is None else None  # only theirs says
        for bad, error, code, message in (  # in this order: the first that applies is raised
            (not differs and self.rank is not None and workers is not None
             and self.rank >= workers, errors.UnsafeRegionError, "rank_out_of_range",
             f"rank {self.rank} is outside [0, {workers}): {path} was created for {workers} "
             "workers; its slot would be another engine's padding"),
            (m.segments != len(self.segments), errors.UnsafeRegionError, "geometry_mismatch",
             f"{path} was created as {m.segments} file(s) but this opener expects "
             f"{len(self.segments)}; the rows would be mapped from the wrong files"),
            (self.engine_token is not None and m.engine_token not in (None, self.engine_token),
             errors.RegionBusyError, "engine_id_collision",
             f"{path} belongs to another engine started with the same engine_id (created by "
             f"pid {m.creator_pid}); refusing to share its bytes"),
            (bool(differs), errors.UnsafeRegionError, "geometry_mismatch",
             f"{path} was created with geometry {jsonable(theirs)} but this opener expects "
             f"{jsonable(mine)}; joining would misplace every slot"),
        ):
            if bad:
                raise error(message, path=path, engine_id=self.engine_id, code=code,
                            pid=m.creator_pid if error is errors.RegionBusyError else None)
        if not m.creator_alive() and not m.persistent:
            logger.warning("joining %s whose creator (pid %d) is gone; nobody will unlink it",
                           self.mmap_path, m.creator_pid)

    def _name_taken(self) -> errors.OffloadError:
        st = m = None
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(self.mmap_path, follow_symlinks=False)
        if st is not None:
            problems = fsguard.stat_problems(st, allowed_uids=self._allowed_uids)
            if problems:  # not merely taken: somebody else's, or not a region at all
                return errors.UnsafeRegionError(
                    f"{self.mmap_path} already exists and {problems[0].message}; check what it "
                    "is before removing it by hand", path=self.mmap_path,
                    engine_id=self.engine_id, code=problems[0].code,
                )
            # only a manifest of this very file counts
            m, _ = manifest_io.read_matching(self.manifest_path, FileId.of(st),
                                             allowed_uids=self._allowed_uids, owner_uid=st.st_uid)
        return errors.RegionBusyError(
            f"{self.mmap_path} already exists; {self._taken_hint(m)}",
            path=self.mmap_path, engine_id=self.engine_id, code="name_taken",
        )

    def _taken_hint(self, m: manifest_io.Manifest | None) -> str:
        """What to do about a taken name, as a command that works on what is there."""
        gc = naming.gc_command(self.shm_dir, self.engine_id,
                        include_persistent=m is not None and m.persistent and m.complete)
        if m is not None and not m.complete:
            if m.creator_alive():
                return f"pid {m.creator_pid} is creating it right now; wait for it to finish"
            return (f"it is what a create left that never finished (pid {m.creator_pid} died "
                    f"half-way); remove it with `{gc}`")
        if m is not None and m.persistent:
            return (f"it was pre-provisioned; if no engine uses it, remove it with `{gc}`, or "
                    "pick another engine_id")
        return f"pick another engine_id, or if nothing uses it, remove it with `{gc}`"

    def _attach(self) -> None:
        attachment = manifest_io.Attachment(
            pid=self._me.pid, start_ticks=self._me.start_ticks, rank=self.rank,
            device_index=self._device_index, rank_source=self._rank_source,
            host=socket.gethostname(), attached_at=time.time(), engine_token=self.engine_token,
        )
        try:
            # the creator's attach also ends creation: sized and pre-faulted, now `ready`
            manifest_io.attach(self.manifest_path, attachment, allowed_uids=self._allowed_uids,
                               ready=self._creator)
        except errors.RegionNotFoundError:
            pass  # a vLLM-made region has no manifest
        except manifest_io.ManifestError as exc:
            if self._creator:
                raise
            logger.warning("cannot record attachment: %s", exc)
        else:
            self._attached = True

    def _abandon(self, *, unlink: bool = True) -> None:
        """Close; a creator also unlinks what it made (never a stub joiners would wait on)."""
        if self._creator and unlink and self.fd is not None:
            if self._unlink_names(manifest=self._manifest_written):
                logger.info("removed %s", self.mmap_path)
            self._creator = False
        self._close()

    def _unlink_names(self, *, manifest: bool = True) -> bool:
        """Unlink the names that still name our inodes, `.mmap.N` first (a new creator
        starts from the bare name), then the manifest; True when the bare name went."""
        assert self.fd is not None
        for path, fd in zip(self.segment_paths[1:], self._segment_fds, strict=False):
            fsguard.unlink_if_same(path, fd)
        if not fsguard.unlink_if_same(self.mmap_path, self.fd):
            return False
        if manifest:
            manifest_io.remove(self.manifest_path)
        return True

    def _mapping(self) -> mmap.mmap:
        if self.mmap_obj is None or self._closed:
            raise errors.OperationFailedError(f"{self.mmap_path} is closed", path=self.mmap_path)
        return self.mmap_obj

    @property
    def base_tensor(self) -> torch.Tensor:
        """The whole mapping as one int8 tensor (vLLM's HiSparse pins slices of it)."""
        if self._base_tensor is None:
            torch = import_torch()
            self._base_tensor = torch.frombuffer(self._mapping(), dtype=torch.int8)
        return self._base_tensor

    # vLLM 0.31-0.33's gpu_worker.pin_mmap_region reads `region._base.data_ptr()`
    _base = base_tensor

    def iter_worker_slot_ranges(self) -> Iterator[tuple[int, int]]:
        """This worker's slots as page-aligned (offset, length) ranges, one per row, as
        vLLM 0.33 yields them: with several files each worker starts on a different one."""
        if self.rank is None:
            raise errors.InvalidInputError("a rank-less region has no worker slot; pass a rank")
        start_of_slot = self.rank * self.cpu_page_size
        first = 0
        if len(self.segments) > 1:
            first = self.rank * self.num_chunks // (self._row_stride // self.cpu_page_size)
        for i in range(self.num_chunks):
            start = (first + i) % self.num_chunks * self._row_stride + start_of_slot
            aligned = start - start % PAGESIZE
            yield aligned, geometry.round_up(start + self.cpu_page_size, PAGESIZE) - aligned

    def _strided(self, offset: int, size: int, limit: int, overflow: Callable[[int], str]
                 ) -> torch.Tensor:
        """(num_chunks, size) at `offset` of every row, strides (row, 1); a view that would
        end past `limit` is refused with `overflow(end)`."""
        if size <= 0:
            raise errors.InvalidInputError(f"tensor page size must be > 0, got {size}")
        if offset + size > limit:
            raise errors.SlotOverflowError(overflow(offset + size))
        view: torch.Tensor = import_torch().as_strided(
            self.base_tensor, size=(self.num_chunks, size), stride=(self._row_stride, 1),
            storage_offset=offset)
        self._views.append(view)
        return view

    def create_next_worker_view(self, tensor_page_size: int) -> torch.Tensor:
        """The next tensor's page in this worker's slot: (num_chunks, size), strides (row, 1)."""
        if self.rank is None:
            raise errors.InvalidInputError("a rank-less region has no worker slot; pass a rank")
        area_end = self._worker_area_end
        view = self._strided(self._worker_offset, tensor_page_size, area_end, lambda end: (
            f"worker offset {end} exceeds worker area end {area_end}: a tensor page of "
            f"{tensor_page_size} bytes overflows rank {self.rank}'s slot by {end - area_end} "
            f"bytes (cpu_page_size {self.geometry.cpu_page_size})"))
        self._worker_offset += tensor_page_size
        return view

    def create_next_canonical_view(self, tensor_page_size: int) -> torch.Tensor:
        """The next tensor's page carved from offset 0 of every row, shared by all workers."""
        view = self._strided(self._canonical_offset, tensor_page_size, self._row_stride,
                             lambda end: f"canonical pages need {end} bytes per row, more "
                             f"than the row stride {self._row_stride}")
        self._canonical_offset += tensor_page_size
        return view

    def create_kv_memoryview(self) -> memoryview:
        """Zero-copy (num_chunks, row_stride) byte view; chunk c is view[c]."""
        return memoryview(self._mapping()).cast("B", (self.num_chunks, self._row_stride))

    @property
    def creator(self) -> bool:
        return self._creator

    @property
    def identity(self) -> FileId:
        if self.fd is None:
            raise errors.OperationFailedError(f"{self.mmap_path} is closed", path=self.mmap_path)
        return FileId.of(os.fstat(self.fd))

    def release_names(self) -> bool:
        """Unlink the names (and the manifest) but keep the mapping, as vLLM's CPU spec does
        after its barrier: the bytes live until the last mapping goes, SIGKILL or not."""
        if self.fd is None or not self._unlink_names():
            return False
        self._creator = False  # nothing of ours is left to unlink at cleanup
        return True

    def cleanup(self) -> None:
        """Release everything; the creator of a non-persistent region also unlinks it."""
        if self._attached:
            try:
                manifest_io.detach(self.manifest_path, self._me.pid, self.rank,
                                   allowed_uids=self._allowed_uids)
            except (errors.OffloadError, OSError) as exc:
                logger.debug("detach from %s: %s", self.manifest_path, exc)
            self._attached = False
        self._abandon(unlink=not self.persistent)

    def add_close_callback(self, callback: Callable[[], None]) -> None:
        """Call `callback` in cleanup() before the mapping goes (the newest first): a copy
        worker drains and unpins there, so that no copy outlives the mapping."""
        self._close_callbacks.append(callback)

    def remove_close_callback(self, callback: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._close_callbacks.remove(callback)

    def _close(self) -> None:
        while self._close_callbacks:
            callback = self._close_callbacks.pop()
            try:
                callback()
            except Exception:  # the mapping must still be released
                logger.exception("%s: a close callback failed", self.mmap_path)
        self._unregister_pins()
        self._closed = True
        # views hold references to the buffer export; drop them before closing the map
        self._views.clear()
        self._base_tensor = None
        if self.mmap_obj is not None:
            try:
                self.mmap_obj.close()
                self.mmap_obj = None
            except BufferError:
                # a native user (a NIC, a C extension) still holds the buffer: unmapping would
                # let it write into reused address space. Keep the mapping, as vLLM does.
                logger.warning("keeping %s mapped: buffers are still exported to native "
                               "users", self.mmap_path)
        for fd in self._segment_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._segment_fds = []
        if self.fd is not None:
            try:
                os.close(self.fd)  # also releases our shared flock
            except OSError as exc:
                if exc.errno != errno.EBADF:
                    raise
            self.fd = None

    def __enter__(self) -> SharedOffloadRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def _unregister_pins(self) -> None:
        """Undo vLLM's page-locking as vLLM's class does: each of `pinned_addresses` (else
        the whole mapping), newest first. Our copy worker unpins earlier, in its callback."""
        if not self.is_pinned:
            return
        addresses = list(self.pinned_addresses)
        if not addresses and self.mmap_obj is not None:
            addresses = [ctypes.addressof(ctypes.c_char.from_buffer(self.mmap_obj))]
        unregister = _host_unregister() or (lambda address: None)
        for address in reversed(addresses):
            try:
                unregister(address)
            except Exception:  # the mapping must still be released
                logger.warning("%s: unregistering pinned memory at %#x failed", self.mmap_path,
                               address, exc_info=True)
        self.pinned_addresses.clear()
        self.is_pinned = False

    def __repr__(self) -> str:
        # safe on an object whose __init__ failed early, or that was never initialised
        return (f"SharedOffloadRegion({getattr(self, 'engine_id', '?')!r}, "
                f"rank={getattr(self, 'rank', None)}, "
                f"geometry={getattr(self, 'geometry', None)}, "
                f"creator={getattr(self, '_creator', False)})")


def _host_unregister() -> Callable[[int], object] | None:
    """What undoes vLLM's host registration here: 0.32+'s `host_unregister` (from modules
    already loaded: the core never imports vLLM), else the CUDA runtime, as 0.31 did."""
    for module in ("vllm.v1.kv_offload.cpu.shared_offload_region",
                   "vllm.v1.kv_offload.cpu.host_register"):
        if callable(unregister := getattr(sys.modules.get(module), "host_unregister", None)):
            return unregister  # type: ignore[no-any-return]
    torch = import_torch()
    if not torch.cuda.is_available():
        return None  # nothing can have been registered without a CUDA runtime
    return torch.cuda.cudart().cudaHostUnregister  # type: ignore[no-any-return]
