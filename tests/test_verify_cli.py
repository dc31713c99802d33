"""`verify-rank-layout`: plan mode through the CLI, live mode against real worker processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import Holder, run_cli_subprocess

from vllm_offload_cli.core.host import residency
from vllm_offload_cli.core.region.naming import region_path

PAGE = os.sysconf("SC_PAGE_SIZE")


def _problems(doc: dict[str, Any]) -> list[str]:
    return [p["code"] for p in doc["data"]["problems"]]


def _ask(holder: Holder, command: str) -> None:
    """Send a command that answers 'ok', and wait for the answer."""
    holder.send(command)
    assert holder.proc.stdout is not None
    assert holder.proc.stdout.readline().strip() == "ok"


# -- plan mode ---------------------------------------------------------------------------

@pytest.mark.parametrize(("world", "dp"), [(1, 1), (2, 1), (4, 2), (2, 4), (8, 1)])
def test_plan_contiguous_layouts_pass(cli: Any, world: int, dp: int) -> None:
    result = cli("verify-rank-layout", "--world-size", str(world), "--dp-size", str(dp),
                 "--json")
    assert result.exit_code == 0, result.stdout
    doc = result.json
    assert doc["ok"] and doc["data"]["ok"] and doc["errors"] == []
    data = doc["data"]
    assert (data["mode"], data["rank_source"], data["devices"]) == ("plan", "device-modulo",
                                                                    "contiguous")
    assert len(data["replicas"]) == dp
    for k, replica in enumerate(data["replicas"]):
        assert replica["engine_id_suffix"] == ("" if dp == 1 else f"_dp{k}")
        assert [w["slot"] for w in replica["workers"]] == list(range(world))
        assert [w["device_index"] for w in replica["workers"]] == [
            k * world + w for w in range(world)]
        assert {w["status"] for w in replica["workers"]} == {"ok"}


def test_plan_non_contiguous_devices_fail_with_the_colliding_workers(cli: Any) -> None:
    result = cli("verify-rank-layout", "--world-size", "2", "--devices", "0,2;1,3", "--json")
    assert result.exit_code == 3
    doc = result.json
    assert not doc["ok"] and not doc["data"]["ok"]
    assert [e["code"] for e in doc["errors"]] == ["slot_collision", "slot_collision"]
    first = doc["data"]["problems"][0]
    assert first["workers"] == [{"replica": 0, "worker": 0}, {"replica": 0, "worker": 1}]
    assert first["slot"] == 0
    assert "replica 0 workers 0 and 1 both -> slot 0" in first["message"]


def test_plan_logical_rank_passes_the_same_layout(cli: Any) -> None:
    result = cli("verify-rank-layout", "--world-size", "2", "--devices", "0,2;1,3",
                 "--rank-source", "logical", "--json")
    assert result.exit_code == 0
    assert [[w["slot"] for w in r["workers"]] for r in result.json["data"]["replicas"]] == [
        [0, 1], [0, 1]]


def test_plan_one_device_per_process_fails(cli: Any) -> None:
    result = cli("verify-rank-layout", "--world-size", "4", "--dp-size", "2", "--devices",
                 "per-process", "--json")
    assert result.exit_code == 3
    problems = result.json["data"]["problems"]
    assert [(p["code"], len(p["workers"])) for p in problems] == [("slot_collision", 4)] * 2
    assert problems[1]["message"].startswith("replica 1 workers 0, 1, 2 and 3 all -> slot 0")


def test_plan_without_dp_suffix_reports_the_shared_engine_id(cli: Any) -> None:
    result = cli("verify-rank-layout", "--world-size", "2", "--dp-size", "2",
                 "--rank-source", "logical", "--no-dp-suffix", "--json")
    assert result.exit_code == 3
    assert _problems(result.json) == ["engine_id_collision", "slot_collision",
                                      "slot_collision"]
    assert result.json["data"]["problems"][0]["replicas"] == [0, 1]


def test_plan_reads_cuda_visible_devices(cli: Any) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "2,0,3,1,4"}
    result = cli("verify-rank-layout", "--world-size", "2", "--dp-size", "2", "--devices",
                 "env", "--json", env=env)
    assert result.exit_code == 0
    workers = [w for r in result.json["data"]["replicas"] for w in r["workers"]]
    assert [(w["device_index"], w["device"]) for w in workers] == [
        (0, "2"), (1, "0"), (2, "3"), (3, "1")]
    assert [w["code"] for w in result.json["warnings"]] == ["unused_devices"]


def test_plan_table_for_people(cli: Any) -> None:
    result = cli("verify-rank-layout", "--world-size", "2", "--devices", "0,2;1,3")
    assert result.exit_code == 3
    out = result.stdout
    for column in ("REPLICA", "ENGINE ID", "WORKER", "DEVICE", "SLOT", "STATUS"):
        assert column in out
    assert "<engine_id>_dp1" in out
    assert "slot_collision" in out
    assert "FAIL: 2 problem(s)" in out
    assert result.stderr == ""
    ok = cli("verify-rank-layout", "--world-size", "2")
    assert ok.exit_code == 0
    assert "OK: every worker has its own slot" in ok.stdout


@pytest.mark.parametrize(("args", "needle"), [
    (["--world-size", "0"], "--world-size must be an integer greater than 0, got 0"),
    (["--world-size", "-3"], "--world-size must be an integer greater than 0, got -3"),
    (["--world-size", "2", "--dp-size", "0"], "--dp-size must be an integer greater than 0"),
    ([], "plan mode needs --world-size"),
    (["--world-size", "2", "--devices", "0,x"], "'x' is not a device index"),
    (["--world-size", "2", "--devices", "0,1;"], "replica 1 has no devices"),
    (["--world-size", "2", "--devices", "0,1;2"], "replica 1 has 1 device(s)"),
    (["--world-size", "2", "--dp-size", "3", "--devices", "0,1;2,3"], "--dp-size is 3"),
    (["--world-size", "2", "--devices", "env"], "CUDA_VISIBLE_DEVICES is not set"),
    (["--world-size", "2", "--rank-source", "tp"], "unknown rank source 'tp'"),
    (["--world-size", "2", "--cpu-page-size", "4096"], "--cpu-page-size only applies with an "
                                                       "ENGINE_ID"),
    (["some-engine", "--devices", "0,1"], "--devices only applies with no ENGINE_ID"),
    (["bad/id"], "engine_id 'bad/id' contains '/'"),
    (["some-engine", "--world-size", "0"], "--world-size must be greater than 0, got 0"),
    (["some-engine", "--cpu-page-size", "0"], "--cpu-page-size must be greater than 0"),
    (["some-engine", "--cpu-page-size", "4kb"], "has unknown unit 'kb'"),
    (["--world-size", "two"], "Invalid value for '--world-size'"),
])
def test_bad_input_is_one_line_and_exit_2(cli: Any, shm_dir: Path, args: list[str],
                                          needle: str) -> None:
    env = {"VLLM_OFFLOAD_SHM_DIR": str(shm_dir), "CUDA_VISIBLE_DEVICES": None}
    result = cli("verify-rank-layout", *args, env=env)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert result.stderr.startswith("Error: ")
    assert needle in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr


def test_bad_input_in_json(cli: Any, shm_dir: Path) -> None:
    result = cli("verify-rank-layout", "--world-size", "0", "--json")
    assert result.exit_code == 2
    assert result.json["errors"][0]["code"] == "invalid_layout"


def test_unknown_engine_id_is_exit_2(cli: Any, shm_dir: Path) -> None:
    result = cli("verify-rank-layout", "nobody", "--shm-dir", str(shm_dir), "--json")
    assert result.exit_code == 2
    (error,) = result.json["errors"]
    assert error["code"] == "not_found"
    assert error["message"].startswith(f"no region named nobody in {shm_dir}")


# -- live mode -----------------------------------------------------------------------------

def _region_worker(holders: Any, shm_dir: Path, engine_id: str, rank: int | str, *,
                   world: int | str = 2, blocks: int = 4, page: int = PAGE,
                   stride: int | None = None, device: int | str = "none",
                   source: str = "device-modulo") -> Holder:
    """A worker process that opens the region through the core class, as the engine would."""
    stride = stride if stride is not None else -(-2 * page // PAGE) * PAGE
    h: Holder = holders("region", str(shm_dir), engine_id, str(blocks), str(rank),
                        str(stride), str(page), str(world), str(device), source)
    return h


def _verify(cli: Any, shm_dir: Path, *args: str) -> Any:
    return cli("verify-rank-layout", *args, "--shm-dir", str(shm_dir), "--json")


def test_live_sound_layout_passes(cli: Any, holders: Any, shm_dir: Path) -> None:
    workers = [_region_worker(holders, shm_dir, "good", r, device=r) for r in (0, 1)]
    result = _verify(cli, shm_dir, "good")
    assert result.exit_code == 0, result.stdout
    data = result.json["data"]
    assert (data["mode"], data["ok"], data["geometry_source"]) == ("live", True, "manifest")
    assert data["geometry"] == {"num_blocks": 4, "row_stride": 2 * PAGE, "cpu_page_size": PAGE,
                                "world_size": 2}
    assert sorted((w["pid"], w["rank"], w["device_index"], w["rank_source"])
                  for w in data["workers"]) == sorted(
        (h.pid, r, r, "device-modulo") for r, h in enumerate(workers))
    for slot in data["slots"]:
        assert slot["status"] == "ok"
        assert slot["populated_fraction"] == 1.0
        assert slot["pages"] == 4
        assert [w["pid"] for w in slot["workers"]] == [workers[slot["slot"]].pid]
    human = cli("verify-rank-layout", "good", "--shm-dir", str(shm_dir))
    assert human.exit_code == 0
    assert "OK: sizes, ranks and slots are consistent" in human.stdout
    assert f"pid {workers[1].pid} dev 1" in human.stdout


def test_live_two_workers_on_one_rank(cli: Any, holders: Any, shm_dir: Path) -> None:
    """Each process sees only its own GPU and folds index 0: the issue's bug, live."""
    a = _region_worker(holders, shm_dir, "twins", 0, device=0)
    b = _region_worker(holders, shm_dir, "twins", 0, device=0)
    result = _verify(cli, shm_dir, "twins")
    assert result.exit_code == 3
    problems = {p["code"]: p for p in result.json["data"]["problems"]}
    assert set(problems) == {"rank_duplicate", "rank_missing", "device_shared",
                             "slot_unpopulated"}
    dup = problems["rank_duplicate"]
    assert dup["ranks"] == [0] and sorted(dup["pids"]) == sorted([a.pid, b.pid])
    assert f"rank 0 is attached 2 times: pids {a.pid} and {b.pid}" in dup["message"]
    assert problems["rank_missing"]["ranks"] == [1]
    assert problems["slot_unpopulated"]["slot"] == 1
    slots = result.json["data"]["slots"]
    assert slots[0]["status"] == "rank_duplicate,device_shared"
    assert slots[1]["status"] == "rank_missing,slot_unpopulated"


def test_live_rank_out_of_range(cli: Any, holders: Any, shm_dir: Path) -> None:
    """How a rank past the world gets recorded in reality.

    Engines open regions through vLLM's constructor, which carries no world size,
    so often no world size is recorded anywhere: the class can only check that a
    slot fits in the row. With 1 KiB slots a one-page row has room for 4, so a
    worker that computed rank 3 (the raw device index of a second replica) is let
    in. The operator knows the world size: `--world-size 2` shows rank 3 is wrong.
    """
    _region_worker(holders, shm_dir, "spill", "none", world="none", page=1024, stride=PAGE)
    _region_worker(holders, shm_dir, "spill", 0, world="none", page=1024, stride=PAGE, device=0)
    _region_worker(holders, shm_dir, "spill", 1, world="none", page=1024, stride=PAGE, device=1)
    stray = _region_worker(holders, shm_dir, "spill", 3, world="none", page=1024,
                           stride=PAGE, device=3, source="device-index")
    result = _verify(cli, shm_dir, "spill", "--world-size", "2")
    assert result.exit_code == 3
    problems = result.json["data"]["problems"]
    codes = [p["code"] for p in problems]
    assert "rank_out_of_range" in codes
    out = problems[codes.index("rank_out_of_range")]
    assert (out["ranks"], out["pids"]) == ([3], [stray.pid])
    assert f"pid {stray.pid} is attached as rank 3, outside [0, 2)" in out["message"]
    human = cli("verify-rank-layout", "spill", "--world-size", "2", "--shm-dir", str(shm_dir))
    assert "outside the row" in human.stdout


def test_joiner_past_the_recorded_world_is_refused(cli: Any, holders: Any,
                                                   shm_dir: Path) -> None:
    """Where a world size was recorded (by `create`), the core refuses such a worker."""
    created = cli("create", "spill", "--world-size", "2", "--cpu-page-size", "1KiB",
                  "--num-blocks", "4", "--no-populate", "--shm-dir", str(shm_dir))
    assert created.exit_code == 0, created.stderr
    with pytest.raises(RuntimeError, match="rank_out_of_range"):
        _region_worker(holders, shm_dir, "spill", 3, world="none", page=1024, stride=PAGE)


def _vllm_workers(holders: Any, shm_dir: Path, engine_id: str, ranks: tuple[int, ...], *,
                  world: int = 2, blocks: int = 5, page: int = PAGE) -> list[Holder]:
    """Workers that open the region as vLLM does: no manifest, no lock."""
    stride = -(-world * page // PAGE) * PAGE
    return [holders("vllm", str(shm_dir), engine_id, str(blocks), str(r), str(stride),
                    str(page)) for r in ranks]


def test_live_vllm_region_needs_its_geometry(cli: Any, holders: Any, shm_dir: Path) -> None:
    _vllm_workers(holders, shm_dir, "bare", (0, 1))
    result = _verify(cli, shm_dir, "bare")
    assert result.exit_code == 2
    assert "has no manifest (made by vLLM?)" in result.json["errors"][0]["message"]
    assert "--world-size and --cpu-page-size" in result.json["errors"][0]["message"]


def test_live_vllm_region_with_the_right_geometry_passes(cli: Any, holders: Any,
                                                         shm_dir: Path) -> None:
    for worker in _vllm_workers(holders, shm_dir, "bare", (0, 1)):
        _ask(worker, "fill 7")
    result = _verify(cli, shm_dir, "bare", "--world-size", "2", "--cpu-page-size", str(PAGE))
    assert result.exit_code == 0, result.stdout
    data = result.json["data"]
    assert data["geometry_source"] == "arguments"
    assert data["geometry"]["num_blocks"] == 5
    assert [s["populated_fraction"] for s in data["slots"]] == [1.0, 1.0]
    assert [w["code"] for w in result.json["warnings"]] == ["no_manifest"]


def test_live_vllm_region_with_a_wrong_world_size(cli: Any, holders: Any,
                                                  shm_dir: Path) -> None:
    """5 rows of 2 slots are 10 pages; rows of 4 slots do not divide them."""
    for worker in _vllm_workers(holders, shm_dir, "bare", (0, 1)):
        _ask(worker, "fill 7")
    result = _verify(cli, shm_dir, "bare", "--world-size", "4", "--cpu-page-size", str(PAGE))
    assert result.exit_code == 3
    (problem,) = result.json["data"]["problems"]
    assert problem["code"] == "size_mismatch"
    assert (f"is {10 * PAGE} bytes, not a whole number of rows of {4 * PAGE} bytes"
            in problem["message"])
    assert "2 rows and" in problem["message"]


def test_live_slot_never_populated_in_a_vllm_region(cli: Any, holders: Any,
                                                    shm_dir: Path) -> None:
    first, _second = _vllm_workers(holders, shm_dir, "half", (0, 1))
    _ask(first, "fill 1")  # the second worker attached but never wrote
    result = _verify(cli, shm_dir, "half", "--world-size", "2", "--cpu-page-size", str(PAGE))
    assert result.exit_code == 3
    (problem,) = result.json["data"]["problems"]
    assert (problem["code"], problem["slot"]) == ("slot_unpopulated", 1)
    assert "slot 1 (bytes" in problem["message"]
    assert [s["status"] for s in result.json["data"]["slots"]] == ["ok", "slot_unpopulated"]


def test_live_slot_never_populated_by_region_workers(cli: Any, holders: Any,
                                                     shm_dir: Path) -> None:
    stride = 3 * PAGE
    for rank in (0, 2):
        _region_worker(holders, shm_dir, "gap", rank, world=3, stride=stride, device=rank)
    result = _verify(cli, shm_dir, "gap")
    assert result.exit_code == 3
    assert _problems(result.json) == ["rank_missing", "slot_unpopulated"]
    assert result.json["data"]["problems"][1]["slot"] == 1
    assert "no live worker claims it" in result.json["data"]["problems"][1]["message"]


def test_live_check_faults_nothing_in_and_changes_nothing(cli: Any, holders: Any,
                                                          shm_dir: Path) -> None:
    (worker,) = _vllm_workers(holders, shm_dir, "quiet", (0,), blocks=8)
    _ask(worker, "write 3 9")
    path = region_path(shm_dir, "quiet")
    before = os.stat(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        resident_before = residency.resident_bytes(fd)
        result = _verify(cli, shm_dir, "quiet", "--world-size", "2", "--cpu-page-size",
                         str(PAGE))
        assert residency.resident_bytes(fd) == resident_before == PAGE
    finally:
        os.close(fd)
    after = os.stat(path)
    assert (after.st_mtime_ns, after.st_size, after.st_mode) == (
        before.st_mtime_ns, before.st_size, before.st_mode)
    slots = result.json["data"]["slots"]
    assert [(s["resident_pages"], s["pages"]) for s in slots] == [(1, 8), (0, 8)]


def test_live_mixed_rank_sources(cli: Any, holders: Any, shm_dir: Path) -> None:
    _region_worker(holders, shm_dir, "mixed", 0, device=0, source="device-modulo")
    other = _region_worker(holders, shm_dir, "mixed", 1, device=1, source="logical")
    result = _verify(cli, shm_dir, "mixed")
    assert result.exit_code == 3
    (problem,) = result.json["data"]["problems"]
    assert problem["code"] == "mixed_rank_sources"
    assert other.pid in problem["pids"]


def test_live_one_gpu_per_process_with_logical_ranks_passes(cli: Any, holders: Any,
                                                            shm_dir: Path) -> None:
    """Every worker sees index 0 of its own GPU; logical ranks keep them apart."""
    for rank in (0, 1):
        _region_worker(holders, shm_dir, "ray", rank, device=0, source="logical")
    result = _verify(cli, shm_dir, "ray")
    assert result.exit_code == 0, result.stdout
    assert [w["code"] for w in result.json["warnings"]] == ["device_index_shared"]


def test_live_world_size_contradicting_the_manifest(cli: Any, holders: Any,
                                                    shm_dir: Path) -> None:
    for rank in (0, 1):
        _region_worker(holders, shm_dir, "told", rank, device=rank)
    result = _verify(cli, shm_dir, "told", "--world-size", "4")
    assert result.exit_code == 3
    (problem,) = result.json["data"]["problems"]
    assert problem["code"] == "geometry_mismatch"
    assert "records world size 2, --world-size says 4" in problem["message"]


def test_live_ignores_workers_that_died(cli: Any, holders: Any, shm_dir: Path) -> None:
    _region_worker(holders, shm_dir, "ghost", 0, device=0)
    _region_worker(holders, shm_dir, "ghost", 1, device=1)
    crashed = _region_worker(holders, shm_dir, "ghost", 1, device=1)
    crashed.kill()  # SIGKILL: its attachment stays in the manifest
    result = _verify(cli, shm_dir, "ghost")
    assert result.exit_code == 0, result.stdout
    assert result.json["data"]["stale_attachments"] == 1


def test_live_refuses_to_follow_a_symlink(cli: Any, shm_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"\0" * PAGE)
    os.symlink(target, region_path(shm_dir, "link"))
    result = _verify(cli, shm_dir, "link", "--world-size", "1", "--cpu-page-size", str(PAGE))
    assert result.exit_code == 6
    assert result.json["errors"][0]["code"] == "symlink"


def test_live_check_in_a_real_process_does_not_import_torch(holders: Any,
                                                            shm_dir: Path) -> None:
    for rank in (0, 1):
        _region_worker(holders, shm_dir, "lean", rank, device=rank)
    script = ("import sys; from vllm_offload_cli.cli.app import main\n"
              "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
              "    print('torch' in sys.modules, e.code, file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", script, "verify-rank-layout", "lean",
                           "--shm-dir", str(shm_dir)], capture_output=True, text=True,
                          timeout=60)
    assert proc.stderr.strip().splitlines()[-1] == "False 0"
    real = run_cli_subprocess("verify-rank-layout", "lean", "--shm-dir", str(shm_dir), "--json")
    assert real.exit_code == 0
    assert real.json["data"]["ok"] is True


def _provisioned(cli: Any, shm_dir: Path, engine_id: str) -> Path:
    """A region pre-provisioned by `create` for 2 workers, with its manifest, nobody attached."""
    created = cli("create", engine_id, "--world-size", "2", "--cpu-page-size", str(PAGE),
                  "--num-blocks", "4", "--shm-dir", str(shm_dir))
    assert created.exit_code == 0, created.stderr
    return region_path(shm_dir, engine_id)


def test_live_file_shorter_than_its_manifest(cli: Any, shm_dir: Path) -> None:
    path = _provisioned(cli, shm_dir, "short")
    os.truncate(path, 3 * PAGE)  # one and a half rows of the four the manifest records
    result = _verify(cli, shm_dir, "short")
    assert result.exit_code == 3
    (problem,) = result.json["data"]["problems"]
    assert problem["code"] == "size_mismatch"
    assert f"is {3 * PAGE} bytes but its manifest geometry needs {8 * PAGE}" in (
        problem["message"])
    # residency is read over the one whole row that is there
    assert [s["pages"] for s in result.json["data"]["slots"]] == [1, 1]
    assert [w["code"] for w in result.json["warnings"]] == ["no_workers"]


def test_live_corrupt_manifest(cli: Any, shm_dir: Path) -> None:
    _provisioned(cli, shm_dir, "garbled")
    manifest = shm_dir / "vllm_offload_garbled.manifest.json"
    manifest.write_text("{not json")
    result = _verify(cli, shm_dir, "garbled")
    assert result.exit_code == 3
    assert _problems(result.json) == ["manifest_invalid", "geometry_unknown"]
    told = _verify(cli, shm_dir, "garbled", "--world-size", "2", "--cpu-page-size", str(PAGE))
    assert told.exit_code == 3
    assert _problems(told.json) == ["manifest_invalid"]
    assert told.json["data"]["geometry_source"] == "arguments"
    assert [s["populated_fraction"] for s in told.json["data"]["slots"]] == [1.0, 1.0]


def test_live_symlinked_manifest_is_a_problem_not_followed(cli: Any, shm_dir: Path,
                                                          tmp_path: Path) -> None:
    _provisioned(cli, shm_dir, "planted")
    manifest = shm_dir / "vllm_offload_planted.manifest.json"
    decoy = tmp_path / "decoy.json"
    decoy.write_text(manifest.read_text())
    manifest.unlink()
    manifest.symlink_to(decoy)
    result = _verify(cli, shm_dir, "planted", "--world-size", "2", "--cpu-page-size",
                     str(PAGE))
    assert result.exit_code == 3
    assert _problems(result.json) == ["manifest_symlink"]


def test_a_region_nobody_joined_says_so_instead_of_a_population(cli: Any,
                                                                shm_dir: Path) -> None:
    """create pre-faults every slot: 100% there would say nothing about any worker."""
    made = cli("create", "fresh", "--world-size", "2", "--cpu-page-size", str(PAGE),
               "--num-blocks", "4", "--shm-dir", str(shm_dir))
    assert made.exit_code == 0, made.stderr
    doc = _verify(cli, shm_dir, "fresh").json
    assert doc["data"]["joined"] is False
    human = cli("verify-rank-layout", "fresh", "--shm-dir", str(shm_dir))
    rows = [line for line in human.stdout.splitlines() if line.lstrip()[:1].isdigit()]
    assert len(rows) == 2 and all("not joined yet" in row for row in rows)
    assert "%" not in "".join(rows)
    assert not [line for line in human.stdout.splitlines() if line != line.rstrip()]
