"""Crash-restart loop: an engine SIGKILLed at random moments, 20 times, leaks nothing.

Each round starts the engine's ranks at once, lets them write their slots,
and SIGKILLs all of them at a random moment (before, during or after their
start-up steps). The next round must clean up whatever that left: a whole
region, a file its creator never sized, a manifest or its temporary file.
At the end: one region, the right size, and the shm directory holds only it.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from tests.engine_ranks import Engine
from vllm_offload_cli.core.region import fsguard

PAGE = 64 * 1024
WORLD = 3
STRIDE = WORLD * PAGE
BLOCKS = 32
ROUNDS = 20


def _dir_usage(shm_dir: Path) -> tuple[list[str], int]:
    """Region files and their bytes (the start-up lock's private directory aside)."""
    names = sorted(n for n in os.listdir(shm_dir) if n != fsguard.private_dir_name())
    return names, sum(os.stat(shm_dir / n).st_blocks * 512 for n in names)


@pytest.mark.slow
def test_twenty_crash_restarts_end_with_one_region_and_no_leaked_bytes(shm_dir: Path) -> None:
    rng = random.Random(1010)
    leftovers: list[int] = []  # bytes the tmpfs held between rounds (before the restart)
    reclaimed = 0
    reclaimers: list[int] = []  # per start: how many ranks reclaimed something
    left_region = 0  # rounds whose kill left a region file behind
    for _ in range(ROUNDS):
        engine = Engine(shm_dir, "prod", num_blocks=BLOCKS, row_stride=STRIDE,
                        cpu_page_size=PAGE, world_size=WORLD)
        try:
            ranks = [engine.spawn(k) for k in range(WORLD)]
            deadline = time.monotonic() + rng.uniform(0.0, 1.5)
            reporting = 0
            for r in ranks:  # write slots as ranks come up, until the kill moment
                if time.monotonic() >= deadline:
                    break
                info = r.ready()
                if "error" in info:
                    raise AssertionError(info)
                reclaimed += info["reclaimed_bytes"]
                reporting += info["action"] == "reclaimed"
                r.ask("fill 9")
            reclaimers.append(reporting)
            time.sleep(max(0.0, deadline - time.monotonic()))
            engine.kill()
        finally:
            engine.close()
        names, used = _dir_usage(shm_dir)
        leftovers.append(used)
        left_region += "vllm_offload_prod.mmap" in names
        assert used <= BLOCKS * STRIDE + 2 * 4096  # at most one region and its manifest
    assert max(reclaimers) <= 1

    final = Engine(shm_dir, "prod", num_blocks=BLOCKS, row_stride=STRIDE, cpu_page_size=PAGE,
                   world_size=WORLD)
    try:
        ranks = final.start(WORLD)
        assert all(r.ok for r in ranks), [r.info for r in ranks]
        reclaimed += sum(r.info["reclaimed_bytes"] for r in ranks)
        assert sum(r.info["action"] == "reclaimed" for r in ranks) <= 1
        for r in ranks:
            assert r.ask("zero") == '{"zero": true}'  # a fresh region, never the old bytes
            r.ask("fill 1")
        names, used = _dir_usage(shm_dir)
        assert names == ["vllm_offload_prod.manifest.json", "vllm_offload_prod.mmap"]
        region = os.stat(shm_dir / "vllm_offload_prod.mmap")
        assert region.st_size == BLOCKS * STRIDE
        manifest = os.stat(shm_dir / "vllm_offload_prod.manifest.json").st_blocks * 512
        assert used == region.st_blocks * 512 + manifest  # nothing else holds tmpfs memory
        print(f"\nrestart loop: {ROUNDS} SIGKILLed starts, {left_region} left a region file; "
              f"reclaiming ranks per start {reclaimers}; tmpfs held between rounds "
              f"max {max(leftovers)} B (one leftover region at most, "
              f"{BLOCKS * STRIDE} B); reclaimed {reclaimed} B in total by exactly one rank "
              f"per start; at the end {names} using {used} B")
    finally:
        final.close()
