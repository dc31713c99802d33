"""vLLM's offloading specs, started through the engine hook.

Selected by `kv_connector_extra_config` `spec_name` (`HardenedCPUOffloadingSpec`
or `HardenedTieringOffloadingSpec`), with `spec_module_path` set to this module
or by name alone once the plugin has registered them. Each subclasses vLLM's
own spec and only runs the start-up steps around `super()`: vLLM still
builds and owns its region object (its worker reads private fields of it),
but always joins a file the hook made under the start-up lock: exact size,
no stale bytes, no other engine on it.

Known refusals (another engine holds the engine_id, no room, an unsafe
leftover) stop the engine: that is the protection. Anything unexpected in the
hook is logged and vLLM starts as it would without it, unless
`kv_connector_extra_config["vllm_offload_strict"]` is true.

This module imports vLLM; `vllm_offload_cli.engine` itself does not.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from vllm.v1.kv_offload.cpu import spec as _cpu_spec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from vllm_offload_cli.core.base.errors import (
    InsufficientSpaceError,
    RegionBusyError,
    UnsafeRegionError,
)
from vllm_offload_cli.core.region.segments import VLLM_CPU_SEGMENTS
from vllm_offload_cli.engine.identity import ENGINE_TOKEN_ENV, valid_token
from vllm_offload_cli.engine.lease import EngineLease, RegionRequest, open_region

logger = logging.getLogger(__name__)

STRICT_KEY = "vllm_offload_strict"
# Refusals are the hook's purpose: they stop the engine even outside strict mode.
_REFUSALS = (RegionBusyError, InsufficientSpaceError, UnsafeRegionError)


def _open(spec: Any, rank: int | None, segments: int) -> EngineLease | None:
    """Run the start-up steps for the region `spec` is about to build; None: skipped."""
    if spec.num_chunks <= 0 or not spec._uses_shared_region():
        return None  # vLLM uses no shared region here: nothing to guard
    token = os.environ.get(ENGINE_TOKEN_ENV)
    if not valid_token(token):
        logger.warning("vllm-offload: %s is not set (the vllm_offload plugin did not run in "
                       "the engine's first process); engine_id collisions cannot be told "
                       "apart from this engine's own workers and are not refused",
                       ENGINE_TOKEN_ENV)
        token = None
    request = RegionRequest(
        engine_id=spec.config.engine_id, num_blocks=spec.num_chunks, rank=rank,
        row_stride=spec.kv_bytes_per_chunk, cpu_page_size=spec.cpu_page_size_per_worker,
        world_size=spec.config.parallel.world_size, num_segments=segments,
        replicated=bool(spec.replicated_layout),
    )
    try:
        return open_region(request, token=token)
    except _REFUSALS:
        raise
    except Exception as exc:
        if spec.extra_config.get(STRICT_KEY):
            raise
        logger.warning("vllm-offload: start-up steps failed (%s: %s); starting as plain vLLM "
                       "(set %s to fail instead)", type(exc).__name__, exc, STRICT_KEY,
                       exc_info=True)
        return None


def _leased(spec: Any, rank: int | None, segments: int,
            build: Callable[[], Any]) -> tuple[Any, EngineLease | None]:
    """Open our lease first, then let vLLM build on it; never keep a lease vLLM failed on."""
    lease = _open(spec, rank, segments)
    try:
        built = build()
    except BaseException:
        if lease is not None:
            lease.close()
        raise
    return built, lease


def _worker_rank(spec: Any) -> int:
    return 0 if spec.replicated_layout else int(spec.config.parallel.rank)


class HardenedCPUOffloadingSpec(CPUOffloadingSpec):  # type: ignore[misc]
    """vLLM's CPU spec (segmented region, unlinked after its barrier), hardened."""

    def create_worker(self, kv_caches: Any) -> Any:
        segments = getattr(_cpu_spec, "_REGION_SEGMENTS", VLLM_CPU_SEGMENTS)
        worker, lease = _leased(self, _worker_rank(self), segments,
                                lambda: super(HardenedCPUOffloadingSpec, self)
                                .create_worker(kv_caches))
        if lease is not None:
            self._vllm_offload_lease = lease
            if lease.creator:
                # vLLM's barrier has passed: every worker mapped the region. vLLM
                # unlinks here too when it created the file; we created it.
                lease.release_name()
        return worker


class HardenedTieringOffloadingSpec(TieringOffloadingSpec):  # type: ignore[misc]
    """vLLM's tiering spec (one file, never unlinked by vLLM), hardened.

    Its scheduler joins the region rank-less after every worker mapped it (the
    engine core builds the scheduler after the KV caches), so that join is
    where the name is released: from then on a SIGKILL leaks nothing.
    """

    def create_worker(self, kv_caches: Any) -> Any:
        worker, lease = _leased(self, _worker_rank(self), 1,
                                lambda: super(HardenedTieringOffloadingSpec, self)
                                .create_worker(kv_caches))
        if lease is not None:
            self._vllm_offload_lease = lease
        return worker

    def get_manager(self) -> Any:
        if self._manager:
            return super().get_manager()
        manager, lease = _leased(self, None, 1,
                                 lambda: super(HardenedTieringOffloadingSpec, self)
                                 .get_manager())
        if lease is not None:
            self._vllm_offload_scheduler_lease = lease
            if not lease.creator:  # workers made it and mapped it: nobody needs the name
                lease.release_name()
        return manager
