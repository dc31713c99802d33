"""One vLLM process (a worker, or the engine core's scheduler) running vLLM's own spec code.

Usage: vllm_process.py ROLE SPEC_NAME ENGINE_ID RANK WORLD CPU_BYTES PAGE BARRIER_DIR
ROLE is "worker" (spec.get_worker) or "scheduler" (spec.get_manager). The
spec comes from vLLM's real OffloadingSpecFactory after our plugin
registered it, built from vLLM's real OffloadingConfig. Prints one JSON line
(what the kernel maps where vLLM's region lies and where the hook's does: files,
inodes, offsets), then reads stdin: "write V" fills this worker's slot through
vLLM's own tensor view; "check V" reads the hook's slot through the hook's
mapping of the files; "exit" ends the process. DEVICE_INDEX (default: RANK) is
the device this process's torch reports; SEGMENT_MIN_BYTES scales vLLM's 1 GiB
rule down (vLLM's constant only: the hook must follow it).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import vllm_stubs


def main() -> None:
    role, spec_name, engine_id = sys.argv[1:4]
    rank, world, cpu_bytes, page = (int(x) for x in sys.argv[4:8])
    root = vllm_stubs.vllm_root()
    assert root is not None, "vLLM sources not found"
    vllm_stubs.load(root, vllm_stubs.FileBarrier(sys.argv[8], rank, world))
    devices = os.environ.get("DEVICES")  # e.g. "1,0": rank r runs on device DEVICES[r]
    vllm_stubs.device_stand_in(int(devices.split(",")[rank]) if devices else rank)
    if os.environ.get("SEGMENT_MIN_BYTES"):  # vLLM's 1 GiB rule, scaled down for tests
        from vllm.v1.kv_offload.cpu import shared_offload_region as vllm_region

        vllm_region._MIN_SEGMENT_BYTES = int(os.environ["SEGMENT_MIN_BYTES"])  # vLLM's only

    from vllm.v1.kv_offload import config as c
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from vllm_offload_cli.core.base.errors import OffloadError
    from vllm_offload_cli.engine import plugin

    plugin.register()
    plugin.register()  # vLLM may load plugins more than once per process
    config = c.OffloadingConfig(
        groups=(c.OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=page, enable_kv_cache_events=False,
        extra_config={"spec_name": spec_name, "cpu_bytes_to_use": cpu_bytes},
        engine_id=engine_id,
        model=c.OffloadingModelConfig(name="m", dtype="float16"),
        cache=c.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=c.OffloadingParallelConfig(
            rank=rank, world_size=world, tp_size=world, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False),
    )
    spec = OffloadingSpecFactory.create_spec(config)
    path = f"/dev/shm/vllm_offload_{engine_id}.mmap"
    view = None
    try:
        if role == "worker":
            region = spec.get_worker(None).kwargs["mmap_region"]  # what vLLM hands its worker
            hold = getattr(spec, "_vllm_offload_hold", None)  # None: plain vLLM's spec
            # vLLM's own view of its own mapping: where it starts, how long it is
            view = region.create_next_worker_view(page)
            storage = view.untyped_storage()
            vllm_start, length = storage.data_ptr(), storage.nbytes()
        else:
            spec.get_manager()
            hold = spec._vllm_offload_scheduler_hold
    except OffloadError as exc:
        print(json.dumps({"error": exc.message, "code": exc.code, "pid": exc.pid}), flush=True)
        sys.exit(3)
    doc: dict[str, Any] = {
        "pid": os.getpid(), "spec": type(spec).__name__,
        "spec_bases": [b.__module__ + "." + b.__name__ for b in type(spec).__mro__[1:3]],
        "num_chunks": spec.num_chunks, "row_stride": spec.kv_bytes_per_chunk}
    if hold is None:  # plain vLLM: what it mapped, and the slot its view starts at
        doc.update(vllm_files=vllm_stubs.mapped_files(vllm_start, length),
                   vllm_slot=view.storage_offset() // page if view is not None else None,
                   name_linked=os.path.exists(path))
        print(json.dumps(doc), flush=True)
        sys.stdin.readline()
        view = None
        region.cleanup()
        return
    ours = hold.region
    assert ours.mmap_obj is not None and ours.fd is not None
    ino = os.fstat(ours.fd).st_ino
    our_start = vllm_stubs.address_of(ours.mmap_obj)
    if role != "worker":  # the scheduler's region: the other mapping of our file here
        [(vllm_start, end)] = [m for m in vllm_stubs.mappings_of(ino) if m[0] != our_start]
        length = end - vllm_start
    vllm_files = vllm_stubs.mapped_files(vllm_start, length)
    doc.update(
        hook_creator=hold.creator, slot=ours.rank,
        vllm_slot=view.storage_offset() // page if view is not None else None,
        vllm_files=vllm_files, hook_files=vllm_stubs.mapped_files(our_start, length),
        same_inode={f["ino"] for f in vllm_files} >= {ino},
        name_linked=os.path.exists(path), ino=ino)
    print(json.dumps(doc), flush=True)
    for line in sys.stdin:
        words = line.split()
        if words and words[0] == "write" and view is not None:
            view.fill_(int(words[1]))  # through vLLM's strided view, at vLLM's slot
            print("ok", flush=True)
        elif words and words[0] == "check":  # through the hook's mapping, at the hook's slot
            mm, want = ours.mmap_obj, bytes([int(words[1])]) * page
            stride = ours.geometry.row_stride
            good = all(mm[b * stride + ours.rank * page:][:page] == want
                       for b in range(ours.num_chunks))
            print(json.dumps({"match": good}), flush=True)
        elif words and words[0] == "exit":
            break
    view = None
    if role == "worker":
        region.cleanup()
    hold.close()


if __name__ == "__main__":
    main()
