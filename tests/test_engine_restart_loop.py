"""Crash-restart loop: an engine SIGKILLed at 20 different moments leaks nothing.

Each round starts the engine's ranks at once, lets them write their slots,
and SIGKILLs all of them at a moment picked from what can be seen from
outside: at once (before any start-up step), as soon as a new region file
appears (mid start-up), or once 1, 2 or all ranks have reported. The next round
must clean up whatever that left: a whole region, a file its creator never
sized, a manifest or its temporary file. At the end: one region, the right size,
and the shm directory holds only it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.engine_ranks import Engine, Rank
from vllm_offload_cli.core.region import fsguard

PAGE = 64 * 1024
WORLD = 3
STRIDE = WORLD * PAGE
BLOCKS = 32
ROUNDS = 20
MOMENTS = ("at once", "new region file", *range(1, WORLD + 1))  # ints: ranks reported


def _dir_usage(shm_dir: Path) -> tuple[list[str], int]:
    """Region files and their bytes (the start-up lock's private directory aside)."""
    names = sorted(n for n in os.listdir(shm_dir) if n != fsguard.private_dir_name())
    return names, sum(os.stat(shm_dir / n).st_blocks * 512 for n in names)


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _new_file_or_exit(path: Path, before: int | None, ranks: list[Rank]
                      ) -> Callable[[], bool]:
    return lambda: (_inode(path) not in (None, before)
                    or any(r.proc.poll() is not None for r in ranks))


@pytest.mark.slow
def test_twenty_crash_restarts_end_with_one_region_and_no_leaked_bytes(shm_dir: Path) -> None:
    moments = [MOMENTS[i % len(MOMENTS)] for i in range(ROUNDS)]
    random.Random(1010).shuffle(moments)
    region_path = shm_dir / "vllm_offload_prod.mmap"
    leftovers: list[int] = []  # bytes the tmpfs held between rounds (before the restart)
    reclaimed = 0
    reclaimers: list[int] = []  # per start: how many ranks reclaimed something
    for moment in moments:
        engine = Engine(shm_dir, "prod", num_blocks=BLOCKS, row_stride=STRIDE,
                        cpu_page_size=PAGE, world_size=WORLD)
        try:
            before = _inode(region_path)
            ranks = [engine.spawn(k) for k in range(WORLD)]
            if moment == "new region file":
                assert wait_until(_new_file_or_exit(region_path, before, ranks), timeout=60,
                                  interval=0.001)
            reporting = 0
            for r in ranks[:moment if isinstance(moment, int) else 0]:  # write slots
                info = r.ready()
                if "error" in info:
                    raise AssertionError(info)
                reclaimed += info["reclaimed_bytes"]
                reporting += info["action"] == "reclaimed"
                r.ask("fill 9")
            reclaimers.append(reporting)
            engine.kill()
        finally:
            engine.close()
        names, used = _dir_usage(shm_dir)
        leftovers.append(used)
        # at most one region and its manifest
        assert used <= BLOCKS * STRIDE + 2 * 4096, (moment, names, used)
    assert max(reclaimers) <= 1, reclaimers

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
        # nothing else holds tmpfs memory
        assert used == region.st_blocks * 512 + manifest, (names, used, leftovers)
    finally:
        final.close()
