"""The one place that imports torch, lazily and quietly.

torch prints a UserWarning at import when NumPy is absent; we use no NumPy,
so that warning is noise on an operator's terminal.
"""

from __future__ import annotations

import warnings
from types import ModuleType


def import_torch() -> ModuleType:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch
    return torch
