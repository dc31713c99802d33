"""The one place that imports torch, lazily and quietly.

torch prints a UserWarning at import when NumPy is absent; we use no NumPy,
so that warning is noise on an operator's terminal. The warning filter is
set up only for the first import: `warnings.catch_warnings` rewrites the
process-wide filter list (tens of microseconds, and not thread-safe), and the
copy threads call this on every job.
"""

from __future__ import annotations

import sys
import warnings
from types import ModuleType


def import_torch() -> ModuleType:
    loaded = sys.modules.get("torch")
    if loaded is not None and hasattr(loaded, "Tensor"):  # fully imported, not mid-import
        return loaded
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch
    return torch
