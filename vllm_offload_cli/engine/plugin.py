"""The `vllm.general_plugins` entry point: make the hardened specs known to vLLM. vLLM calls
it in every process and an exception would abort the engine, so it is idempotent, imports
vLLM only inside the call and never raises (it logs) unless `VLLM_OFFLOAD_STRICT=1`."""

from __future__ import annotations

import contextlib
import logging
import os

from vllm_offload_cli.engine.identity import ENGINE_TOKEN_ENV, engine_token
from vllm_offload_cli.engine.vllm_rules import rules_or_none

logger = logging.getLogger(__name__)

STRICT_ENV = "VLLM_OFFLOAD_STRICT"
SPEC_MODULE = "vllm_offload_cli.engine.vllm_spec"
SPEC_NAMES = ("HardenedCPUOffloadingSpec", "HardenedTieringOffloadingSpec")
# Our variables an engine may carry (the CLI's too); any other `VLLM_OFFLOAD_*` is added.
ENV_PREFIX = "VLLM_OFFLOAD_"
ENV_NAMES = (ENGINE_TOKEN_ENV, STRICT_ENV, "VLLM_OFFLOAD_SHM_DIR", "VLLM_OFFLOAD_SYSLOG_SOCKET")
PACKAGE_LOGGER = "vllm_offload_cli"
VLLM_LOGGER = "vllm.vllm_offload"  # under vLLM's "vllm" logger: its handlers, its level


def register() -> None:
    """Register both spec names with vLLM's OffloadingSpecFactory (once per process)."""
    strict = os.environ.get(STRICT_ENV) == "1"
    try:
        engine_token()
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        join_vllm_logging()
        register_environment()

        rules = rules_or_none(strict=strict)
        if rules is None:
            return  # warned: nothing registered, the engine runs as plain vLLM
        logger.debug("vllm-offload: %s", rules)
        for name in SPEC_NAMES:
            with contextlib.suppress(ValueError):  # registered already: a second call
                OffloadingSpecFactory.register_spec(name, SPEC_MODULE, name)
    except Exception:
        if strict:
            raise
        logger.warning("vllm-offload: could not register the hardened offloading specs; "
                       "select them with spec_module_path=%s instead", SPEC_MODULE,
                       exc_info=True)


def register_environment() -> None:
    """Register our names in vLLM's `envs.environment_variables` (vLLM checks every `VLLM_*`
    name); getters return None: its values feed torch.compile's cache key."""
    with contextlib.suppress(ImportError):
        from vllm import envs

        table = getattr(envs, "environment_variables", None)
        if isinstance(table, dict):
            for name in (*ENV_NAMES, *(n for n in os.environ if n.startswith(ENV_PREFIX))):
                table.setdefault(name, lambda: None)  # nothing to act on, nothing to hash


class _ToVllm(logging.Handler):
    """Hands our records to vLLM's logger tree, so vLLM's handlers write them."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger(VLLM_LOGGER)
        if target.isEnabledFor(record.levelno):  # vLLM's level, read at each record
            target.handle(record)


def join_vllm_logging() -> None:
    """Our package's records appear in the engine's log, as vLLM's own do (nothing
    else configures our loggers there); not propagated, so no record shows twice."""
    package = logging.getLogger(PACKAGE_LOGGER)
    if any(isinstance(h, _ToVllm) for h in package.handlers):
        return
    package.addHandler(_ToVllm())
    package.setLevel(logging.DEBUG)  # the level that counts is vLLM's, in _ToVllm
    package.propagate = False
