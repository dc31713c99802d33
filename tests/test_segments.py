"""Segmented regions (`.mmap`, `.mmap.1`, ...): vLLM 0.33's split, created and joined by the core.

Regions of several GiB are made sparse (no pre-fault): tmpfs allocates only
the pages a test touches, so the files are real but cost almost nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from vllm_offload_cli.core.base.errors import RegionBusyError, UnsafeRegionError
from vllm_offload_cli.core.region import SharedOffloadRegion
from vllm_offload_cli.core.region.geometry import (
    VLLM_CPU_SEGMENTS,
    Segment,
    effective_segments,
    split,
)

GiB = 1 << 30
MiB = 1 << 20


@pytest.mark.parametrize(("size", "expected"), [
    (GiB - 1, 1), (GiB, 1), (2 * GiB, 2), (33 * GiB + 5, 32), (512 * GiB, 32)])
def test_vllms_rule_for_the_number_of_files(size: int, expected: int) -> None:
    assert effective_segments(VLLM_CPU_SEGMENTS, size) == expected
    assert effective_segments(VLLM_CPU_SEGMENTS, size, min_bytes=GiB // 2) == min(
        32, size // (GiB // 2))  # a release's own minimum, as the hook reads it


def test_rows_split_cdiv_and_the_last_file_takes_the_rest() -> None:
    assert split(10, 4096, 4) == (Segment(0, 0, 3 * 4096), Segment(1, 3 * 4096, 3 * 4096),
                                  Segment(2, 6 * 4096, 3 * 4096), Segment(3, 9 * 4096, 4096))
    assert len(split(5, 4096, 4)) == 3  # cdiv(5, 4) = 2 rows a file: fewer files than asked
    assert split(3, 4096, 1) == (Segment(0, 0, 3 * 4096),)


def _open(shm_dir: Path, rank: int | None, **kw: Any) -> SharedOffloadRegion:
    return SharedOffloadRegion("seg", 6, rank, 512 * MiB, 256 * MiB, shm_dir=shm_dir,
                               world_size=2, populate_pages=False, preflight=False,
                               num_segments=32, **kw)


def test_create_and_join_map_the_files_back_to_back(shm_dir: Path) -> None:
    with _open(shm_dir, 0) as creator, _open(shm_dir, 1) as joiner:
        assert creator.creator and not joiner.creator
        names = sorted(p.name for p in shm_dir.iterdir() if ".mmap" in p.name)
        assert names == ["vllm_offload_seg.mmap", "vllm_offload_seg.mmap.1",
                         "vllm_offload_seg.mmap.2"]
        assert all(os.stat(shm_dir / n).st_size == GiB for n in names)
        assert creator.mmap_obj is not None and joiner.mmap_obj is not None
        for row in range(6):  # rank 1 writes its slot; the creator reads it; so does the file
            offset = row * 512 * MiB + 256 * MiB
            joiner.mmap_obj[offset:offset + 4] = bytes([row + 1]) * 4
            assert creator.mmap_obj[offset:offset + 4] == bytes([row + 1]) * 4
            f = shm_dir / ("vllm_offload_seg.mmap" + (f".{row // 2}" if row >= 2 else ""))
            with open(f, "rb") as fh:
                fh.seek(offset - (row // 2) * GiB)
                assert fh.read(4) == bytes([row + 1]) * 4
    assert list(shm_dir.iterdir()) == []  # the creator's cleanup removed every file


def test_a_joiner_expecting_another_split_is_refused(shm_dir: Path) -> None:
    with _open(shm_dir, 0), pytest.raises(UnsafeRegionError, match="geometry needs 3221225472"):
        SharedOffloadRegion("seg", 6, 1, 512 * MiB, 256 * MiB, shm_dir=shm_dir, world_size=2,
                            populate_pages=False, preflight=False, num_segments=1)


def test_a_leftover_segment_stops_a_create_and_leaves_nothing(shm_dir: Path) -> None:
    stray = shm_dir / "vllm_offload_seg.mmap.2"
    stray.touch(mode=0o600)
    with pytest.raises(RegionBusyError, match=r"mmap\.2 already exists"):
        _open(shm_dir, 0)
    assert sorted(p.name for p in shm_dir.iterdir()) == ["vllm_offload_seg.mmap.2"]


def test_cli_create_splits_by_default_and_inspect_groups_the_files(
        cli: Any, shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No vLLM here: the newest release's layout, said so; single-file on request."""
    monkeypatch.setattr("vllm_offload_cli.engine.vllm_rules.vllm_root", lambda: None)
    made = cli("create", "seg", "--world-size", "2", "--cpu-page-size", "1MiB", "--size",
               "3GiB", "--no-populate", "--shm-dir", str(shm_dir), "--json")
    assert made.exit_code == 0, made.stderr
    assert [Path(p).name for p in made.json["data"]["paths"]] == [
        "vllm_offload_seg.mmap", "vllm_offload_seg.mmap.1", "vllm_offload_seg.mmap.2"]
    assert made.json["data"]["vllm_layout"] == {"name": "segmented", "basis": "newest",
                                                "vllm_version": None}
    assert [w["code"] for w in made.json["warnings"]] == ["vllm_not_found"]
    one = cli("create", "tier", "--world-size", "2", "--cpu-page-size", "1MiB", "--size",
              "3GiB", "--no-populate", "--vllm-layout", "single-file", "--shm-dir",
              str(shm_dir), "--json")
    assert [Path(p).name for p in one.json["data"]["paths"]] == ["vllm_offload_tier.mmap"]
    assert one.json["data"]["vllm_layout"]["basis"] == "requested"
    assert one.json["warnings"] == []
    seen = cli("inspect", "--shm-dir", str(shm_dir), "--json").json["data"]["regions"]
    assert sorted((r["engine_id"], len(r["paths"]), r["size_bytes"], r["vllm_layout"],
                   r["problems"]) for r in seen) == [
        ("seg", 3, 3 * GiB, "segmented", []), ("tier", 1, 3 * GiB, "single-file", [])]
    table = cli("inspect", "--shm-dir", str(shm_dir)).stdout
    assert "LAYOUT" in table and "segmented/3" in table and "single-file" in table
    gone = cli("gc", "--include-persistent", "--min-age", "0", "--shm-dir", str(shm_dir))
    assert gone.exit_code == 0 and list(shm_dir.iterdir()) == []


def test_a_region_vllm_made_shows_its_layout_by_its_files(cli: Any, shm_dir: Path) -> None:
    """No manifest: `.mmap.N` files say segmented, one named file single-file."""
    for name in ("vllm_offload_a.mmap", "vllm_offload_a.mmap.1", "vllm_offload_b.mmap"):
        with open(shm_dir / name, "wb") as f:
            f.truncate(1 << 20)
        os.chmod(shm_dir / name, 0o600)
    seen = cli("inspect", "--shm-dir", str(shm_dir), "--json").json["data"]["regions"]
    assert sorted((r["engine_id"], r["vllm_layout"]) for r in seen) == [
        ("a", "segmented"), ("b", "single-file")]


def test_the_layout_is_the_manifests_file_count_and_old_manifests_still_read(
        shm_dir: Path) -> None:
    """`vllm_layout` is derived from `segments`; a manifest that still stores it (written
    by an earlier release) reads as before, whatever it says there."""
    import json

    from vllm_offload_cli.core.region import manifest as manifest_io

    with SharedOffloadRegion("old", 4, 0, 4096, 4096, shm_dir=shm_dir, world_size=1,
                             num_segments=2, min_segment_bytes=4096) as region:
        path = Path(region.manifest_path)
        doc = json.loads(path.read_text())
        assert "vllm_layout" not in doc and doc["segments"] == 2
        assert manifest_io.read(str(path)).vllm_layout == "segmented"
        path.write_text(json.dumps({**doc, "vllm_layout": "single-file"}))
        assert manifest_io.read(str(path)).vllm_layout == "segmented"


def test_an_exact_segment_count_is_a_request_and_excludes_a_layout(cli: Any,
                                                                  shm_dir: Path) -> None:
    args = ("create", "n", "--world-size", "2", "--cpu-page-size", "1MiB", "--size", "3GiB",
            "--no-populate", "--shm-dir", str(shm_dir), "--json")
    both = cli(*args, "--segments", "1", "--vllm-layout", "segmented")
    assert both.exit_code == 2 and "one of --segments and --vllm-layout" in both.stderr + str(
        both.json["errors"])
    one = cli(*args, "--segments", "1")
    assert one.exit_code == 0, one.stderr
    assert one.json["data"]["vllm_layout"] == {"name": "single-file", "basis": "requested",
                                               "vllm_version": None}
