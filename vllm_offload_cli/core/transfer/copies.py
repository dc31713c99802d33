"""How a job's bytes move: fixed rules read off the block ids alone (every host copies a
job alike), the same code for CUDA and CPU tensors; `TensorPair.rule` says which. Indexed
kernels need both sides on one device, so GPU <-> host is slice or batched (one
cudaMemcpyAsync per piece, as vLLM's swap_blocks). Rows move as words never computed
with; 16-byte words only where `complex_copies_exact` proves them bit-exact.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_offload_cli.core.base.extras import import_torch
from vllm_offload_cli.core.transfer.jobs import CopyJob, Direction

if TYPE_CHECKING:
    from concurrent.futures import Executor

    import torch
    from torch import Tensor

    from vllm_offload_cli.core.transfer.jobs import Ids

_WORDS = {16: "complex128", 8: "int64", 4: "int32", 2: "int16"}  # bytes: dtype, widest first
SPLIT_MIN_BYTES = 1 << 20  # a batched call smaller than this stays on one thread
# torch spreads a copy of more elements than this (at::internal::GRAIN_SIZE) over its own
# threads; in a call split over two threads, rows are cut to this so each stays on one
PART_MAX_ELEMENTS = 32768
# index_select wins on small rows (one call, not one per row), the split batched call on
# large ones
GATHER_MAX_ROW_BYTES = 512 << 10


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


def _halfway(sizes: list[int]) -> int:
    """The piece index that splits `sizes` into two halves of about equal bytes."""
    ends = list(itertools.accumulate(sizes))  # C loops: a job has thousands of pieces
    return min(bisect.bisect_left(ends, ends[-1] / 2) + 1, len(sizes))


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
        cut = _halfway(sizes)
        if helper is not None and sum(sizes) >= SPLIT_MIN_BYTES and cut < len(dsts):
            other = helper.submit(_copy_many, dsts[cut:], srcs[cut:], non_blocking)
            try:
                _copy_many(dsts[:cut], srcs[:cut], non_blocking)
            finally:
                other.result()
            used[used.index("batched")] = "batched/2"
        else:
            _copy_many(dsts, srcs, non_blocking)
    return "+".join(used)
