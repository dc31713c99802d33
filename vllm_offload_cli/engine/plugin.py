"""The `vllm.general_plugins` entry point: make the hardened specs known to vLLM.

vLLM calls it with no arguments in every process (API server, engine core,
each worker, short-lived inspection subprocesses) before devices exist; an
exception here would abort the engine's start-up. So it is idempotent, never
raises (it logs) unless `VLLM_OFFLOAD_STRICT=1`, and imports vLLM only here,
inside the call. It also gives the engine its identity token in the first
process, so every worker spawned later inherits it.

Inside vLLM the hook is a good citizen: vLLM validates every `VLLM_*`
variable (a warning at each start; `--fail-on-environ-validation` refuses the
engine), so our names are registered as known before vLLM checks them; and
the hook's records go where vLLM's own go, in vLLM's format, at vLLM's level.

A vLLM whose region code is not understood (`vllm_rules`) gets nothing
registered and one warning; the engine then runs as plain vLLM (specs named by
`spec_module_path` stand aside the same way). Strict mode refuses instead.
"""

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
# Every variable of ours an engine's environment may carry (the CLI's, set for a
# sidecar in the same pod, included); any other `VLLM_OFFLOAD_*` found is registered too.
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


def _no_value() -> None:
    """What vLLM reads for our names: nothing to act on, nothing to hash."""
    return None


def register_environment() -> None:
    """Make our variables known to vLLM's `envs.environment_variables` table.

    vLLM checks every `VLLM_*` name in the environment against that table
    (`Platform.validate_environ`, after plugins are loaded). Its values also
    feed torch.compile's cache key (`envs.compile_factors`): the engine token
    is random per engine, so each getter returns None and the key stays the
    same across restarts. Names already known are left alone; a vLLM without
    that table validates nothing to register with.
    """
    try:
        from vllm import envs
    except ImportError:
        return
    table = getattr(envs, "environment_variables", None)
    if not isinstance(table, dict):
        return
    for name in (*ENV_NAMES, *(n for n in os.environ if n.startswith(ENV_PREFIX))):
        table.setdefault(name, _no_value)


class _ToVllm(logging.Handler):
    """Hands our records to vLLM's logger tree, so vLLM's handlers write them."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger(VLLM_LOGGER)
        if target.isEnabledFor(record.levelno):  # vLLM's level, read at each record
            target.handle(record)


def join_vllm_logging() -> None:
    """Our package's records appear in the engine's log, as vLLM's own do.

    In vLLM's processes nothing configures our loggers: without this, INFO is
    dropped and warnings reach stderr bare. vLLM's "vllm" logger does not
    propagate to the root, so neither do ours once joined (no record twice).
    """
    package = logging.getLogger(PACKAGE_LOGGER)
    if any(isinstance(h, _ToVllm) for h in package.handlers):
        return
    package.addHandler(_ToVllm())
    package.setLevel(logging.DEBUG)  # the level that counts is vLLM's, in _ToVllm
    package.propagate = False
