"""Check a transfer's block lists, then find the runs that make copying it cheap.

Validation runs on the caller's thread, before any byte moves: a bad block id
must be an exception at submit time, never a corrupted region later. Runs are
the unit of work of every copy path: n consecutive (source, destination)
pairs are one slice copy instead of n block copies.

All the work here is vectorised (torch on int64 index tensors), so a transfer
of thousands of blocks costs a handful of tensor operations, not a Python loop.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple

from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.base.torch_import import import_torch

if TYPE_CHECKING:
    import torch
    from torch import Tensor


class Direction(str, enum.Enum):
    """Which way a transfer goes; each direction completes in submission order."""

    STORE = "store"  # device -> region
    LOAD = "load"  # region -> device


class Run(NamedTuple):
    """`length` consecutive blocks: source `src` .. onto destination `dst` .."""

    src: int
    dst: int
    length: int


class Span(NamedTuple):
    """Positions [start, stop) of a plan's pairs (in the order the span refers to)."""

    start: int
    stop: int


def as_block_ids(values: Any, *, what: str) -> torch.Tensor:
    """Any sequence of integer block ids (list, range, tensor) as a 1-D int64 CPU tensor."""
    torch = import_torch()
    ids: Tensor
    if isinstance(values, torch.Tensor):
        ids = values.detach()
    elif isinstance(values, (str, bytes, bytearray)) or not hasattr(values, "__len__"):
        raise InvalidInputError(f"{what} must be a sequence of integer block ids, "
                                f"got {type(values).__name__}", code="invalid_blocks")
    elif len(values) == 0:
        empty: Tensor = torch.empty(0, dtype=torch.int64)
        return empty
    else:
        try:
            ids = torch.as_tensor(values if isinstance(values, (list, tuple)) else list(values))
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise InvalidInputError(f"{what} must be integer block ids: {exc}",
                                    code="invalid_blocks") from exc
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise InvalidInputError(f"{what} must be integer block ids, got dtype {ids.dtype}",
                                code="invalid_blocks")
    if ids.dim() != 1:
        raise InvalidInputError(f"{what} must be one-dimensional, got shape "
                                f"{tuple(ids.shape)}", code="invalid_blocks")
    as_int64: Tensor = ids.to(device="cpu", dtype=torch.int64)
    return as_int64


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def _check_range(ids: torch.Tensor, limit: int, *, label: str, holder: str) -> None:
    """One reduction in the common case; positions are searched only to explain a failure."""
    if ids.numel() == 0:
        return
    torch = import_torch()
    low, high = (int(v) for v in torch.aminmax(ids))
    if low < 0:
        pos = _first(ids < 0)
        raise InvalidInputError(f"{label} block id {int(ids[pos])} (position {pos}) is "
                                "negative", code="block_out_of_range")
    if high >= limit:
        pos = _first(ids >= limit)
        valid = f"valid ids 0..{limit - 1}" if limit else "it has none"
        raise InvalidInputError(
            f"{label} block id {int(ids[pos])} (position {pos}) is out of range: {holder} "
            f"has {limit} blocks ({valid})", code="block_out_of_range")


def plan_transfer(job_id: int, direction: Direction, src_blocks: Any, dst_blocks: Any, *,
                  device_blocks: int, region_blocks: int) -> TransferPlan:
    """Validate one job's block lists and describe it; raises InvalidInputError."""
    prefix = f"{direction.value} job {job_id}"
    src = as_block_ids(src_blocks, what=f"{prefix}: source blocks")
    dst = as_block_ids(dst_blocks, what=f"{prefix}: destination blocks")
    if src.numel() != dst.numel():
        raise InvalidInputError(f"{prefix}: {src.numel()} source blocks but {dst.numel()} "
                                "destination blocks; they are copied pairwise",
                                code="length_mismatch")
    if direction is Direction.STORE:
        src_holder, dst_holder = "the device cache", "the region"
        src_limit, dst_limit = device_blocks, region_blocks
    else:
        src_holder, dst_holder = "the region", "the device cache"
        src_limit, dst_limit = region_blocks, device_blocks
    _check_range(src, src_limit, label=f"{prefix}: source", holder=src_holder)
    _check_range(dst, dst_limit, label=f"{prefix}: destination", holder=dst_holder)
    if dst.numel() < 2:
        return TransferPlan(job_id, direction, src, dst)
    torch = import_torch()
    # Pairs are ordered by destination: destinations are unique, so the order
    # of the pairs does not change the result, and sorted ids reveal runs.
    step = dst.diff()
    if int(step.min()) <= 0:  # not strictly ascending already: sort, then look again
        dst, order = torch.sort(dst)
        src = src[order]
        step = dst.diff()
        repeated = step == 0
        if bool(repeated.any()):
            block = int(dst[1:][_first(repeated)])
            raise InvalidInputError(
                f"{prefix}: destination block {block} appears more than once; two copies "
                "into one block would race", code="duplicate_destination")
    return TransferPlan(job_id, direction, src, dst, step)


def _spans(breaks: torch.Tensor, n: int) -> list[Span]:
    """Split positions [0, n) where `breaks` (length n-1) is True."""
    if n == 0:
        return []
    cuts = (breaks.nonzero().flatten() + 1).tolist()
    bounds = [0, *cuts, n]
    return [Span(a, b) for a, b in itertools.pairwise(bounds)]


def _count(breaks: torch.Tensor, n: int) -> int:
    return int(breaks.sum()) + 1 if n else 0


def _lengths(breaks: torch.Tensor, n: int) -> Tensor:
    """Length of each run, vectorised: the gaps between consecutive breaks."""
    torch = import_torch()
    cuts = breaks.nonzero().flatten() + 1
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), cuts,
                        torch.full((1,), n, dtype=torch.int64)])
    lengths: Tensor = bounds.diff()
    return lengths


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """A validated job: pairs (src[i] -> dst[i]) with destinations strictly ascending."""

    job_id: int
    direction: Direction
    src: torch.Tensor  # int64, CPU, in destination order
    dst: torch.Tensor  # int64, CPU, strictly ascending
    dst_step: torch.Tensor | None = None  # dst.diff(), when already computed

    @property
    def num_blocks(self) -> int:
        return int(self.dst.numel())

    # -- runs in destination order ---------------------------------------------

    @cached_property
    def _dst_breaks(self) -> torch.Tensor:
        step = self.dst_step if self.dst_step is not None else self.dst.diff()
        return step != 1

    @cached_property
    def _joint_breaks(self) -> torch.Tensor:
        return self._dst_breaks | (self.src.diff() != 1)

    @cached_property
    def dst_run_count(self) -> int:
        """How many runs of consecutive destination blocks."""
        return _count(self._dst_breaks, self.num_blocks)

    @cached_property
    def joint_run_count(self) -> int:
        """How many runs where source and destination both advance by one."""
        return _count(self._joint_breaks, self.num_blocks)

    def run_lengths(self, kind: str) -> Tensor:
        """Blocks per run, for runs of `kind`: "joint", "dst" or "src" (see the counts)."""
        breaks = {"joint": lambda: self._joint_breaks, "dst": lambda: self._dst_breaks,
                  "src": lambda: self._src_breaks}[kind]()
        return _lengths(breaks, self.num_blocks)

    def dst_spans(self) -> list[Span]:
        """Positions of each run of consecutive destinations (sources arbitrary)."""
        return _spans(self._dst_breaks, self.num_blocks)

    def joint_runs(self) -> list[Run]:
        """Maximal runs that are one slice on both sides."""
        if self.joint_run_count == 1:
            return [Run(int(self.src[0]), int(self.dst[0]), self.num_blocks)]
        spans = _spans(self._joint_breaks, self.num_blocks)
        if not spans:
            return []
        starts = [s.start for s in spans]
        src = self.src[starts].tolist()
        dst = self.dst[starts].tolist()
        return [Run(s, d, span.stop - span.start)
                for s, d, span in zip(src, dst, spans, strict=True)]

    # -- runs in source order ----------------------------------------------------

    @cached_property
    def _by_src(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.joint_run_count <= 1:  # one run: already in source order
            return self.src, self.dst
        torch = import_torch()
        src_sorted, order = torch.sort(self.src, stable=True)
        return src_sorted, self.dst[order]

    @property
    def src_sorted(self) -> torch.Tensor:
        """Sources ascending (duplicates possible)."""
        return self._by_src[0]

    @property
    def dst_by_src(self) -> torch.Tensor:
        """Destinations in the order of `src_sorted`."""
        return self._by_src[1]

    @cached_property
    def _src_breaks(self) -> torch.Tensor:
        return self.src_sorted.diff() != 1

    @cached_property
    def src_run_count(self) -> int:
        """How many runs of consecutive sources (a repeated source starts a new run)."""
        if self.joint_run_count <= 1:
            return self.joint_run_count
        return _count(self._src_breaks, self.num_blocks)

    def src_spans(self) -> list[Span]:
        """Positions (in `src_sorted` order) of each run of consecutive sources."""
        return _spans(self._src_breaks, self.num_blocks)
