"""Rank sources: the named slot functions the engine hook and the verifier share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.region import SharedOffloadRegion
from vllm_offload_cli.core.region.naming import manifest_path, region_path
from vllm_offload_cli.core.region.ranks import (
    DEVICE_INDEX,
    DEVICE_MODULO,
    LOGICAL,
    RANK_SOURCES,
    RankSource,
    WorkerPlace,
    parse_rank_source,
)


@pytest.mark.parametrize(("device", "world", "slot"), [
    (0, 1, 0), (3, 1, 0), (0, 2, 0), (1, 2, 1), (2, 2, 0), (3, 2, 1), (5, 4, 1), (7, 8, 7),
])
def test_device_modulo_folds_the_device_index_into_the_world(device: int, world: int,
                                                              slot: int) -> None:
    assert DEVICE_MODULO.slot(WorkerPlace(local_rank=0, device_index=device,
                                         world_size=world)) == slot


def test_logical_ignores_the_device() -> None:
    for device in (0, 2, 7):
        assert LOGICAL.slot(WorkerPlace(local_rank=1, device_index=device, world_size=2)) == 1


def test_device_index_is_the_unfolded_pre_47987_behaviour() -> None:
    assert DEVICE_INDEX.slot(WorkerPlace(local_rank=0, device_index=3, world_size=2)) == 3


def test_every_worker_seeing_index_0_collides_only_for_device_based_sources() -> None:
    """The one-GPU-per-process case of the issue: every current_device_index() is 0."""
    places = [WorkerPlace(local_rank=w, device_index=0, world_size=4) for w in range(4)]
    assert {DEVICE_MODULO.slot(p) for p in places} == {0}
    assert [LOGICAL.slot(p) for p in places] == [0, 1, 2, 3]
    assert DEVICE_MODULO.device_based and DEVICE_INDEX.device_based
    assert not LOGICAL.device_based


def test_registry_names() -> None:
    assert list(RANK_SOURCES) == ["device-modulo", "logical", "device-index"]
    assert all(RANK_SOURCES[name].name == name for name in RANK_SOURCES)
    with pytest.raises(TypeError):
        RANK_SOURCES["mine"] = LOGICAL  # type: ignore[index]


@pytest.mark.parametrize("text", ["device-modulo", "DEVICE_MODULO", " device_modulo "])
def test_parse_forgives_case_and_underscores(text: str) -> None:
    assert parse_rank_source(text) is DEVICE_MODULO


def test_parse_refuses_unknown_names_listing_the_known_ones() -> None:
    with pytest.raises(InvalidInputError) as err:
        parse_rank_source("tp-rank")
    assert err.value.code == "invalid_rank_source"
    assert "device-modulo, logical, device-index" in str(err.value)


def test_parse_accepts_registered_objects_only() -> None:
    assert parse_rank_source(LOGICAL) is LOGICAL
    impostor = RankSource(name="logical", slot=DEVICE_MODULO.slot,
                          description="not the real one", device_based=True)
    with pytest.raises(InvalidInputError):
        parse_rank_source(impostor)
    with pytest.raises(InvalidInputError):
        parse_rank_source(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("kw", [
    {"local_rank": 0, "device_index": 0, "world_size": 0},
    {"local_rank": -1, "device_index": 0, "world_size": 2},
    {"local_rank": 0, "device_index": -1, "world_size": 2},
    {"local_rank": True, "device_index": 0, "world_size": 2},
    {"local_rank": 0, "device_index": 1.0, "world_size": 2},
])
def test_worker_place_refuses_nonsense(kw: dict[str, int]) -> None:
    with pytest.raises(InvalidInputError):
        WorkerPlace(**kw)


def test_each_named_source_picks_its_own_slot() -> None:
    place = WorkerPlace(local_rank=1, device_index=2, world_size=2)
    assert parse_rank_source("device-modulo").slot(place) == 0
    assert parse_rank_source("logical").slot(place) == 1
    assert parse_rank_source(DEVICE_INDEX).slot(place) == 2


def test_region_records_the_canonical_rank_source(shm_dir: Path) -> None:
    region = SharedOffloadRegion("ranked", 2, 1, 8192, 4096, shm_dir=shm_dir, world_size=2,
                                 rank_source="Device_Modulo", device_index=3)
    try:
        doc = json.loads(manifest_path(shm_dir, "ranked").read_text())
        assert doc["rank_source"] == "device-modulo"
        (attachment,) = doc["attachments"]
        assert (attachment["rank"], attachment["device_index"], attachment["rank_source"]) == (
            1, 3, "device-modulo")
    finally:
        region.cleanup()
    with SharedOffloadRegion("ranked", 2, 0, 8192, 4096, shm_dir=shm_dir, world_size=2,
                             rank_source=LOGICAL):
        doc = json.loads(manifest_path(shm_dir, "ranked").read_text())
        assert doc["attachments"][0]["rank_source"] == "logical"


def test_region_refuses_an_unknown_rank_source_before_touching_the_directory(
        shm_dir: Path) -> None:
    with pytest.raises(InvalidInputError) as err:
        SharedOffloadRegion("ranked", 2, 0, 8192, 4096, shm_dir=shm_dir, world_size=2,
                            rank_source="gpu-uuid")
    assert err.value.code == "invalid_rank_source"
    assert not region_path(shm_dir, "ranked").exists()
    assert list(shm_dir.iterdir()) == []
