"""The adapter against the vLLM release in use, from its released wheel's sources.

Real processes run vLLM's OffloadingSpecFactory (after our plugin registered
the names), vLLM's OffloadingConfig, our specs subclassing vLLM's CPU and
tiering specs, vLLM's own SharedOffloadRegion (on /dev/shm, where vLLM
hard-codes it) and the tiering managers; tests/helpers/vllm_stubs.py lists
the few GPU-only modules replaced. CI runs this file once per release of the
support matrix (0.31.0, 0.32.0, 0.33.0: VLLM_OFFLOAD_VLLM_SRC, see .ci/run)
with VLLM_OFFLOAD_REQUIRE_VLLM=1, which turns a missing vLLM into a failure.

What is compared is public behaviour: the files the kernel maps where vLLM's
region lies and where the hook's does, the bytes each side sees, the files on
disk. Where releases differ, a test branches on what `vllm_rules`' table says
of the release, and one test checks that row against what plain vLLM does.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_offload_cli.core.region.geometry import effective_segments
from vllm_offload_cli.engine.vllm_rules import DEVICE_MODULO, VllmRules, read_rules

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import vllm_stubs

HELPER = Path(__file__).parent / "helpers" / "vllm_process.py"
PAGE = 64 * 1024
CPU_BYTES = 8 << 20
SCALED_MIN = 1 << 20  # vLLM's 1 GiB-per-file rule scaled down (vLLM's constant only)

if vllm_stubs.vllm_root() is None:
    if os.environ.get("VLLM_OFFLOAD_REQUIRE_VLLM") == "1":
        raise RuntimeError("vLLM's sources are required (VLLM_OFFLOAD_VLLM_SRC) but absent")
    pytest.skip("vLLM's sources are not available (set VLLM_OFFLOAD_VLLM_SRC)",
                allow_module_level=True)


class VllmEngine:
    """The processes of one `vllm serve`: one token, one barrier directory."""

    def __init__(self, engine_id: str, tmp: Path, spec: str, world: int,
                 env: dict[str, str] | None = None) -> None:  # env: DEVICES, SEGMENT_MIN_BYTES
        self.engine_id, self.spec, self.world = engine_id, spec, world
        self.barrier = tmp / f"barrier-{secrets.token_hex(4)}"
        self.barrier.mkdir()
        self.env = {**os.environ, "VLLM_OFFLOAD_ENGINE_TOKEN": secrets.token_hex(16),
                    **(env or {})}
        self.procs: list[subprocess.Popen[str]] = []

    def spawn(self, role: str, rank: int) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            [sys.executable, str(HELPER), role, self.spec, self.engine_id, str(rank),
             str(self.world), str(CPU_BYTES), str(PAGE), str(self.barrier)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=self.env)
        self.procs.append(p)
        return p

    def workers(self) -> list[tuple[subprocess.Popen[str], dict[str, Any]]]:
        procs = [self.spawn("worker", r) for r in range(self.world)]
        return [(p, report(p)) for p in procs]


def report(p: subprocess.Popen[str]) -> dict[str, Any]:
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        raise AssertionError(p.stderr.read() if p.stderr else "no output")
    doc: dict[str, Any] = json.loads(line)
    return doc


def ask(p: subprocess.Popen[str], command: str) -> str:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(command + "\n")
    p.stdin.flush()
    return p.stdout.readline().strip()


@pytest.fixture
def engine_id() -> Iterator[str]:
    eid = f"vllm-offload-test-{secrets.token_hex(6)}"
    yield eid
    for p in Path("/dev/shm").glob(f"vllm_offload_{eid}.*"):
        p.unlink()


@pytest.fixture
def engines(tmp_path: Path, engine_id: str) -> Iterator[Any]:
    made: list[VllmEngine] = []

    def make(spec: str, world: int = 2, **kw: Any) -> VllmEngine:
        e = VllmEngine(engine_id, tmp_path, spec, world, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        for p in e.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
            for s in (p.stdin, p.stdout, p.stderr):
                if s is not None:
                    s.close()


@pytest.fixture(scope="module")
def rules() -> VllmRules:
    root = vllm_stubs.vllm_root()
    assert root is not None
    return read_rules(root)


def _bytes_agree(workers: list[tuple[subprocess.Popen[str], dict[str, Any]]]) -> None:
    for rank, (p, _) in enumerate(workers):
        assert ask(p, f"write {rank + 3}") == "ok"
    for rank, (p, _) in enumerate(workers):  # vLLM's views and our mapping: same bytes
        assert ask(p, f"check {rank + 3}") == '{"match": true}'


def _names(files: list[dict[str, Any]]) -> list[str]:
    return [f["name"] for f in files]


def test_what_the_rules_read_is_what_plain_vllm_does(engines: Any, engine_id: str,
                                                      rules: VllmRules) -> None:
    """vLLM's own CPU spec, no hook: its files and slots are what vllm_rules predicted.

    Devices reversed (rank 0 on device 1): a release that folds the device index
    puts rank 0 on slot 1; one that uses the logical rank keeps it on slot 0.
    """
    e = engines("CPUOffloadingSpec", env={"DEVICES": "1,0",
                                          "SEGMENT_MIN_BYTES": str(SCALED_MIN)})
    workers = e.workers()
    files = effective_segments(rules.cpu_worker.segments, CPU_BYTES, min_bytes=SCALED_MIN)
    base = f"vllm_offload_{engine_id}.mmap"
    for rank, (_, info) in enumerate(workers):
        assert info["spec"] == "CPUOffloadingSpec"
        assert _names(info["vllm_files"]) == [base] + [f"{base}.{i}" for i in range(1, files)]
        want = 1 - rank if rules.cpu_worker.rank_source == DEVICE_MODULO else rank
        assert info["vllm_slot"] == want
    # both reported, so vLLM's creator is past its barrier (and its unlink, if it has one)
    linked = bool(list(Path("/dev/shm").glob(f"{base}*")))
    assert linked is not rules.cpu_worker.barrier


def test_cpu_spec_workers_join_the_hooks_region_and_vllm_unlinks_nothing(
        engines: Any, engine_id: str, rules: VllmRules) -> None:
    workers = engines("HardenedCPUOffloadingSpec").workers()
    infos = [info for _, info in workers]
    assert {i["spec"] for i in infos} == {"HardenedCPUOffloadingSpec"}
    assert infos[0]["spec_bases"][0] == "vllm.v1.kv_offload.cpu.spec.CPUOffloadingSpec"
    assert sorted(i["hook_creator"] for i in infos) == [False, True]  # vLLM only joined
    for i in infos:  # vLLM maps the hook's file, at the slot the hook recorded
        assert i["same_inode"] and i["vllm_files"] == i["hook_files"]
        assert i["vllm_slot"] == i["slot"]
    assert infos[0]["num_chunks"] == CPU_BYTES // (2 * PAGE)
    _bytes_agree(workers)
    # every worker passed vLLM's barrier, so the name was released, as vLLM does
    assert rules.cpu_worker.barrier
    assert not list(Path("/dev/shm").glob(f"vllm_offload_{engine_id}.*"))


def test_the_hook_makes_the_files_this_vllm_joins(engines: Any, engine_id: str,
                                                 rules: VllmRules) -> None:
    """vLLM's 1 GiB-per-file rule scaled to 1 MiB in vLLM alone: the hook follows it.

    A release that splits (0.33's CPU spec) maps 8 files of 8 rows; one that does
    not (0.31, 0.32) maps one file, and would time out on a split region.
    """
    e = engines("HardenedCPUOffloadingSpec", env={"SEGMENT_MIN_BYTES": str(SCALED_MIN)})
    workers = e.workers()
    files = 8 if rules.cpu_worker.segments > 1 else 1
    base = f"vllm_offload_{engine_id}.mmap"
    for _, info in workers:
        assert _names(info["vllm_files"]) == [base] + [f"{base}.{i}" for i in range(1, files)]
        assert info["vllm_files"] == info["hook_files"]  # same files, same order, same offsets
    _bytes_agree(workers)


def test_workers_that_each_see_one_device_get_the_slots_vllm_gives(
        engines: Any, rules: VllmRules) -> None:
    """Each worker sees only its own GPU (index 0 everywhere). Where vLLM folds the
    device index (0.31) both would write slot 0: the hook refuses the second worker,
    naming the first. Where vLLM uses the logical rank, both start on their slots."""
    e = engines("HardenedTieringOffloadingSpec", env={"DEVICES": "0,0"})
    first = e.spawn("worker", 0)
    info = report(first)
    assert info["slot"] == 0 and info["vllm_slot"] == 0
    second = e.spawn("worker", 1)
    other = report(second)
    if rules.tiering_worker.rank_source == DEVICE_MODULO:
        assert (other["code"], other["pid"]) == ("slot_collision", info["pid"])
        assert second.wait(timeout=30) == 3
    else:
        assert other["slot"] == other["vllm_slot"] == 1
        _bytes_agree([(first, info), (second, other)])


def test_tiering_name_is_released_only_after_the_scheduler_joined(
        engines: Any, engine_id: str, rules: VllmRules) -> None:
    e = engines("HardenedTieringOffloadingSpec")
    workers = e.workers()
    assert all(info["name_linked"] for _, info in workers)  # the scheduler has yet to join
    manifest = json.loads(Path(f"/dev/shm/vllm_offload_{engine_id}.manifest.json").read_text())
    assert (manifest["segments"], manifest["vllm_layout_basis"]) == (1, "vllm")  # single-file
    assert {a["rank_source"] for a in manifest["attachments"]} == {
        rules.tiering_worker.rank_source}  # as this release picks slots
    scheduler = e.spawn("scheduler", 0)
    info = report(scheduler)
    assert info["spec"] == "HardenedTieringOffloadingSpec" and info["same_inode"]
    assert info["hook_creator"] is False and info["name_linked"] is False
    assert _names(info["vllm_files"]) == [f"vllm_offload_{engine_id}.mmap"]
    _bytes_agree(workers)


def test_a_second_engine_with_the_same_id_is_refused_inside_vllm(engines: Any) -> None:
    first = engines("HardenedTieringOffloadingSpec").workers()
    second = engines("HardenedTieringOffloadingSpec").spawn("worker", 0)
    info = report(second)
    assert info["code"] == "engine_id_collision"
    assert info["pid"] in {i["pid"] for _, i in first}
    assert second.wait(timeout=30) == 3


def test_a_stale_tiering_leftover_of_a_killed_engine_is_replaced(engines: Any,
                                                                  engine_id: str) -> None:
    old = engines("HardenedTieringOffloadingSpec").workers()
    _bytes_agree(old)
    for p, _ in old:
        p.kill()
        p.wait(timeout=10)
    assert Path(f"/dev/shm/vllm_offload_{engine_id}.mmap").exists()  # leaked, as in vLLM
    new = engines("HardenedTieringOffloadingSpec").workers()
    for rank, (p, _) in enumerate(new):
        assert ask(p, f"check {rank + 3}") == '{"match": false}'  # fresh bytes, not stale
    assert {i["ino"] for _, i in new}.isdisjoint({i["ino"] for _, i in old})
