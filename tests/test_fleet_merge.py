"""The fleet's merge and render, without Ray: real node-local answers, merged.

`node_task` is what every Ray node runs; here it runs in this process against
private shm dirs (one per "node"), and the answers of nodes that failed or
timed out are what the Ray runner reports for them.
"""

from __future__ import annotations

import io
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
from region_files import region_file

from vllm_offload_cli.cli import inspect as inspect_cli
from vllm_offload_cli.cli.common import Out
from vllm_offload_cli.cli.fleet import node_task, render_gc, render_inspect, render_verify
from vllm_offload_cli.core.base.exit_status import PRECEDENCE, ExitStatus
from vllm_offload_cli.fleet import (
    ANSWERED,
    FAILED,
    TIMED_OUT,
    FleetResult,
    NodeResult,
    answered,
)

INSPECT: dict[str, Any] = {"engine_ids": None, "fmt": "table", "output": None,
                           "no_residency": False}
GC: dict[str, Any] = {"engine_ids": None, "dry_run": True, "min_age": 0.0,
                      "include_persistent": False, "all_users": False, "prometheus": None}


def _answer(node: str, command: str, options: dict[str, Any], shm: Path) -> NodeResult:
    return NodeResult(node_id=node * 28, node_name="10.0.0.1", outcome=ANSWERED,
                      envelope=node_task(command, options, str(shm)), seconds=0.01)


def _missing(node: str, outcome: str, reason: str) -> NodeResult:
    """A node that did not answer, as the Ray runner reports it."""
    return NodeResult(node_id=node * 56, node_name=f"10.0.0.{ord(node) - ord('a') + 1}",
                      outcome=outcome, reason=reason, reason_code=outcome, seconds=5)


def _fleet(command: str, *nodes: NodeResult) -> FleetResult:
    return FleetResult(address="auto", nodes=nodes, timeout=60)


def _show(render: Any, result: FleetResult, **kw: Any) -> str:
    buf = io.StringIO()
    render(Out(buf), result, **kw)
    return buf.getvalue()


@pytest.fixture
def two_dirs(shm_dir: Path) -> tuple[Path, Path]:
    a, b = shm_dir / "a", shm_dir / "b"
    a.mkdir()
    b.mkdir()
    return a, b


def test_node_task_is_the_node_local_envelope(cli: Any, shm_dir: Path) -> None:
    region_file(shm_dir, "leak")
    doc = node_task("inspect", INSPECT, str(shm_dir))
    local = cli("inspect", "--shm-dir", str(shm_dir), "--json").json
    assert doc["node"]["shm_dir"] == str(shm_dir) and doc["node"]["pid"] == os.getpid()
    assert {k: v for k, v in doc.items() if k != "node"}.keys() == local.keys()
    assert doc["exit_code"] == local["exit_code"] == 0
    keys = ("engine_id", "state", "paths", "size_bytes")
    assert [[r[k] for k in keys] for r in doc["data"]["regions"]] == \
        [[r[k] for k in keys] for r in local["data"]["regions"]]


def test_node_task_uses_the_nodes_own_default(shm_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OFFLOAD_SHM_DIR", str(shm_dir))
    assert node_task("inspect", INSPECT, None)["data"]["shm_dir"] == str(shm_dir)


def test_node_task_reports_errors_as_the_cli_does(cli: Any, shm_dir: Path) -> None:
    missing = str(shm_dir / "nope")
    doc = node_task("garbage-collect", GC, missing)
    local = cli("gc", "--dry-run", "--shm-dir", missing, "--json").json
    assert doc["exit_code"] == local["exit_code"] == 2
    assert doc["errors"] == local["errors"]


def test_partial_answer_exits_7_and_keeps_the_others(two_dirs: tuple[Path, Path]) -> None:
    a, b = two_dirs
    region_file(a, "leak_dp1")
    result = FleetResult(address="head:6379", nodes=(
        _answer("a", "inspect", INSPECT, a), _answer("b", "inspect", INSPECT, b),
        _missing("c", FAILED, "node died: raylet gone"),
        _missing("d", TIMED_OUT, "no answer within 5 s")), timeout=5)
    assert result.exit_code == ExitStatus.PARTIAL
    data = result.data()
    assert data["partial"] is True and (data["nodes_total"], data["nodes_answered"]) == (4, 2)
    assert [n["status"] for n in data["nodes"]] == ["ok", "ok", "failed", "timed_out"]
    assert data["nodes"][0]["data"]["regions"][0]["engine_id"] == "leak_dp1"
    assert data["nodes"][2]["data"] is None and data["nodes"][2]["exit_code"] is None
    assert [e["code"] for e in result.errors()] == ["node_failed", "node_timed_out"]
    # two nodes share one address: the label adds the node id
    assert [n["label"] for n in data["nodes"][:2]] == ["10.0.0.1/aaaaaaaa", "10.0.0.1/bbbbbbbb"]
    text = _show(render_inspect, result)
    assert text.splitlines()[0].split()[:3] == ["NODE", "ENGINE", "ID"]
    assert "10.0.0.1/aaaaaaaa  leak_dp1" in text
    assert "node 10.0.0.3: FAILED: node died: raylet gone" in text
    assert "node 10.0.0.4: TIMED OUT: no answer within 5 s" in text
    assert "2 of 4 node(s) answered; PARTIAL: 2 node(s) did not; exit 7." in text


def test_exit_code_is_the_worst_node_and_refusal_is_named(two_dirs: tuple[Path, Path]) -> None:
    a, b = two_dirs
    os.mkfifo(b / "vllm_offload_odd.mmap", 0o600)
    options = {"engine_id": "odd", "world_size": None, "dp_size": None, "devices": None,
               "rank_source": None, "no_dp_suffix": False, "cpu_page_size": None}
    result = _fleet("verify-rank-layout", _answer("a", "verify-rank-layout", options, a),
                    _answer("b", "verify-rank-layout", options, b))
    assert [n.status for n in result.nodes] == ["absent", "refused"]
    assert result.exit_code == 6
    assert result.errors()[0]["code"] == "not_regular_file"
    assert "node 10.0.0.1/bbbbbbbb: REFUSED" in _show(render_verify, result)


def test_a_region_on_no_node_is_exit_2(two_dirs: tuple[Path, Path]) -> None:
    opts = {**INSPECT, "engine_ids": ["nowhere"]}
    result = _fleet("inspect", *(
        _answer(n, "inspect", opts, d) for n, d in zip("ab", two_dirs, strict=True)))
    assert [n.status for n in result.nodes] == ["absent", "absent"] and result.exit_code == 2
    assert [e["code"] for e in result.errors()] == ["not_found"]
    assert "no node has a region named nowhere" in _show(render_inspect, result)


def test_gc_plan_lists_every_node(two_dirs: tuple[Path, Path]) -> None:
    a, b = two_dirs
    old = time.time() - 3600
    for d, name in ((a, "one"), (b, "two")):
        os.utime(region_file(d, name), (old, old))
    result = _fleet("garbage-collect", *(
        _answer(n, "garbage-collect", GC, d) for n, d in zip("ab", two_dirs, strict=True)))
    assert result.exit_code == 0
    text = _show(render_gc, result, quiet=False)
    assert "10.0.0.1/aaaaaaaa: Would remove one:" in text
    assert "10.0.0.1/bbbbbbbb: Would remove two:" in text
    assert "from 2 region(s) across the fleet (dry run: nothing was changed)." in text
    assert (a / "vllm_offload_one.mmap").exists() and (b / "vllm_offload_two.mmap").exists()


def test_no_node_is_a_failure() -> None:
    assert _fleet("inspect").exit_code == 1


def test_a_node_on_another_version_is_warned_about(shm_dir: Path) -> None:
    node = _answer("a", "inspect", INSPECT, shm_dir)
    result = _fleet("inspect", node)
    assert node.envelope is not None

    def mismatches(version: str) -> list[dict[str, str]]:
        return [w for w in result.warnings(version) if w["code"] == "version_mismatch"]

    assert mismatches(node.envelope["node"]["version"]) == []
    [warning] = mismatches("0.0.0-other")
    assert "node 10.0.0.1 runs vllm-offload" in warning["message"]


# -- precedence: the merged exit status names what to act on first, not the largest code --


def _said(node: str, code: int, *errors: str, data: dict[str, Any] | None = None
          ) -> NodeResult:
    """A node that answered `code` with these error codes (a synthetic envelope)."""
    envelope = {"schema_version": 1, "command": "x", "ok": code == 0, "exit_code": code,
                "data": data or {}, "warnings": [],
                "errors": [{"code": e, "message": f"{e} here"} for e in errors]}
    return NodeResult(node_id=node * 56, node_name=f"n{node}", outcome=ANSWERED,
                      envelope=envelope)


ANSWERABLE = [s for s in PRECEDENCE if s not in (ExitStatus.PARTIAL, ExitStatus.INTERRUPTED)]


@pytest.mark.parametrize(("first", "second"), [
    (a, b) for i, a in enumerate(ANSWERABLE) for b in ANSWERABLE[i + 1:]])
def test_the_more_important_node_status_wins(first: ExitStatus, second: ExitStatus) -> None:
    for order in ((first, second), (second, first)):
        nodes = [_said(n, s, *(["e"] if s else [])) for n, s in zip("ab", order, strict=True)]
        assert _fleet("inspect", *nodes).exit_code == first


def test_problems_found_outrank_a_busy_node() -> None:
    assert _fleet("verify-rank-layout", _said("a", 3, "p"), _said("b", 4, "busy")
                  ).exit_code == ExitStatus.PROBLEMS_FOUND


def test_a_finding_outranks_a_node_that_did_not_answer() -> None:
    result = _fleet("garbage-collect", _said("a", 6, "pid_namespace"),
                    _missing("b", TIMED_OUT, "no answer within 60 s"))
    assert result.exit_code == ExitStatus.UNSAFE and result.data()["partial"] is True


def test_a_node_interrupted_there_makes_the_answer_partial() -> None:
    """The operator did not interrupt the fleet run: 130 from a node is not 130 for it."""
    result = _fleet("inspect", _said("a", 0), _said("b", 130, "interrupted"))
    assert result.exit_code == ExitStatus.PARTIAL and result.data()["partial"] is True
    assert "PARTIAL: 1 node(s) were interrupted; exit 7." in _show(render_inspect, result)
    # ... and what another node found still outranks it
    assert _fleet("verify-rank-layout", _said("a", 3, "p"), _said("b", 130, "interrupted")
                  ).exit_code == ExitStatus.PROBLEMS_FOUND


def test_unknown_codes_count_as_failed() -> None:
    assert _fleet("inspect", _said("a", 0), _said("b", 99, "new")).exit_code == 1


def test_regions_on_different_nodes_are_all_found(two_dirs: tuple[Path, Path]) -> None:
    a, b = two_dirs
    region_file(a, "x")
    region_file(b, "y")
    for command, options in (("inspect", INSPECT), ("garbage-collect", GC)):
        named = {**options, "engine_ids": ["x", "y"]}
        result = _fleet(command, _answer("a", command, named, a), _answer("b", command, named, b))
        assert [n.exit_code for n in result.nodes] == [2, 2]  # each node lacks one
        assert result.exit_code == 0 and result.errors() == []
        named = {**options, "engine_ids": ["x", "z"]}
        result = _fleet(command, _answer("a", command, named, a), _answer("b", command, named, b))
        assert result.exit_code == 2
        assert [e["message"] for e in result.errors()] == ["no node has a region named z"]


def test_a_node_that_did_not_answer_may_have_the_region(two_dirs: tuple[Path, Path]) -> None:
    opts = {**INSPECT, "engine_ids": ["nowhere"]}
    result = _fleet("inspect", _answer("a", "inspect", opts, two_dirs[0]),
                    _missing("b", FAILED, "worker crashed"))
    assert result.exit_code == ExitStatus.PARTIAL and result.on_no_node() is None


def test_a_failed_removal_beside_a_missing_name_counts_as_failed() -> None:
    """gc on a node that lacks one named region and failed to remove another."""
    node = _said("a", 2, "not_found", "unlink_failed", data={"not_found": ["y"]})
    other = _said("b", 2, "not_found", data={"not_found": ["x"]})
    assert _fleet("garbage-collect", node, other).exit_code == ExitStatus.FAILED


# -- the fleet table is inspect's table; a node's answer is another host's data ----------


def test_the_fleet_table_is_inspects_table_with_a_node_column(shm_dir: Path) -> None:
    region_file(shm_dir, "leak_dp1")
    node = _answer("a", "inspect", INSPECT, shm_dir)
    assert node.envelope is not None
    fleet = _show(render_inspect, _fleet("inspect", node)).splitlines()
    local = io.StringIO()
    inspect_cli.render_table(Out(local), node.envelope["data"])
    table = local.getvalue().splitlines()
    assert fleet[0].split() == ["NODE", *table[0].split()]
    owner = inspect_cli.TABLE_HEADERS.index("OWNER")
    fleet_row, local_row = fleet[1].split()[1:], table[1].split()
    assert fleet_row[owner] == str(os.geteuid())  # a uid's name is per host: the number
    del fleet_row[owner], local_row[owner]
    assert fleet_row == local_row


def test_escape_sequences_from_a_node_never_reach_the_terminal() -> None:
    evil = "\x1b]0;owned\x07\x1b[2J"
    region = {"engine_id": f"e{evil}", "linked": True, "dp_rank": None, "state": "stale",
              "uid": 0, "size_bytes": 4096, "resident_bytes": 0, "vllm_layout": evil,
              "age_seconds": 5.0, "paths": [], "numa_nodes": {evil: 1},
              "holders": [{"pid": 1, "name": evil, "rank": evil}],
              "problems": [{"code": evil, "message": evil}]}
    node = _said("a", 0, data={"shm_dir": evil, "regions": [region],
                               "shm": {"total_bytes": 1, "free_bytes": 1}})
    for wide in (False, True):
        text = _show(render_inspect, _fleet("inspect", node), wide=wide)
        assert "\x1b" not in text and "\x07" not in text and "\\x1b" in text


@pytest.mark.parametrize(("answer", "why"), [
    (["not", "an", "envelope"], "a list, not a JSON object"),
    ("a string", "a str, not a JSON object"),
    ({"exit_code": 0, "data": {"regions": ["a string region"]}}, "data.regions"),
    ({"exit_code": 0, "data": {"regions": [{"engine_id": "x", "age_seconds": math.nan}]}},
     "not plain JSON"),
    ({"exit_code": "0", "data": {}}, "no integer exit_code"),
    ({"exit_code": 0, "data": {}, "errors": "boom"}, "errors is not a list"),
])
def test_a_malformed_node_answer_is_a_failed_node_not_a_crash(shm_dir: Path, answer: Any,
                                                               why: str) -> None:
    bad = answered("b" * 56, "10.0.0.2", answer, 0.1)
    assert (bad.outcome, bad.reason_code) == (FAILED, "malformed_answer") and why in bad.reason
    result = _fleet("inspect", _answer("a", "inspect", INSPECT, shm_dir), bad)
    assert result.exit_code == ExitStatus.PARTIAL
    text = _show(render_inspect, result)
    assert "node 10.0.0.2: FAILED: malformed answer" in text
    json.dumps(result.data(), allow_nan=False)  # --json on the head still works
