"""The engine start-up hook, importable without vLLM or torch (`vllm_spec` and `plugin`
are the modules only vLLM loads)."""

from vllm_offload_cli.engine.claim import ClaimResult, claim, startup_lock
from vllm_offload_cli.engine.identity import ENGINE_TOKEN_ENV, EngineIdCollisionError, engine_token
from vllm_offload_cli.engine.region_hold import RegionHold, RegionRequest, open_region

__all__ = ["ENGINE_TOKEN_ENV", "ClaimResult", "EngineIdCollisionError", "RegionHold",
           "RegionRequest", "claim", "engine_token", "open_region", "startup_lock"]
