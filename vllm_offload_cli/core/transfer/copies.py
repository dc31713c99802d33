"""Copy jobs: block ids checked (a bad one fails the submit, never corrupts a region) and
copied at submit; then moved by fixed rules read off the ids alone (`TensorPair.rule`), the
same code for CUDA and CPU. GPU <-> host is slice or batched (indexed kernels need one
device): one cudaMemcpyAsync per piece, as vLLM's swap_blocks. Rows move as words never
computed with; 16-byte words only where `complex_copies_exact` proves them bit-exact.
"""

from __future__ import annotations

import bisect
import enum
import functools
import itertools
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.base.extras import import_torch

if TYPE_CHECKING:
    from concurrent.futures import Executor

    import numpy as np
    import numpy.typing as npt
    import torch
    from torch import Tensor

    Ids = npt.NDArray[np.int64]

_WORDS = {16: "complex128", 8: "int64", 4: "int32", 2: "int16"}  # bytes: dtype, widest first
SPLIT_MIN_BYTES = 1 << 20  # a batched call smaller than this stays on one thread
# torch spreads a copy of more elements than this (at::internal::GRAIN_SIZE) over its own
# threads; in a call split over two threads, rows are cut to this so each stays on one
PART_MAX_ELEMENTS = 32768
# index_select wins on small rows (one call, not one per row), the split batched call on
# large ones
GATHER_MAX_ROW_BYTES = 512 << 10


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

    @functools.cached_property
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

    @functools.cached_property
    def by_source(self) -> Ids:
        """The pair positions ordered by source id."""
        import numpy as np

        return np.argsort(self.src_ids, kind="stable")

    @functools.cached_property
    def src_one_run(self) -> bool:
        """Are the sources, in some order, one run of distinct consecutive blocks?"""
        n, ids = self.num_blocks, self.src_ids
        return n < 2 or (int(ids.max()) - int(ids.min()) == n - 1
                         and bool((_diff(ids[self.by_source]) == 1).all()))

    @functools.cached_property
    def dst_by_source(self) -> torch.Tensor:
        """Destination ids in source order, as an int64 CPU tensor."""
        return cast("torch.Tensor", import_torch().from_numpy(self.dst_ids[self.by_source]))

    @functools.cached_property
    def src(self) -> torch.Tensor:
        """Source ids as an int64 CPU tensor sharing the job's memory (destination order)."""
        return cast("torch.Tensor", import_torch().from_numpy(self.src_ids))


@functools.cache
def complex_copies_exact() -> bool:
    """Do this build's copy kernels (every one the rules use) move complex128 elements bit
    for bit? A float path that quiets a signalling NaN would corrupt KV bytes silently."""
    torch = import_torch()
    patterns = (0x7FF0000000000001, 0xFFF0000000000001, 0x7FF8000000000123,
                0x7FF4000000000000, 0x0000000000000001, 0x8000000000000000,
                0x7FF0000000000000, 0xFFFFFFFFFFFFFFFF)
    row = b"".join(struct.pack("<Q", p) for p in patterns) * 1024  # 64 KiB per row
    data = bytearray(b"".join(bytes([i]) + row[1:] for i in range(8)))
    src = torch.frombuffer(data, dtype=torch.int8).clone().view(8, len(row))
    perm = torch.tensor([3, 1, 0, 2, 7, 5, 4, 6])
    words = src.view(torch.complex128)
    copied = torch.empty_like(words).copy_(words)
    scattered = torch.empty_like(words).index_copy_(0, perm, words)
    gathered = torch.index_select(words, 0, perm)
    return bool(torch.equal(copied.view(torch.int8), src)
                and torch.equal(scattered.view(torch.int8)[perm], src)
                and torch.equal(gathered.view(torch.int8), src[perm]))


def word_width(*rows: torch.Tensor) -> int:
    """Widest element size (bytes) every row view can be reinterpreted as."""
    page = rows[0].shape[1]
    for width, name in _WORDS.items():
        if page % width or (name == "complex128" and not complex_copies_exact()):
            continue
        if all(r.stride(0) % width == 0 and r.storage_offset() % width == 0
               and r.data_ptr() % width == 0 for r in rows):
            return width
    return 1


def as_words(rows: torch.Tensor, width: int) -> torch.Tensor:
    """Reinterpret int8 rows as `width`-byte elements (a view; no copy)."""
    if width == 1:
        return rows
    return rows.view(getattr(import_torch(), _WORDS[width]))


class RowViews:
    """One view per row (or part of a row) of a (rows, words) tensor, made on first use and
    kept: making a view costs as much as copying a small block. Plain lists, because both
    lanes pick from one cache at once and a numpy object array was not safe for that."""

    def __init__(self, rows: Tensor, part: int) -> None:
        import numpy as np

        self._rows = rows
        words = rows.shape[1]
        # where each view starts and how long it is: a row cut into parts of `part`
        self._parts = [(start, min(part, words - start)) for start in range(0, words, part)]
        self.part_bytes = [n * rows.element_size() for _, n in self._parts]
        self._views: list[tuple[Tensor, ...]] = [()] * rows.shape[0]
        self._made = np.zeros(rows.shape[0], dtype=np.bool_)

    def pick(self, ids: Ids) -> list[Tensor]:
        """The views of rows `ids`, in order (each row's parts in order)."""
        views, made = self._views, self._made
        if not made[ids].all():
            for i in ids[~made[ids]].tolist():
                row = self._rows[i]
                views[i] = tuple(row[start:start + n] for start, n in self._parts)
            made[ids] = True
        if len(self._parts) == 1:
            return [views[i][0] for i in ids.tolist()]
        return [view for i in ids.tolist() for view in views[i]]


@dataclass(eq=False, kw_only=True)
class TensorPair:
    """One KV tensor's device rows and region rows, as words of the same width.
    `one_device`: can an indexed kernel read one side and write the other?"""

    device: torch.Tensor
    region: torch.Tensor
    row_bytes: int
    one_device: bool
    _views: dict[tuple[int, int], RowViews] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, device: Tensor, region: Tensor) -> TensorPair:
        """Int8 rows of both sides, as the widest words both allow."""
        width = word_width(device, region)
        return cls(device=as_words(device, width), region=as_words(region, width),
                   row_bytes=device.shape[1], one_device=device.device == region.device)

    @property
    def dense(self) -> bool:
        """Are consecutive rows adjacent on both sides (a run is one span of bytes)?"""
        return all(t.stride(0) * t.element_size() == self.row_bytes
                   for t in (self.device, self.region))

    def sides(self, direction: Direction) -> tuple[Tensor, Tensor]:
        """(source, destination) of a copy in `direction`."""
        store = direction is Direction.STORE
        return (self.device, self.region) if store else (self.region, self.device)

    def rows(self, tensor: Tensor, *, in_parts: bool = False) -> RowViews:
        """Cached views of `tensor`'s rows, cut into parts of PART_MAX_ELEMENTS if asked."""
        words = tensor.shape[1]
        part = min(PART_MAX_ELEMENTS, words) if in_parts else words  # one cache if whole
        if (id(tensor), part) not in self._views:
            self._views[(id(tensor), part)] = RowViews(tensor, part)
        return self._views[(id(tensor), part)]

    def rule(self, job: CopyJob) -> str:
        """slice: one run on both sides; gather: destinations one run of small rows
        (index_select); scatter: sources one run (index_copy_); else batched (one piece per
        run, or per block where rows are not adjacent, all in one _foreach_copy_ call)."""
        if job.runs[2].size == 1 and (self.one_device or self.dense):
            return "slice"
        if self.one_device and job.dst_one_run and self.row_bytes < GATHER_MAX_ROW_BYTES:
            return "gather"
        if self.one_device and job.src_one_run:
            return "scatter"
        return "batched"


def _pieces(pair: TensorPair, job: CopyJob, dsts: list[Tensor], srcs: list[Tensor],
            sizes: list[int], *, in_parts: bool) -> None:
    """Append one tensor's batched pieces: a row view per block in ascending order of the
    region's blocks (the faster walk), or, where rows are dense, one view per run.
    `in_parts`: rows cut into parts of PART_MAX_ELEMENTS, for a call split over two threads."""
    src, dst = pair.sides(job.direction)
    firsts_src, firsts_dst, lengths = job.runs
    if not pair.dense or lengths.size == job.num_blocks:
        src_ids, dst_ids = job.src_ids, job.dst_ids
        if job.direction is Direction.LOAD:  # walk the region (the source) upwards
            src_ids, dst_ids = src_ids[job.by_source], dst_ids[job.by_source]
        src_rows = pair.rows(src, in_parts=in_parts)
        srcs += src_rows.pick(src_ids)
        dsts += pair.rows(dst, in_parts=in_parts).pick(dst_ids)
        sizes += src_rows.part_bytes * job.num_blocks
        return
    first = len(srcs)
    srcs += pair.rows(src).pick(firsts_src)
    dsts += pair.rows(dst).pick(firsts_dst)
    for i, (s, d, n) in enumerate(zip(firsts_src.tolist(), firsts_dst.tolist(),
                                      lengths.tolist(), strict=True), first):
        if n > 1:
            srcs[i], dsts[i] = src[s:s + n], dst[d:d + n]
    sizes += (lengths * pair.row_bytes).tolist()


def _copy_many(dsts: list[Tensor], srcs: list[Tensor], non_blocking: bool) -> None:
    """dsts[i].copy_(srcs[i]) for every i, in one C++ loop."""
    import_torch()._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


def copy_job(pairs: list[TensorPair], job: CopyJob, *, non_blocking: bool = False,
             helper: Executor | None = None) -> str:
    """Issue every copy of `job` on the calling thread (and `helper`, for halves of a batched
    call of SPLIT_MIN_BYTES or more); returns the rules used, e.g. "slice+batched/2" (/2:
    split over two threads). On CUDA the copies are queued on the current stream."""
    torch = import_torch()
    n = job.num_blocks
    if n == 0:
        return "none"
    used: list[str] = []
    dsts: list[Tensor] = []
    srcs: list[Tensor] = []
    sizes: list[int] = []
    s, d = int(job.src_ids.min()), int(job.dst_ids[0])  # where a slice, gather, scatter start
    for pair in pairs:
        rule = pair.rule(job)
        src, dst = pair.sides(job.direction)
        if rule == "slice":
            dst[d:d + n].copy_(src[s:s + n], non_blocking=non_blocking)
        elif rule == "gather":
            torch.index_select(src, 0, job.src, out=dst[d:d + n])
        elif rule == "scatter":
            dst.index_copy_(0, job.dst_by_source, src[s:s + n])
        else:
            _pieces(pair, job, dsts, srcs, sizes, in_parts=helper is not None)
        if rule not in used:
            used.append(rule)
    if dsts:
        cut = len(dsts)
        if helper is not None and sum(sizes) >= SPLIT_MIN_BYTES:  # never on CUDA
            # the piece that halves the bytes (C loops: a job has thousands of pieces)
            ends = list(itertools.accumulate(sizes))
            cut = min(bisect.bisect_left(ends, ends[-1] / 2) + 1, len(sizes))
        if helper is not None and cut < len(dsts):
            other = helper.submit(_copy_many, dsts[cut:], srcs[cut:], non_blocking)
            try:
                _copy_many(dsts[:cut], srcs[:cut], non_blocking)
            finally:
                other.result()
            used[used.index("batched")] = "batched/2"
        else:
            _copy_many(dsts, srcs, non_blocking)
    return "+".join(used)
