"""engine_id validation and region file naming."""

from __future__ import annotations

import pytest

from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.region.naming import (
    MAX_ENGINE_ID_LEN,
    manifest_path,
    parse_manifest_filename,
    parse_region_filename,
    region_path,
    split_engine_id,
    validate_engine_id,
    with_dp_rank,
)


@pytest.mark.parametrize("good", ["a", "engine-1", "6f1c.b2_x", "A" * MAX_ENGINE_ID_LEN,
                                  "uuid_dp3", "..a", "-x"])
def test_valid_engine_ids(good: str) -> None:
    assert validate_engine_id(good) == good


@pytest.mark.parametrize(("bad", "why"), [
    ("", "empty"),
    (".", "directory reference"),
    ("..", "directory reference"),
    ("../x", "'/'"),
    ("a/b", "'/'"),
    ("a\0b", "'\\x00'"),
    ("a b", "' '"),
    ("é", "'é'"),
    ("A" * (MAX_ENGINE_ID_LEN + 1), "limit"),
])
def test_invalid_engine_ids_say_why(bad: str, why: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        validate_engine_id(bad)
    assert why in info.value.message
    assert info.value.code == "invalid_engine_id"


def test_paths_are_built_only_from_valid_ids(tmp_path: object) -> None:
    assert str(region_path("/dev/shm", "e_dp1")) == "/dev/shm/vllm_offload_e_dp1.mmap"
    assert str(manifest_path("/x", "e")) == "/x/vllm_offload_e.manifest.json"
    with pytest.raises(InvalidInputError):
        region_path("/dev/shm", "../etc/passwd")


def test_dp_suffix_round_trip() -> None:
    assert with_dp_rank("base", 3) == "base_dp3"
    assert with_dp_rank("base", None) == "base"
    parts = split_engine_id("a_b_dp12")
    assert (parts.base_engine_id, parts.dp_rank) == ("a_b", 12)
    assert split_engine_id("plain").dp_rank is None
    assert split_engine_id("x_dp01").dp_rank is None  # vLLM never zero-pads
    assert split_engine_id("_dp1").dp_rank is None  # needs a base
    with pytest.raises(InvalidInputError):
        with_dp_rank("base", -1)


@pytest.mark.parametrize(("name", "engine_id", "segment"), [
    ("vllm_offload_e.mmap", "e", 0),
    ("vllm_offload_e_dp2.mmap.1", "e_dp2", 1),
    ("vllm_offload_a.mmap.mmap.7", "a.mmap", 7),
])
def test_region_filenames_parse(name: str, engine_id: str, segment: int) -> None:
    parsed = parse_region_filename(name)
    assert parsed is not None
    assert (parsed.engine_id, parsed.segment) == (engine_id, segment)


@pytest.mark.parametrize("name", [
    "vllm_offload_.mmap", "vllm_offload_e.mmap.0", "vllm_offload_e.mmap.01", "vllm_offload_e",
    "other_e.mmap", "vllm_offload_e.mmap.tmp", "vllm_offload_a b.mmap",
    "vllm_offload_e.manifest.json",
])
def test_foreign_names_are_not_regions(name: str) -> None:
    assert parse_region_filename(name) is None


def test_manifest_names() -> None:
    assert parse_manifest_filename("vllm_offload_e_dp0.manifest.json") == "e_dp0"
    assert parse_manifest_filename("vllm_offload_e.mmap") is None
    assert parse_manifest_filename(".vllm_offload_e.manifest.json.tmp.1.ab") is None
