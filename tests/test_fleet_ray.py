"""`vllm-offload fleet` on a real 3-node Ray cluster on this machine.

Every node is a real raylet with its own workers; each gets its own private
shm directory through its environment ($VLLM_OFFLOAD_SHM_DIR, the production
default), so "which node answered" is visible in the data. One cluster per
module: starting Ray is the slow part.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import require_root, wait_until
from region_files import region_file

from vllm_offload_cli.core.base.exit_status import most_important
from vllm_offload_cli.core.region.geometry import PAGESIZE

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

SLOW_SITE = Path(__file__).parent / "helpers" / "slow_site"
NODE_ARGS: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 80 * 1024 * 1024}
OLD = time.time() - 3600  # a stale region left an hour ago


@dataclass
class FleetCluster:
    cluster: Any
    address: str
    shm: dict[str, Path]  # node id -> that node's private shm dir
    extra: list[Path] = field(default_factory=list)

    def add_node(self, **env: str) -> tuple[Any, Path]:
        path = Path(tempfile.mkdtemp(prefix="vllm-offload-fleet-", dir="/dev/shm"))
        node = self.cluster.add_node(**NODE_ARGS, env_vars={
            "VLLM_OFFLOAD_SHM_DIR": str(path), **env})
        self.cluster.wait_for_nodes()
        self.shm[node.node_id] = path
        return node, path


@pytest.fixture(scope="module")
def fleet() -> Iterator[FleetCluster]:
    head_dir = Path(tempfile.mkdtemp(prefix="vllm-offload-fleet-", dir="/dev/shm"))
    cluster = Cluster(initialize_head=True, head_node_args={
        **NODE_ARGS, "include_dashboard": False,
        "env_vars": {"VLLM_OFFLOAD_SHM_DIR": str(head_dir)}})
    fc = FleetCluster(cluster, cluster.address, {cluster.head_node.node_id: head_dir})
    try:
        fc.add_node()
        fc.add_node()
        yield fc
    finally:
        cluster.shutdown()
        for path in fc.shm.values():
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def dirs(fleet: FleetCluster) -> Iterator[list[Path]]:
    """The three nodes' shm dirs (head first), emptied after each test."""
    paths = list(fleet.shm.values())[:3]
    yield paths
    for path in paths:
        for entry in path.iterdir():
            entry.unlink()


def _fleet(fleet: FleetCluster, *args: str, timeout: float = 240) -> tuple[int, dict[str, Any]]:
    """Run `vllm-offload fleet ... --json` as a real process: its own Ray driver."""
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_offload_cli", "fleet", *args, "--address", fleet.address,
         "--json"], capture_output=True, text=True, timeout=timeout,
        env={k: v for k, v in os.environ.items() if k != "VLLM_OFFLOAD_SHM_DIR"})
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def _by_dir(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The fleet's node entries keyed by the shm dir each node used."""
    return {n["host"]["shm_dir"]: n for n in doc["data"]["nodes"] if n["host"]}


def _holder(shm: Path, engine_id: str) -> subprocess.Popen[str]:
    helper = Path(__file__).parent / "helpers" / "holder.py"
    proc = subprocess.Popen([sys.executable, str(helper), "region", str(shm), engine_id, "4",
                             "0", str(2 * PAGESIZE), str(PAGESIZE), "2"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and "error" not in proc.stdout.readline()
    return proc


def _stale(shm: Path, engine_id: str) -> Path:
    path = region_file(shm, engine_id)
    os.utime(path, (OLD, OLD))
    return path


def _persistent(shm: Path, engine_id: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "vllm_offload_cli", "create", engine_id,
                           "--world-size", "2", "--cpu-page-size", "4KiB", "--num-blocks", "4",
                           "--shm-dir", str(shm), "--json"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _local(command: str, shm: Path, *args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "vllm_offload_cli", command, *args,
                           "--shm-dir", str(shm), "--json"], capture_output=True, text=True,
                          timeout=60)
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def test_inspect_merges_every_node(fleet: FleetCluster, dirs: list[Path]) -> None:
    a, b, c = dirs
    holder = _holder(a, "live_dp0")
    try:
        _persistent(b, "prov")
        _stale(c, "leak")
        code, doc = _fleet(fleet, "inspect")
        assert code == 0, doc
        assert doc["command"] == "fleet inspect" and doc["ok"] is True
        data = doc["data"]
        assert data["nodes_total"] == data["nodes_answered"] == 3 and not data["partial"]
        nodes = _by_dir(doc)
        assert set(nodes) == {str(a), str(b), str(c)}
        states = {d: {r["engine_id"]: r["state"] for r in n["data"]["regions"]}
                  for d, n in nodes.items()}
        assert states == {str(a): {"live_dp0": "live"}, str(b): {"prov": "persistent"},
                          str(c): {"leak": "stale"}}
        assert [h["pid"] for h in nodes[str(a)]["data"]["regions"][0]["holders"]] == [
            holder.pid]
        for d, n in nodes.items():  # the same answer as the node-local command
            local = _local("inspect", Path(d))
            assert n["exit_code"] == local["exit_code"] == 0 and n["status"] == "ok"
            assert [(r["engine_id"], r["state"], r["paths"]) for r in n["data"]["regions"]] \
                == [(r["engine_id"], r["state"], r["paths"]) for r in local["data"]["regions"]]
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_inspect_table_has_a_node_column(fleet: FleetCluster, dirs: list[Path]) -> None:
    _stale(dirs[1], "leak_dp3")
    proc = subprocess.run([sys.executable, "-m", "vllm_offload_cli", "fleet", "inspect",
                           "--address", fleet.address], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["NODE", "ENGINE", "ID"]
    summaries = {line.split(": ")[1]: line.split(": ")[0] for line in lines
                 if line.startswith(("1", "2")) and ": /dev/shm/" in line}
    assert set(summaries) == {str(d) for d in dirs}  # one summary line per node
    row = next(line for line in lines if "leak_dp3" in line)
    assert row.split()[:4] == [summaries[str(dirs[1])], "leak_dp3", "3", "stale"]
    assert "3 of 3 node(s) answered" in proc.stdout


def test_gc_dry_run_shows_the_plan_then_gc_removes_only_the_stale(
        fleet: FleetCluster, dirs: list[Path]) -> None:
    a, b, c = dirs
    holder = _holder(a, "live")
    try:
        _persistent(b, "prov")
        leak = _stale(c, "leak")
        code, plan = _fleet(fleet, "gc", "--dry-run", "--min-age", "0")
        assert code == 0, plan
        nodes = _by_dir(plan)
        assert [r["engine_id"] for r in nodes[str(c)]["data"]["removed"]] == ["leak"]
        assert {k["engine_id"]: k["code"] for k in nodes[str(a)]["data"]["kept"]} == {
            "live": "live"}
        assert [k["engine_id"] for k in nodes[str(b)]["data"]["kept"]] == ["prov"]
        assert all(n["data"]["dry_run"] for n in nodes.values())
        assert leak.exists()

        code, done = _fleet(fleet, "garbage-collect", "--min-age", "0")
        assert code == 0, done
        assert not leak.exists()
        assert (a / "vllm_offload_live.mmap").exists() and (b / "vllm_offload_prov.mmap").exists()
        assert _by_dir(done)[str(c)]["data"]["freed_bytes"] > 0
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_a_node_that_refuses_is_reported_and_sets_the_exit_code(
        fleet: FleetCluster, dirs: list[Path]) -> None:
    """Node-local exit 6 (a region name that is no regular file) propagates, named by node."""
    os.mkfifo(dirs[1] / "vllm_offload_odd.mmap", 0o600)
    local = _local("verify-rank-layout", dirs[1], "odd")
    assert local["exit_code"] == 6
    code, doc = _fleet(fleet, "verify-rank-layout", "odd")
    assert code == 6 and doc["exit_code"] == 6 and doc["ok"] is False
    statuses = sorted(n["status"] for n in doc["data"]["nodes"])
    assert statuses == ["absent", "absent", "refused"]  # the others have no such region
    refused = next(n for n in doc["data"]["nodes"] if n["status"] == "refused")
    assert refused["errors"] == local["errors"]
    assert [e["code"] for e in doc["errors"]] == [local["errors"][0]["code"]]
    assert refused["label"] in doc["errors"][0]["message"]


def test_a_region_on_no_node_is_bad_input(fleet: FleetCluster, dirs: list[Path]) -> None:
    code, doc = _fleet(fleet, "inspect", "nowhere")
    assert code == 2 and [n["status"] for n in doc["data"]["nodes"]] == ["absent"] * 3


def test_plan_mode_runs_on_every_node(fleet: FleetCluster, dirs: list[Path]) -> None:
    code, doc = _fleet(fleet, "verify-rank-layout", "--world-size", "2", "--dp-size", "2",
                       "--devices", "0,0;1,1")
    assert code == 3
    assert [n["exit_code"] for n in doc["data"]["nodes"]] == [3, 3, 3]
    assert all(n["data"]["mode"] == "plan" and n["data"]["problems"]
               for n in doc["data"]["nodes"])


@pytest.mark.parametrize("timeout", ["5", "0"])  # 0: a time already up, as for gc and inspect
def test_unreachable_cluster_is_one_error_line(timeout: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "vllm_offload_cli", "fleet", "inspect",
                           "--address", "127.0.0.1:1", "--timeout", timeout],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stdout == "" and proc.stderr.startswith("Error: cannot connect to the Ray")


def _alive() -> int:
    return len([n for n in ray.nodes() if n["Alive"]])


@pytest.fixture
def blind_node(fleet: FleetCluster) -> Iterator[Path]:
    """A node in its own PID namespace, like Ray in a container without hostPID.

    Its tasks cannot see the host's processes: a region held from outside
    looks unheld there. Started with `ray start` inside `unshare`, joining
    the test cluster; gone (and known dead) before the next test.
    """
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True, check=False) if shutil.which("unshare") else None
    require_root("needs unshare --pid (root) for a node in its own PID namespace",
                 granted=probe is not None and probe.returncode == 0)
    shm = Path(tempfile.mkdtemp(prefix="vllm-offload-fleet-", dir="/dev/shm"))
    ray_cli = Path(sys.executable).parent / "ray"
    ray.init(address=fleet.address, logging_level="ERROR", log_to_driver=False)
    others = _alive()
    proc = subprocess.Popen(
        ["unshare", "--pid", "--kill-child", "--mount-proc", str(ray_cli), "start",
         "--address", fleet.address, "--num-cpus", "1", "--object-store-memory",
         str(NODE_ARGS["object_store_memory"]), "--disable-usage-stats", "--block"],
        env={**os.environ, "VLLM_OFFLOAD_SHM_DIR": str(shm)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: _alive() > others, timeout=180)
        yield shm
    finally:
        proc.kill()  # unshare ignores SIGTERM; its death kills the namespace and the node
        proc.wait(timeout=60)
        wait_until(lambda: _alive() <= others, timeout=120)
        ray.shutdown()
        shutil.rmtree(shm, ignore_errors=True)


def _blind_local(*args: str) -> dict[str, Any]:
    """The node-local command run in a PID namespace of its own, as the blind node runs it."""
    proc = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m",
                           "vllm_offload_cli", *args, "--json"], capture_output=True, text=True,
                          timeout=60)
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def test_gc_on_a_node_that_cannot_see_the_hosts_processes(
        fleet: FleetCluster, dirs: list[Path], blind_node: Path) -> None:
    """Fleet gc is node-local gc there: the node's answer (a refusal, exit 6, once gc knows
    its blind spots) is the fleet's answer for that node, and the fleet exit code carries it.
    A region held from outside the node's namespace is never removed."""
    holder = _holder(blind_node, "held")  # a host process the blind node cannot see
    try:
        leak = _stale(dirs[0], "leak")
        code, plan = _fleet(fleet, "gc", "--dry-run", "--min-age", "0")
        node = _by_dir(plan)[str(blind_node)]
        local = _blind_local("gc", "--dry-run", "--min-age", "0", "--shm-dir", str(blind_node))
        assert node["exit_code"] == local["exit_code"]
        assert [e["code"] for e in node["errors"]] == [e["code"] for e in local["errors"]]
        assert code == plan["exit_code"] == most_important(
            n["exit_code"] for n in plan["data"]["nodes"])
        if local["exit_code"] == 6:  # node-local gc refuses where it is blind
            assert node["status"] == "refused" and code == 6
            assert any(e["node_id"] == node["node_id"] for e in plan["errors"])
        else:  # it keeps the region: its lock is held from outside
            assert [k["engine_id"] for k in node["data"]["kept"]] == ["held"]
        assert [r["engine_id"] for r in _by_dir(plan)[str(dirs[0])]["data"]["removed"]] == [
            "leak"]

        _fleet(fleet, "gc", "--min-age", "0")
        assert (blind_node / "vllm_offload_held.mmap").exists()
        assert not leak.exists()  # the other nodes were collected all the same
    finally:
        holder.kill()
        holder.wait(timeout=10)


@pytest.fixture(scope="module")
def slow_node(fleet: FleetCluster) -> Iterator[tuple[Any, Path, Path]]:
    """A 4th node whose new workers wait while a gate file exists (helpers/slow_site)."""
    gate = Path(tempfile.mkdtemp(prefix="vllm-offload-gate-")) / "gate"
    path = os.pathsep.join(p for p in (str(SLOW_SITE), os.environ.get("PYTHONPATH")) if p)
    node, shm = fleet.add_node(PYTHONPATH=path, VLLM_OFFLOAD_TEST_GATE=str(gate))
    try:
        yield node, shm, gate
    finally:
        gate.unlink(missing_ok=True)
        shutil.rmtree(gate.parent, ignore_errors=True)


def _close_gate(gate: Path) -> None:
    gate.unlink(missing_ok=True)
    Path(f"{gate}.started").unlink(missing_ok=True)


def test_a_node_that_does_not_answer_in_time_is_reported(
        fleet: FleetCluster, dirs: list[Path], slow_node: tuple[Any, Path, Path]) -> None:
    _, slow_shm, gate = slow_node
    _stale(dirs[0], "leak")
    gate.touch()
    try:
        code, doc = _fleet(fleet, "inspect", "--timeout", "8")
    finally:
        _close_gate(gate)
    assert code == 7 and doc["exit_code"] == 7 and doc["data"]["partial"] is True
    slow = [n for n in doc["data"]["nodes"] if n["status"] == "timed_out"]
    assert len(slow) == 1 and slow[0]["data"] is None and "8 s" in slow[0]["reason"]
    assert doc["errors"][0]["code"] == "node_timed_out"
    assert _by_dir(doc)[str(dirs[0])]["data"]["regions"][0]["engine_id"] == "leak"
    assert len(_by_dir(doc)) == 3 and str(slow_shm) not in _by_dir(doc)


def test_a_node_killed_mid_run_shows_as_failed(
        fleet: FleetCluster, dirs: list[Path], slow_node: tuple[Any, Path, Path]) -> None:
    node, slow_shm, gate = slow_node
    _stale(dirs[2], "leak")
    _stale(slow_shm, "on_the_dead_node")
    gate.touch()
    started = Path(f"{gate}.started")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_offload_cli", "fleet", "inspect", "--address",
         fleet.address, "--json", "--timeout", "150"], stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True)
    try:
        # the fleet's task waits on the slow node: a worker started there for it
        assert wait_until(started.exists, timeout=120)
        fleet.cluster.remove_node(node, allow_graceful=False)
        out, _ = proc.communicate(timeout=200)
    finally:
        proc.kill()
        _close_gate(gate)
    doc = json.loads(out)
    assert proc.returncode == 7 and doc["data"]["partial"] is True
    dead = [n for n in doc["data"]["nodes"] if n["status"] == "failed"]
    assert len(dead) == 1 and dead[0]["data"] is None and dead[0]["reason"]
    assert dead[0]["reason_code"] == "node_died"
    assert dead[0]["reason"].startswith("the node died during the run")
    assert dead[0]["node_id"] == node.node_id
    assert doc["errors"][0]["code"] == "node_failed"
    answered = _by_dir(doc)
    assert set(answered) == {str(d) for d in dirs}  # the others still answered
    assert [r["engine_id"] for r in answered[str(dirs[2])]["data"]["regions"]] == ["leak"]
