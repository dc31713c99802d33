"""The one place that imports torch, lazily, and without the warning it prints when
NumPy is absent (tensor views need none); without torch, a MissingExtraError."""

from __future__ import annotations

import sys
import warnings
from types import ModuleType

from vllm_offload_cli.core.base.extras import COPY, missing_extra


def import_torch() -> ModuleType:
    # only the first import changes the process-wide warning filters (the copy threads
    # call this on every job)
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
