"""`vllm-offload benchmark` with tiny sizes: envelope, figures present, nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import run_cli_subprocess, wait_until

from vllm_offload_cli.core.base.extras import import_torch
from vllm_offload_cli.core.transfer.bench import PATTERNS, BenchConfig, run_benchmark

TINY = ("--size", "1MiB", "--cpu-page-size", "16KiB,64KiB", "--repeat", "1",
        "--blocks-per-transfer", "4")
NO_GPU = not import_torch().cuda.is_available()


def test_json_envelope_has_every_figure_and_the_region_is_gone(cli: Any, shm_dir: Path) -> None:
    result = cli("benchmark", "--device", "cpu", "--json", "--shm-dir", str(shm_dir), *TINY)
    assert result.exit_code == 0, result.stdout + result.stderr
    doc = result.json
    assert set(doc) == {"schema_version", "command", "ok", "exit_code", "data", "errors",
                        "warnings"}
    assert (doc["command"], doc["ok"], doc["exit_code"], doc["errors"]) == (
        "benchmark", True, 0, [])
    data = doc["data"]
    assert data["device"] == "cpu" and data["pinned"] is None and data["removed"] is True
    assert data["engine_id"].startswith(f"bench-{os.getpid()}-")
    assert [p["block_bytes"] for p in data["prefault"]] == [16384, 65536]
    assert all(p["gbps"] > 0 for p in data["prefault"])
    rows = data["rows"]
    assert [(r["block_bytes"], r["pattern"]) for r in rows] == [
        (size, pattern) for size in (16384, 65536) for pattern in PATTERNS]
    for row in rows:
        assert row["mode"] == "cpu" and row["verified"] is True
        assert row["blocks_per_transfer"] == 4
        assert row["transfer_bytes"] == 4 * row["block_bytes"]
        for side in ("store", "load"):
            figure = row[side]
            assert figure["gbps"] > 0 and figure["memcpy_gbps"] > 0
            assert figure["ratio"] == pytest.approx(figure["gbps"] / figure["memcpy_gbps"],
                                                    abs=1e-3)
            assert figure["method"]
    assert set(data["target"]["patterns"]) == set(PATTERNS)
    assert {p: v["ratio"] for p, v in data["target"]["patterns"].items()} == {
        "contiguous": 0.9, "device-scattered": 0.8, "scattered": 0.75}
    # the rule each job was copied by: fixed by the pattern, the same in every run
    methods = {(r["pattern"], side): r[side]["method"] for r in rows
               for side in ("store", "load")}
    assert methods == {("contiguous", "store"): "slice", ("contiguous", "load"): "slice",
                       ("device-scattered", "store"): "gather",
                       ("device-scattered", "load"): "scatter",
                       ("scattered", "store"): "batched", ("scattered", "load"): "batched"}
    assert "copy_costs" not in data
    assert list(shm_dir.iterdir()) == []


def test_table_on_stdout(cli: Any, shm_dir: Path) -> None:
    result = cli("benchmark", "--device", "cpu", "--shm-dir", str(shm_dir), *TINY,
                 "--pattern", "scattered", "--world-size", "2")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "Pre-fault" in out and "removed" in out and "world size 2" in out
    assert "scattered" in out and "contiguous" not in out
    assert "memcpy" in out and "Target" in out
    # one line per row, never cut, whatever the width (COLUMNS is set by the fixture or not)
    (header,) = [line for line in out.splitlines() if line.startswith("BLOCK ")]
    assert header.split()[-4:] == ["STORED", "BY", "LOADED", "BY"]
    rows = [line for line in out.splitlines() if line.split()[1:2] == ["scattered"]]
    assert rows and all(line.split()[-2:] == ["batched", "batched"] for line in rows)
    assert not [line for line in out.splitlines() if line != line.rstrip() or "…" in line]
    assert list(shm_dir.iterdir()) == []


@pytest.mark.skipif(not NO_GPU, reason="this host has a GPU")
def test_cuda_without_a_gpu_is_exit_5(cli: Any, shm_dir: Path) -> None:
    result = cli("benchmark", "--device", "cuda", "--json", "--shm-dir", str(shm_dir), *TINY)
    assert result.exit_code == 5
    (error,) = result.json["errors"]
    assert error["code"] == "no_device"
    assert "no CUDA device is available" in error["message"] and "--device cpu" in \
        error["message"]
    human = cli("benchmark", "--device", "cuda", "--shm-dir", str(shm_dir), *TINY)
    assert human.exit_code == 5 and human.stderr.startswith("Error: --device cuda")
    assert list(shm_dir.iterdir()) == []


@pytest.mark.parametrize(("args", "message"), [
    (("--size", "16KiB", "--cpu-page-size", "16KiB"), "it needs at least 2"),
    (("--size", "64KiB", "--cpu-page-size", "16KiB", "--blocks-per-transfer", "5"),
     "--blocks-per-transfer 5 exceeds the 4 blocks"),
    (("--cpu-page-size", "lots"), "is not a size"),
    (("--size", "1mb"), "unknown unit"),
    (("--repeat", "0"), "repeat"),
])
def test_bad_sizes_are_usage_errors(cli: Any, shm_dir: Path, args: tuple[str, ...],
                                    message: str) -> None:
    result = cli("benchmark", "--device", "cpu", "--json", "--shm-dir", str(shm_dir), *args)
    assert result.exit_code == 2, result.stdout
    assert message in result.json["errors"][0]["message"]
    assert list(shm_dir.iterdir()) == []


def test_an_interruption_mid_run_still_removes_the_region(shm_dir: Path) -> None:
    seen: list[int] = []

    def interrupt(done: int, total: int) -> None:
        seen.append(len(list(shm_dir.iterdir())))  # the scratch region and its manifest
        if done > total // 3:
            raise KeyboardInterrupt

    config = BenchConfig(shm_dir=str(shm_dir), device="cpu", size_bytes=1 << 20,
                         block_sizes=(16384, 65536), repeat=2, blocks_per_transfer=4)
    with pytest.raises(KeyboardInterrupt):
        run_benchmark(config, progress=interrupt)
    assert max(seen) == 2
    assert list(shm_dir.iterdir()) == []


def _ready(shm_dir: Path) -> bool:
    for manifest in shm_dir.glob("*.manifest.json"):
        try:
            doc = json.loads(manifest.read_text())
        except (OSError, ValueError):  # not written yet, or being replaced
            continue
        if doc.get("state") == "ready" and doc.get("attachments"):
            return True
    return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_from_outside_removes_the_region(shm_dir: Path, signum: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_offload_cli", "benchmark", "--device", "cpu", "--json",
         "--shm-dir", str(shm_dir), "--size", "8MiB", "--cpu-page-size", "64KiB",
         "--repeat", "100000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # the region is ready (its creator attached) and the copies have begun: a signal
        # during creation is the region's own tests' business
        assert wait_until(lambda: _ready(shm_dir), timeout=60), \
            "the benchmark never finished creating its region"
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert '"code": "interrupted"' in out
    assert list(shm_dir.iterdir()) == []


def test_help_lists_the_options() -> None:
    result = run_cli_subprocess("benchmark", "--help")
    assert result.exit_code == 0
    for option in ("--device", "--size", "--cpu-page-size", "--world-size",
                   "--blocks-per-transfer", "--repeat", "--pattern"):
        assert option in result.stdout


def test_the_cli_default_rounds_are_the_library_default() -> None:
    """The CLI spells the default out (importing the copy path would slow --help)."""
    from vllm_offload_cli.cli.benchmark import benchmark_cmd
    from vllm_offload_cli.core.transfer.bench import DEFAULT_REPEAT

    default = benchmark_cmd.defaults()["repeat"]
    assert default == DEFAULT_REPEAT == BenchConfig(shm_dir="/", device="cpu").repeat


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_cpu_baseline_copies_between_the_workers_own_buffers(shm_dir: Path,
                                                                  world_size: int) -> None:
    """The memcpy baseline moves the job's byte count between the device tensor's first
    bytes and the region mapping's last bytes (the same memory the jobs use), both ways."""
    from vllm_offload_cli.core.region import SharedOffloadRegion
    from vllm_offload_cli.core.region.geometry import default_row_stride
    from vllm_offload_cli.core.transfer.bench import _Baseline

    torch = import_torch()
    block, num_blocks, n = 16384, 8, 4
    row_stride = default_row_stride(world_size, block)
    region = SharedOffloadRegion("base", num_blocks, 0, row_stride, block, shm_dir=shm_dir,
                                 world_size=world_size)
    try:
        device = torch.randint(-128, 128, (num_blocks, block), dtype=torch.int8,
                               generator=torch.Generator().manual_seed(3))
        view = region.create_next_worker_view(block)
        baseline = _Baseline("cpu", n * block, device, view)
        assert baseline.nbytes == n * block and not baseline.cuda
        assert baseline.batch(store=True, count=1) > 0
        total = num_blocks * row_stride
        raw = Path(region.mmap_path).read_bytes()
        assert len(raw) == total
        head = device.view(torch.uint8).view(-1)[:n * block].numpy().tobytes()
        assert raw[total - n * block:] == head and raw[:total - n * block] == bytes(
            total - n * block)  # nothing outside the span was touched
        device.zero_()
        baseline.batch(store=False, count=1)
        assert device.view(torch.uint8).view(-1)[:n * block].numpy().tobytes() == head
        assert not device.view(-1)[n * block:].any()
        del baseline, view
    finally:
        region.cleanup()
