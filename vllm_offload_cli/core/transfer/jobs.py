"""A copy job: its block lists checked at submit (a bad id is an exception then, never a
corrupted region later), copied (the caller may reuse its buffers), ordered by destination.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.base.extras import import_torch

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

    Ids = npt.NDArray[np.int64]


class Direction(str, enum.Enum):
    """Which way a transfer goes; each direction completes in submission order."""

    STORE = "store"  # device -> region
    LOAD = "load"  # region -> device


def _refuse(what: str, must: str) -> InvalidInputError:
    return InvalidInputError(f"{what} must be {must}", code="invalid_blocks")


def as_block_ids(values: Any, *, what: str) -> Ids:
    """Integer block ids (list, range, tensor, numpy array...) as a fresh 1-D int64 array."""
    torch = import_torch()
    if not isinstance(values, torch.Tensor):
        return _sequence_ids(values, what)
    if values.dtype is torch.int64 and values.is_cpu and values.dim() == 1:
        # the usual case, in the fewest calls (an integer tensor never requires grad)
        return cast("Ids", values.numpy().copy())
    t = values.detach()
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise _refuse(what, f"integer block ids, got dtype {t.dtype}")
    if t.dim() != 1:
        raise _refuse(what, f"one-dimensional, got shape {tuple(t.shape)}")
    # a conversion, so a copy: int64 CPU ids took the first branch
    return cast("Ids", t.to(device="cpu", dtype=torch.int64).numpy())


def _sequence_ids(values: Any, what: str) -> Ids:
    import numpy as np

    if isinstance(values, (str, bytes, bytearray)) or not hasattr(values, "__len__"):
        raise _refuse(what, f"a sequence of integer block ids, got {type(values).__name__}")
    if len(values) == 0:
        return np.empty(0, dtype=np.int64)
    try:
        ids = np.asarray(values if isinstance(values, (list, tuple, np.ndarray))
                         else list(values))
    except (TypeError, ValueError, OverflowError) as exc:
        raise _refuse(what, f"integer block ids: {exc}") from exc
    if ids.dtype.kind not in "iu":  # bool, float, object (mixed), strings...
        raise _refuse(what, f"integer block ids, got {ids.dtype.name} values")
    if ids.ndim != 1:
        raise _refuse(what, f"one-dimensional, got shape {tuple(ids.shape)}")
    if ids.dtype.kind == "u" and ids.size and int(ids.max()) > np.iinfo(np.int64).max:
        raise _refuse(what, "integer block ids: an id does not fit in 64 bits")
    return np.array(ids, dtype=np.int64)


def _check_range(ids: Ids, holder: str, limit: int, *, label: str,
                 ascending: bool = False) -> None:
    """Ascending ids are bounded by their ends; positions are searched only on failure."""
    if ids.size == 0:
        return
    low, high = (int(ids[0]), int(ids[-1])) if ascending else (int(ids.min()), int(ids.max()))
    if low < 0:
        pos = int((ids < 0).argmax())  # the first
        raise InvalidInputError(f"{label} block id {int(ids[pos])} (position {pos}) is "
                                "negative", code="block_out_of_range")
    if high >= limit:
        pos = int((ids >= limit).argmax())
        valid = f"valid ids 0..{limit - 1}" if limit else "it has none"
        raise InvalidInputError(
            f"{label} block id {int(ids[pos])} (position {pos}) is out of range: {holder} "
            f"has {limit} blocks ({valid})", code="block_out_of_range")


def make_job(job_id: int, direction: Direction, src_blocks: Any, dst_blocks: Any, *,
                  device_blocks: int, region_blocks: int) -> CopyJob:
    """Validate one job's block lists and order its pairs by destination."""
    import numpy as np

    prefix = f"{direction.value} job {job_id}"
    src = as_block_ids(src_blocks, what=f"{prefix}: source blocks")
    dst = as_block_ids(dst_blocks, what=f"{prefix}: destination blocks")
    if src.size != dst.size:
        raise InvalidInputError(f"{prefix}: {src.size} source blocks but {dst.size} "
                                "destination blocks; they are copied pairwise",
                                code="length_mismatch")
    sides = [("the device cache", device_blocks), ("the region", region_blocks)]
    src_side, dst_side = sides if direction is Direction.STORE else sides[::-1]
    _check_range(src, *src_side, label=f"{prefix}: source")
    # destinations are unique, so ordering the pairs by them changes nothing but reveals runs
    ascending = dst.size < 2 or int(_diff(dst).min()) > 0
    _check_range(dst, *dst_side, label=f"{prefix}: destination", ascending=ascending)
    if not ascending:
        order = np.argsort(dst)  # any order of equal ids will do: they are refused
        dst, src = dst[order], src[order]
        repeated = _diff(dst) == 0
        if repeated.any():
            block = int(dst[1:][repeated.argmax()])
            raise InvalidInputError(
                f"{prefix}: destination block {block} appears more than once; two copies "
                "into one block would race", code="duplicate_destination")
    return CopyJob(job_id=job_id, direction=direction, src_ids=src, dst_ids=dst)


def _diff(ids: Ids) -> Ids:
    """ids[i + 1] - ids[i] in one ufunc call, cheaper than np.diff."""
    return ids[1:] - ids[:-1]


@dataclass(frozen=True, eq=False, kw_only=True)
class CopyJob:
    """A validated job: pairs (src_ids[i] -> dst_ids[i]) of int64 numpy arrays it owns,
    destinations strictly ascending."""

    job_id: int
    direction: Direction
    src_ids: Ids  # in destination order
    dst_ids: Ids  # strictly ascending

    @property
    def num_blocks(self) -> int:
        return int(self.dst_ids.size)

    @cached_property
    def runs(self) -> tuple[Ids, Ids, Ids]:
        """(first source, first destination, length) of each maximal run where source
        and destination both advance by one, as arrays."""
        import numpy as np

        n = self.num_blocks
        breaks = (_diff(self.dst_ids) != 1) | (_diff(self.src_ids) != 1)
        starts = np.concatenate((np.zeros(min(n, 1), dtype=np.int64),
                                 np.flatnonzero(breaks) + 1))
        lengths: Ids = np.diff(np.append(starts, n))
        return self.src_ids[starts], self.dst_ids[starts], lengths

    @property
    def dst_one_run(self) -> bool:
        """Are the destinations one run (distinct and ascending: the ends tell)?"""
        n = self.num_blocks
        return n == 0 or int(self.dst_ids[-1]) - int(self.dst_ids[0]) == n - 1

    @cached_property
    def by_source(self) -> Ids:
        """The pair positions ordered by source id."""
        import numpy as np

        return np.argsort(self.src_ids, kind="stable")

    @property
    def src_one_run(self) -> bool:
        """Are the sources, in some order, one run of distinct consecutive blocks?"""
        n, ids = self.num_blocks, self.src_ids
        return n < 2 or (int(ids.max()) - int(ids.min()) == n - 1
                         and bool((_diff(ids[self.by_source]) == 1).all()))

    @cached_property
    def dst_by_source(self) -> torch.Tensor:
        """Destination ids in source order, as an int64 CPU tensor."""
        return cast("torch.Tensor", import_torch().from_numpy(self.dst_ids[self.by_source]))

    @cached_property
    def src(self) -> torch.Tensor:
        """Source ids as an int64 CPU tensor sharing the job's memory (destination order)."""
        return cast("torch.Tensor", import_torch().from_numpy(self.src_ids))
