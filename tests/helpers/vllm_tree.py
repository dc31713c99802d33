"""A stand-in vLLM source tree: the few modules vllm_rules reads and the hook imports.

Our own minimal code, not vLLM's: a region class whose constructor takes the
parameters given, a CPU and a tiering spec that build it as told, and a spec
factory that records what was registered. Each call records itself in
`vllm.v1.kv_offload.calls` so a test can tell what ran: plain vLLM's
`create_worker`, and every region built.
"""

from __future__ import annotations

from pathlib import Path

REGION = '''
_MIN_SEGMENT_BYTES = {min_segment_bytes}


class SharedOffloadRegion:
    def __init__(self, engine_id, num_chunks, rank, kv_bytes_per_chunk, cpu_page_size,
                 {params}):
        from vllm.v1.kv_offload import calls

        calls.append(("region", engine_id, rank))
'''

CPU_SPEC = '''
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

_REGION_SEGMENTS = 32


class CPUOffloadingSpec:
    def __init__(self, config):
        self.config = config
        self.extra_config = config.extra_config
        self.num_chunks = 4
        self.kv_bytes_per_chunk = 4096
        self.cpu_page_size_per_worker = 2048
        self.replicated_layout = False
        self._manager = None

    def _uses_shared_region(self):
        return True

    def get_manager(self):
        return None

    def create_worker(self, kv_caches):
        from vllm.v1.kv_offload import calls

        calls.append(("plain create_worker",))
        {rank_line}
        return SharedOffloadRegion(
            engine_id=self.config.engine_id, num_chunks=self.num_chunks, rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker, {call})
'''

TIERING_SPEC = '''
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class TieringOffloadingSpec(CPUOffloadingSpec):
    def create_worker(self, kv_caches):
        rank = self.config.parallel.rank
        return SharedOffloadRegion(engine_id="t", num_chunks=1, rank=rank,
                                   kv_bytes_per_chunk=4096, cpu_page_size=4096)

    def get_manager(self):
        return SharedOffloadRegion(engine_id="t", num_chunks=1, rank=None,
                                   kv_bytes_per_chunk=4096, cpu_page_size=4096)
'''

FACTORY = '''
from vllm.v1.kv_offload import calls


class OffloadingSpecFactory:
    @classmethod
    def register_spec(cls, name, module_path, class_name):
        calls.append(("registered", name))
'''

LOGICAL = "rank = self.config.parallel.rank"
DEVICE_MODULO = ("import torch; rank = torch.accelerator.current_device_index() % "
                 "self.config.parallel.world_size")


def write(root: Path, *, params: str = "barrier=None", call: str = "barrier=print",
          rank_line: str = LOGICAL, min_segment_bytes: str = "1 << 30",
          version: str = "0.99.0") -> Path:
    """A tree under `root` (returned, for sys.path); `params` and `call` are source text."""
    package = root / "vllm"
    files = {
        "__init__.py": "",
        "_version.py": f"__version__ = version = {version!r}\n",
        "v1/__init__.py": "",
        "v1/kv_offload/__init__.py": "calls = []\n",
        "v1/kv_offload/factory.py": FACTORY,
        "v1/kv_offload/cpu/__init__.py": "",
        "v1/kv_offload/cpu/shared_offload_region.py": REGION.format(
            params=params, min_segment_bytes=min_segment_bytes),
        "v1/kv_offload/cpu/spec.py": CPU_SPEC.format(rank_line=rank_line, call=call),
        "v1/kv_offload/tiering/__init__.py": "",
        "v1/kv_offload/tiering/spec.py": TIERING_SPEC,
    }
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root
