"""One engine process's hold on its region, opened before vLLM (which only joins): its shared
flock and manifest attachment (with the token) let `inspect` and `gc` prove the region alive."""

from __future__ import annotations

import atexit
import logging
import os
from dataclasses import dataclass

from vllm_offload_cli.core.base.errors import OffloadError, RegionNotFoundError, UnsafeRegionError
from vllm_offload_cli.core.region import carried
from vllm_offload_cli.core.region import manifest as manifest_io
from vllm_offload_cli.core.region.geometry import MIN_SEGMENT_BYTES, effective_segments, split
from vllm_offload_cli.core.region.naming import DEFAULT_SHM_DIR
from vllm_offload_cli.core.region.ranks import LOGICAL
from vllm_offload_cli.core.region.shared_region import SharedOffloadRegion
from vllm_offload_cli.engine.claim import ClaimResult, RegionShape, claim, startup_lock

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RegionRequest:
    """The region one engine process is about to map, in vLLM's terms."""

    engine_id: str
    num_blocks: int
    rank: int | None  # None: the scheduler's rank-less view
    row_stride: int
    cpu_page_size: int
    world_size: int
    num_segments: int = 1  # files asked for; vLLM's rule caps it by min_segment_bytes
    replicated: bool = False  # every worker maps slot 0 (vLLM's replicated MLA layout)
    min_segment_bytes: int = MIN_SEGMENT_BYTES
    rank_source: str = LOGICAL.name  # how vLLM picked `rank` (a core.region.ranks name)
    device_index: int | None = None  # the device the rank was folded from, if it was
    vllm_layout_basis: str | None = None  # "vllm" where the files follow vLLM's code

    @property
    def size_bytes(self) -> int:
        return self.num_blocks * self.row_stride

    @property
    def shape(self) -> RegionShape:
        """What an existing region must be for this process to join it."""
        files = len(split(self.num_blocks, self.row_stride,
                          effective_segments(self.num_segments, self.size_bytes,
                                             min_bytes=self.min_segment_bytes)))
        return RegionShape(size_bytes=self.size_bytes, num_segments=files,
                           num_blocks=self.num_blocks, row_stride=self.row_stride,
                           cpu_page_size=self.cpu_page_size,
                           world_size=None if self.replicated else self.world_size)


class RegionHold:
    """The open region plus what the claim found; `close()` on shutdown."""

    def __init__(self, region: SharedOffloadRegion, claimed: ClaimResult) -> None:
        self.region = region
        self.claimed = claimed
        self.creator = region.creator  # this process made the file
        try:  # the manifest of this very file, if it has one of ours
            m, _ = manifest_io.read_matching(region.manifest_path, region.identity,
                                             owner_uid=os.geteuid())
        except (OffloadError, OSError):
            m = None
        self.pre_provisioned = m is not None and m.persistent and m.complete
        # what inspect, verify and gc need once the names are released, while the engine lives
        self._carried = None if m is None else carried.carry(m)
        self._pid = os.getpid()
        atexit.register(self._close_at_exit)  # a process that never shuts vLLM down

    def release_name(self) -> bool:
        """Unlink the names once every process mapped the region (a SIGKILL then leaks
        nothing), unless pre-provisioned; True when unlinked."""
        if self.pre_provisioned:
            return False
        gone = self.region.release_names()
        if gone:
            logger.info("released the name %s; the region lives on in its mappings",
                        self.region.mmap_path)
        return gone

    def close(self) -> None:
        """Detach, unlock, unmap; unlink where this process made a non-persistent region."""
        atexit.unregister(self._close_at_exit)
        self.region.cleanup()
        if self._carried is not None:
            os.close(self._carried)
            self._carried = None

    def _close_at_exit(self) -> None:
        if os.getpid() == self._pid:  # a forked child inherits the handler, not the hold
            self.close()


def check_slot(region: SharedOffloadRegion, token: str | None, *, replicated: bool) -> None:
    """After the map: this worker's slot is in range (the core checked) and nobody else's."""
    if region.rank is None or replicated or token is None:
        return
    try:
        m = manifest_io.read(region.manifest_path)
    except (manifest_io.ManifestError, OSError, RegionNotFoundError):
        return
    for a in m.live_attachments():
        if a.rank == region.rank and a.pid != os.getpid() and a.engine_token == token:
            raise UnsafeRegionError(
                f"rank {region.rank} of {region.mmap_path} is already used by pid {a.pid} of "
                "this engine; two workers computing one slot would overwrite each other's "
                "KV blocks (check the rank source and device visibility)",
                path=region.mmap_path, engine_id=region.engine_id, pid=a.pid,
                code="slot_collision",
            )


def open_region(
    request: RegionRequest,
    *,
    token: str | None,
    shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR,
    lock_timeout: float = 120.0,
) -> RegionHold:
    """Claim the name, create or join the region through the core, check the slot."""
    with startup_lock(shm_dir, timeout=lock_timeout):
        claimed = claim(request.engine_id, shm_dir=shm_dir, token=token,
                        size_bytes=request.size_bytes, identity=token is not None,
                        shape=request.shape)
        region = SharedOffloadRegion(
            request.engine_id, request.num_blocks, request.rank, request.row_stride,
            request.cpu_page_size, shm_dir=shm_dir,
            world_size=None if request.replicated else request.world_size,
            layout="canonical" if request.replicated else "worker",
            rank_source=None if request.rank is None else request.rank_source,
            device_index=request.device_index,
            populate_pages=False, preflight=False, join_timeout=30.0,
            num_segments=request.num_segments, min_segment_bytes=request.min_segment_bytes,
            vllm_layout_basis=request.vllm_layout_basis, engine_token=token,
        )
        try:  # still under the lock: of two workers on one slot, the second is refused
            check_slot(region, token, replicated=request.replicated)
        except BaseException:
            region.cleanup()
            raise
    return RegionHold(region, claimed)
