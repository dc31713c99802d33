"""`vllm-offload inspect` against real regions held (or abandoned) by real processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import run_cli_subprocess

from vllm_offload_cli.core.base.units import format_bytes
from vllm_offload_cli.core.region.geometry import PAGESIZE

ROW = 2 * PAGESIZE
GEO = ["4", str(ROW), str(PAGESIZE)]  # after the rank: num_blocks is first


def holder_args(mode: str, shm_dir: Path, engine_id: str, rank: str = "0",
                world: str = "2") -> list[str]:
    return [mode, str(shm_dir), engine_id, "4", rank, str(ROW), str(PAGESIZE), world]


def regions(cli: Any, shm_dir: Path, *ids: str) -> dict[str, Any]:
    r = cli("inspect", *ids, "--shm-dir", str(shm_dir), "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    return {reg["engine_id"] + ("" if reg["linked"] else " (unlinked)"): reg
            for reg in r.json["data"]["regions"]}


def test_empty_directory(cli: Any, shm_dir: Path) -> None:
    r = cli("inspect", "--shm-dir", str(shm_dir), "--json")
    assert r.exit_code == 0
    data = r.json["data"]
    assert data["regions"] == [] and data["shm"]["total_bytes"] > 0
    assert isinstance(data["uninspectable_processes"], int)
    human = cli("inspect", "--shm-dir", str(shm_dir))
    assert "No offload regions" in human.stdout


def test_live_region_with_ranked_holders(cli: Any, shm_dir: Path, holders: Any) -> None:
    h0 = holders(*holder_args("region", shm_dir, "eng_dp0", "0"))
    h1 = holders(*holder_args("region", shm_dir, "eng_dp0", "1"))
    reg = regions(cli, shm_dir)["eng_dp0"]
    assert reg["state"] == "live" and reg["linked"] is True
    assert (reg["base_engine_id"], reg["dp_rank"]) == ("eng", 0)
    assert {(h["pid"], h["rank"]) for h in reg["holders"]} == {(h0.pid, 0), (h1.pid, 1)}
    assert all({"map", "fd", "lock"} <= set(h["via"]) for h in reg["holders"])
    assert reg["geometry"]["world_size"] == 2
    assert reg["resident_bytes"] == reg["size_bytes"] == 4 * ROW
    assert reg["mode"] == "0600" and reg["uid"] == os.geteuid()
    assert reg["problems"] == []


def test_sigkilled_holder_leaves_a_stale_region(cli: Any, shm_dir: Path, holders: Any) -> None:
    h = holders(*holder_args("region", shm_dir, "gone", "0", "1"))
    assert regions(cli, shm_dir)["gone"]["state"] == "live"
    h.kill()
    reg = regions(cli, shm_dir)["gone"]
    assert reg["state"] == "stale" and reg["holders"] == []


def test_persistent_region_from_create(cli: Any, shm_dir: Path) -> None:
    assert cli("create", "pre", "--world-size", "1", "--cpu-page-size", "4KiB",
               "--num-blocks", "2", "--shm-dir", str(shm_dir)).exit_code == 0
    reg = regions(cli, shm_dir)["pre"]
    assert reg["state"] == "persistent" and reg["persistent"] is True


@pytest.mark.parametrize("mode", ["fd-only", "map-only"])
def test_holders_that_never_lock_are_found(cli: Any, shm_dir: Path, holders: Any,
                                           mode: str) -> None:
    creator = holders(*holder_args("vllm", shm_dir, "v", "0"))
    user = holders(*holder_args(mode, shm_dir, "v", "0"))
    creator.stop("crash")  # a vLLM creator killed hard: the name stays
    reg = regions(cli, shm_dir)["v"]
    assert reg["state"] == "live"
    assert [h["pid"] for h in reg["holders"]] == [user.pid]
    assert reg["holders"][0]["via"] == (["fd"] if mode == "fd-only" else ["map"])
    assert reg["geometry"] is None, "vLLM writes no manifest"


def test_unlinked_but_mapped_region_is_still_found(cli: Any, shm_dir: Path,
                                                   holders: Any) -> None:
    h = holders(*holder_args("vllm-unlink", shm_dir, "ghost_dp3"))
    assert os.listdir(shm_dir) == []
    reg = regions(cli, shm_dir)["ghost_dp3 (unlinked)"]
    assert reg["linked"] is False and reg["state"] == "live"
    assert reg["dp_rank"] == 3 and reg["size_bytes"] == 4 * ROW
    assert [x["pid"] for x in reg["holders"]] == [h.pid]
    assert reg["paths"] == [str(shm_dir / "vllm_offload_ghost_dp3.mmap")]
    human = cli("inspect", "--shm-dir", str(shm_dir))
    assert "ghost_dp3 (unlinked)" in human.stdout


def test_restarted_replica_beside_its_ghost_is_a_dp_collision(cli: Any, shm_dir: Path,
                                                              holders: Any) -> None:
    holders(*holder_args("vllm-unlink", shm_dir, "r_dp1"))
    holders(*holder_args("region", shm_dir, "r_dp1"))
    found = regions(cli, shm_dir)
    assert set(found) == {"r_dp1", "r_dp1 (unlinked)"}
    for reg in found.values():
        assert "dp_collision" in [p["code"] for p in reg["problems"]]
    table = cli("inspect", "--shm-dir", str(shm_dir)).stdout
    [why] = [p["message"] for p in found["r_dp1"]["problems"] if p["code"] == "dp_collision"]
    assert table.count(why) == 1  # one sentence for both regions, said once


def _write(path: Path, size: int, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, mode)
    os.ftruncate(fd, size)
    os.fchmod(fd, mode)
    os.close(fd)


def test_segments_are_grouped_and_gaps_reported(cli: Any, shm_dir: Path) -> None:
    for suffix in ("", ".1", ".3"):
        _write(shm_dir / f"vllm_offload_seg.mmap{suffix}", ROW)
    reg = regions(cli, shm_dir)["seg"]
    assert len(reg["paths"]) == 3 and reg["size_bytes"] == 3 * ROW
    assert [p["code"] for p in reg["problems"]] == ["segment_gap"]
    assert reg["state"] == "stale"


def test_problems_are_reported(cli: Any, shm_dir: Path, holders: Any) -> None:
    _write(shm_dir / "vllm_offload_open.mmap", ROW, mode=0o644)
    h = holders(*holder_args("region", shm_dir, "short", "0", "1"))
    h.stop("crash")
    os.truncate(shm_dir / "vllm_offload_short.mmap", ROW)  # no longer matches its manifest
    _write(shm_dir / "vllm_offload_bad.mmap", ROW)
    manifest = shm_dir / "vllm_offload_bad.manifest.json"
    manifest.write_text("{")
    manifest.chmod(0o600)
    found = regions(cli, shm_dir)
    codes = {k: [p["code"] for p in v["problems"]] for k, v in found.items()}
    assert codes == {"open": ["unsafe_mode"], "short": ["size_mismatch"],
                     "bad": ["manifest_invalid"]}


def test_foreign_files_are_ignored(cli: Any, shm_dir: Path) -> None:
    (shm_dir / "notes.txt").write_text("x")
    (shm_dir / "vllm_offload_bad name.mmap").write_text("x")
    assert regions(cli, shm_dir) == {}


def test_named_region_filter_and_unknown_name(cli: Any, shm_dir: Path) -> None:
    for name in ("a", "b"):
        _write(shm_dir / f"vllm_offload_{name}.mmap", ROW)
    assert list(regions(cli, shm_dir, "b")) == ["b"]
    r = cli("inspect", "zzz", "--shm-dir", str(shm_dir))
    assert r.exit_code == 2 and "no region named zzz" in r.stderr
    r = cli("inspect", "../x", "--shm-dir", str(shm_dir), "--json")
    assert r.exit_code == 2 and r.json["errors"][0]["code"] == "invalid_engine_id"


def test_human_table(cli: Any, shm_dir: Path, holders: Any) -> None:
    h = holders(*holder_args("region", shm_dir, "tbl", "1"))
    r = cli("inspect", "--shm-dir", str(shm_dir))
    assert r.exit_code == 0
    assert "ENGINE ID" in r.stdout and "tbl" in r.stdout and "live" in r.stdout
    assert f" 1 ({h.pid})" in r.stdout, "narrow: the count and the first pid"
    wide = cli("inspect", "--wide", "--shm-dir", str(shm_dir))
    name = psutil.Process(h.pid).name()  # python, python3.11, ...: however it was started
    assert f"{h.pid} {name} r1" in wide.stdout


def test_prometheus_textfile_is_written_atomically(cli: Any, shm_dir: Path,
                                                   tmp_path: Path) -> None:
    _write(shm_dir / "vllm_offload_p_dp2.mmap", ROW)
    out = tmp_path / "vllm_offload.prom"
    r = cli("inspect", "--format", "prometheus", "--output", str(out), "--shm-dir",
            str(shm_dir), "--json")
    assert r.exit_code == 0 and r.json["data"]["output"] == str(out)
    text = out.read_text()
    ino = os.stat(shm_dir / "vllm_offload_p_dp2.mmap").st_ino
    assert 'vllm_offload_region_state{base_engine_id="p",engine_id="p_dp2",' \
           f'inode="{ino}",state="stale"}} 1.0' in text
    assert ('vllm_offload_region_dp_rank{base_engine_id="p",engine_id="p_dp2",'
            f'inode="{ino}"}} 2.0') in text
    assert "vllm_offload_shm_free_bytes" in text
    assert sorted(os.listdir(tmp_path)) == ["vllm_offload.prom"], "no temp file left"
    stdout = cli("inspect", "--format", "prometheus", "--shm-dir", str(shm_dir))
    assert "# TYPE vllm_offload_region_size_bytes gauge" in stdout.stdout


@pytest.mark.parametrize("args", [["--output", "x.prom"],
                                  ["--format", "prometheus", "--json"],
                                  ["--format", "yaml"]])
def test_inconsistent_format_options(cli: Any, shm_dir: Path, args: list[str]) -> None:
    r = cli("inspect", *args, "--shm-dir", str(shm_dir))
    assert r.exit_code == 2
    if "--json" in args:
        assert "needs --output FILE" in r.json["errors"][0]["message"]
    else:
        assert r.stderr.startswith("Error: ")


def test_format_json_equals_json_flag(cli: Any, shm_dir: Path) -> None:
    a = cli("inspect", "--format", "json", "--shm-dir", str(shm_dir)).json
    b = cli("inspect", "--json", "--shm-dir", str(shm_dir)).json
    assert a["command"] == b["command"] == "inspect"
    assert a["data"]["regions"] == b["data"]["regions"] == []


def test_real_subprocess_run(shm_dir: Path) -> None:
    _write(shm_dir / "vllm_offload_sub.mmap", ROW)
    r = run_cli_subprocess("inspect", "--shm-dir", str(shm_dir), "--json")
    assert r.exit_code == 0
    doc = json.loads(r.stdout)  # exactly one JSON document on stdout
    assert [x["engine_id"] for x in doc["data"]["regions"]] == ["sub"]


def test_prometheus_output_follows_the_conventions(cli: Any, shm_dir: Path,
                                                   tmp_path: Path) -> None:
    """Parsed by prometheus_client and `promtool check metrics` where installed: unit
    suffixes, a creation timestamp instead of an age, no empty label values."""
    from prometheus_client.parser import text_string_to_metric_families

    _write(shm_dir / "vllm_offload_p_dp2.mmap", ROW)
    _write(shm_dir / "vllm_offload_plain.mmap", ROW)
    inspect_text = cli("inspect", "--format", "prometheus", "--shm-dir", str(shm_dir)).stdout
    gc_file = tmp_path / "gc.prom"
    assert cli("gc", "--dry-run", "--prometheus", str(gc_file), "--shm-dir",
               str(shm_dir)).exit_code == 0
    for text in (inspect_text, gc_file.read_text()):
        families = {f.name: f for f in text_string_to_metric_families(text)}
        samples = [s for f in families.values() for s in f.samples]
        assert samples and all(v != "" for s in samples for v in s.labels.values())
        assert not [n for n in families if n.endswith(("_age_seconds", "_bytes_freed"))]
        if shutil.which("promtool"):
            check = subprocess.run(["promtool", "check", "metrics"], input=text,
                                   capture_output=True, text=True, timeout=60)
            assert check.returncode == 0, check.stdout + check.stderr
    families = {f.name: f for f in text_string_to_metric_families(inspect_text)}
    created = {s.labels["engine_id"]: s.value
               for s in families["vllm_offload_region_created_timestamp_seconds"].samples}
    mtime = (shm_dir / "vllm_offload_plain.mmap").stat().st_mtime
    assert created["plain"] == pytest.approx(mtime)
    ranks = {s.labels["engine_id"]: s.value
             for s in families["vllm_offload_region_dp_rank"].samples}
    assert ranks == {"p_dp2": 2}
    gc_names = {f.name for f in text_string_to_metric_families(gc_file.read_text())}
    assert "vllm_offload_gc_freed_bytes" in gc_names


# -- answers for scripts, and why a region is stale -------------------------------------


def test_check_answers_in_the_exit_status(cli: Any, shm_dir: Path, holders: Any) -> None:
    """Like `fuser -s`: 3 when a region shown is stale or has a problem, 0 otherwise;
    -q prints nothing; --state narrows what is shown, and what is checked."""
    holders(*holder_args("region", shm_dir, "busy"))
    clean = cli("inspect", "--check", "-q", "--shm-dir", str(shm_dir))
    assert (clean.exit_code, clean.stdout) == (0, "")
    _write(shm_dir / "vllm_offload_leak.mmap", ROW)
    flagged = cli("inspect", "--check", "-q", "--shm-dir", str(shm_dir))
    assert (flagged.exit_code, flagged.stdout) == (3, "")
    assert cli("inspect", "--check", "--state", "live", "--shm-dir",
               str(shm_dir)).exit_code == 0
    doc = cli("inspect", "--check", "--state", "stale", "--json", "--shm-dir", str(shm_dir))
    assert doc.exit_code == 3 and doc.json["exit_code"] == 3
    assert [r["engine_id"] for r in doc.json["data"]["regions"]] == ["leak"]
    assert doc.json["data"]["check"] == {"flagged": ["leak"]}
    table = cli("inspect", "-s", "live", "--shm-dir", str(shm_dir))
    assert table.exit_code == 0 and "busy" in table.stdout and "leak" not in table.stdout
    both = cli("inspect", "-s", "live", "--state", "stale", "--json", "--shm-dir", str(shm_dir))
    assert sorted(r["engine_id"] for r in both.json["data"]["regions"]) == ["busy", "leak"]
    assert cli("inspect", "--state", "gone", "--shm-dir", str(shm_dir)).exit_code == 2


def test_why_a_region_is_stale(cli: Any, shm_dir: Path, holders: Any) -> None:
    """-v and JSON: the creator's pid and that it exited, the recorded holders' exit,
    when anything last happened; the footer says what gc would free."""
    h = holders(*holder_args("region", shm_dir, "dead"))
    pid = h.pid
    h.stop("crash")
    doc = regions(cli, shm_dir)["dead"]
    assert doc["state"] == "stale"
    ev = doc["evidence"]
    assert (ev["creator_pid"], ev["creator_alive"]) == (pid, False)
    assert ev["recorded_holders"] == [{"pid": pid, "rank": 0, "alive": False}]
    assert ev["last_activity_at"] is not None
    verbose = cli("inspect", "-v", "--shm-dir", str(shm_dir))
    assert (f"dead: stale: no process maps it, has it open or holds its lock; creator pid "
            f"{pid} exited; 1 of 1 recorded holder(s) exited (pid {pid}); last activity ") \
        in verbose.stdout
    size = os.stat(shm_dir / "vllm_offload_dead.mmap").st_blocks * 512
    full = cli("inspect", "--json", "--shm-dir", str(shm_dir)).json["data"]
    assert full["gc_would_free_bytes"] == size > 0
    assert verbose.stdout.rstrip().endswith(f"1 stale; gc would free {format_bytes(size)}")
    gc = cli("gc", "--dry-run", "--min-age", "0", "--json", "--shm-dir", str(shm_dir))
    assert gc.json["data"]["freed_bytes"] == size  # the footer's figure is gc's own


def test_prometheus_file_is_the_one_way_gc_has(cli: Any, shm_dir: Path,
                                               tmp_path: Path) -> None:
    """`inspect --prometheus FILE` as `gc --prometheus FILE`: quiet, checked first."""
    _write(shm_dir / "vllm_offload_p.mmap", ROW)
    out = tmp_path / "regions.prom"
    r = cli("inspect", "--prometheus", str(out), "--shm-dir", str(shm_dir))
    assert (r.exit_code, r.stdout) == (0, "")
    assert 'engine_id="p"' in out.read_text()
    doc = cli("inspect", "--prometheus", str(out), "--json", "--shm-dir", str(shm_dir)).json
    assert doc["data"]["output"] == str(out)
    bad = cli("inspect", "--prometheus", str(tmp_path / "nodir" / "x.prom"), "--shm-dir",
              str(shm_dir), "--json")
    assert bad.exit_code == 2 and bad.json["errors"][0]["code"] == "bad_output"
    both = cli("inspect", "--prometheus", str(out), "--format", "json", "--shm-dir",
               str(shm_dir))
    assert both.exit_code == 2


def test_a_symlink_named_like_a_region_is_a_problem_not_a_stale_region(
        cli: Any, shm_dir: Path, tmp_path: Path) -> None:
    """gc never removes it, so `stale 0B` promised what gc does not do."""
    target = tmp_path / "target"
    target.write_text("x")
    (shm_dir / "vllm_offload_ln.mmap").symlink_to(target)
    doc = cli("inspect", "--json", "--shm-dir", str(shm_dir)).json["data"]
    assert doc["regions"] == []
    [entry] = doc["unsafe_entries"]
    assert entry["engine_id"] == "ln" and entry["paths"] == [str(shm_dir / "vllm_offload_ln.mmap")]
    assert [p["code"] for p in entry["problems"]] == ["symlink"]
    table = cli("inspect", "--shm-dir", str(shm_dir)).stdout
    assert "0 region(s), 0 stale" in table and "not a region (symlink)" in table
    assert cli("inspect", "--check", "-q", "--shm-dir", str(shm_dir)).exit_code == 3
    prom = cli("inspect", "--format", "prometheus", "--shm-dir", str(shm_dir)).stdout
    assert "vllm_offload_unsafe_entries 1.0" in prom and 'state="stale"} 1.0' not in prom
    gc = cli("gc", "--min-age", "0", "--no-syslog", "--shm-dir", str(shm_dir))
    assert gc.exit_code == 0 and (shm_dir / "vllm_offload_ln.mmap").is_symlink()
