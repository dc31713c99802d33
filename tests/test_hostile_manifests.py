"""Manifests are untrusted input (issue 9, rows 1, 2, 3 and 10).

Any local user can write a file named like a manifest beside a region. Whatever
it holds, `inspect` (every format), `gc` and `verify-rank-layout` must finish,
report a `manifest_*` problem and judge the region as if it had no manifest;
`--json` output must stay strict JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_root
from tests.region_files import SIZE, region_file
from vllm_offload_cli.core.region import manifest as manifest_io
from vllm_offload_cli.core.region.naming import manifest_path

NOBODY = 65534


@pytest.fixture
def root() -> None:
    require_root("a second user's file needs root")


needs_root = pytest.mark.usefixtures("root")


def _strict(text: str) -> Any:
    """json.loads that refuses NaN and Infinity, as any strict JSON reader does."""
    def refuse(name: str) -> Any:
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def _valid_doc(region: Path, **changes: Any) -> dict[str, Any]:
    st = region.stat()
    doc: dict[str, Any] = {
        "manifest_version": 1, "engine_id": region.name[len("vllm_offload_"):-len(".mmap")],
        "geometry": {"num_blocks": 4, "row_stride": 8192, "cpu_page_size": 4096,
                     "world_size": 2},
        "layout": "worker", "rank_source": None, "persistent": True, "state": "ready",
        "region": {"dev": st.st_dev, "ino": st.st_ino},
        "creator": {"pid": 1, "start_ticks": 1, "host": "h", "created_at": time.time()},
        "attachments": [],
    }
    doc.update(changes)
    return doc


def _plant(shm_dir: Path, engine_id: str, payload: bytes, *, uid: int | None = None) -> Path:
    """A manifest file with these exact bytes, mode 0600, owned by `uid` (default: us)."""
    path = manifest_path(shm_dir, engine_id)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, payload)
        if uid is not None:
            os.fchown(fd, uid, uid)
    finally:
        os.close(fd)
    return path


def _inspect(cli: Any, shm_dir: Path) -> dict[str, Any]:
    result = cli("inspect", "--shm-dir", str(shm_dir), "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    doc = _strict(result.stdout)
    return {r["engine_id"]: r for r in doc["data"]["regions"]}


def _codes(region: dict[str, Any]) -> list[str]:
    return [p["code"] for p in region["problems"]]


HOSTILE = {
    "deep_nesting": b"[" * 5000,
    "deep_objects": b'{"a":' * 3000 + b"1" + b"}" * 3000,
    "huge_int_created_at": None,  # built from a valid doc below
    "float_overflow": None,
    "nan": None,
    "infinity": None,
    "huge_created_at": None,
    "wrong_types": None,
    "negative_blocks": None,
    "long_string": None,
    "not_utf8": b'{"manifest_version": 1, "engine_id": "\xff\xfe"}',
    "empty": b"",
    "truncated": b'{"manifest_version": 1, "engine_id": ',
    "array": b"[1, 2, 3]",
    "too_big": b" " * (2 << 20) + b"{}",
}


def _payload(kind: str, region: Path) -> bytes:
    fixed = HOSTILE[kind]
    if fixed is not None:
        return fixed
    doc = _valid_doc(region)
    text = json.dumps(doc)
    now = json.dumps(doc["creator"]["created_at"])
    swaps = {
        "huge_int_created_at": (now, "9" * 400),
        "float_overflow": (now, "1e400"),
        "nan": (now, "NaN"),
        "infinity": (now, "-Infinity"),
        "huge_created_at": (now, "1e300"),
        "wrong_types": ('"persistent": true', '"persistent": "yes"'),
        "negative_blocks": ('"num_blocks": 4', '"num_blocks": -4'),
        "long_string": ('"host": "h"', '"host": "' + "h" * 100_000 + '"'),
    }
    old, new = swaps[kind]
    assert old in text
    return text.replace(old, new, 1).encode()


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_manifest_is_a_problem_not_a_crash(cli: Any, shm_dir: Path, kind: str,
                                                   tmp_path: Path) -> None:
    region = region_file(shm_dir, "victim")
    _plant(shm_dir, "victim", _payload(kind, region))
    found = _inspect(cli, shm_dir)["victim"]
    assert _codes(found) == ["manifest_invalid"]
    assert found["state"] == "stale" and found["persistent"] is False
    assert found["geometry"] is None
    # the prometheus output and the table render too
    prom = tmp_path / "m.prom"
    result = cli("inspect", "--shm-dir", str(shm_dir), "--format", "prometheus",
                 "--output", str(prom))
    assert result.exit_code == 0, result.stderr
    assert 'vllm_offload_region_problems{base_engine_id="victim"' in prom.read_text()
    assert cli("inspect", "--shm-dir", str(shm_dir)).exit_code == 0
    verify = cli("verify-rank-layout", "victim", "--shm-dir", str(shm_dir), "--json")
    assert verify.exit_code == 3
    assert [p["code"] for p in _strict(verify.stdout)["data"]["problems"]] == [
        "manifest_invalid", "geometry_unknown"]
    # judged as if it had no manifest: an unused, unpersisted region is reclaimed
    gc = cli("gc", "--min-age", "0", "--shm-dir", str(shm_dir), "--json")
    assert gc.exit_code == 0, gc.stdout
    assert [r["engine_id"] for r in _strict(gc.stdout)["data"]["removed"]] == ["victim"]
    assert sorted(os.listdir(shm_dir)) == []


def test_manifest_read_is_bounded_by_what_is_read(shm_dir: Path) -> None:
    """The size check does not trust st_size alone: at most limit + 1 bytes are read."""
    region = region_file(shm_dir, "big")
    path = _plant(shm_dir, "big", json.dumps(_valid_doc(region)).encode() + b" " * (2 << 20))
    with pytest.raises(manifest_io.ManifestError, match="longer than"):
        manifest_io.read(str(path))


def _forged(shm_dir: Path, engine_id: str, **changes: Any) -> Path:
    """Root's region as vLLM leaves it (no manifest), and another user's manifest beside it."""
    region = region_file(shm_dir, engine_id)
    doc = _valid_doc(region, **changes)
    doc["geometry"] = {"num_blocks": 1, "row_stride": SIZE, "cpu_page_size": SIZE,
                       "world_size": 1}
    return _plant(shm_dir, engine_id, json.dumps(doc).encode(), uid=NOBODY)


@needs_root
@pytest.mark.parametrize("created_at", [None, 1e300])
def test_foreign_manifest_is_ignored(cli: Any, shm_dir: Path, created_at: float | None
                                     ) -> None:
    """Row 3: a forged `persistent: true` manifest must not keep root's region forever."""
    changes = {} if created_at is None else {"creator": {
        "pid": 1, "start_ticks": 1, "host": "h", "created_at": created_at}}
    planted = _forged(shm_dir, "rooted", **changes)
    found = _inspect(cli, shm_dir)["rooted"]
    assert _codes(found) == ["manifest_foreign"]
    assert found["state"] == "stale" and found["geometry"] is None
    assert found["age_seconds"] is not None and found["age_seconds"] < 3600
    # verify-rank-layout does not take the forged geometry
    verify = cli("verify-rank-layout", "rooted", "--shm-dir", str(shm_dir), "--json")
    doc = _strict(verify.stdout)
    assert verify.exit_code == 3
    assert doc["data"]["geometry_source"] is None
    assert [p["code"] for p in doc["data"]["problems"]] == ["manifest_foreign",
                                                           "geometry_unknown"]
    # plain gc reclaims it (no --include-persistent, no --all-users needed: it is root's)
    gc = cli("gc", "--min-age", "0", "--shm-dir", str(shm_dir), "--json")
    assert gc.exit_code == 0
    assert [r["engine_id"] for r in _strict(gc.stdout)["data"]["removed"]] == ["rooted"]
    assert not (shm_dir / "vllm_offload_rooted.mmap").exists()
    assert planted.exists()  # another user's file: not ours to remove without --all-users


@needs_root
def test_foreign_deep_manifest_is_not_parsed(cli: Any, shm_dir: Path) -> None:
    """Row 1 as reported: another user's `[` x 5000 is refused by owner before parsing."""
    region_file(shm_dir, "deep")
    _plant(shm_dir, "deep", b"[" * 5000, uid=NOBODY)
    assert _codes(_inspect(cli, shm_dir)["deep"]) == ["manifest_foreign"]
    gc = cli("gc", "--min-age", "0", "--all-users", "--shm-dir", str(shm_dir))
    assert gc.exit_code == 0, gc.stderr
    assert os.listdir(shm_dir) == []  # root with --all-users takes both


def test_manifest_of_wrong_shape_files_is_refused(cli: Any, shm_dir: Path) -> None:
    """A FIFO, a hard-linked file or a group-readable file never counts as a manifest."""
    region_file(shm_dir, "fifo")
    os.mkfifo(manifest_path(shm_dir, "fifo"), 0o600)  # opening it must not hang
    region = region_file(shm_dir, "linked")
    _plant(shm_dir, "linked", json.dumps(_valid_doc(region)).encode())
    os.link(manifest_path(shm_dir, "linked"), shm_dir / "elsewhere")
    region = region_file(shm_dir, "open")
    path = _plant(shm_dir, "open", json.dumps(_valid_doc(region)).encode())
    path.chmod(0o644)
    found = _inspect(cli, shm_dir)
    assert _codes(found["fifo"]) == ["manifest_not_regular_file"]
    assert _codes(found["linked"]) == ["manifest_link_count"]
    assert _codes(found["open"]) == ["manifest_unsafe_mode"]
    assert all(r["state"] == "stale" for r in found.values())


def test_manifest_naming_another_engine_is_invalid(cli: Any, shm_dir: Path) -> None:
    region = region_file(shm_dir, "mine")
    _plant(shm_dir, "mine", json.dumps(_valid_doc(region, engine_id="other")).encode())
    assert _codes(_inspect(cli, shm_dir)["mine"]) == ["manifest_invalid"]


def test_json_output_refuses_nan() -> None:
    """Row 10, last line of defence: the envelope printer never writes NaN."""
    from vllm_offload_cli.cli.common import print_json

    with pytest.raises(ValueError, match="Out of range float"):
        print_json({"x": float("nan")})


CARRIER = '''
import os, sys, time
from vllm_offload_cli.core.region import carried
from vllm_offload_cli.core.region.geometry import Geometry
from vllm_offload_cli.core.region.manifest import Manifest
path, how = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, 16 * 65536)
st = os.fstat(fd)
m = Manifest(engine_id="other" if how == "other_id" else "prod",
             geometry=Geometry(num_blocks=16, row_stride=65536, cpu_page_size=65536,
                               world_size=1),
             region_dev=st.st_dev, region_ino=st.st_ino + (how == "other_inode"),
             creator_pid=os.getpid(), creator_start_ticks=None, creator_host="h",
             created_at=time.time() - 30)
held = carried.carry(m)
if how == "mode":
    os.fchmod(held, 0o644)
os.unlink(path)  # released: the region lives on in this process only
print("ready", flush=True)
sys.stdin.read()
'''


@pytest.mark.parametrize("how", ["ok", "mode", "other_id", "other_inode"])
def test_a_released_regions_carried_manifest_counts_only_when_it_is_its_own(
        shm_dir: Path, cli: Any, how: str) -> None:
    """What a holder of a released region carries (core.region.carried) is read as any
    manifest is: only 0600, of the region's owner, for that very inode and name."""
    proc = subprocess.Popen([sys.executable, "-c", CARRIER,
                             str(shm_dir / "vllm_offload_prod.mmap"), how],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        doc = _strict(cli("inspect", "--shm-dir", str(shm_dir), "--json").stdout)
        [region] = doc["data"]["regions"]
        assert (region["linked"], region["state"]) == (False, "live")
        if how == "ok":
            assert region["geometry"]["num_blocks"] == 16 and region["age_seconds"] >= 30
        else:
            assert region["geometry"] is None and region["age_seconds"] is None
    finally:
        proc.kill()
        proc.wait(timeout=10)
