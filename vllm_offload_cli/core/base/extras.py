"""Optional dependencies (extras) and the one refusal: an entry point that needs one
calls `require()` before any work, so a missing module is a MissingExtraError naming
the `pip install` line, never an ImportError from deep inside a copy."""

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
    """Raise MissingExtraError unless every module of `extra` can be imported; finds
    them without importing, so the caller decides when torch loads."""
    missing = [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]
    if missing:
        raise missing_extra(extra, missing, what=what)
