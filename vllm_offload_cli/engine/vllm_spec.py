"""vLLM's offloading specs with the start-up steps around `super()` (imports vLLM): vLLM
joins a file the hook made under the start-up lock. Known refusals stop the engine; anything
unexpected is logged and vLLM starts plain, unless `vllm_offload_strict` is set."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from vllm_offload_cli.core.base import errors
from vllm_offload_cli.engine import vllm_rules
from vllm_offload_cli.engine.identity import ENGINE_TOKEN_ENV, valid_token
from vllm_offload_cli.engine.plugin import join_vllm_logging
from vllm_offload_cli.engine.region_hold import RegionHold, RegionRequest, open_region
from vllm_offload_cli.engine.vllm_rules import RegionCall, VllmRules

logger = logging.getLogger(__name__)
join_vllm_logging()  # selected by spec_module_path alone, the plugin may not have run

STRICT_KEY = "vllm_offload_strict"
# Refusals are the hook's purpose: they stop the engine even outside strict mode.
_REFUSALS = (errors.RegionBusyError, errors.InsufficientSpaceError, errors.UnsafeRegionError)


def _slot(spec: Any, call: RegionCall) -> tuple[int | None, int | None]:
    """(the slot vLLM's code gives this process, the device index it came from)."""
    if call.rank_source is None:
        return None, None
    if spec.replicated_layout:
        return 0, None
    if call.rank_source == vllm_rules.DEVICE_MODULO:
        import torch  # present wherever vLLM runs; read as vLLM reads it

        device = int(torch.accelerator.current_device_index())
        return device % int(spec.config.parallel.world_size), device
    return int(spec.config.parallel.rank), None


def _open(spec: Any, rules: VllmRules, call: RegionCall) -> RegionHold | None:
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
    try:
        rank, device = _slot(spec, call)
        request = RegionRequest(
            engine_id=spec.config.engine_id, num_blocks=spec.num_chunks, rank=rank,
            row_stride=spec.kv_bytes_per_chunk, cpu_page_size=spec.cpu_page_size_per_worker,
            world_size=spec.config.parallel.world_size, num_segments=call.segments,
            replicated=bool(spec.replicated_layout),
            min_segment_bytes=rules.min_segment_bytes,
            rank_source=call.rank_source or vllm_rules.LOGICAL, device_index=device,
            vllm_layout_basis="vllm",
        )
        return open_region(request, token=token)
    except Exception as exc:
        if isinstance(exc, _REFUSALS) or spec.extra_config.get(STRICT_KEY):
            raise
        logger.warning("vllm-offload: start-up steps failed (%s: %s); starting as plain vLLM "
                       "(set %s to fail instead)", type(exc).__name__, exc, STRICT_KEY,
                       exc_info=True)
        return None


def _held(spec: Any, which: str, attr: str, build: Callable[[], Any]
          ) -> tuple[Any, RegionHold | None, RegionCall | None]:
    """Take our hold first (for the RegionCall `which`, kept as `spec.<attr>`), then let
    vLLM build on it; never keep a hold vLLM failed on. vLLM not understood: it builds alone."""
    rules = vllm_rules.rules_or_none(strict=bool(spec.extra_config.get(STRICT_KEY)))  # None: warned
    call: RegionCall | None = None if rules is None else getattr(rules, which)
    hold = None if rules is None or call is None else _open(spec, rules, call)
    try:
        built = build()
    except BaseException:
        if hold is not None:
            hold.close()
        raise
    if hold is None:
        return built, hold, call
    setattr(spec, attr, hold)
    shutdown: Any = getattr(built, "shutdown", None)

    def shutdown_then_close() -> None:  # vLLM's shutdown releases its region, then ours goes
        try:
            shutdown()
        finally:
            hold.close()

    if callable(shutdown):  # else (or slotted, frozen) closed at interpreter exit
        with contextlib.suppress(AttributeError):
            built.shutdown = shutdown_then_close
    return built, hold, call


class HardenedCPUOffloadingSpec(CPUOffloadingSpec):  # type: ignore[misc]
    """vLLM's CPU spec (the files and slots of the vLLM in use), hardened."""

    def create_worker(self, kv_caches: Any) -> Any:
        worker, hold, call = _held(self, "cpu_worker", "_vllm_offload_hold", lambda: super(
            HardenedCPUOffloadingSpec, self).create_worker(kv_caches))
        if hold is not None and hold.creator and call is not None and call.barrier:
            # past vLLM's barrier every worker mapped it; vLLM's creator unlinks here too
            hold.release_name()
        return worker


class HardenedTieringOffloadingSpec(TieringOffloadingSpec):  # type: ignore[misc]
    """vLLM's tiering spec (one file, never unlinked by vLLM), hardened: its scheduler
    joins after every worker mapped the region, so that is where the name is released."""

    def create_worker(self, kv_caches: Any) -> Any:
        return _held(self, "tiering_worker", "_vllm_offload_hold", lambda: super(
            HardenedTieringOffloadingSpec, self).create_worker(kv_caches))[0]

    def get_manager(self) -> Any:
        if self._manager:
            return super().get_manager()
        manager, hold, _ = _held(self, "tiering_scheduler", "_vllm_offload_scheduler_hold",
                                 lambda: super(HardenedTieringOffloadingSpec, self).get_manager())
        if hold is not None and not hold.creator:  # workers made and mapped it: name unneeded
            hold.release_name()
        return manager
