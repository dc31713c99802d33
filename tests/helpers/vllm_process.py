"""One vLLM process (a worker, or the engine core's scheduler) running vLLM's own spec code.

Usage: vllm_process.py ROLE SPEC_NAME ENGINE_ID RANK WORLD CPU_BYTES PAGE BARRIER_DIR
ROLE is "worker" (spec.get_worker) or "scheduler" (spec.get_manager). The
spec comes from vLLM's real OffloadingSpecFactory after our plugin
registered it, built from vLLM's real OffloadingConfig. Prints one JSON line,
then reads stdin: "write V" fills this worker's slot through vLLM's own
tensor view; "check V" reads the same bytes through the hook's mapping of the
files; "exit" ends the process.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import vllm_stubs


def main() -> None:
    role, spec_name, engine_id = sys.argv[1:4]
    rank, world, cpu_bytes, page = (int(x) for x in sys.argv[4:8])
    root = vllm_stubs.vllm_root()
    assert root is not None, "vLLM sources not found"
    vllm_stubs.load(root, vllm_stubs.FileBarrier(sys.argv[8], rank, world))
    if os.environ.get("SEGMENT_MIN_BYTES"):  # vLLM's 1 GiB rule, scaled down for tests
        from vllm.v1.kv_offload.cpu import shared_offload_region as vllm_region

        from vllm_offload_cli.core.region import segments

        vllm_region._MIN_SEGMENT_BYTES = int(os.environ["SEGMENT_MIN_BYTES"])
        segments.MIN_SEGMENT_BYTES = int(os.environ["SEGMENT_MIN_BYTES"])

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
    try:
        if role == "worker":
            region = spec.get_worker(None).kwargs["mmap_region"]
            lease = spec._vllm_offload_lease
        else:
            spec.get_manager()
            region = spec._scheduler_mmap
            lease = spec._vllm_offload_scheduler_lease
    except OffloadError as exc:
        print(json.dumps({"error": exc.message, "code": exc.code, "pid": exc.pid}), flush=True)
        sys.exit(3)
    ours = lease.region
    print(json.dumps({
        "pid": os.getpid(), "spec": type(spec).__name__,
        "spec_bases": [b.__module__ + "." + b.__name__ for b in type(spec).__mro__[1:3]],
        "vllm_creator": region._creator, "hook_creator": lease.creator,
        "same_inode": os.fstat(region.fd).st_ino == os.fstat(ours.fd).st_ino,
        "vllm_segments": len(region._segments), "hook_segments": len(ours.segments),
        "num_chunks": spec.num_chunks, "row_stride": spec.kv_bytes_per_chunk,
        "name_linked": os.path.exists(path), "ino": os.fstat(ours.fd).st_ino,
    }), flush=True)
    view = None
    for line in sys.stdin:
        words = line.split()
        if words and words[0] == "write":
            view = view if view is not None else region.create_next_worker_view(page)
            view.fill_(int(words[1]))
            print("ok", flush=True)
        elif words and words[0] == "check":
            mm, want = ours.mmap_obj, bytes([int(words[1])]) * page
            good = all(mm[b * ours._row_stride + rank * page:][:page] == want
                       for b in range(ours.num_blocks))
            print(json.dumps({"match": good}), flush=True)
        elif words and words[0] == "exit":
            break
    view = None
    region.cleanup()
    lease.close()


if __name__ == "__main__":
    main()
