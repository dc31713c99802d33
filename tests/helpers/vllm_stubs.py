"""Load vLLM's offloading modules from its released wheel, without its GPU stack.

vLLM's top-level import pulls the whole serving engine (model executor,
CUDA kernels, transformers). The offloading specs need little of it, so the
package shells `vllm` and `vllm.distributed` are made without running their
`__init__`, and only what cannot exist on a CPU-only host is replaced:

* `vllm.platforms` (device detection; here a CUDA platform stand-in),
* `vllm._custom_ops`, `vllm.triton_utils`, `vllm.v1.kv_offload.cpu.gpu_worker`,
  `vllm.v1.kv_offload.cpu.host_register` (CUDA kernels, cudaHostRegister),
* `vllm.distributed.parallel_state` (torch.distributed groups: the barrier is
  a file barrier between the test's processes),
* `vllm.distributed.device_communicators.shm_broadcast` (its free-space check
  needs zmq; only vLLM's creator path calls it, which the hook never takes),
* `vllm.distributed.kv_transfer...offloading.metrics` (pulls VllmConfig and
  the whole connector stack; only a stats container is used).

Everything else (the spec factory, OffloadingConfig, the CPU and tiering
specs, vLLM's SharedOffloadRegion, the CPU and tiering managers, vLLM's
logger and envs) is vLLM's own code from the wheel.

tests/helpers/vllm_engine.py takes the other road, `cuda_stand_in()`: the real
`vllm` package and `vllm.config` (with the libraries .ci/run installs), only
the platform and the CUDA copy worker replaced.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

SRC_ENV = "VLLM_OFFLOAD_VLLM_SRC"  # a directory holding the unpacked wheel's `vllm/`


def vllm_root() -> Path | None:
    """Where vLLM's sources are: $VLLM_OFFLOAD_VLLM_SRC, or an installed vllm."""
    env = os.environ.get(SRC_ENV)
    if env:
        return Path(env) if (Path(env) / "vllm" / "v1" / "kv_offload").is_dir() else None
    spec = importlib.util.find_spec("vllm")  # finds, does not import
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent.parent


def _shell(name: str, root: Path) -> None:
    module = types.ModuleType(name)
    module.__path__ = [str(root / name.replace(".", "/"))]
    sys.modules[name] = module


def _stub(name: str, **attrs: Any) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


class _CudaLikePlatform:
    device_type = "cuda"

    def is_cuda_alike(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_pin_memory_available(self) -> bool:
        return False


class FakeGpuWorker:
    """Stands in for CPUOffloadingWorker (CUDA copies); keeps what vLLM handed it."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def shutdown(self) -> None:
        """As vLLM's worker ends: its copies stop, then it releases the region it owns."""
        region = self.kwargs.get("mmap_region")
        if region is not None:
            region.cleanup()


class FileBarrier:
    """A barrier between `world` processes: each arrival is a file in `directory`."""

    def __init__(self, directory: str, rank: int, world: int) -> None:
        self.directory, self.rank, self.world, self.generation = directory, rank, world, 0

    def barrier(self) -> None:
        self.generation += 1
        Path(self.directory, f"{self.generation}.{self.rank}").touch()
        deadline = time.monotonic() + 60
        while len(list(Path(self.directory).glob(f"{self.generation}.*"))) < self.world:
            if time.monotonic() > deadline:
                raise TimeoutError("file barrier")
            time.sleep(0.005)


def device_stand_in(index: int) -> None:
    """What `torch.accelerator.current_device_index()` says on a GPU host: this process's
    device (vLLM 0.31 folds it into the slot; a CPU-only torch raises instead)."""
    import torch

    torch.accelerator.current_device_index = lambda *args: index


def mapped_files(start: int, length: int) -> list[dict[str, Any]]:
    """The files the kernel maps in [start, start + length), in address order.

    Public behaviour, whoever made the mapping: each entry is one file's piece
    (adjacent pieces of one file merged): its name, inode, and offset from `start`.
    """
    pieces: list[dict[str, Any]] = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if hi <= start or lo >= start + length or len(fields) < 6:
                continue
            name = os.path.basename(fields[5].strip().removesuffix(" (deleted)"))
            ino, file_offset = int(fields[4]), int(fields[2], 16)
            last = pieces[-1] if pieces else None
            if (last is not None and last["ino"] == ino
                    and last["file_offset"] + last["length"] == file_offset):
                last["length"] += hi - lo
                continue
            pieces.append({"name": name, "ino": ino, "offset": lo - start,
                           "file_offset": file_offset, "length": hi - lo})
    return pieces


def mappings_of(ino: int) -> list[tuple[int, int]]:
    """(start, end) of every mapping of inode `ino` in this process."""
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) >= 5 and int(fields[4]) == ino:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                found.append((lo, hi))
    return found


def load(root: Path, barrier: FileBarrier | None = None) -> None:
    sys.path.insert(0, str(root))
    _shell("vllm", root)
    _shell("vllm.distributed", root)
    group = barrier or FileBarrier("/nonexistent", 0, 1)

    def get_group() -> FileBarrier:
        return group

    _stub("vllm.platforms", current_platform=_CudaLikePlatform())
    _stub("vllm.distributed.parallel_state", get_world_group=get_group,
          get_inner_dp_world_group=get_group)
    _stub("vllm.distributed.device_communicators.shm_broadcast",
          check_shm_free_space=lambda *a, **k: None)
    _stub("vllm._custom_ops")
    _stub("vllm.triton_utils", HAS_TRITON=False, triton=None, tl=None)
    _stub("vllm.v1.kv_offload.cpu.host_register", host_register=lambda *a, **k: None,
          host_unregister=lambda *a, **k: None)
    _stub("vllm.v1.kv_offload.cpu.gpu_worker", CPUOffloadingWorker=FakeGpuWorker)

    class Stats:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.data: dict[str, Any] = {}

    _stub("vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics",
          OffloadingConnectorStats=Stats)


def cuda_stand_in() -> None:
    """For the real-VllmConfig path: only the device and the CUDA copy worker stand in.

    vLLM's own `vllm` package is imported (no shells). The platform becomes a
    subclass of vLLM's own `Platform` with the CUDA enum, as vLLM only uses the
    shared region on CUDA-alike devices; CPUOffloadingWorker (CUDA streams and
    tensors) becomes `FakeGpuWorker` in the two spec modules that build it.
    """
    import vllm.platforms
    from vllm.platforms.interface import Platform, PlatformEnum

    class CudaStandIn(Platform):  # type: ignore[misc]
        _enum = PlatformEnum.CUDA
        device_name = "cuda"
        device_type = "cuda"
        dispatch_key = "CUDA"

    vllm.platforms._current_platform = CudaStandIn()
    from vllm.v1.kv_offload.cpu import spec as cpu_spec
    from vllm.v1.kv_offload.tiering import spec as tiering_spec

    cpu_spec.CPUOffloadingWorker = FakeGpuWorker
    tiering_spec.CPUOffloadingWorker = FakeGpuWorker


def tiny_model_class(torch: Any) -> type:
    """A model class for vLLM's registry (never run): ModelConfig inspects, not loads."""

    class VllmOffloadTinyForCausalLM(torch.nn.Module):  # type: ignore[misc]
        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            super().__init__()

        def embed_input_ids(self, input_ids: Any) -> Any:
            return input_ids

        def forward(self, input_ids: Any, positions: Any, **kwargs: Any) -> Any:
            return input_ids

        def compute_logits(self, hidden_states: Any) -> Any:
            return hidden_states

    return VllmOffloadTinyForCausalLM


def address_of(mm: Any) -> int:
    """Where an mmap object is mapped (to find it in /proc/self/maps)."""
    buf = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(buf)
    finally:
        del buf
