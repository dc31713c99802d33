"""NUMA placement and huge pages: chosen by `create`, observed by `inspect` and
`verify-rank-layout`.

Everything runs against this host's real kernel: its NUMA nodes (usually one
here), its THP settings and real tmpfs files. What the host lacks is skipped,
never faked; the one place a topology is passed in is the multi-node
comparison rule, fed with real move_pages answers.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import Holder, require_root, wait_until

from vllm_offload_cli.core.host import observed_placement as observed
from vllm_offload_cli.core.layout import check
from vllm_offload_cli.core.region import manifest as manifest_io
from vllm_offload_cli.core.region import page_policy
from vllm_offload_cli.core.region.geometry import Geometry
from vllm_offload_cli.core.system import libc, memory, mounts, processes
from vllm_offload_cli.core.system.files import FileId

PAGE = os.sysconf("SC_PAGE_SIZE")
TOPO = memory.topology()
FIRST_NODE = TOPO.nodes[0]
NUMA_CALLS = pytest.mark.skipif(not libc.numa_syscalls_available(),
                                reason="no NUMA system call numbers for this architecture")


def _create(cli: Any, shm_dir: Path, engine_id: str, *extra: str, size: str = "4MiB") -> Any:
    return cli("create", engine_id, "--world-size", "2", "--cpu-page-size", "64KiB",
               "--size", size, "--shm-dir", str(shm_dir), "--json", *extra)


# -- topology ------------------------------------------------------------------------------

def test_cpulist_parsing() -> None:
    assert memory.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert memory.parse_cpulist("") == frozenset()
    with pytest.raises(ValueError):
        memory.parse_cpulist("3-1")
    with pytest.raises(ValueError):
        memory.parse_cpulist("x")


def test_host_topology_has_this_process_cpus() -> None:
    mine = processes.allowed_cpus(os.getpid())
    assert mine is not None and mine
    assert TOPO.nodes_of_cpus(mine), "every CPU this process may use belongs to a node"
    assert set(TOPO.with_memory) <= set(TOPO.nodes)


def test_missing_sysfs_is_one_node_not_a_crash(tmp_path: Path) -> None:
    topo = memory.topology(str(tmp_path / "absent"))
    assert topo.nodes == (0,) and topo.single_node and not topo.from_sysfs
    assert topo.with_memory == {0}
    assert processes.allowed_cpus(2**22 + 12345) is None  # no such process


def test_garbage_in_sysfs_is_tolerated(tmp_path: Path) -> None:
    (tmp_path / "online").write_text("0-1\n")
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "cpulist").write_text("0-3\n")
    (tmp_path / "node1").mkdir()
    (tmp_path / "node1" / "cpulist").write_text("garbage\n")
    (tmp_path / "has_memory").write_text("0\n")
    topo = memory.topology(str(tmp_path))
    assert topo.nodes == (0, 1) and topo.cpus[1] == frozenset()
    assert topo.with_memory == {0}


# -- chosen: --numa-node ---------------------------------------------------------------------

def _mapping_policy(pid: int, ino: int) -> str:
    """The memory policy numa_maps shows for `pid`'s mapping of inode `ino`."""
    starts = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and int(fields[4]) == ino:
                starts.add(int(fields[0].split("-")[0], 16))
    with open(f"/proc/{pid}/numa_maps") as f:
        for line in f:
            addr, policy = line.split()[:2]
            if int(addr, 16) in starts:
                return policy
    raise AssertionError(f"pid {pid} does not map inode {ino}")


@NUMA_CALLS
def test_create_binds_pages_to_the_node(cli: Any, shm_dir: Path) -> None:
    result = _create(cli, shm_dir, "bound", "--numa-node", str(FIRST_NODE))
    assert result.exit_code == 0, result.stdout + result.stderr
    data = result.json["data"]
    assert data["placement"] == {"numa_policy": "bind", "numa_nodes": [FIRST_NODE],
                                 "huge_pages": "never", "huge_pages_advised": False,
                                 "huge_page_bytes": None}
    m = manifest_io.read(data["manifest"])
    assert m.placement is not None and m.placement["numa_policy"] == "bind"
    assert m.placement["numa_nodes"] == [FIRST_NODE]
    # the shared policy lives on the file: a later mapping (here vLLM-like, no core)
    # shows it in numa_maps, and every page it maps is on that node
    h = Holder("vllm", str(shm_dir), "bound", str(data["geometry"]["num_blocks"]), "none",
               str(data["geometry"]["row_stride"]), "65536")
    try:
        assert _mapping_policy(h.pid, h.info["ino"]) == f"bind:{FIRST_NODE}"
        inspected = cli("inspect", "bound", "--shm-dir", str(shm_dir), "--json").json
        (region,) = inspected["data"]["regions"]
        assert region["numa_nodes"] == {str(FIRST_NODE): data["size_bytes"]}
        assert region["placement"]["requested"]["numa_policy"] == "bind"
    finally:
        h.close()


@NUMA_CALLS
@pytest.mark.parametrize(("policy", "expected"), [("interleave", "interleave"),
                                                  ("preferred", "prefer")])
def test_other_policies_reach_the_kernel(cli: Any, shm_dir: Path, holders: Any, policy: str,
                                         expected: str) -> None:
    extra = ["--numa-policy", policy]
    if policy == "preferred":
        extra += ["--numa-node", str(FIRST_NODE)]
    result = _create(cli, shm_dir, policy, *extra)
    assert result.exit_code == 0, result.stdout + result.stderr
    data = result.json["data"]
    assert data["placement"]["numa_policy"] == policy
    assert data["placement"]["numa_nodes"] == sorted(TOPO.with_memory) if (
        policy == "interleave") else [FIRST_NODE]
    h = holders("vllm", str(shm_dir), policy, str(data["geometry"]["num_blocks"]), "none",
                str(data["geometry"]["row_stride"]), "65536")
    assert _mapping_policy(h.pid, h.info["ino"]).startswith(expected)


@pytest.mark.parametrize("spec", ["999", "0,999", "-1", "x", "0-", ""])
def test_a_node_that_does_not_exist_is_exit_2_and_creates_nothing(cli: Any, shm_dir: Path,
                                                                   spec: str) -> None:
    result = _create(cli, shm_dir, "nowhere", "--numa-node", spec)
    assert result.exit_code == 2, result.stdout
    (error,) = result.json["errors"]
    assert error["code"] == "invalid_numa_node"
    assert spec in error["message"] or "999" in error["message"]
    assert list(shm_dir.iterdir()) == []
    human = cli("create", "nowhere", "--world-size", "1", "--cpu-page-size", "4KiB",
                "--size", "1MiB", "--shm-dir", str(shm_dir), "--numa-node", spec)
    assert human.exit_code == 2
    assert human.stderr.count("Error:") == 1 and "Traceback" not in human.stderr
    assert list(shm_dir.iterdir()) == []


def test_preferred_takes_one_node(cli: Any, shm_dir: Path) -> None:
    result = _create(cli, shm_dir, "two", "--numa-policy", "preferred", "--numa-node",
                     f"{FIRST_NODE},{FIRST_NODE + 1}")
    assert result.exit_code == 2
    assert list(shm_dir.iterdir()) == []


def test_bind_without_a_node_is_exit_2(cli: Any, shm_dir: Path) -> None:
    result = _create(cli, shm_dir, "nonode", "--numa-policy", "bind")
    assert result.exit_code == 2
    assert "needs a node" in result.json["errors"][0]["message"]
    assert list(shm_dir.iterdir()) == []


@NUMA_CALLS
def test_core_class_takes_the_placement(shm_dir: Path) -> None:
    """The engine's way in: keyword-only extras on SharedOffloadRegion."""
    from vllm_offload_cli.core.region.shared_region import SharedOffloadRegion

    g = Geometry.for_workers(num_blocks=8, world_size=2, cpu_page_size=PAGE)
    with SharedOffloadRegion("engine", g.num_blocks, None, g.row_stride, g.cpu_page_size,
                             shm_dir=shm_dir, world_size=2, numa_node=FIRST_NODE) as region:
        assert region.placement.numa_policy == "bind"
        m = manifest_io.read(region.manifest_path)
        assert m.placement == {"numa_policy": "bind", "numa_nodes": [FIRST_NODE],
                               "huge_pages": "never", "huge_pages_advised": False}
        assert _mapping_policy(os.getpid(), region.identity.ino) == f"bind:{FIRST_NODE}"
    with pytest.raises(Exception) as info:
        SharedOffloadRegion("engine2", g.num_blocks, None, g.row_stride, g.cpu_page_size,
                            shm_dir=shm_dir, world_size=2, numa_node=4095)
    assert getattr(info.value, "code", None) == "invalid_numa_node"
    assert list(shm_dir.iterdir()) == []


# -- manifest ----------------------------------------------------------------------------------

def test_manifest_without_placement_is_read(cli: Any, shm_dir: Path) -> None:
    result = _create(cli, shm_dir, "plain")
    assert result.exit_code == 0
    doc = json.loads(Path(result.json["data"]["manifest"]).read_text())
    assert "placement" not in doc  # default placement: the manifest is as before
    assert manifest_io.read(result.json["data"]["manifest"]).placement is None


@pytest.mark.parametrize("bad", [
    "nope", {"numa_policy": "everywhere"}, {"numa_nodes": ["0"]}, {"numa_nodes": [-1]},
    {"numa_nodes": [True]}, {"huge_pages": "sometimes"}, {"huge_pages_advised": "yes"},
])
def test_manifest_with_a_bad_placement_is_corrupt(cli: Any, shm_dir: Path, bad: Any) -> None:
    result = _create(cli, shm_dir, "tampered")
    mpath = Path(result.json["data"]["manifest"])
    doc = json.loads(mpath.read_text())
    doc["placement"] = bad
    mpath.write_text(json.dumps(doc))
    with pytest.raises(manifest_io.ManifestError):
        manifest_io.read(str(mpath))
    inspected = cli("inspect", "tampered", "--shm-dir", str(shm_dir), "--json")
    assert inspected.exit_code == 0  # hostile input: reported, never a crash
    (region,) = inspected.json["data"]["regions"]
    assert "manifest_invalid" in [p["code"] for p in region["problems"]]


# -- huge pages ----------------------------------------------------------------------------------

def test_thp_support_follows_the_kernel_and_the_mount(tmp_path: Path) -> None:
    table = [mounts.Mount(point, fstype, mounts.parse_options(options)) for point, fstype, options
             in (("/", "ext4", "rw,relatime"), ("/dev/shm", "tmpfs", "rw,nosuid,size=1024k"),
                 ("/mnt/huge", "tmpfs", "rw,size=1024k,huge=advise"),
                 ("/mnt/always x", "tmpfs", "rw,huge=within_size"))]

    def support(setting: str, where: str) -> page_policy.ThpSupport:
        return page_policy.judge_thp(where, memory.selected_word(setting), table)

    assert not support("always within_size advise [never] deny force", "/dev/shm").allowed
    assert support("always within_size advise [never] deny force", "/mnt/huge").allowed
    assert support("[always] within_size advise never deny force", "/mnt/always x").allowed
    denied = support("always within_size advise never [deny] force", "/mnt/huge")
    assert not denied.allowed and "deny" in denied.reason
    assert support("always within_size advise never deny [force]", "/dev/shm").allowed
    other = support("[advise] never", str(tmp_path))
    assert not other.allowed and "not on tmpfs" in other.reason
    missing = page_policy.judge_thp("/dev/shm", None, table)
    assert not missing.allowed


def test_the_mount_table_is_this_hosts(shm_dir: Path) -> None:
    """psutil's table, read for real: the shm directory is on tmpfs, /proc is proc."""
    table = mounts.mounts()
    held = mounts.mount_of(os.path.realpath(shm_dir), table)
    assert held is not None and held.fstype == "tmpfs" and "size" in held.options
    proc = mounts.top_mount_at("/proc", table)
    assert proc is not None and proc.fstype == "proc"


def test_huge_pages_where_the_kernel_refuses(cli: Any, shm_dir: Path) -> None:
    support = page_policy.thp_support(shm_dir)
    if support.allowed:
        pytest.skip(f"this host gives huge pages in {shm_dir} ({support.setting})")
    always = _create(cli, shm_dir, "huge", "--huge-pages", "always")
    assert always.exit_code == 5, always.stdout
    (error,) = always.json["errors"]
    assert error["code"] == "huge_pages_unavailable"
    assert support.setting.split("=")[-1] in error["message"]
    assert list(shm_dir.iterdir()) == []  # refused before anything was created

    auto = _create(cli, shm_dir, "huge", "--huge-pages", "auto")
    assert auto.exit_code == 0
    assert [w["code"] for w in auto.json["warnings"]] == ["huge_pages_unavailable"]
    assert auto.json["data"]["placement"]["huge_pages_advised"] is False
    m = manifest_io.read(auto.json["data"]["manifest"])
    assert m.placement is not None and m.placement["huge_pages"] == "auto"
    human = cli("create", "huge2", "--world-size", "1", "--cpu-page-size", "4KiB", "--size",
                "1MiB", "--shm-dir", str(shm_dir), "--huge-pages", "auto")
    assert human.exit_code == 0 and "huge pages not available" in human.stderr


_PRIVATE_MOUNT = """
set -e
mount -t tmpfs -o size=64m,huge=advise vllm-offload-test "$1"
shift
"$@"
"""


def _in_private_thp_mount(tmp_path: Path, script: str) -> subprocess.CompletedProcess[str]:
    """Run `script` (python) in a private mount namespace with a huge=advise tmpfs at DIR."""
    require_root("needs root for a private tmpfs mount")
    require_root("unshare(1) is not installed", granted=shutil.which("unshare") is not None)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    code = tmp_path / "script.py"
    code.write_text(script)
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           _PRIVATE_MOUNT, "sh", str(mnt), sys.executable, str(code), str(mnt)],
                          capture_output=True, text=True, timeout=120)
    require_root(f"cannot mount a private tmpfs here: {proc.stderr.strip()}",
                 granted="mount:" not in proc.stderr)
    if proc.returncode == 99:  # the kernel's THP setting, not a privilege
        pytest.skip(f"no huge pages in a huge=advise tmpfs here: {proc.stderr.strip()}")
    return proc


_HUGE_SCRIPT = """
import json, sys
from click.testing import CliRunner
from vllm_offload_cli.cli.app import app
from vllm_offload_cli.core.region.page_policy import thp_support
shm = sys.argv[1]
if not thp_support(shm).allowed:
    print(thp_support(shm).reason, file=sys.stderr)
    sys.exit(99)
run = CliRunner().invoke
out = {}
for name, mode in (("big", "always"), ("small", "never")):
    r = run(app, ["create", name, "--world-size", "1", "--cpu-page-size", "2MiB", "--size",
                  "16MiB", "--shm-dir", shm, "--huge-pages", mode, "--json"])
    out[name] = json.loads(r.stdout)
from vllm_offload_cli.core.region.shared_region import SharedOffloadRegion
held = SharedOffloadRegion("held", 8, None, 2 << 20, 2 << 20, shm_dir=shm, world_size=1,
                           huge_pages="always")  # this process is its holder
r = run(app, ["inspect", "--shm-dir", shm, "--json"])
out["inspect"] = json.loads(r.stdout)
held.cleanup()
r = run(app, ["inspect", "--shm-dir", shm])
out["table"] = r.stdout
print(json.dumps(out))
"""


def test_huge_pages_on_a_tmpfs_that_allows_them(tmp_path: Path) -> None:
    proc = _in_private_thp_mount(tmp_path, _HUGE_SCRIPT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    big = out["big"]["data"]
    assert out["big"]["exit_code"] == 0 and big["placement"]["huge_pages_advised"]
    assert big["placement"]["huge_page_bytes"] == 16 * 1024 * 1024  # what the kernel gave
    assert out["small"]["data"]["placement"]["huge_page_bytes"] is None  # not asked
    regions = {r["engine_id"]: r for r in out["inspect"]["data"]["regions"]}
    # nobody holds them: seen through inspect's own mapping (move_pages, smaps)
    assert regions["big"]["placement"]["source"] == "move_pages"
    assert regions["big"]["huge_page_bytes"] == 16 * 1024 * 1024
    assert regions["big"]["numa_nodes"] == {str(FIRST_NODE): 16 * 1024 * 1024}
    assert regions["small"]["huge_page_bytes"] == 0
    # a holder's own account: its smaps and numa_maps, matched by inode
    held = regions["held"]
    assert held["placement"]["source"] == "numa_maps"
    assert held["numa_nodes"] == {str(FIRST_NODE): 16 * 1024 * 1024}
    assert held["huge_page_bytes"] == 16 * 1024 * 1024
    assert held["placement"]["requested"]["huge_pages"] == "always"
    assert "thp:100%" in out["table"]


# -- observed --------------------------------------------------------------------------------

def _file(shm_dir: Path, name: str, size: int, touched: range) -> tuple[int, mmap.mmap]:
    fd = os.open(shm_dir / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size)
    for page in touched:
        mm[page * PAGE] = 1
    return fd, mm


@NUMA_CALLS
def test_own_mapping_sees_the_node_of_every_resident_page(shm_dir: Path) -> None:
    fd, mm = _file(shm_dir, "x", 64 * PAGE, range(0, 64, 2))
    try:
        got = observed.sample_resident(fd, 64 * PAGE)
        assert got.asked == 32 and got.nodes == {FIRST_NODE: 32 * PAGE}
        sampled = observed.sample_resident(fd, 64 * PAGE, sample=5)
        assert sampled.asked == 5 and sampled.nodes == {FIRST_NODE: 32 * PAGE}
        # measuring allocated nothing: the untouched pages are still holes
        from vllm_offload_cli.core.host import residency
        assert residency.resident_bytes(fd) == 32 * PAGE
        empty = observed.sample_pages(fd, 64 * PAGE, [])
        assert empty.asked == 0 and empty.nodes == {}
    finally:
        mm.close()
        os.close(fd)


def test_holder_numa_maps_match_by_inode_even_when_unlinked(shm_dir: Path,
                                                             holders: Any) -> None:
    h = holders("vllm-unlink", str(shm_dir), "ghost", "8", "none", str(PAGE), str(PAGE))
    h.send("fill 7")  # rank none: no slot to fill; the mapping alone counts
    st_dev = os.stat(shm_dir).st_dev
    fid = FileId(st_dev, h.info["ino"])
    found = observed.merge(h.pid, observed.scan_holder(h.pid, {fid}), [fid])
    assert found is not None and found.pid == h.pid
    assert found.huge_bytes == 0 or found.huge_bytes <= 8 * PAGE
    assert set(found.nodes) <= set(TOPO.nodes)
    other = FileId(st_dev, h.info["ino"] + 10**9)
    assert observed.scan_holder(h.pid, {other}) == []
    assert observed.scan_holder(2**22 + 12345, {fid}) is None  # no such process


def test_inspect_shows_placement_of_held_unheld_and_empty_regions(
        cli: Any, shm_dir: Path, holders: Any) -> None:
    assert _create(cli, shm_dir, "full").exit_code == 0
    assert _create(cli, shm_dir, "empty", "--no-populate").exit_code == 0
    g = Geometry.for_workers(num_blocks=4, world_size=2, cpu_page_size=PAGE)
    worker = holders("region", str(shm_dir), "held", "4", "0", str(g.row_stride), str(PAGE),
                     "2")
    result = cli("inspect", "--shm-dir", str(shm_dir), "--json")
    assert result.exit_code == 0
    regions = {r["engine_id"]: r for r in result.json["data"]["regions"]}
    full, empty, held = regions["full"], regions["empty"], regions["held"]
    assert full["numa_nodes"] == {str(FIRST_NODE): full["resident_bytes"]} != {}
    assert empty["numa_nodes"] == {} and empty["resident_bytes"] == 0
    if TOPO.single_node and not page_policy.thp_support(shm_dir).allowed:
        # nothing to read: every resident byte is on the one node, none in huge pages
        assert held["placement"]["source"] == "single_node"
        assert held["numa_nodes"] == {str(FIRST_NODE): held["resident_bytes"]}
        assert held["huge_page_bytes"] == 0
    else:
        # the worker pre-faulted only its slot: numa_maps counts the pages it maps
        assert held["placement"]["source"] == "numa_maps"
        assert held["placement"]["pid"] == worker.pid
        assert held["numa_nodes"] == {str(FIRST_NODE): 4 * PAGE}
    for r in regions.values():  # PMD-mapped bytes are resident bytes: never more
        assert r["huge_page_bytes"] is None or (
            0 <= r["huge_page_bytes"] <= (r["resident_bytes"] or 0)), r
    table = cli("inspect", "--shm-dir", str(shm_dir))
    assert "NUMA" in table.stdout and f"n{FIRST_NODE}:100%" in table.stdout
    prom = cli("inspect", "--shm-dir", str(shm_dir), "--format", "prometheus")
    ino = os.stat(shm_dir / "vllm_offload_full.mmap").st_ino
    assert (f'vllm_offload_region_numa_bytes{{base_engine_id="full",'
            f'engine_id="full",inode="{ino}",node="{FIRST_NODE}"}}') in prom.stdout


# -- verify-rank-layout: affinity ------------------------------------------------------------------

def _worker(holders: Any, shm_dir: Path, rank: int) -> Holder:
    g = Geometry.for_workers(num_blocks=4, world_size=2, cpu_page_size=PAGE)
    h: Holder = holders("region", str(shm_dir), "aff", "4", str(rank), str(g.row_stride),
                        str(PAGE), "2", str(rank))
    return h


def test_verify_reports_worker_affinity_and_slot_nodes(cli: Any, shm_dir: Path,
                                                       holders: Any) -> None:
    workers = [_worker(holders, shm_dir, r) for r in (0, 1)]
    result = cli("verify-rank-layout", "aff", "--shm-dir", str(shm_dir), "--json")
    assert result.exit_code == 0, result.stdout
    numa_rows = {w["rank"]: w for w in result.json["data"]["numa"]}
    for rank, h in enumerate(workers):
        row = numa_rows[rank]
        assert row["pid"] == h.pid
        cpus = processes.allowed_cpus(h.pid)
        assert cpus is not None
        assert row["cpu_nodes"] == sorted(TOPO.nodes_of_cpus(cpus))
        assert row["slot_numa_nodes"] == {str(FIRST_NODE): 4 * PAGE}
        if TOPO.single_node:
            assert row["remote"] is False
    if TOPO.single_node:
        assert "numa_remote" not in [w["code"] for w in result.json["warnings"]]


@NUMA_CALLS
def test_remote_slot_rule_with_real_page_nodes(shm_dir: Path, holders: Any) -> None:
    """The multi-node path: the worker's CPUs are declared to be on another node than the
    one move_pages reports for its slot (a two-node topology passed in; pages are real)."""
    worker = _worker(holders, shm_dir, 0)
    cpus = processes.allowed_cpus(worker.pid)
    assert cpus is not None
    other = FIRST_NODE + 1
    split = memory.Topology({FIRST_NODE: frozenset(), other: cpus},
                          frozenset({FIRST_NODE, other}), True)
    g = Geometry.for_workers(num_blocks=4, world_size=2, cpu_page_size=PAGE)
    fd = os.open(shm_dir / "vllm_offload_aff.mmap", os.O_RDONLY)
    try:
        (far,) = check.check_workers(fd, g, 4, [(worker.pid, 0)], topo=split)
        (near,) = check.check_workers(fd, g, 4, [(worker.pid, 0)], topo=TOPO)
    finally:
        os.close(fd)
    assert far.cpu_nodes == (other,) and far.slot_numa_nodes == {FIRST_NODE: 4 * PAGE}
    assert far.remote and f"node(s) {FIRST_NODE}" in check.remote_message(far)
    assert near.remote is (not TOPO.nodes_of_cpus(cpus) >= {FIRST_NODE})


def test_vanished_worker_has_unknown_affinity(shm_dir: Path, holders: Any) -> None:
    worker = _worker(holders, shm_dir, 0)
    g = Geometry.for_workers(num_blocks=4, world_size=2, cpu_page_size=PAGE)
    fd = os.open(shm_dir / "vllm_offload_aff.mmap", os.O_RDONLY)
    try:
        worker.kill()
        assert wait_until(lambda: not Path(f"/proc/{worker.pid}").exists())
        (gone,) = check.check_workers(fd, g, 4, [(worker.pid, 0)])
    finally:
        os.close(fd)
    assert gone.cpu_nodes is None and gone.remote is False


# -- benchmark --huge-pages ------------------------------------------------------------------

_BENCH = ("benchmark", "--device", "cpu", "--size", "8MiB", "--cpu-page-size", "2MiB",
          "--repeat", "1", "--pattern", "contiguous", "--huge-pages", "--json")


def test_benchmark_says_why_huge_pages_were_not_measured(cli: Any, shm_dir: Path) -> None:
    support = page_policy.thp_support(shm_dir)
    if support.allowed:
        pytest.skip(f"this host gives huge pages in {shm_dir}")
    result = cli(*_BENCH, "--shm-dir", str(shm_dir))
    assert result.exit_code == 0, result.stdout
    huge = result.json["data"]["huge_pages"]
    assert huge["available"] is False and huge["reason"] == support.reason
    assert huge["ratio"] is None and huge["huge"] is None
    assert result.json["data"]["rows"]  # the rest of the benchmark ran
    assert list(shm_dir.iterdir()) == []


_BENCH_SCRIPT = f"""
import sys
from click.testing import CliRunner
from vllm_offload_cli.cli.app import app
from vllm_offload_cli.core.region.page_policy import thp_support
if not thp_support(sys.argv[1]).allowed:
    sys.exit(99)
r = CliRunner().invoke(app, [*{list(_BENCH)!r}, "--shm-dir", sys.argv[1]])
print(r.stdout)
import os
print(sorted(os.listdir(sys.argv[1])), file=sys.stderr)
"""


def test_benchmark_compares_normal_and_huge_pages(tmp_path: Path) -> None:
    proc = _in_private_thp_mount(tmp_path, _BENCH_SCRIPT)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["exit_code"] == 0
    huge = doc["data"]["huge_pages"]
    assert huge["available"] is True and huge["block_bytes"] == 2 * 1024 * 1024
    assert huge["huge"]["huge_page_bytes"] == 8 * 1024 * 1024  # the kernel gave them
    assert not huge["normal"]["huge_page_bytes"]
    for key in ("prefault", "store", "load"):
        assert huge["ratio"][key] > 0
        assert huge["normal"][f"{key}_gbps"] > 0 and huge["huge"][f"{key}_gbps"] > 0
    assert doc["data"]["removed"] is True
    assert proc.stderr.strip().endswith("[]")  # nothing left in the tmpfs
