"""A region user in its own process, for tests of liveness, races and crashes.

Usage: holder.py MODE SHM_DIR ENGINE_ID NUM_BLOCKS RANK ROW_STRIDE CPU_PAGE_SIZE [WORLD
       [DEVICE_INDEX [RANK_SOURCE]]]
MODE:
  region    open through vllm_offload_cli's SharedOffloadRegion (flock + manifest)
  vllm      open like vLLM 0.33 does: O_CREAT|O_EXCL or join, mmap, no flock
  vllm-unlink  like vllm, then unlink the name while keeping the mapping
  fd-only   open the existing file and keep only the descriptor (no map, no lock)
  map-only  map the existing file read-only, close the descriptor (no fd, no lock)
  probe     what inspect does while it measures residency: a read-only descriptor and
            a read-only mapping of the existing file, both kept
  flock-only  take LOCK_SH on the existing file, then park the descriptor in a
            unix socket's queue (SCM_RIGHTS, never received) and close it: the
            lock lives on with no descriptor or mapping in /proc/<pid>
RANK, WORLD and DEVICE_INDEX are integers or "none"; DEVICE_INDEX and
RANK_SOURCE are recorded in the manifest (mode region only). Prints one JSON
line when ready, then reads stdin: "write B V" fills this rank's slot of row B
with byte V; "fill V" fills this rank's slot of every row (what vLLM's
pre-fault of its own slot allocates); "exit" cleans up and exits 0; "crash"
exits at once without cleanup.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import socket
import sys
import time


def _vllm_open(path: str, size: int) -> tuple[int, bool]:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileExistsError:
        fd = os.open(path, os.O_RDWR)
        deadline = time.monotonic() + 30
        while os.fstat(fd).st_size < size:
            if time.monotonic() > deadline:
                raise TimeoutError(path) from None
            time.sleep(0.005)
        return fd, False
    os.ftruncate(fd, size)
    return fd, True


def _opt_int(text: str) -> int | None:
    return None if text == "none" else int(text)


def main() -> None:
    mode, shm_dir, engine_id = sys.argv[1:4]
    num_blocks, rank_s, row_stride, page = sys.argv[4:8]
    world = _opt_int(sys.argv[8]) if len(sys.argv) > 8 else None
    device_index = _opt_int(sys.argv[9]) if len(sys.argv) > 9 else None
    rank_source = sys.argv[10] if len(sys.argv) > 10 else None
    rank = None if rank_s == "none" else int(rank_s)
    num_blocks_i, row_stride_i, page_i = int(num_blocks), int(row_stride), int(page)
    path = os.path.join(shm_dir, f"vllm_offload_{engine_id}.mmap")
    size = num_blocks_i * row_stride_i
    region = None
    mm: mmap.mmap | None = None
    fd = -1
    creator = False
    try:
        if mode == "region":
            from vllm_offload_cli.core.region import SharedOffloadRegion

            region = SharedOffloadRegion(engine_id, num_blocks_i, rank, row_stride_i, page_i,
                                         shm_dir=shm_dir, world_size=world,
                                         device_index=device_index, rank_source=rank_source)
            mm, creator = region.mmap_obj, region.creator
            ino = os.fstat(region.fd).st_ino  # type: ignore[arg-type]
        elif mode in ("vllm", "vllm-unlink"):
            fd, creator = _vllm_open(path, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            ino = os.fstat(fd).st_ino
            if mode == "vllm-unlink":
                os.unlink(path)
        elif mode == "fd-only":
            fd = os.open(path, os.O_RDONLY)
            ino = os.fstat(fd).st_ino
        elif mode == "probe":
            from vllm_offload_cli.core.region import fsguard
            from vllm_offload_cli.core.system import libc

            fd = fsguard.open_existing(path, os.O_RDONLY)
            libc.map_readonly(fd, os.fstat(fd).st_size)
            ino = os.fstat(fd).st_ino
        elif mode == "map-only":
            # Python's mmap keeps a dup of the descriptor; map through libc to hold none
            from vllm_offload_cli.core.system import libc

            fd = os.open(path, os.O_RDONLY)
            libc.map_readonly(fd, os.fstat(fd).st_size)
            ino = os.fstat(fd).st_ino
            os.close(fd)
            fd = -1
        elif mode == "flock-only":
            fd = os.open(path, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_SH)
            ino = os.fstat(fd).st_ino
            parked = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            socket.send_fds(parked[0], [b"x"], [fd])  # kept in flight: the open file lives
            os.close(fd)
            fd = -1
        else:
            raise SystemExit(f"unknown mode {mode}")
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}",
                          "code": getattr(exc, "code", None)}), flush=True)
        sys.exit(3)
    print(json.dumps({"pid": os.getpid(), "creator": creator, "ino": ino}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "write" and mm is not None and rank is not None:
            block, value = int(words[1]), int(words[2])
            start = block * row_stride_i + rank * page_i
            mm[start:start + page_i] = bytes([value]) * page_i
            print("ok", flush=True)
        elif words[0] == "fill" and mm is not None and rank is not None:
            value = bytes([int(words[1])]) * page_i
            for block in range(num_blocks_i):
                start = block * row_stride_i + rank * page_i
                mm[start:start + page_i] = value
            print("ok", flush=True)
        elif words[0] == "crash":
            os._exit(9)
        elif words[0] == "exit":
            break
    if region is not None:
        region.cleanup()
    else:
        if mm is not None:
            mm.close()
        if fd >= 0:
            os.close(fd)
        if creator and mode == "vllm" and os.path.exists(path):
            os.unlink(path)


if __name__ == "__main__":
    main()
