"""Test-only: the hardened specs on vLLM's CPU platform, for tests/test_real_engine.py.

vLLM 0.32 offloads only on CUDA-alike and XPU devices. This module lifts
exactly that refusal and nothing else; everything else the engine runs is
vLLM's own (connector, scheduler, manager, CPU spec, SharedOffloadRegion and
its barrier) and ours (the hardened spec under it). What it stands in for,
in vllm/v1/kv_offload/cpu/ of vLLM 0.32:

* spec.py `CPUOffloadingSpec._uses_shared_region`: `is_cuda_alike() and not
  is_rocm() or is_xpu()`, False on CPU (no shared region at all): True here;
* spec.py `CPUOffloadingSpec.get_worker` (the tiering spec inherits it): raises
  "only supported on CUDA-alike and XPU GPUs" off those platforms: not here;
* gpu_worker.py `CPUOffloadingWorker`, built by cpu/spec.py and tiering/spec.py
  (CUDA streams, events, a copy kernel; asserts CUDA/XPU tensors):
  `TorchCopyWorker` below, the same views
  of vLLM's region (`create_next_worker_view`), each copy done with torch at
  submit. One offloaded block per device block (`blocks_per_chunk` 1).

For the test it also checks what it moves: each stored block's bytes are
remembered (crc32), and each loaded block must come back into the device's
KV cache with exactly those bytes; it logs both through vLLM's logger.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload import base
from vllm.v1.kv_offload.cpu import spec as vllm_cpu_spec
from vllm.v1.kv_offload.tiering import spec as vllm_tiering_spec

from vllm_offload_cli.engine.vllm_spec import (
    HardenedCPUOffloadingSpec,
    HardenedTieringOffloadingSpec,
)

logger = logging.getLogger("vllm.vllm_offload_test")  # vLLM's handlers: the engine's log


class TorchCopyWorker(base.OffloadingWorker):  # type: ignore[misc]
    """CPUOffloadingWorker's job on the CPU platform: copy whole blocks, done at submit."""

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, num_cpu_chunks: int,
                 mmap_region: Any = None, **_: Any) -> None:
        assert blocks_per_chunk == 1 and mmap_region is not None
        self._mmap_region = mmap_region
        self._pairs = []
        for t in kv_caches.tensors:  # as vLLM's worker views them
            device = t.tensor.view(torch.int8).view((-1, t.page_size_bytes))
            self._pairs.append((device, mmap_region.create_next_worker_view(t.page_size_bytes)))
        self._done: list[Any] = []
        self._stored: dict[int, int] = {}  # offloaded block -> crc32 of the device bytes

    def _crc(self, block: int) -> int:
        crc = 0
        for device, _ in self._pairs:
            crc = zlib.crc32(device[block].numpy().tobytes(), crc)
        return crc

    def _copy(self, job_id: int, src: Any, dst: Any, store: bool) -> bool:
        s = torch.from_numpy(np.asarray(src.block_ids, dtype=np.int64))
        d = torch.from_numpy(np.asarray(dst.block_ids, dtype=np.int64))
        size = 0
        for device, host in self._pairs:
            if store:
                host[d] = device[s]
            else:
                device[d] = host[s]
            size += int(s.numel()) * device.shape[1]
        if store:
            self._stored.update((int(c), self._crc(int(g))) for g, c in zip(s, d, strict=True))
            logger.info("offload test worker: stored %d block(s)", len(s))
        else:
            same = all(self._stored.get(int(c)) == self._crc(int(g))
                       for c, g in zip(s, d, strict=True))
            logger.info("offload test worker: loaded %d block(s), bytes as stored: %s",
                        len(s), same)
        self._done.append(base.TransferResult(job_id=job_id, success=True,
                                              transfer_size=size, transfer_time=0.0))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=False)

    def get_finished(self) -> list[Any]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return

    def shutdown(self) -> None:  # as vLLM's worker: its views go, then its region
        self._pairs.clear()
        self._mmap_region.cleanup()


# what vLLM's create_worker builds, in both specs' modules
vllm_cpu_spec.CPUOffloadingWorker = TorchCopyWorker
vllm_tiering_spec.CPUOffloadingWorker = TorchCopyWorker


def _get_worker(spec: Any, kv_caches: Any) -> Any:
    """CPUOffloadingSpec.get_worker without its platform refusal."""
    if not spec._worker:
        spec._worker = spec.create_worker(kv_caches)
    return spec._worker


class CPUPlatformOffloadingSpec(HardenedCPUOffloadingSpec):
    """HardenedCPUOffloadingSpec with vLLM's platform gate lifted (see the module text)."""

    def _uses_shared_region(self) -> bool:
        return True

    def get_worker(self, kv_caches: Any) -> Any:
        return _get_worker(self, kv_caches)


class TieringPlatformOffloadingSpec(HardenedTieringOffloadingSpec):
    """HardenedTieringOffloadingSpec with the platform refusal it inherits lifted (the
    tiering spec already uses the shared region on every platform)."""

    def get_worker(self, kv_caches: Any) -> Any:
        return _get_worker(self, kv_caches)
