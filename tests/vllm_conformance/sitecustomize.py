"""Substitute vllm_offload_cli's SharedOffloadRegion for vLLM's own class, in every process.

Only for the vLLM conformance job in .ci/run, which puts this folder first on
PYTHONPATH: Python imports `sitecustomize` at start-up, in the test runner and in
every process vLLM's tests spawn. When vLLM's region module has run, its
`SharedOffloadRegion` is replaced by ours, so each later
`from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion`
(vLLM's specs, workers, HiSparse, the tests themselves) gets our class.
Nothing else of vLLM is touched.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

TARGET = "vllm.v1.kv_offload.cpu.shared_offload_region"


class _Substituting(importlib.abc.Loader):
    """Runs vLLM's module as usual, then puts our class in its place."""

    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.real.exec_module(module)
        from vllm_offload_cli.core.region.shared_region import SharedOffloadRegion

        module.vllm_SharedOffloadRegion = module.SharedOffloadRegion  # type: ignore[attr-defined]
        module.SharedOffloadRegion = SharedOffloadRegion  # type: ignore[attr-defined]


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Substituting(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
