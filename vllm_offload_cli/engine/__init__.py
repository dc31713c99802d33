"""The engine startup hook: identity, reclaim, pre-flight and liveness for vLLM's region.

Plain core calls, importable without vLLM and without torch; the vLLM
adapter (`vllm_spec`) and the `vllm.general_plugins` entry point (`plugin`)
are separate modules that only vLLM loads.
"""

from vllm_offload_cli.engine.claim import ClaimResult, claim, startup_lock
from vllm_offload_cli.engine.identity import (
    ENGINE_TOKEN_ENV,
    EngineIdCollisionError,
    engine_token,
)
from vllm_offload_cli.engine.region_hold import RegionHold, RegionRequest, open_region

__all__ = ["ENGINE_TOKEN_ENV", "ClaimResult", "EngineIdCollisionError", "RegionHold",
           "RegionRequest", "claim", "engine_token", "open_region", "startup_lock"]
