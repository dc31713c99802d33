"""One engine worker (one rank) storing KV blocks into a shared region, in its own process.

Usage: copy_rank.py SHM_DIR ENGINE_ID NUM_BLOCKS ROW_STRIDE CPU_PAGE_SIZE WORLD RANK BLOCKS
BLOCKS is a comma-separated list of region blocks to fill. The worker has two
KV tensors (pages of 1000 and CPU_PAGE_SIZE-1000 bytes) whose bytes are
`fill_byte(rank, tensor, block)` everywhere; device block i goes to region
block BLOCKS[i]. Prints one JSON line with the job's result, then exits after
cleanup (the creator keeps the file: the region is persistent).
"""

from __future__ import annotations

import json
import sys


def fill_byte(rank: int, tensor: int, block: int) -> int:
    return (rank * 67 + tensor * 29 + block * 13 + 1) % 251 + 1  # never 0: 0 means untouched


def main() -> None:
    import torch

    from vllm_offload_cli.core.region import SharedOffloadRegion
    from vllm_offload_cli.core.transfer import CopyWorker

    shm_dir, engine_id = sys.argv[1:3]
    num_blocks, row_stride, page, world, rank = (int(v) for v in sys.argv[3:8])
    blocks = [int(b) for b in sys.argv[8].split(",")]
    region = SharedOffloadRegion(engine_id, num_blocks, rank, row_stride, page,
                                 shm_dir=shm_dir, world_size=world, persistent=True)
    sizes = (1000, page - 1000)
    tensors = [torch.empty((len(blocks), size), dtype=torch.uint8) for size in sizes]
    for t_index, tensor in enumerate(tensors):
        for i, block in enumerate(blocks):
            tensor[i] = fill_byte(rank, t_index, block)
    worker = CopyWorker(region, tensors)
    worker.submit_store(rank, list(range(len(blocks))), blocks)
    worker.wait([rank])
    (result,) = worker.get_finished()
    worker.shutdown()
    region.cleanup()
    print(json.dumps({"rank": rank, "success": result.success, "bytes": result.bytes,
                      "error": result.error}), flush=True)


if __name__ == "__main__":
    main()
