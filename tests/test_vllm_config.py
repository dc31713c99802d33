"""The adapter driven by a real `vllm.config.VllmConfig`, through the vLLM release's own code.

tests/helpers/vllm_engine.py is a `vllm serve` in miniature. What runs for real,
from the released wheel's sources: the `vllm` package itself; `vllm.config`
(ModelConfig reading a config.json, CacheConfig's kv_offloading_size, ParallelConfig
tp=2 on the mp backend, KVTransferConfig, VllmConfig's post-init that turns
kv_offloading_size into `cpu_bytes_to_use` and selects OffloadingConnector);
`vllm.plugins.load_general_plugins` (our entry point); the KV cache planner
(`resolve_kv_cache_layout`, `get_global_kv_cache_groups`, `get_kv_cache_configs`,
`generate_scheduler_kv_cache_config`); `vllm.distributed.parallel_state`
(`init_distributed_environment` on gloo, its world group's barrier between the
two forked rank processes); the connector's `build_offloading_config`;
`OffloadingSpecFactory`; vLLM's CPU and tiering specs under ours; vLLM's
SharedOffloadRegion on /dev/shm with its worker views; the tiering managers.

Stand-ins, for what cannot exist on a CPU-only host: the platform (a subclass of
vLLM's `Platform` with the CUDA enum), the model class (registered, never run),
the per-layer FullAttentionSpecs a model runner would report, and
CPUOffloadingWorker (CUDA tensors and streams).

The expected geometry is computed here from the model's numbers and vLLM's rules,
not read back from vLLM. Without vLLM's sources the module skips; with
VLLM_OFFLOAD_REQUIRE_VLLM=1 (CI) a missing source tree or library fails instead.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vllm_offload_cli.core.host.discovery import discover
from vllm_offload_cli.core.region.geometry import effective_segments, layout_of
from vllm_offload_cli.engine.vllm_rules import read_rules

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import vllm_stubs

HELPER = Path(__file__).parent / "helpers" / "vllm_engine.py"
REQUIRED = os.environ.get("VLLM_OFFLOAD_REQUIRE_VLLM") == "1"
MODEL = {"architectures": ["VllmOffloadTinyForCausalLM"], "model_type": "llama",
         "hidden_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 128,
         "max_position_embeddings": 256, "torch_dtype": "float16", "rms_norm_eps": 1e-5}
TP = 2
BLOCK_TOKENS = 16
OFFLOAD_GIB = 1 / 128  # --kv-offloading-size in GiB: 8 MiB
pytestmark = pytest.mark.slow  # real vLLM engines start: about a minute each

if vllm_stubs.vllm_root() is None:
    if REQUIRED:
        raise RuntimeError("vLLM's sources are required (VLLM_OFFLOAD_VLLM_SRC) but absent")
    pytest.skip("vLLM's sources are not available (set VLLM_OFFLOAD_VLLM_SRC)",
                allow_module_level=True)

_unavailable: list[str] = []  # set once the first engine finds vLLM's libraries missing


@dataclass(frozen=True)
class Geometry:
    """vLLM's offload layout, from the model's numbers (vllm/v1/kv_offload/cpu/spec.py)."""

    worker_bytes_per_block: int
    page: int  # cpu_page_size: one rank's slot in a row
    row_stride: int
    num_chunks: int


def expected(blocks_per_chunk: int) -> Geometry:
    head_size = MODEL["hidden_size"] // MODEL["num_attention_heads"]
    heads_per_rank = MODEL["num_key_value_heads"] // TP
    fp16 = 2
    per_layer = 2 * BLOCK_TOKENS * heads_per_rank * head_size * fp16  # K and V
    per_block = per_layer * MODEL["num_hidden_layers"]
    page = per_block * blocks_per_chunk
    stride = -(-page * TP // mmap.PAGESIZE) * mmap.PAGESIZE  # not replicated: tp copies
    return Geometry(per_block, page, stride, int(OFFLOAD_GIB * 2**30) // stride)


class Engine:
    """One run of vllm_engine.py; `reports` holds its REPORT lines, in order."""

    def __init__(self, tmp: Path, engine_id: str, spec: str, **options: Any) -> None:
        model_dir = tmp / "model"
        model_dir.mkdir(exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(MODEL))
        barrier = tmp / f"gloo-{secrets.token_hex(4)}"
        barrier.mkdir()
        args = {"spec": spec, "engine_id": engine_id, "model_dir": str(model_dir), "tp": TP,
                "offload_gib": OFFLOAD_GIB, "blocks_per_chunk": 1,
                "barrier_dir": str(barrier), **options}
        env = {k: v for k, v in os.environ.items() if k != "VLLM_OFFLOAD_ENGINE_TOKEN"}
        env.update(options.pop("env", {}))
        self.proc = subprocess.Popen([sys.executable, str(HELPER), json.dumps(args)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.reports: list[dict[str, Any]] = []
        self.stderr = ""

    def until_ready(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("REPORT "):
                self.reports.append(json.loads(line[len("REPORT "):]))
                if "ready" in self.reports[-1] or "unavailable" in self.reports[-1]:
                    break
        if not self.reports or "ready" not in self.reports[-1]:
            self.finish()
            if self.reports and "unavailable" in self.reports[-1]:
                _unavailable.append(self.reports[-1]["unavailable"])
                needed(self.reports[-1]["unavailable"])
            raise AssertionError(f"the engine stopped early: {self.reports}\n{self.stderr}")

    def finish(self) -> int:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
        out, self.stderr = self.proc.communicate(timeout=120)
        self.reports += [json.loads(line[len("REPORT "):]) for line in out.splitlines()
                         if line.startswith("REPORT ")]
        return self.proc.returncode

    @property
    def workers(self) -> list[dict[str, Any]]:
        return sorted((r for r in self.reports if "worker" in r), key=lambda r: r["worker"])

    @property
    def scheduler(self) -> dict[str, Any]:
        [doc] = [r for r in self.reports if "scheduler" in r]
        return doc


def needed(why: str) -> None:
    message = f"vLLM's config code cannot be imported here ({why}); see .ci/run"
    if REQUIRED:
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def engine_id() -> Iterator[str]:
    eid = f"vllm-offload-test-{secrets.token_hex(6)}"
    yield eid
    for p in Path("/dev/shm").glob(f"vllm_offload_{eid}.*"):
        if p.is_dir():
            p.rmdir()
        else:
            p.unlink()


@pytest.fixture
def start(tmp_path: Path, engine_id: str) -> Iterator[Any]:
    made: list[Engine] = []

    def run(spec: str, **options: Any) -> Engine:
        if _unavailable:
            needed(_unavailable[0])
        e = Engine(tmp_path, engine_id, spec, **options)
        made.append(e)
        e.until_ready()
        return e

    yield run
    for e in made:
        if e.proc.poll() is None:
            e.proc.kill()
        e.proc.wait(timeout=30)
        for s in (e.proc.stdin, e.proc.stdout, e.proc.stderr):
            if s is not None and not s.closed:
                s.close()


def check_geometry(doc: dict[str, Any], want: Geometry, blocks_per_chunk: int) -> None:
    """What vLLM's builder and spec computed equals what the model's numbers say."""
    assert doc["extra_config"]["cpu_bytes_to_use"] == OFFLOAD_GIB * 2**30  # kv_offloading_size
    assert (doc["world_size"], doc["replicated_layout"]) == (TP, False)
    assert doc["worker_kv_bytes_per_block"] == want.worker_bytes_per_block
    assert doc["blocks_per_chunk"] == blocks_per_chunk
    assert (doc["cpu_page_size"], doc["row_stride"], doc["num_chunks"]) == (
        want.page, want.row_stride, want.num_chunks)


def check_worker(doc: dict[str, Any], want: Geometry) -> None:
    """vLLM's view of this rank's slot, and the bytes every rank wrote, seen through ours."""
    rank = doc["worker"]
    assert "exception" not in doc, doc
    # VllmConfig's post-init turned kv_offloading_size into the connector and its bytes
    assert (doc["kv_connector"], doc["kv_role"]) == ("OffloadingConnector", "kv_both")
    assert doc["rank"] == rank and doc["hooked"] and doc["token_set"]
    assert doc["view_shape"] == [want.num_chunks, want.page]
    assert doc["view_stride"] == [want.row_stride, 1]
    assert doc["view_offset"] == rank * want.page
    assert doc["same_inode"] and doc["hold_locked"]  # vLLM mapped the hook's file
    padding = [0] if want.row_stride > TP * want.page else []
    # every row: rank r's slot holds r + 3 only, the padding zeros only
    assert doc["rows"] == [[[r + 3] for r in range(TP)] + [padding]]


def check_ended_cleanly(e: Engine) -> None:
    """vLLM's shutdown() of each worker (and of the scheduler's manager) closed the hook's
    hold too: nothing of the region stays mapped, open or locked in that process."""
    closed = [r for r in e.reports if "shut_down" in r]
    assert sorted(r["shut_down"] for r in closed) == list(range(TP))
    assert not [r for r in closed if r["mapped_after"] or r["hold_open"]], closed
    assert not [r for r in e.reports if "scheduler_shut_down" in r and r["mapped_after"]]


# vLLM's own format: "(<process> pid=N) INFO MM-DD HH:MM:SS [file.py:line] message"
VLLM_INFO = r"pid=\d+\) INFO \d\d-\d\d [\d:]+ \[[^\]]*region_hold\.py:\d+\] "


def test_cpu_spec_from_a_real_vllm_config(start: Any, engine_id: str) -> None:
    """TP=2 workers, vLLM's 1 GiB-per-file rule scaled to 1 MiB: 8 files where the release
    splits (0.33), else one; rows padded."""
    want = expected(blocks_per_chunk=1)
    assert want.row_stride > TP * want.page  # this model's rows need padding: checked too
    e = start("HardenedCPUOffloadingSpec", segment_min_bytes=1 << 20)
    workers = e.workers
    assert [w["worker"] for w in workers] == list(range(TP))
    rules = read_rules(vllm_stubs.vllm_root())  # 0.33's CPU spec splits; 0.31, 0.32 do not
    files = effective_segments(rules.cpu_worker.segments, want.num_chunks * want.row_stride,
                               min_bytes=1 << 20)
    assert files == (min(32, want.num_chunks * want.row_stride // (1 << 20))
                     if layout_of(rules.cpu_worker.segments) == "segmented" else 1)
    for w in workers:
        assert w["spec"] == "HardenedCPUOffloadingSpec"
        assert w["spec_base"] == "vllm.v1.kv_offload.cpu.spec.CPUOffloadingSpec"
        check_geometry(w, want, 1)
        check_worker(w, want)
        assert len(w["vllm_files"]) == files  # vLLM's rule, scaled in vLLM alone
        assert w["vllm_files"] == w["hook_files"]  # the hook made exactly those files
    assert sorted(w["hook_creator"] for w in workers) == [False, True]
    assert len({w["ino"] for w in workers}) == 1
    # vLLM's barrier passed, the name went, as vLLM does; the engine still holds it
    assert not list(Path("/dev/shm").glob(f"vllm_offload_{engine_id}.mmap*"))
    # ... and `inspect`/`gc` see every file alive, held by both ranks (a released
    # name leaves each segment file its own entry)
    regions = discover("/dev/shm", engine_ids=[engine_id], measure_residency=False).regions
    base = f"/dev/shm/vllm_offload_{engine_id}.mmap"
    assert sorted(p for r in regions for p in r.paths) == sorted(
        [base] + [f"{base}.{i}" for i in range(1, files)])
    for region in regions:
        assert region.state == "live" and not region.linked
        assert {w["pid"] for w in workers} <= {h.pid for h in region.holders}
    assert e.finish() == 0 and e.reports[-1] == {"done": [0] * TP}
    check_ended_cleanly(e)
    # the hook's INFO record, in the engine's log through vLLM's logging
    assert re.search(VLLM_INFO + "released the name /dev/shm/vllm_offload_", e.stderr), e.stderr


def test_tiering_spec_from_a_real_vllm_config(start: Any, engine_id: str) -> None:
    """Two blocks per chunk; the scheduler joins rank-less, then the name is released."""
    want = expected(blocks_per_chunk=2)
    e = start("HardenedTieringOffloadingSpec", blocks_per_chunk=2)
    workers = e.workers
    for w in workers:
        assert w["spec_base"] == "vllm.v1.kv_offload.tiering.spec.TieringOffloadingSpec"
        check_geometry(w, want, 2)
        check_worker(w, want)
        assert w["name_linked"]  # until the scheduler has joined
    sched = e.scheduler
    check_geometry(sched, want, 2)
    assert sched["hooked"] and sched["same_inode"] and sched["ino"] == workers[0]["ino"]
    assert sched["hook_creator"] is False
    assert sched["rows"] == workers[0]["rows"]  # the workers' bytes, seen by the scheduler
    assert sched["name_linked"] is False
    assert not Path(f"/dev/shm/vllm_offload_{engine_id}.mmap").exists()
    assert e.finish() == 0 and e.reports[-1] == {"done": [0] * TP}
    check_ended_cleanly(e)


def test_no_variable_of_ours_makes_vllm_refuse_the_engine(start: Any) -> None:
    """vLLM validates every VLLM_* name (`--fail-on-environ-validation` refuses the engine,
    else a warning): the token the plugin sets and an operator's settings are known to it,
    and none of them changes torch.compile's cache key (the token is random per engine)."""
    env = {"VLLM_OFFLOAD_SHM_DIR": "/dev/shm", "VLLM_OFFLOAD_SOME_FUTURE_SETTING": "1"}
    e = start("HardenedCPUOffloadingSpec", tp=1, env=env)
    [checked] = [r for r in e.reports if "environ" in r]
    assert checked["environ"] == "valid"
    assert set(checked["compile_factors"].values()) == {None}
    assert {"VLLM_OFFLOAD_ENGINE_TOKEN", *env} <= set(checked["compile_factors"])
    assert e.finish() == 0
    assert "Unknown vLLM environment variable" not in e.stderr
    # still validating: a stray name of nobody's is refused as before
    stray = start("HardenedCPUOffloadingSpec", tp=1, env={"VLLM_NOBODYS_SETTING": "1"})
    [checked] = [r for r in stray.reports if "environ" in r]
    assert checked["environ"] == "Unknown vLLM environment variable detected: VLLM_NOBODYS_SETTING"
    assert stray.finish() == 0


# The creator's manifest write fails (an injected EIO): not one of the hook's refusals
# (busy, no space, unsafe) but an unexpected failure, after the file was made.
FAIL = {"fail_manifest_write": True}


def test_in_strict_mode_a_failing_start_up_step_raises_into_vllm(
        start: Any, engine_id: str) -> None:
    e = start("HardenedCPUOffloadingSpec", strict=True, **FAIL)
    assert e.finish() == 0
    assert [(w["exception"], "hooked" in w) for w in e.workers] == [
        ("OSError", False)] * TP  # raised out of spec.get_worker
    assert not list(Path("/dev/shm").glob(f"vllm_offload_{engine_id}.mmap*"))


def test_outside_strict_mode_a_failing_start_up_step_is_logged_and_vllm_starts(
        start: Any, engine_id: str) -> None:
    """One worker (see the next test for two): vLLM makes and maps its region itself."""
    e = start("HardenedCPUOffloadingSpec", tp=1, **FAIL)
    assert e.finish() == 0
    [w] = e.workers
    assert "exception" not in w, w
    assert (w["hooked"], w["view_offset"]) == (False, 0)
    assert w["name_linked"] is False  # vLLM's creator path: made it, unlinked it
    assert e.stderr.count("start-up steps failed (OSError") == 1
    assert "set vllm_offload_strict to fail instead" in e.stderr


def test_outside_strict_mode_a_failing_start_up_step_lets_every_rank_start(
        start: Any, engine_id: str) -> None:
    """The rank that creates fails on the manifest and starts as plain vLLM; the other joins
    it: the creator is a forked sibling without the token in /proc/PID/environ, and its
    inherited beacon is what proves it belongs to this engine, not to another one."""
    e = start("HardenedCPUOffloadingSpec", **FAIL)
    assert e.finish() == 0
    assert not [w for w in e.workers if "exception" in w]
    assert e.stderr.count("start-up steps failed (OSError") == 1
    assert "engine_id_collision" not in e.stderr and "is in use" not in e.stderr
    hooked = [w for w in e.workers if w["hooked"]]
    assert len(hooked) == TP - 1 and all(w["same_inode"] for w in hooked)
