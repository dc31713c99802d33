"""`vllm-offload gc`: what goes, what stays and why, with real files and real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import require_root, run_cli_subprocess, wait_until
from region_files import GEOMETRY, SIZE, SLOT, region_file

from vllm_offload_cli.core.host.discovery import discover
from vllm_offload_cli.core.reclaim import collector as reclaim
from vllm_offload_cli.core.reclaim.report import GcOptions

OTHER_UID = 12345
# the widest gc this user may run: --all-users is root's
WIDEST = ("--all-users",) if os.geteuid() == 0 else ()


def gc_json(cli: Any, shm_dir: Path, *args: str, expect: int = 0) -> dict[str, Any]:
    result = cli("gc", "--shm-dir", str(shm_dir), "--json", *args)
    assert result.exit_code == expect, result.stdout + result.stderr
    doc: dict[str, Any] = result.json
    assert doc["command"] == "garbage-collect"
    return doc


def removed_ids(doc: dict[str, Any]) -> list[str]:
    return [r["engine_id"] for r in doc["data"]["removed"]]


def kept(doc: dict[str, Any], engine_id: str) -> dict[str, Any]:
    matches = [k for k in doc["data"]["kept"] if k["engine_id"] == engine_id]
    assert len(matches) == 1, doc["data"]["kept"]
    return matches[0]


def identity(path: Path) -> tuple[int, int]:
    st = os.stat(path, follow_symlinks=False)
    return st.st_dev, st.st_ino


# -- what is removed ---------------------------------------------------------------


def test_region_of_a_killed_engine_goes_with_its_manifest(cli: Any, shm_dir: Path,
                                                         holders: Any) -> None:
    h = holders("region", str(shm_dir), "crashed", *GEOMETRY)
    region = shm_dir / "vllm_offload_crashed.mmap"
    manifest = shm_dir / "vllm_offload_crashed.manifest.json"
    assert kept(gc_json(cli, shm_dir, "--min-age", "0"), "crashed")["code"] == "live"
    h.kill()  # SIGKILL: no cleanup, the kernel drops its lock and mapping
    assert region.exists() and manifest.exists()

    doc = gc_json(cli, shm_dir, "--min-age", "0")

    assert removed_ids(doc) == ["crashed"]
    entry = doc["data"]["removed"][0]
    assert entry["paths"] == [str(region)]
    assert entry["manifest"] == str(manifest)
    assert entry["bytes"] == SIZE
    assert doc["data"]["freed_bytes"] == entry["freed_bytes"] > 0
    assert not region.exists() and not manifest.exists()
    assert doc["data"]["kept"] == [] and doc["ok"] is True


def test_segments_go_with_their_region(cli: Any, shm_dir: Path) -> None:
    bare = region_file(shm_dir, "seg")
    first = region_file(shm_dir, "seg", segment=1)
    second = region_file(shm_dir, "seg", segment=2)

    doc = gc_json(cli, shm_dir, "--min-age", "0")

    assert doc["data"]["removed"][0]["paths"] == [str(bare), str(first), str(second)]
    assert doc["data"]["removed"][0]["bytes"] == 3 * SIZE
    assert doc["data"]["freed_bytes"] == 3 * SIZE  # filled: every page was allocated
    assert os.listdir(shm_dir) == []


def test_creator_stub_that_never_got_sized_is_removed_once_old(cli: Any, shm_dir: Path) -> None:
    region_file(shm_dir, "stub", size=0)
    assert kept(gc_json(cli, shm_dir), "stub")["code"] == "too_young"
    assert removed_ids(gc_json(cli, shm_dir, "--min-age", "0")) == ["stub"]


def test_only_named_engine_ids_are_collected(cli: Any, shm_dir: Path) -> None:
    region_file(shm_dir, "a")
    b = region_file(shm_dir, "b")

    doc = gc_json(cli, shm_dir, "--min-age", "0", "a", "missing", expect=2)

    assert removed_ids(doc) == ["a"]
    assert b.exists()
    # a name that matches nothing is an error, as for inspect (a typo must not pass as done)
    assert doc["data"]["not_found"] == ["missing"]
    assert [e["code"] for e in doc["errors"]] == ["not_found"]


def test_invalid_engine_id_is_bad_usage(cli: Any, shm_dir: Path) -> None:
    doc = gc_json(cli, shm_dir, "../etc", expect=2)
    assert doc["errors"][0]["code"] == "invalid_engine_id"


# -- what is kept, and why -------------------------------------------------------


@pytest.mark.parametrize("mode", ["map-only", "vllm"])
def test_region_used_only_through_a_mapping_without_a_lock(cli: Any, shm_dir: Path,
                                                          holders: Any, mode: str) -> None:
    """vLLM never flocks: the /proc maps scan alone proves it alive."""
    if mode == "map-only":
        region_file(shm_dir, "mapped")
    h = holders(mode, str(shm_dir), "mapped", *GEOMETRY)
    path = shm_dir / "vllm_offload_mapped.mmap"
    before = identity(path)

    doc = gc_json(cli, shm_dir, "--min-age", "0", "--include-persistent")

    k = kept(doc, "mapped")
    assert (k["code"], k["pid"]) == ("live", h.pid)
    assert "map" in k["reason"]
    assert identity(path) == before
    h.kill()
    assert removed_ids(gc_json(cli, shm_dir, "--min-age", "0")) == ["mapped"]


def test_region_held_only_by_an_open_descriptor(cli: Any, shm_dir: Path, holders: Any) -> None:
    region_file(shm_dir, "fd")
    h = holders("fd-only", str(shm_dir), "fd", *GEOMETRY)

    k = kept(gc_json(cli, shm_dir, "--min-age", "0"), "fd")

    assert (k["code"], k["pid"]) == ("live", h.pid)
    assert "fd" in k["reason"]
    assert (shm_dir / "vllm_offload_fd.mmap").exists()


def test_region_held_only_by_our_shared_flock(cli: Any, shm_dir: Path, holders: Any) -> None:
    """No descriptor and no mapping in /proc/<pid>: only the lock says it is in use."""
    path = region_file(shm_dir, "locked")
    h = holders("flock-only", str(shm_dir), "locked", *GEOMETRY)
    fd_targets = [os.readlink(f"/proc/{h.pid}/fd/{n}") for n in os.listdir(f"/proc/{h.pid}/fd")]
    assert not any("vllm_offload_" in t for t in fd_targets)
    assert "vllm_offload_" not in Path(f"/proc/{h.pid}/maps").read_text()

    k = kept(gc_json(cli, shm_dir, "--min-age", "0"), "locked")

    assert (k["code"], k["pid"]) == ("live", h.pid)
    assert path.exists()
    h.kill()
    assert removed_ids(gc_json(cli, shm_dir, "--min-age", "0")) == ["locked"]


def test_region_whose_name_was_unlinked_while_mapped(cli: Any, shm_dir: Path,
                                                     holders: Any) -> None:
    h = holders("vllm-unlink", str(shm_dir), "ghost", *GEOMETRY)

    doc = gc_json(cli, shm_dir, "--min-age", "0", "--include-persistent")

    k = kept(doc, "ghost")
    assert (k["code"], k["pid"], k["linked"]) == ("live", h.pid, False)
    assert doc["data"]["removed"] == []
    h.send("write 1 7")  # the engine keeps working on its mapping
    assert h.proc.stdout is not None and h.proc.stdout.readline().strip() == "ok"


def test_persistent_region_is_kept_unless_asked(cli: Any, shm_dir: Path) -> None:
    made = cli("create", "pre", "--shm-dir", str(shm_dir), "--world-size", "2",
               "--cpu-page-size", "4KiB", "--num-blocks", "4", "--json")
    assert made.exit_code == 0, made.stderr

    k = kept(gc_json(cli, shm_dir, "--min-age", "0"), "pre")
    assert k["code"] == "persistent"
    assert "--include-persistent" in k["reason"]

    doc = gc_json(cli, shm_dir, "--min-age", "0", "--include-persistent")
    assert removed_ids(doc) == ["pre"]
    assert doc["data"]["removed"][0]["manifest"] is not None
    assert os.listdir(shm_dir) == []


def test_young_region_is_kept(cli: Any, shm_dir: Path) -> None:
    region_file(shm_dir, "young")
    k = kept(gc_json(cli, shm_dir), "young")
    assert k["code"] == "too_young"
    assert "--min-age 60" in k["reason"]
    assert kept(gc_json(cli, shm_dir, "--min-age", "3600"), "young")["code"] == "too_young"


def test_symlink_named_like_a_region_is_never_followed(cli: Any, shm_dir: Path) -> None:
    target = shm_dir / "precious.bin"
    target.write_bytes(b"do not touch")
    os.chmod(target, 0o600)
    link = shm_dir / "vllm_offload_trap.mmap"
    link.symlink_to(target)
    dangling = shm_dir / "vllm_offload_dangling.mmap"
    dangling.symlink_to(shm_dir / "nowhere")
    manifest_link = shm_dir / "vllm_offload_mlink.manifest.json"
    manifest_link.symlink_to(target)
    before = identity(target), target.stat().st_mtime_ns

    doc = gc_json(cli, shm_dir, "--min-age", "0", "--include-persistent", *WIDEST)

    assert kept(doc, "trap")["code"] == "symlink"
    assert kept(doc, "dangling")["code"] == "symlink"
    assert doc["data"]["removed"] == [] and doc["data"]["orphan_manifests_removed"] == []
    assert link.is_symlink() and dangling.is_symlink() and manifest_link.is_symlink()
    assert (identity(target), target.stat().st_mtime_ns) == before
    assert target.read_bytes() == b"do not touch"


def test_a_symlinked_segment_keeps_the_whole_region(cli: Any, shm_dir: Path) -> None:
    bare = region_file(shm_dir, "half")
    target = shm_dir / "elsewhere.bin"
    target.write_bytes(b"x")
    (shm_dir / "vllm_offload_half.mmap.1").symlink_to(target)

    assert kept(gc_json(cli, shm_dir, "--min-age", "0"), "half")["code"] == "symlink"
    assert bare.exists() and target.exists()


def test_another_users_region_needs_root_and_all_users(cli: Any, shm_dir: Path) -> None:
    require_root("needs root to chown a file to another user")
    path = region_file(shm_dir, "theirs")
    os.chown(path, OTHER_UID, OTHER_UID)

    k = kept(gc_json(cli, shm_dir, "--min-age", "0"), "theirs")
    assert k["code"] == "foreign_owner"
    assert "--all-users" in k["reason"] and str(OTHER_UID) in k["reason"]
    assert path.exists()

    assert removed_ids(gc_json(cli, shm_dir, "--min-age", "0", "--all-users")) == ["theirs"]
    assert not path.exists()


def as_user(uid: int, cli: Any, *args: str) -> tuple[int, dict[str, Any]]:
    """Run the CLI in a forked child that dropped to `uid` (no exec: the interpreter
    may live where that user cannot read)."""
    require_root("needs root to become another user")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            # import lazily-loaded modules first: that user may not read our stdlib
            with tempfile.TemporaryDirectory(prefix="vllm-offload-test-",
                                             dir="/dev/shm") as scratch:
                cli("gc", "--shm-dir", scratch, "--min-age", "0", "--dry-run", "--json")
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            result = cli(*args)
            os.write(write_end, json.dumps([result.exit_code, result.stdout]).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    code, stdout = json.loads(data)
    return code, json.loads(stdout)


def test_all_users_is_refused_to_a_non_root_caller(cli: Any, shm_dir: Path) -> None:
    os.chmod(shm_dir, 0o755)  # readable to that user: the refusal must be about --all-users
    code, doc = as_user(OTHER_UID, cli, "gc", "--shm-dir", str(shm_dir), "--all-users",
                        "--json")
    assert code == 2
    assert doc["errors"][0]["code"] == "not_root"


def test_failed_removal_exits_1_and_says_which_file(cli: Any, shm_dir: Path) -> None:
    """A real refusal: the caller owns the file but may not write the directory."""
    path = region_file(shm_dir, "stuck")
    if os.geteuid() == 0:
        os.chown(path, OTHER_UID, OTHER_UID)
        os.chmod(shm_dir, 0o755)  # others may list and open, not unlink
    code, doc = as_user(OTHER_UID, cli, "gc", "--shm-dir", str(shm_dir), "--min-age", "0",
                        "--json")
    assert code == 1, doc
    assert doc["ok"] is False and doc["errors"][0]["code"] == "remove_failed"
    assert str(path) in doc["errors"][0]["message"]
    assert doc["data"]["failures"][0]["engine_id"] == "stuck"
    assert doc["data"]["removed"] == []
    assert path.exists()


def test_names_that_are_not_regions_are_untouched(cli: Any, shm_dir: Path) -> None:
    names = ["vllm_offload_x.mmap.bak", "vllm_offload_.mmap", "vllm_offload_a b.mmap",
             "other.mmap", "vllm_offload_x.mmap.0", "vllm_offload_x.mmap.01",
             "xvllm_offload_y.mmap", "vllm_offload_y.mmap.tmp", "vllm_offload_z.manifest"]
    for name in names:
        (shm_dir / name).write_bytes(b"keep")
        os.chmod(shm_dir / name, 0o600)
    (shm_dir / "vllm_offload_dir.mmap").mkdir()

    doc = gc_json(cli, shm_dir, "--min-age", "0", "--include-persistent", *WIDEST)

    assert kept(doc, "dir")["code"] == "not_regular_file"
    assert doc["data"]["removed"] == [] and doc["data"]["orphan_manifests_removed"] == []
    assert sorted(os.listdir(shm_dir)) == sorted([*names, "vllm_offload_dir.mmap"])


def test_hard_linked_region_is_kept(cli: Any, shm_dir: Path) -> None:
    path = region_file(shm_dir, "linked")
    os.link(path, shm_dir / "second-name")
    k = kept(gc_json(cli, shm_dir, "--min-age", "0"), "linked")
    assert k["code"] == "link_count"
    assert path.exists()


def test_group_readable_region_is_removed_when_the_kernel_proves_it_unused(
        cli: Any, shm_dir: Path) -> None:
    """Mode 0644 lets any process map it, also one /proc hides from us: the owner's
    write lease proves that no process has it open, so it goes."""
    path = region_file(shm_dir, "open", mode=0o644)
    doc = gc_json(cli, shm_dir, "--min-age", "0")
    assert removed_ids(doc) == ["open"]
    assert not path.exists()


# -- manifests and temporary files ---------------------------------------------------


def test_orphaned_manifest_is_removed_once_old(cli: Any, shm_dir: Path) -> None:
    made = cli("create", "orphan", "--shm-dir", str(shm_dir), "--world-size", "1",
               "--cpu-page-size", "4KiB", "--num-blocks", "2", "--json")
    assert made.exit_code == 0
    (shm_dir / "vllm_offload_orphan.mmap").unlink()  # removed by hand, manifest left
    manifest = shm_dir / "vllm_offload_orphan.manifest.json"

    assert gc_json(cli, shm_dir)["data"]["orphan_manifests_removed"] == []
    assert manifest.exists()
    doc = gc_json(cli, shm_dir, "--min-age", "0")
    assert doc["data"]["orphan_manifests_removed"] == [str(manifest)]
    assert not manifest.exists()


def test_manifest_of_an_unlinked_but_mapped_region_is_not_an_orphan(
        cli: Any, shm_dir: Path, holders: Any) -> None:
    made = cli("create", "u", "--shm-dir", str(shm_dir), "--world-size", "2",
               "--cpu-page-size", "4KiB", "--num-blocks", "4", "--json")
    assert made.exit_code == 0
    holders("vllm-unlink", str(shm_dir), "u", *GEOMETRY)  # joins, then unlinks the name
    assert not (shm_dir / "vllm_offload_u.mmap").exists()

    doc = gc_json(cli, shm_dir, "--min-age", "0", "--include-persistent")

    assert doc["data"]["orphan_manifests_removed"] == []
    assert (shm_dir / "vllm_offload_u.manifest.json").exists()


def test_leftover_manifest_temp_files(cli: Any, shm_dir: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = shm_dir / f".vllm_offload_t.manifest.json.tmp.{dead_pid}.0badc0de"
    writing = shm_dir / f".vllm_offload_t.manifest.json.tmp.{os.getpid()}.0badc0de"
    lookalike = shm_dir / f".vllm_offload_t.manifest.json.tmp.{dead_pid}.NOTHEX"
    for p in (stale, writing, lookalike):
        p.write_text("{}")

    assert gc_json(cli, shm_dir)["data"]["temp_files_removed"] == []  # young
    doc = gc_json(cli, shm_dir, "--min-age", "0")

    assert doc["data"]["temp_files_removed"] == [str(stale)]
    assert not stale.exists() and writing.exists() and lookalike.exists()


def test_one_listing_when_no_temp_file_is_there(shm_dir: Path, monkeypatch: Any) -> None:
    """discovery's listing says whether a manifest temporary is there: without one gc does
    not list a (maybe million-file) directory a second time for them."""
    region_file(shm_dir, "x")
    listed: list[str] = []
    scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda p: (listed.append(str(p)), scandir(p))[1])
    reclaim.collect(shm_dir, GcOptions(min_age=0.0))
    assert listed.count(str(shm_dir)) == 1
    (shm_dir / ".vllm_offload_x.manifest.json.tmp.999999999.abcdef01").write_text("{}")
    report = reclaim.collect(shm_dir, GcOptions(min_age=0.0))
    assert listed.count(str(shm_dir)) == 3 and len(report.temp_files_removed) == 1


# -- dry run, output, metrics ------------------------------------------------------


def _snapshot(shm_dir: Path) -> dict[str, tuple[int, int, int]]:
    out = {}
    for name in os.listdir(shm_dir):
        st = os.stat(shm_dir / name, follow_symlinks=False)
        out[name] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def test_dry_run_changes_nothing(cli: Any, shm_dir: Path, holders: Any) -> None:
    region_file(shm_dir, "stale")
    region_file(shm_dir, "stale", segment=1)
    region_file(shm_dir, "live")
    holders("map-only", str(shm_dir), "live", *GEOMETRY)
    (shm_dir / "vllm_offload_lost.manifest.json").write_text("{}")
    os.chmod(shm_dir / "vllm_offload_lost.manifest.json", 0o600)
    (shm_dir / ".vllm_offload_x.manifest.json.tmp.999999999.abcdef01").write_text("{}")
    before = _snapshot(shm_dir)

    doc = gc_json(cli, shm_dir, "--min-age", "0", "--dry-run")

    assert _snapshot(shm_dir) == before
    data = doc["data"]
    assert data["dry_run"] is True
    assert removed_ids(doc) == ["stale"] and data["freed_bytes"] == 2 * SIZE
    assert kept(doc, "live")["code"] == "live"
    assert data["orphan_manifests_removed"] == [str(shm_dir / "vllm_offload_lost.manifest.json")]
    assert len(data["temp_files_removed"]) == 1
    # and the real run then does exactly what the dry run announced
    real = gc_json(cli, shm_dir, "--min-age", "0")["data"]
    assert [r["paths"] for r in real["removed"]] == [r["paths"] for r in data["removed"]]
    assert real["orphan_manifests_removed"] == data["orphan_manifests_removed"]


def test_human_output_says_what_was_freed_and_why_the_rest_stayed(
        cli: Any, shm_dir: Path, holders: Any) -> None:
    region_file(shm_dir, "gone")
    region_file(shm_dir, "busy")
    h = holders("fd-only", str(shm_dir), "busy", *GEOMETRY)

    result = cli("gc", "--shm-dir", str(shm_dir), "--min-age", "0")

    assert result.exit_code == 0
    assert "Removed gone: 32KiB of memory, 32KiB file size" in result.stdout
    assert f"Kept busy: held by pid {h.pid}" in result.stdout
    assert "Freed 32KiB from 1 region(s)" in result.stdout
    quiet = cli("gc", "--shm-dir", str(shm_dir), "--min-age", "0", "-q")
    assert quiet.exit_code == 0 and quiet.stdout == ""  # nothing removed: silent for cron


def test_dry_run_human_output(cli: Any, shm_dir: Path) -> None:
    region_file(shm_dir, "maybe")
    result = cli("garbage-collect", "--shm-dir", str(shm_dir), "--min-age", "0", "--dry-run")
    assert "Would remove maybe" in result.stdout
    assert "dry run: nothing was changed" in result.stdout
    assert (shm_dir / "vllm_offload_maybe.mmap").exists()


def test_prometheus_textfile(cli: Any, shm_dir: Path, tmp_path: Path, holders: Any) -> None:
    region_file(shm_dir, "old")
    region_file(shm_dir, "held")
    holders("fd-only", str(shm_dir), "held", *GEOMETRY)
    prom = tmp_path / "gc.prom"

    doc = gc_json(cli, shm_dir, "--min-age", "0", "--prometheus", str(prom))

    assert doc["data"]["prometheus"] == str(prom)
    values = _metrics(prom.read_text())
    assert values["vllm_offload_gc_regions_seen"] == 2
    assert values["vllm_offload_gc_regions_removed"] == 1
    assert values["vllm_offload_gc_freed_bytes"] == SIZE
    assert values["vllm_offload_gc_errors"] == 0
    assert values['vllm_offload_gc_regions_kept{reason="live"}'] == 1
    assert values['vllm_offload_gc_regions_kept{reason="too_young"}'] == 0
    assert values["vllm_offload_gc_last_run_timestamp_seconds"] == pytest.approx(
        doc["data"]["started_at"], abs=1)
    assert [p.name for p in tmp_path.iterdir()] == ["gc.prom"]  # no temp file left


def _metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_prometheus_into_a_missing_directory_is_bad_usage(cli: Any, shm_dir: Path) -> None:
    doc = gc_json(cli, shm_dir, "--prometheus", str(shm_dir / "no" / "gc.prom"), expect=2)
    assert doc["errors"][0]["code"] == "bad_output"


def test_gc_never_imports_torch(shm_dir: Path) -> None:
    region_file(shm_dir, "t")
    code = textwrap.dedent(f"""
        import sys
        from vllm_offload_cli.cli.app import main
        try:
            main(["gc", "--shm-dir", {str(shm_dir)!r}, "--min-age", "0", "-q"])
        except SystemExit as exc:
            assert not exc.code, exc.code
        assert "torch" not in sys.modules, "gc imported torch"
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not (shm_dir / "vllm_offload_t.mmap").exists()


# -- races: every decision is re-checked under the lock ------------------------------


def test_a_user_that_appears_after_discovery_is_seen_under_the_lock(
        shm_dir: Path, holders: Any) -> None:
    path = region_file(shm_dir, "late")
    inventory = discover(shm_dir)  # it looked stale here...
    assert inventory.regions[0].state == "stale"
    h = holders("map-only", str(shm_dir), "late", *GEOMETRY)  # ...then vLLM mapped it

    report = reclaim.reclaim(inventory, GcOptions(min_age=0))

    assert report.removed == ()
    assert (report.kept[0].code, report.kept[0].pid) == ("live", h.pid)
    assert "after locking" in report.kept[0].message
    assert path.exists()


def test_a_lock_taken_after_discovery_keeps_the_region(shm_dir: Path, holders: Any) -> None:
    path = region_file(shm_dir, "joined")
    inventory = discover(shm_dir)
    h = holders("flock-only", str(shm_dir), "joined", *GEOMETRY)

    report = reclaim.reclaim(inventory, GcOptions(min_age=0))

    assert (report.kept[0].code, report.kept[0].pid) == ("live", h.pid)
    assert path.exists()


def test_a_name_replaced_after_discovery_is_left_alone(shm_dir: Path) -> None:
    path = region_file(shm_dir, "swapped")
    inventory = discover(shm_dir)
    path.unlink()
    region_file(shm_dir, "swapped")  # a new engine took the name: another inode
    new = identity(path)

    report = reclaim.reclaim(inventory, GcOptions(min_age=0))

    assert report.kept[0].code == "changed"
    assert identity(path) == new


def test_a_region_another_collector_is_examining_is_reported_busy(shm_dir: Path) -> None:
    """LOCK_EX held elsewhere (what a concurrent gc does) is reported as such."""
    path = region_file(shm_dir, "contended")
    inventory = discover(shm_dir)
    # exclusive lock, descriptor parked in a socket: only /proc/locks shows it
    locker = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, socket, sys
        fd = os.open({str(path)!r}, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        parked = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        socket.send_fds(parked[0], [b"x"], [fd])
        os.close(fd)
        print("locked", flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout is not None and locker.stdout.readline().strip() == "locked"
        report = reclaim.reclaim(inventory, GcOptions(min_age=0))
    finally:
        locker.kill()
        locker.wait()
    assert (report.kept[0].code, report.kept[0].pid) == ("busy", locker.pid)
    assert path.exists()


def test_a_vanished_file_is_not_an_error(shm_dir: Path) -> None:
    path = region_file(shm_dir, "fleeting")
    inventory = discover(shm_dir)
    path.unlink()  # e.g. the engine's own cleanup, or another gc

    report = reclaim.reclaim(inventory, GcOptions(min_age=0))

    assert report.errors == () and report.removed == () and report.kept == ()
    assert report.vanished == ("fleeting",)


def test_a_bug_while_opening_fails_instead_of_reading_as_unreadable(
        shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only refusals become an "unreadable" region that gc keeps; a programming error
    must surface, or no test would ever notice it."""
    from vllm_offload_cli.core.region import fsguard

    region_file(shm_dir, "buggy")

    def broken(*args: object, **kwargs: object) -> int:
        raise TypeError("a bug")

    monkeypatch.setattr(fsguard, "open_existing", broken)
    with pytest.raises(TypeError, match="a bug"):
        discover(shm_dir)


def test_two_gc_processes_at_once_never_fail_and_never_remove_twice(shm_dir: Path) -> None:
    for rnd in range(4):
        ids = [f"r{rnd}x{i}" for i in range(60)]
        for engine_id in ids:
            region_file(shm_dir, engine_id, size=SLOT)
        procs = [subprocess.Popen(
            [sys.executable, "-m", "vllm_offload_cli", "gc", "--shm-dir", str(shm_dir),
             "--min-age", "0", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True) for _ in range(2)]
        docs = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, out + err
            docs.append(json.loads(out))
        removed = [set(removed_ids(d)) for d in docs]
        assert not removed[0] & removed[1]
        assert all(d["data"]["failures"] == [] for d in docs)
        for me, d in enumerate(docs):  # only ever kept because of the other collector
            other = procs[1 - me].pid
            assert all(k["code"] in ("live", "busy") and k["pid"] in (other, None)
                       for k in d["data"]["kept"]), d["data"]["kept"]
        # what both deferred to each other, the next run takes
        rest = set(removed_ids(collect_json(shm_dir)))
        assert removed[0] | removed[1] | rest == set(ids)
        assert not (removed[0] | removed[1]) & rest
        assert os.listdir(shm_dir) == []


def collect_json(shm_dir: Path) -> dict[str, Any]:
    result = run_cli_subprocess("gc", "--shm-dir", str(shm_dir), "--min-age", "0", "--json")
    assert result.exit_code == 0, result.stderr
    return result.json


def test_a_real_subprocess_run(shm_dir: Path) -> None:
    region_file(shm_dir, "sub")
    result = run_cli_subprocess("gc", "--shm-dir", str(shm_dir), "--min-age", "0")
    assert result.exit_code == 0, result.stderr
    assert "Removed sub" in result.stdout
    assert wait_until(lambda: not (shm_dir / "vllm_offload_sub.mmap").exists(), timeout=1)
