"""Delivers a real SIGINT to this process while the CLI's modules load.

On PYTHONPATH of one test's subprocess only: the first import of `click`
(which `vllm_offload_cli.cli.app` needs) sends SIGINT to the process itself,
so the interrupt lands in the middle of module loading, as a user's Ctrl-C can.
"""

import importlib.abc
import os
import signal
import sys


class _InterruptOnClick(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name == "click":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None


sys.meta_path.insert(0, _InterruptOnClick())
