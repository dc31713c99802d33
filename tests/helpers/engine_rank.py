"""One process of an engine, opening its region through the engine hook (a rank stand-in).

Usage: engine_rank.py SHM_DIR ENGINE_ID NUM_BLOCKS RANK ROW_STRIDE CPU_PAGE_SIZE WORLD
       [SEGMENTS]
RANK is an integer or "none" (the scheduler). The engine token comes from
VLLM_OFFLOAD_ENGINE_TOKEN, as the plugin sets it for every process of one
engine. Prints one JSON line (the claim and the region's inode, or the error),
then reads stdin: "fill V" writes byte V into (the first page of) this rank's slot
of every row; "zero" answers whether those bytes are all zero; "release" unlinks
the names; "exit" cleans up; "leave" exits without cleaning up (the lease's
interpreter-exit hook must); "crash" exits at once.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    from vllm_offload_cli.core.base.errors import OffloadError
    from vllm_offload_cli.engine.region_hold import RegionRequest, open_region

    shm_dir, engine_id = sys.argv[1:3]
    num_blocks, rank_s, row_stride, page, world = sys.argv[3:8]
    segments = int(sys.argv[8]) if len(sys.argv) > 8 else 1
    rank = None if rank_s == "none" else int(rank_s)
    request = RegionRequest(engine_id=engine_id, num_blocks=int(num_blocks), rank=rank,
                            row_stride=int(row_stride), cpu_page_size=int(page),
                            world_size=int(world), num_segments=segments)
    token = os.environ.get("VLLM_OFFLOAD_ENGINE_TOKEN")
    try:
        lease = open_region(request, token=token, shm_dir=shm_dir, lock_timeout=60)
    except OffloadError as exc:
        print(json.dumps({"error": exc.message, "code": exc.code, "pid": exc.pid}), flush=True)
        sys.exit(3)
    region = lease.region
    assert region.fd is not None and region.mmap_obj is not None
    print(json.dumps({"pid": os.getpid(), "rank": rank, "creator": region.creator,
                      "action": lease.claimed.action,
                      "reclaimed_bytes": lease.claimed.reclaimed_bytes,
                      "ino": os.fstat(region.fd).st_ino}), flush=True)
    mm, stride = region.mmap_obj, int(row_stride)
    size = min(int(page), 4096)  # a marker per row: segmented test regions are sparse
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "fill" and rank is not None:
            value = bytes([int(words[1])]) * size
            for block in range(int(num_blocks)):
                start = block * stride + rank * int(page)
                mm[start:start + size] = value
            print("ok", flush=True)
        elif words[0] == "zero" and rank is not None:
            at = rank * int(page)
            zero = all(mm[b * stride + at:b * stride + at + size].count(0) == size
                       for b in range(int(num_blocks)))
            print(json.dumps({"zero": zero}), flush=True)
        elif words[0] == "release":
            print(json.dumps({"released": lease.release_name()}), flush=True)
        elif words[0] == "leave":
            sys.exit(0)
        elif words[0] == "crash":
            os._exit(9)
        elif words[0] == "exit":
            break
    lease.close()


if __name__ == "__main__":
    main()
