"""Capacity pre-flight: tmpfs, memory cgroup (v1 and v2) and MemAvailable."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_offload_cli.core.base.errors import InsufficientSpaceError
from vllm_offload_cli.core.region.capacity import (
    Capacity,
    ShmUsage,
    check_fits,
    measure,
)
from vllm_offload_cli.core.system.memory import cgroup_headroom

GiB = 1 << 30


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cgroup_v2_takes_the_tightest_ancestor(tmp_path: Path) -> None:
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    _tree(proc, {"self/cgroup": "0::/kubepods/pod1/ctr\n"})
    _tree(cg, {
        "kubepods/memory.max": str(100 * GiB), "kubepods/memory.current": str(10 * GiB),
        "kubepods/pod1/memory.max": str(8 * GiB), "kubepods/pod1/memory.current": str(5 * GiB),
        "kubepods/pod1/ctr/memory.max": "max", "kubepods/pod1/ctr/memory.current": "0",
    })
    assert cgroup_headroom(proc, cg) == (8 * GiB, 3 * GiB)


def test_cgroup_v1_and_unlimited(tmp_path: Path) -> None:
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    _tree(proc, {"self/cgroup": "12:cpu,cpuacct:/x\n4:memory:/docker/abc\n"})
    _tree(cg, {"memory/docker/abc/memory.limit_in_bytes": str(2 * GiB),
               "memory/docker/abc/memory.usage_in_bytes": str(GiB // 2)})
    assert cgroup_headroom(proc, cg) == (2 * GiB, GiB + GiB // 2)
    _tree(cg, {"memory/docker/abc/memory.limit_in_bytes": str(1 << 62)})
    assert cgroup_headroom(proc, cg) == (None, None)
    assert cgroup_headroom(tmp_path / "absent", cg) == (None, None)


def test_cgroup_v1_takes_the_tightest_ancestor_too(tmp_path: Path) -> None:
    """A pod's limit one level above the container's (v1's hierarchy) was missed, so
    `create` was OOM-killed instead of exiting 5 (issue 30, finding 11)."""
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    _tree(proc, {"self/cgroup": "4:memory:/kubepods/pod1/ctr\n"})
    _tree(cg, {
        "memory/memory.limit_in_bytes": str(1 << 62), "memory/memory.usage_in_bytes": "0",
        "memory/kubepods/pod1/memory.limit_in_bytes": str(4 * GiB),
        "memory/kubepods/pod1/memory.usage_in_bytes": str(3 * GiB),
        "memory/kubepods/pod1/ctr/memory.limit_in_bytes": str(1 << 62),
        "memory/kubepods/pod1/ctr/memory.usage_in_bytes": str(GiB),
    })
    assert cgroup_headroom(proc, cg) == (4 * GiB, GiB)


def _cap(shm_free: int, cg_free: int | None, avail: int | None) -> Capacity:
    return Capacity(shm=ShmUsage(64 * GiB, shm_free),
                    cgroup_limit_bytes=None if cg_free is None else 99 * GiB,
                    cgroup_free_bytes=cg_free, mem_available_bytes=avail)


@pytest.mark.parametrize(("cap", "code", "hint"), [
    (_cap(1 * GiB, None, None), "shm_full", "--shm-size"),
    (_cap(9 * GiB, 1 * GiB, None), "cgroup_limit", "memory limit"),
    (_cap(9 * GiB, 9 * GiB, 1 * GiB), "memory", "available on this host"),
])
def test_each_limit_is_named_with_a_fix(cap: Capacity, code: str, hint: str) -> None:
    with pytest.raises(InsufficientSpaceError) as info:
        check_fits(2 * GiB, cap, shm_dir="/dev/shm")
    assert info.value.code == code and hint in info.value.message
    assert "2GiB" in info.value.message


def test_fits() -> None:
    check_fits(GiB, _cap(2 * GiB, 2 * GiB, 2 * GiB), shm_dir="/dev/shm")


def test_measure_this_machine(shm_dir: Path) -> None:
    cap = measure(shm_dir)
    assert 0 < cap.shm.free_bytes <= cap.shm.total_bytes
    assert cap.mem_available_bytes is None or cap.mem_available_bytes > 0
