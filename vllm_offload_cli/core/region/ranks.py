"""Rank sources: how a worker picks its slot in every row, as named rules, so
the engine hook, the manifest and `verify-rank-layout` agree on what each name means
(vLLM PR 47987's `current_device_index() % world_size` is right only when each replica's
device indices have distinct residues; vLLM 0.32 and 0.33 use the logical rank)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.base.units import is_int


@dataclass(frozen=True)
class WorkerPlace:
    """What a worker knows when it picks its slot: its logical rank in its replica, and
    `current_device_index()` (a position among the devices *it* sees, not a GPU id)."""

    local_rank: int
    device_index: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("local_rank", "device_index", "world_size"):
            value = getattr(self, name)
            if not is_int(value):
                raise InvalidInputError(f"{name} must be an integer, got {value!r}",
                                        code="invalid_worker_place")
            if value < 0:
                raise InvalidInputError(f"{name} must be >= 0, got {value}",
                                        code="invalid_worker_place")
        if self.world_size == 0:
            raise InvalidInputError("world_size must be greater than 0, got 0",
                                    code="invalid_worker_place")


@dataclass(frozen=True, kw_only=True)
class RankSource:
    """A named way of computing a worker's slot: `slot(place)`."""

    name: str
    slot: Callable[[WorkerPlace], int]
    description: str
    device_based: bool  # two workers on one device index always get one slot


DEVICE_MODULO = RankSource(
    name="device-modulo", slot=lambda place: place.device_index % place.world_size,
    description="current_device_index() % world_size (vLLM PR 47987)", device_based=True)
LOGICAL = RankSource(
    name="logical", slot=lambda place: place.local_rank,
    description="the worker's logical rank within its replica (vLLM 0.32, 0.33)",
    device_based=False)
DEVICE_INDEX = RankSource(
    name="device-index", slot=lambda place: place.device_index,
    description="current_device_index() unfolded (vLLM before PR 47987)", device_based=True)

RANK_SOURCES: Mapping[str, RankSource] = MappingProxyType(
    {s.name: s for s in (DEVICE_MODULO, LOGICAL, DEVICE_INDEX)})


def parse_rank_source(value: str | RankSource) -> RankSource:
    """The registered source for a name; `_` and case are forgiven, nothing else."""
    if isinstance(value, RankSource):
        if RANK_SOURCES.get(value.name) is not value:
            raise InvalidInputError(f"rank source {value.name!r} is not registered",
                                    code="invalid_rank_source")
        return value
    if not isinstance(value, str):
        raise InvalidInputError(f"rank source must be a name, got {value!r}",
                                code="invalid_rank_source")
    if (source := RANK_SOURCES.get(value.strip().lower().replace("_", "-"))) is None:
        known = ", ".join(RANK_SOURCES)
        raise InvalidInputError(f"unknown rank source {value!r}; use one of: {known}",
                                code="invalid_rank_source")
    return source
