"""contrib/prometheus and contrib/grafana: the alert rules and the dashboard read only metrics
the commands write, every PromQL expression parses, and every alert fires where it should.

The metric names come from real `inspect --format prometheus` and `gc --prometheus` runs on a
private shm directory, so a renamed metric breaks this test, not an operator's alert. Parsing
and the rules' unit tests need `promtool` (Debian's `prometheus` package; no smaller source
ships it) and skip without it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_offload_cli.cli.inspect import STATES

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "contrib" / "prometheus" / "vllm-offload.rules.yml"
RULE_TESTS = ROOT / "contrib" / "prometheus" / "vllm-offload.rules.test.yml"
DASHBOARD = ROOT / "contrib" / "grafana" / "vllm-offload.json"

# a metric name: not the middle of a recording rule's `level:metric:operations` name, not a
# textfile's name (vllm_offload_gc.prom) in a label value
OUR_NAME = re.compile(r"(?<![\w:])vllm_offload_\w+(?![\w.\\])")
# what Grafana substitutes before the query reaches Prometheus
GRAFANA_VARIABLES = {"$host": ".*", "${host}": ".*", "$__rate_interval": "5m",
                     "$__interval": "1m", "$__range": "1h"}
NEEDS_PROMTOOL = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool not installed (Debian/Ubuntu: apt-get install prometheus); the rule unit "
    "tests and the PromQL parse check need it")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120)


def textfile_families(text: str) -> set[str]:
    """Every family a textfile declares, with or without samples (a labelled gauge with no
    region yet still has its `# TYPE` line)."""
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


@pytest.fixture(scope="module")
def emitted() -> dict[str, Any]:
    """Metric families and label values from a real inspect and gc run on a private shm dir."""
    from click.testing import CliRunner

    from tests.region_files import private_shm_dir, region_file
    from vllm_offload_cli.cli.app import app

    runner = CliRunner()
    with private_shm_dir() as shm:
        region_file(shm, "leak_dp0")
        assert runner.invoke(app, ["create", "spare", "--world-size", "1", "--cpu-page-size",
                                   "4KiB", "--num-blocks", "4", "--shm-dir", str(shm),
                                   "-q"]).exit_code == 0
        regions = runner.invoke(app, ["inspect", "--format", "prometheus", "--shm-dir",
                                      str(shm)])
        assert regions.exit_code == 0, regions.stderr
        gc_file = shm / "gc.prom.d"
        gc_file.mkdir()
        gc = runner.invoke(app, ["gc", "--dry-run", "--prometheus", str(gc_file / "gc.prom"),
                                 "--shm-dir", str(shm)])
        assert gc.exit_code == 0, gc.stderr
        gc_text = (gc_file / "gc.prom").read_text()
    reasons = set(re.findall(r'vllm_offload_gc_regions_kept\{reason="(\w+)"\}', gc_text))
    return {"names": textfile_families(regions.stdout) | textfile_families(gc_text),
            "states": set(STATES), "reasons": reasons}


def rules_doc() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(RULES.read_text())
    return doc


def rules() -> list[dict[str, Any]]:
    return [r for g in rules_doc()["groups"] for r in g["rules"]]


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, also those inside collapsed rows."""
    out = []
    for p in doc["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in panels(dashboard()) for t in p.get("targets", [])]


def substituted(expr: str) -> str:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    return expr


def check_names(exprs: list[str], emitted: dict[str, Any], recorded: set[str]) -> None:
    names = {n for e in exprs for n in OUR_NAME.findall(e)}
    assert names, "no vllm_offload metric found: the name pattern is broken"
    assert names - emitted["names"] - recorded == set(), sorted(emitted["names"])
    for e in exprs:
        for state in re.findall(r'state="(\w+)"', e):
            assert state in emitted["states"], e
        for reason in re.findall(r'reason=~?"([\w|]+)"', e):
            assert set(reason.split("|")) <= emitted["reasons"], e


# -- the rules -----------------------------------------------------------------------


def test_every_alert_has_a_duration_a_severity_and_annotations_that_name_the_host() -> None:
    alerts = [r for r in rules() if "alert" in r]
    assert len(alerts) >= 10
    for a in alerts:
        assert re.fullmatch(r"\d+[smh]", a["for"]), a["alert"]
        assert a["labels"]["severity"] in ("warning", "critical"), a["alert"]
        text = a["annotations"]["summary"] + a["annotations"]["description"]
        assert "$labels.instance" in text, a["alert"]
        assert "vllm-offload" in a["annotations"]["description"], a["alert"]  # the fix
        if "vllm_offload_region_" in a["expr"] and "sum by" not in a["expr"]:  # per region
            assert "$labels.engine_id" in text, a["alert"]


def test_rules_read_only_metrics_the_commands_write(emitted: dict[str, Any]) -> None:
    recorded = {r["record"] for r in rules() if "record" in r}
    check_names([r["expr"] for r in rules()], emitted, recorded)


def test_every_alert_has_a_firing_and_a_quiet_case_in_the_unit_tests() -> None:
    """promtool checks only what the tests list: each alert must be listed firing, and
    quiet somewhere (an empty list, or a list that leaves some input's subject out: promtool
    then fails if that one fires too)."""

    def subject(labels: dict[str, str]) -> tuple[str | None, ...]:
        return tuple(labels.get(k) for k in ("instance", "engine_id", "pod"))

    fired, quiet = set(), set()
    for group in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        inputs = {subject(dict(re.findall(r'(\w+)="([^"]*)"', s["series"])))
                  for s in group["input_series"]}
        for case in group["alert_rule_test"]:
            expected = {subject(e["exp_labels"]) for e in case["exp_alerts"]}
            if expected:
                fired.add(case["alertname"])
            if len(expected) < len(inputs):
                quiet.add(case["alertname"])
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert alerts - fired == set()
    assert alerts - quiet == set()


@NEEDS_PROMTOOL
def test_promtool_checks_the_rules() -> None:
    check = promtool("check", "rules", str(RULES))
    assert check.returncode == 0, check.stdout + check.stderr


@NEEDS_PROMTOOL
def test_promtool_unit_tests_pass() -> None:
    run = promtool("test", "rules", str(RULE_TESTS))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


# -- the dashboard -------------------------------------------------------------------


def test_dashboard_is_a_grafana_model_with_datasource_and_host_variables() -> None:
    doc = dashboard()
    assert doc["uid"] and doc["title"] and isinstance(doc["schemaVersion"], int)
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    host = variables["host"]
    assert host["type"] == "query" and host["datasource"]["uid"] == "${datasource}"
    assert "instance" in host["definition"]
    ids = [p["id"] for p in panels(doc)]
    assert len(ids) == len(set(ids))
    for p in panels(doc):
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["refId"] and t["expr"], p["title"]
            assert "$host" in t["expr"], (p["title"], t["expr"])  # the host picker applies


def test_dashboard_shows_what_the_issue_asks_for() -> None:
    exprs = " ".join(dashboard_exprs())
    for metric in ("vllm_offload_regions", "vllm_offload_shm_free_bytes",
                   "vllm_offload_region_resident_bytes", "vllm_offload_gc_regions_removed",
                   "vllm_offload_gc_freed_bytes", "vllm_offload_gc_last_run_timestamp_seconds",
                   "vllm_offload_gc_exit_code", "vllm_offload_region_numa_bytes"):
        assert re.search(rf"\b{metric}\b", exprs), metric


def test_dashboard_reads_only_metrics_the_commands_write(emitted: dict[str, Any]) -> None:
    check_names(dashboard_exprs(), emitted, recorded=set())


@NEEDS_PROMTOOL
def test_every_dashboard_expression_parses(tmp_path: Path) -> None:
    """promtool has no bare query parser offline: each expression becomes a recording rule."""
    exprs = dashboard_exprs()
    rules_file = tmp_path / "dashboard.rules.yml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": substituted(e)}
        for i, e in enumerate(exprs)]}]}))
    check = promtool("check", "rules", str(rules_file))
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"{len(exprs)} rules found" in check.stdout


# -- what the rules need from gc -----------------------------------------------------


def test_gc_textfile_carries_its_exit_status(cli: Any, shm_dir: Path, tmp_path: Path) -> None:
    """VllmOffloadGcFailing reads it: 0 for a clean run, the run's own status otherwise."""
    prom = tmp_path / "gc.prom"
    assert cli("gc", "--prometheus", str(prom), "--shm-dir", str(shm_dir)).exit_code == 0
    assert "vllm_offload_gc_exit_code 0.0" in prom.read_text().splitlines()
    missing = cli("gc", "nosuch", "--prometheus", str(prom), "--shm-dir", str(shm_dir))
    assert missing.exit_code == 2
    assert "vllm_offload_gc_exit_code 2.0" in prom.read_text().splitlines()


# -- every region its own series -----------------------------------------------------


def test_two_regions_of_one_engine_id_are_two_series(shm_dir: Path, holders: Any) -> None:
    """A live unlinked ghost beside a stale named region of the same engine_id (the
    dp_collision case): two label sets, each with its own size and state, and the
    per-state counts are the sums of the per-region state series."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.conftest import run_cli_subprocess
    from tests.region_files import region_file

    holders("vllm-unlink", str(shm_dir), "ghost", "4", "0", "8192", "4096", "2")
    region_file(shm_dir, "ghost", size=4096)
    out = run_cli_subprocess("inspect", "--format", "prometheus", "--shm-dir", str(shm_dir))
    assert out.exit_code == 0, out.stderr
    samples = [(m.name, s.name, s.labels, s.value)
               for m in text_string_to_metric_families(out.stdout) for s in m.samples]
    sizes = {s[2]["inode"]: s[3] for s in samples if s[1] == "vllm_offload_region_size_bytes"}
    assert len(sizes) == 2 and sorted(sizes.values()) == [4096.0, 32768.0]
    states = {s[2]["inode"]: s[2]["state"] for s in samples
              if s[1] == "vllm_offload_region_state" and s[3] == 1}
    assert sorted(states.values()) == ["live", "stale"]
    named = os.stat(shm_dir / "vllm_offload_ghost.mmap").st_ino
    assert states[str(named)] == "stale" and sizes[str(named)] == 4096.0
    counts = {s[2]["state"]: s[3] for s in samples if s[1] == "vllm_offload_regions"}
    for state in STATES:
        assert counts[state] == sum(s[3] for s in samples if s[1] == "vllm_offload_region_state"
                                    and s[2]["state"] == state)


# -- gc's counters -------------------------------------------------------------------


def _totals(prom: Path) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for m in text_string_to_metric_families(prom.read_text())
            if m.type == "counter" for s in m.samples}


def test_gc_counters_carry_over_runs(cli: Any, shm_dir: Path, tmp_path: Path) -> None:
    """increase(vllm_offload_gc_removals_total[1h]) works: each run adds to the last file's
    counters; a file that is not gc's own (garbage, another user's) starts them again."""
    from tests.region_files import SIZE, region_file

    prom = tmp_path / "gc.prom"
    gc = ("gc", "--min-age", "0", "--no-syslog", "--prometheus", str(prom), "--shm-dir",
          str(shm_dir))
    region_file(shm_dir, "one")
    assert cli(*gc).exit_code == 0
    region_file(shm_dir, "two")
    region_file(shm_dir, "three")
    assert cli(*gc).exit_code == 0
    assert cli(*gc, "--dry-run").exit_code == 0
    totals = _totals(prom)
    assert totals == {"vllm_offload_gc_runs_total": 3.0,
                      "vllm_offload_gc_removals_total": 3.0,
                      "vllm_offload_gc_freed_bytes_total": 3.0 * SIZE,
                      "vllm_offload_gc_refusals_total": 0.0,
                      "vllm_offload_gc_failures_total": 0.0}
    assert "vllm_offload_gc_regions_removed 0.0" in prom.read_text()  # the gauge: this run
    assert "_created" not in prom.read_text()

    prom.write_text("# TYPE vllm_offload_gc_runs_total counter\nvllm_offload_gc_runs_total NaN\n"
                    "vllm_offload_gc_removals_total{x=\"y\"} 9\ngarbage{\n")
    assert cli(*gc).exit_code == 0
    assert _totals(prom)["vllm_offload_gc_runs_total"] == 1.0
    if os.geteuid() == 0:  # a file another user could have written is not believed
        prom.write_text(prom.read_text().replace("runs_total 1.0", "runs_total 500.0"))
        os.chown(prom, 65534, 65534)
        assert cli(*gc).exit_code == 0
        assert _totals(prom)["vllm_offload_gc_runs_total"] == 1.0
