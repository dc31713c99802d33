"""Optional dependencies by job: which extra brings which module, and the one refusal.

The base install (click, rich, psutil, prometheus_client) runs every node-local
command and the engine hook's steps. torch and numpy come with the `copy` extra:
the copy workers, tensor views and `vllm-offload benchmark` need them, and inside
a vLLM environment they are there anyway. An entry point that needs an extra
calls `require()` before any work, so a missing one is a MissingExtraError (one
line and exit 2 in the CLI) that names the `pip install` line, never an
ImportError from deep inside a copy.
"""

from __future__ import annotations

import importlib.util

from vllm_offload_cli.core.base.errors import MissingExtraError

DISTRIBUTION = "vllm-offload"
COPY = "copy"
# the importable modules each extra installs
EXTRAS: dict[str, tuple[str, ...]] = {COPY: ("torch", "numpy")}


def install_line(extra: str) -> str:
    """The shell command that installs `extra` (quoted: `[` is a glob character)."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def missing_extra(extra: str, missing: list[str], *, what: str) -> MissingExtraError:
    """The error for `what` needing `missing` modules of `extra`."""
    names = " and ".join(missing)
    verb, pronoun = ("is", "it") if len(missing) == 1 else ("are", "them")
    line = install_line(extra)
    return MissingExtraError(f"{what} needs {names}, which {verb} not installed; install "
                             f"{pronoun} with: {line}", extra=extra, install=line)


def require(extra: str, *, what: str) -> None:
    """Raise MissingExtraError unless every module of `extra` can be imported.

    Finds the modules without importing them: the caller decides when torch
    loads (the benchmark sets OpenMP's wait policy before it does), and a
    check costs microseconds, not torch's second.
    """
    missing = [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]
    if missing:
        raise missing_extra(extra, missing, what=what)
