"""The one place that imports torch, lazily and quietly.

torch prints a UserWarning at import when NumPy is absent (a torch installed
without this package's `copy` extra); tensor views need no NumPy, so that
warning is noise on an operator's terminal. The warning filter is
set up only for the first import: `warnings.catch_warnings` rewrites the
process-wide filter list (tens of microseconds, and not thread-safe), and the
copy threads call this on every job.

Without torch (the base install) this raises MissingExtraError with the line
that installs the `copy` extra: a library caller who builds a tensor view gets
the project's error, not a bare ImportError.
"""

from __future__ import annotations

import sys
import warnings
from types import ModuleType

from vllm_offload_cli.core.base.extras import COPY, missing_extra


def import_torch() -> ModuleType:
    loaded = sys.modules.get("torch")
    if loaded is not None and hasattr(loaded, "Tensor"):  # fully imported, not mid-import
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
