"""Extras: an entry point calls `require()` before any work, so a missing module is a
MissingExtraError naming the `pip install` line, never an ImportError from deep inside a
copy; torch is imported in one place, lazily (`import_torch`)."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from types import ModuleType

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
                             f"{pronoun} with: {line}", install=line)


def require(extra: str, *, what: str) -> None:
    """Raise MissingExtraError unless every module of `extra` can be imported; finds
    them without importing, so the caller decides when torch loads."""
    if missing := [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]:
        raise missing_extra(extra, missing, what=what)


def import_torch() -> ModuleType:
    """torch, without the warning it prints when NumPy is absent (tensor views need none)."""
    # only the first import changes the process-wide warning filters (the copy threads
    # call this on every job): torch fully imported, not mid-import, is returned as is
    if (loaded := sys.modules.get("torch")) is not None and hasattr(loaded, "Tensor"):
        return loaded
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        try:
            import torch
        except ModuleNotFoundError as exc:
            if exc.name != "torch":
                raise  # torch is there but broken: a bug to see in full
            raise missing_extra(COPY, ["torch"], what="a tensor view or copy") from None
    return torch
