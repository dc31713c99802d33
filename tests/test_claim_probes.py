"""A probe of this tool is never another engine; a writer is, whatever it calls itself.

inspect measures residency through a read-only descriptor and a read-only
mapping, and gc judges a region through a read-only descriptor: the kernel
records both as unable to write (fdinfo flags, smaps VmFlags). A rank that
joins while one is open, or `preflight` against a live engine, must not name
the probe as the engine_id's other user (issue 30, finding 7).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.engine_ranks import Engine
from vllm_offload_cli.core.host.procscan import flock_holders
from vllm_offload_cli.core.region import fsguard
from vllm_offload_cli.core.system.files import FileId
from vllm_offload_cli.engine.claim import STARTUP_LOCK_NAME

PAGE = 64 * 1024
WORLD = 2
STRIDE = WORLD * PAGE
BLOCKS = 8


@pytest.fixture
def engine(shm_dir: Path) -> Iterator[Engine]:
    e = Engine(shm_dir, "prod", num_blocks=BLOCKS, row_stride=STRIDE, cpu_page_size=PAGE,
               world_size=WORLD)
    try:
        yield e
    finally:
        e.close()


def _probe(holders: Any, shm_dir: Path, mode: str = "probe") -> Any:
    return holders(mode, str(shm_dir), "prod", str(BLOCKS), "0", str(STRIDE), str(PAGE))


def test_a_rank_joins_while_a_probe_holds_the_region(engine: Engine, shm_dir: Path,
                                                      holders: Any) -> None:
    first = engine.spawn(0)
    assert first.ready()["action"] == "create"
    probe = _probe(holders, shm_dir)
    assert probe.info["ino"] == first.info["ino"]
    second = engine.spawn(1).ready()
    assert second.get("action") == "join", second  # was engine_id_collision naming the probe
    assert second["ino"] == first.info["ino"]


def _leftover(engine: Engine) -> None:
    old = engine.spawn(0)
    assert old.ready()["action"] == "create"
    old.kill()  # a SIGKILLed engine's leftover


def _claiming(shm_dir: Path, pid: int) -> bool:
    """`pid` holds the start-up lock: it is in its claim."""
    lock = FileId.of(os.stat(shm_dir / fsguard.private_dir_name() / STARTUP_LOCK_NAME))
    return any(holder == pid for holder, _ in flock_holders(lock))


def test_preflight_waits_out_a_probe_then_reclaims(engine: Engine, shm_dir: Path,
                                                   holders: Any) -> None:
    _leftover(engine)
    probe = _probe(holders, shm_dir)
    proc = subprocess.Popen([sys.executable, "-m", "vllm_offload_cli", "preflight", "prod",
                             "--size", str(BLOCKS * STRIDE), "--shm-dir", str(shm_dir),
                             "--json"], stdout=subprocess.PIPE, text=True)
    assert wait_until(lambda: _claiming(shm_dir, proc.pid))
    probe.stop()  # the probe's pass ends while preflight waits (was: exit 4 naming it)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert json.loads(out)["data"]["replicas"][0]["action"] == "reclaimed"


@pytest.mark.parametrize("mode", ["probe", "map-only"])
def test_a_probe_that_stays_is_named_as_a_reader_not_an_engine(
        engine: Engine, shm_dir: Path, holders: Any, cli: Any, mode: str) -> None:
    _leftover(engine)
    probe = _probe(holders, shm_dir, mode)
    result = cli("preflight", "prod", "--size", str(BLOCKS * STRIDE), "--shm-dir",
                 str(shm_dir), "--json")
    assert result.exit_code == 4
    error = result.json["errors"][0]
    assert error["code"] == "region_busy", error  # was engine_id_collision
    assert f"pid {probe.pid}" in error["message"] and "only read it" in error["message"]
    assert (shm_dir / "vllm_offload_prod.mmap").exists()


def test_a_writer_without_the_token_is_still_another_engine(engine: Engine, shm_dir: Path,
                                                            holders: Any) -> None:
    """The exemption is what the kernel says the holder can do, not what it calls itself:
    a process mapping the region writable is an engine's, and not this one's."""
    writer = _probe(holders, shm_dir, "vllm")
    refused = engine.spawn(0).ready()
    assert (refused.get("code"), refused.get("pid")) == ("engine_id_collision", writer.pid)


def test_a_stale_leftover_held_only_by_a_probe_is_waited_for_then_reclaimed(
        engine: Engine, shm_dir: Path, holders: Any) -> None:
    _leftover(engine)
    probe = _probe(holders, shm_dir)
    rank = engine.spawn(0)
    assert wait_until(lambda: _claiming(shm_dir, rank.proc.pid))
    probe.stop()  # the probe's pass ends while the rank waits
    info = rank.ready()
    assert info.get("action") == "reclaimed", info
