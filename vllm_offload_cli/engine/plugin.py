"""The `vllm.general_plugins` entry point: make the hardened specs known to vLLM.

vLLM calls it with no arguments in every process (API server, engine core,
each worker, short-lived inspection subprocesses) before devices exist; an
exception here would abort the engine's start-up. So it is idempotent, never
raises (it logs) unless `VLLM_OFFLOAD_STRICT=1`, and imports vLLM only here,
inside the call. It also gives the engine its identity token in the first
process, so every worker spawned later inherits it.

A vLLM whose region code is not understood (`vllm_rules`) gets nothing
registered and one warning; the engine then runs as plain vLLM (specs named by
`spec_module_path` stand aside the same way). Strict mode refuses instead.
"""

from __future__ import annotations

import contextlib
import logging
import os

from vllm_offload_cli.engine.identity import engine_token
from vllm_offload_cli.engine.vllm_rules import rules_or_none

logger = logging.getLogger(__name__)

STRICT_ENV = "VLLM_OFFLOAD_STRICT"
SPEC_MODULE = "vllm_offload_cli.engine.vllm_spec"
SPEC_NAMES = ("HardenedCPUOffloadingSpec", "HardenedTieringOffloadingSpec")


def register() -> None:
    """Register both spec names with vLLM's OffloadingSpecFactory (once per process)."""
    strict = os.environ.get(STRICT_ENV) == "1"
    try:
        engine_token()
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        rules = rules_or_none(strict=strict)
        if rules is None:
            return  # warned: nothing registered, the engine runs as plain vLLM
        logger.debug("vllm-offload: %s", rules.summary())
        for name in SPEC_NAMES:
            with contextlib.suppress(ValueError):  # registered already: a second call
                OffloadingSpecFactory.register_spec(name, SPEC_MODULE, name)
    except Exception:
        if strict:
            raise
        logger.warning("vllm-offload: could not register the hardened offloading specs; "
                       "select them with spec_module_path=%s instead", SPEC_MODULE,
                       exc_info=True)
