"""One `vllm serve` in miniature: vLLM's own config code from a real VllmConfig to our spec.

Usage: vllm_engine.py JSON   (keys: spec, engine_id, model_dir, tp, offload_gib,
       blocks_per_chunk, strict, segment_min_bytes, fail_manifest_write)

The process is the engine core. It builds a real `vllm.config.VllmConfig`
(ModelConfig from MODEL_DIR's config.json, CacheConfig with kv_offloading_size,
ParallelConfig tp=N on the mp backend, KVTransferConfig with our spec), loads
vLLM's general plugins (our entry point among them), plans the KV cache with
vLLM's planner, then forks one worker per TP rank, as vLLM's mp executor
does. Each worker joins a gloo group through vLLM's parallel_state, turns the
VllmConfig into an OffloadingConfig with vLLM's `build_offloading_config`,
gets our spec from vLLM's OffloadingSpecFactory and calls `get_worker`; for
the tiering spec the engine core then builds the scheduler's spec and calls
`get_manager`. Reports are lines "REPORT {json}" on stdout (vLLM logs to
stderr); after "REPORT {"ready": ...}" it waits for a line on stdin and exits.

Stand-ins (tests/helpers/vllm_stubs.py's `cuda_stand_in`): the platform (a CUDA
one, as vLLM only uses the shared region on CUDA-alike devices), the model
class (registered, never run: no weights exist), the per-layer KV cache specs
a model runner reports, and CPUOffloadingWorker (it needs CUDA tensors).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import sys
import traceback
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

sys.path.insert(0, os.path.dirname(__file__))
import vllm_stubs

LAYERS = "model.layers.{}.self_attn.attn"


def report(**doc: Any) -> None:
    """One line, written at once: forked workers share this stdout pipe."""
    os.write(1, ("REPORT " + json.dumps(doc) + "\n").encode())


def failure(exc: BaseException) -> dict[str, Any]:
    from vllm_offload_cli.core.base.errors import OffloadError

    doc: dict[str, Any] = {"exception": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, OffloadError):
        doc.update(code=exc.code, error_pid=exc.pid)
    return doc


def build(args: dict[str, Any]) -> tuple[Any, list[Any], Any]:
    """The engine core's part: VllmConfig, plugins, KV cache plan (one config per worker)."""
    import torch
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
    )
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    configure_logging(LoggingConfig())  # as `vllm serve` does from its arguments
    model_cls = vllm_stubs.tiny_model_class(torch)
    ModelRegistry.register_model(model_cls.__name__, model_cls)
    load_general_plugins()  # vLLM's loader: runs our entry point (token, spec names)
    from vllm import envs
    from vllm.platforms import current_platform

    try:  # what `--fail-on-environ-validation` does next, in vLLM's create_engine_config
        current_platform.validate_environ(True)
        environ = "valid"
    except ValueError as exc:
        environ = str(exc)
    report(environ=environ, compile_factors={
        k: v for k, v in envs.compile_factors().items() if k.startswith("VLLM_OFFLOAD_")})

    extra: dict[str, Any] = {"spec_name": args["spec"],
                             "spec_module_path": "vllm_offload_cli.engine.vllm_spec",
                             "blocks_per_chunk": args["blocks_per_chunk"]}
    if args.get("strict"):
        extra["vllm_offload_strict"] = True
    model = ModelConfig(model=args["model_dir"], skip_tokenizer_init=True, dtype="float16",
                        max_model_len=256)
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=16, kv_offloading_size=args["offload_gib"]),
        parallel_config=ParallelConfig(tensor_parallel_size=args["tp"],
                                       distributed_executor_backend="mp"),
        kv_transfer_config=KVTransferConfig(engine_id=args["engine_id"],
                                            kv_connector_extra_config=extra),
    )
    # What each worker's model runner reports: one full-attention layer spec per layer.
    per_worker = {LAYERS.format(i): FullAttentionSpec(
        block_size=config.cache_config.block_size,
        num_kv_heads=model.get_num_kv_heads(config.parallel_config),
        head_size=model.get_head_size(), dtype=model.dtype)
        for i in range(model.get_num_layers(config.parallel_config))}
    specs = [per_worker] * args["tp"]
    resolve_kv_cache_layout(config, [["LBNHC"]] * args["tp"],
                            [s for spec in specs for s in spec.values()])
    memory = [4 << 20] * args["tp"]
    try:  # 0.33: the planner is its own module, and groups the layers first
        from vllm.v1.core.kv_cache_planning import (
            get_global_kv_cache_groups,
            get_kv_cache_configs,
        )
    except ImportError:  # 0.31, 0.32: in kv_cache_utils, grouping inside
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs as plan

        kv_configs = plan(config, specs, memory)
    else:
        kv_configs = get_kv_cache_configs(config, specs, memory,
                                          get_global_kv_cache_groups(config, specs))
    for kv in kv_configs:
        kv.kv_cache_layout = config.cache_config.kv_cache_layout
    return config, kv_configs, generate_scheduler_kv_cache_config(kv_configs)


def describe(spec: Any, offloading: Any) -> dict[str, Any]:
    return {
        "spec": type(spec).__name__,
        "spec_base": type(spec).__mro__[1].__module__ + "." + type(spec).__mro__[1].__name__,
        "extra_config": {k: v for k, v in offloading.extra_config.items()},
        "worker_kv_bytes_per_block": offloading.worker_kv_bytes_per_block,
        "blocks_per_chunk": offloading.cache.blocks_per_chunk,
        "world_size": offloading.parallel.world_size, "rank": offloading.parallel.rank,
        "replicated_layout": offloading.replicated_layout,
        "num_chunks": spec.num_chunks, "row_stride": spec.kv_bytes_per_chunk,
        "cpu_page_size": spec.cpu_page_size_per_worker,
    }


def worker(config: Any, kv_config: Any, rank: int, init: str, args: dict[str, Any],
           commands: int, reported: int) -> None:
    """One TP rank, as vLLM's Worker: rank in the config, gloo group, connector's spec."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.distributed.parallel_state import get_world_group, init_distributed_environment
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from vllm_offload_cli.core.host.procscan import flock_holders
    from vllm_offload_cli.core.system.files import FileId

    config.parallel_config.rank = rank
    vllm_stubs.device_stand_in(rank)  # this rank's GPU: vLLM 0.31 folds it into the slot
    init_distributed_environment(world_size=args["tp"], rank=rank, local_rank=rank,
                                 distributed_init_method=init, backend="gloo")
    offloading = build_offloading_config(config, kv_config)
    spec = OffloadingSpecFactory.create_spec(offloading)
    doc: dict[str, Any] = {"worker": rank, "pid": os.getpid(), **describe(spec, offloading),
                           "kv_connector": config.kv_transfer_config.kv_connector,
                           "kv_role": config.kv_transfer_config.kv_role}
    try:
        got = spec.get_worker(None)
    except Exception as exc:
        report(**doc, **failure(exc))
        os.write(reported, b"r")
        get_world_group().barrier()  # the peer may still be on its way; let it finish
        return
    region = got.kwargs["mmap_region"]
    hold = getattr(spec, "_vllm_offload_hold", None)
    view = region.create_next_worker_view(spec.cpu_page_size_per_worker)
    view.fill_(rank + 3)  # through vLLM's own strided view of its own mapping
    get_world_group().barrier()  # every rank wrote its slot
    storage = view.untyped_storage()  # vLLM's whole mapping, under its own view
    doc.update(
        vllm_files=vllm_stubs.mapped_files(storage.data_ptr(), storage.nbytes()),
        view_shape=list(view.shape), view_stride=list(view.stride()),
        view_offset=view.storage_offset(), token_set=bool(os.environ.get(
            "VLLM_OFFLOAD_ENGINE_TOKEN")),
        name_linked=os.path.exists(f"/dev/shm/vllm_offload_{args['engine_id']}.mmap"),
        hooked=hold is not None)
    if hold is not None:
        ours = hold.region
        fid = FileId.of(os.fstat(ours.fd))
        doc.update(hook_creator=hold.creator,
                   hook_files=vllm_stubs.mapped_files(vllm_stubs.address_of(ours.mmap_obj),
                                                      storage.nbytes()),
                   same_inode=fid.ino in {f["ino"] for f in doc["vllm_files"]}, ino=fid.ino,
                   hold_locked=os.getpid() in [pid for pid, _ in flock_holders(fid)],
                   rows=row_bytes(ours.mmap_obj, spec, args["tp"]))
    report(**doc)
    os.write(reported, b"r")
    os.read(commands, 1)  # hold the region until the engine core says so
    del view, storage  # vLLM keeps a mapping while a view of it is alive
    ino = doc.get("ino")
    got.shutdown()  # as vLLM's connector shuts its worker down: the hook's hold goes too
    report(shut_down=rank, mapped_after=ino is not None and bool(vllm_stubs.mappings_of(ino)),
           hold_open=hold is not None and hold.region.fd is not None)


def row_bytes(mm: Any, spec: Any, world: int) -> list[list[int]]:
    """Per row: the distinct byte values of each rank's slot, then of the row's padding."""
    page, stride = spec.cpu_page_size_per_worker, spec.kv_bytes_per_chunk
    rows = []
    for b in range(spec.num_chunks):
        row = mm[b * stride:(b + 1) * stride]
        cells = [sorted(set(row[r * page:(r + 1) * page])) for r in range(world)]
        rows.append([*cells, sorted(set(row[world * page:]))])
    distinct = {json.dumps(r) for r in rows}  # one line, however many rows
    return [json.loads(r) for r in sorted(distinct)]


def scheduler(config: Any, kv_config: Any, args: dict[str, Any]) -> Any:
    """The engine core's connector scheduler: the tiering spec joins rank-less."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    offloading = build_offloading_config(config, kv_config)
    spec = OffloadingSpecFactory.create_spec(offloading)
    doc: dict[str, Any] = {"scheduler": True, **describe(spec, offloading)}
    try:
        manager = spec.get_manager()
    except Exception as exc:
        report(**doc, **failure(exc))
        return None
    hold = getattr(spec, "_vllm_offload_scheduler_hold", None)
    doc.update(hooked=hold is not None,
               name_linked=os.path.exists(f"/dev/shm/vllm_offload_{args['engine_id']}.mmap"))
    if hold is not None:  # vLLM's mapping of the file: the one that is not the hook's
        ours = hold.region
        ino = os.fstat(ours.fd).st_ino
        mine = vllm_stubs.address_of(ours.mmap_obj)
        theirs = [m for m in vllm_stubs.mappings_of(ino) if m[0] != mine]
        doc.update(hook_creator=hold.creator, ino=ino, same_inode=len(theirs) == 1,
                   rows=[] if len(theirs) != 1 else row_bytes(
                       ctypes.string_at(theirs[0][0], theirs[0][1] - theirs[0][0]), spec,
                       args["tp"]))
    report(**doc)
    return manager, doc.get("ino")


def main() -> None:
    args = json.loads(sys.argv[1])
    root = vllm_stubs.vllm_root()
    if root is None:
        raise SystemExit("vLLM sources not found")
    sys.path.insert(0, str(root))
    try:
        vllm_stubs.cuda_stand_in()
        if args.get("fail_manifest_write"):  # an unexpected failure inside the hook
            from vllm_offload_cli.core.region import manifest

            def fail(*_: Any, **__: Any) -> None:
                raise OSError(errno.EIO, "injected: the manifest cannot be written")

            manifest.write = fail
        if args.get("segment_min_bytes"):  # vLLM's 1 GiB rule, scaled down in vLLM only
            from vllm.v1.kv_offload.cpu import shared_offload_region

            shared_offload_region._MIN_SEGMENT_BYTES = args["segment_min_bytes"]
        config, kv_configs, scheduler_kv = build(args)
    except ImportError as exc:  # a library vLLM's config code needs is not installed
        report(unavailable=f"{type(exc).__name__}: {exc}")
        sys.exit(4)
    init = f"file://{args['barrier_dir']}/gloo-store"
    children = []
    reported_r, reported_w = os.pipe()  # one byte per worker, once it reported
    for rank in range(args["tp"]):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(write_end)
            code = 0
            try:
                worker(config, kv_configs[rank], rank, init, args, read_end, reported_w)
            except BaseException as exc:
                report(worker=rank, **failure(exc), trace=traceback.format_exc()[-2000:])
                os.write(reported_w, b"r")
                code = 1
            sys.stdout.flush()
            os._exit(code)
        os.close(read_end)
        children.append((pid, write_end))
    os.close(reported_w)
    for _ in range(args["tp"]):  # the scheduler is built after the workers' KV caches
        if not os.read(reported_r, 1):
            break
    built = None
    if args["spec"].endswith("TieringOffloadingSpec"):
        built = scheduler(config, scheduler_kv, args)
    report(ready=True)
    sys.stdin.readline()
    if built is not None:  # as vLLM's connector shuts its scheduler side down
        manager, ino = built
        manager.shutdown()
        report(scheduler_shut_down=True,
               mapped_after=ino is not None and bool(vllm_stubs.mappings_of(ino)))
    codes = []
    for pid, write_end in children:
        with contextlib.suppress(OSError):  # a worker that failed has gone already
            os.write(write_end, b"x")
        os.close(write_end)
        codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    report(done=codes)


if __name__ == "__main__":
    main()
