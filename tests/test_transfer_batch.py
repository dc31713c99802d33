"""The batched copy primitive: exact bytes by every mechanism, bad pieces refused, and the
fallback taken when the kernel or a sandbox refuses a mechanism (the probe really fails)."""

from __future__ import annotations

import errno
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.base.torch_import import import_torch
from vllm_offload_cli.core.region import SharedOffloadRegion
from vllm_offload_cli.core.region.geometry import default_row_stride
from vllm_offload_cli.core.transfer import CopyWorker, batch, chain, costs

torch = import_torch()


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    """Forget what was probed and measured, before and after: each test probes anew."""
    probe, forget = batch.available_mechanisms, costs.forget_calibration  # even if patched
    probe.cache_clear()
    forget()
    yield
    probe.cache_clear()
    forget()


def _buffers(size: int = 1 << 20, seed: int = 0) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-128, 128, (size,), dtype=torch.int8, generator=g),
            torch.zeros(size, dtype=torch.int8))


def _expected(src: Any, dst: Any, pieces: list[tuple[int, int, int]]) -> Any:
    out = dst.clone()
    for d, s, n in pieces:
        out[d:d + n] = src[s:s + n]
    return out


def _pieces(src: Any, dst: Any, pieces: list[tuple[int, int, int]]) -> batch.Pieces:
    d, s, n = (torch.tensor(c, dtype=torch.int64) for c in zip(*pieces, strict=True))
    return batch.make_pieces(dst.data_ptr() + d, src.data_ptr() + s, n)


# odd sizes and offsets, a repeated source, more pieces than one syscall takes (IOV_MAX)
ODD = [(0, 7, 1), (1, 100, 4095), (9000, 3, 65537), (80_000, 200_000, 12_345),
       (100_000, 200_000, 333), (300_000, 999_000, 25_000)]
MANY = [(600_000 + 64 * i, 64 * ((i * 7919) % 4000), 60 + i % 5) for i in range(2500)]


@pytest.mark.parametrize("mechanism", batch.MECHANISMS)
@pytest.mark.parametrize("layout", ["odd", "many"])
def test_every_mechanism_copies_exactly(mechanism: str, layout: str) -> None:
    if mechanism not in batch.available_mechanisms():
        pytest.skip(f"{mechanism} is refused on this host")
    src, dst = _buffers()
    pieces = ODD if layout == "odd" else MANY
    batch.copy_pieces(_pieces(src, dst, pieces), mechanism)
    assert torch.equal(dst, _expected(src, torch.zeros_like(dst), pieces))


@pytest.mark.parametrize("mechanism", batch.MECHANISMS)
def test_numpy_addresses_work_by_every_mechanism_even_strided(mechanism: str) -> None:
    """The chain reads addresses as raw 64-bit words: a strided array must not be read
    as if it were contiguous."""
    if mechanism not in batch.available_mechanisms():
        pytest.skip(f"{mechanism} is refused on this host")
    src, dst = _buffers()
    d, s, n = (np.array(c, dtype=np.int64) for c in zip(*MANY, strict=True))

    def strided(a: Any) -> Any:
        return np.repeat(a, 2)[::2]

    d, s, n = strided(dst.data_ptr() + d), strided(src.data_ptr() + s), strided(n)
    assert not (d.flags.c_contiguous or s.flags.c_contiguous or n.flags.c_contiguous)
    batch.copy_pieces(batch.make_pieces(d, s, n), mechanism)
    assert torch.equal(dst, _expected(src, torch.zeros_like(dst), MANY))


def test_chunks_keep_every_piece_in_order_in_shares_of_similar_size() -> None:
    src, dst = _buffers()
    p = _pieces(src, dst, MANY)
    chunks = p.chunks(3)
    assert len(chunks) == 3
    assert [d for c in chunks for d in c.dst] == p.dst.tolist()
    assert [s for c in chunks for s in c.src] == p.src.tolist()
    assert [n for c in chunks for n in c.length] == p.length.tolist()
    sizes = [c.nbytes for c in chunks]
    assert sizes == [int(c.length.sum()) for c in chunks]
    assert sum(sizes) == p.nbytes and max(sizes) - min(sizes) <= 2 * int(p.length.max())
    (whole,) = p.chunks(1)
    assert [a.tolist() for a in whole[:3]] == [p.dst.tolist(), p.src.tolist(),
                                               p.length.tolist()]
    assert whole.nbytes == p.nbytes
    assert len(_pieces(src, dst, ODD[:1]).chunks(4)) == 1


def test_each_chunk_copies_only_its_own_pieces() -> None:
    src, dst = _buffers()
    p = _pieces(src, dst, MANY)
    for mechanism in batch.available_mechanisms():
        dst.zero_()
        first, *_ = p.chunks(4)
        batch.copy_chunk(first, mechanism)
        done = MANY[:len(first.dst)]
        assert torch.equal(dst, _expected(src, torch.zeros_like(dst), done)), mechanism


@pytest.mark.parametrize(("pieces", "message"), [
    ([(0, 500, 100), (50, 900, 100)], "overlapping destination"),
    ([(0, 500, 100), (100, 900, 100)], None),  # adjacent is fine
    ([(0, 1000, 100), (200, 1000, 100)], None),  # a repeated source is fine
], ids=["dst-dst", "adjacent", "same-source"])
def test_destinations_may_not_overlap_each_other(pieces: list[tuple[int, int, int]],
                                                message: str | None) -> None:
    src, dst = _buffers(4096)
    if message is None:
        batch.copy_pieces(_pieces(src, dst, pieces), "memmove")
        assert torch.equal(dst, _expected(src, torch.zeros_like(dst), pieces))
        return
    with pytest.raises(InvalidInputError, match=message) as info:
        _pieces(src, dst, pieces)
    assert info.value.code == "overlapping_pieces"
    assert not dst.any(), "nothing was copied"


def test_a_destination_may_not_overlap_any_source() -> None:
    buf = torch.arange(4096, dtype=torch.int32).view(torch.int8)
    base = buf.data_ptr()
    one = torch.tensor
    with pytest.raises(InvalidInputError, match="overlaps a piece's source"):
        # the long first source covers the second destination
        batch.make_pieces(base + one([20_000, 5000]), base + one([0, 12_000]),
                          one([10_000, 100]))
    with pytest.raises(InvalidInputError, match="overlaps a piece's source"):
        batch.make_pieces(base + one([100]), base + one([60]), one([50]))  # memmove territory
    ok = batch.make_pieces(base + one([100]), base + one([50]), one([50]))  # touching only
    assert ok.count == 1


@pytest.mark.parametrize(("build", "message"), [
    (lambda t: batch.make_pieces(t([1000]), t([2000, 3000]), 8), "must pair up"),
    (lambda t: batch.make_pieces(t([1000]), t([2000]), 0), "positive length"),
    (lambda t: batch.make_pieces(t([1000]), t([2000]), t([-8])), "positive length"),
    (lambda t: batch.make_pieces(t([0]), t([2000]), 8), "null or negative address"),
    (lambda t: batch.make_pieces(t([1000.0]), t([2000.0]), 8), "1-D int64"),
    (lambda t: batch.make_pieces(t([[1000]]), t([[2000]]), 8), "1-D int64"),
], ids=["mismatch", "zero-length", "negative-length", "null", "float", "2-d"])
def test_invalid_pieces_are_refused_before_any_copy(build: Any, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message) as info:
        build(torch.tensor)
    assert info.value.code == "invalid_pieces"


def test_no_pieces_copy_nothing() -> None:
    empty = torch.empty(0, dtype=torch.int64)
    p = batch.make_pieces(empty, empty, 8)
    assert p.count == 0 and p.nbytes == 0 and p.chunks(4) == []
    batch.copy_pieces(p, "memcpy")


def test_unknown_mechanism_is_a_bug_not_a_silent_fallback() -> None:
    src, dst = _buffers(4096)
    with pytest.raises(ValueError, match="unknown batched copy mechanism"):
        batch.copy_pieces(_pieces(src, dst, ODD[:1]), "dma")


# -- refusals: the probe fails for real, the next mechanism is used ------------------------------

def _refuse(*args: Any) -> int:
    raise OSError(errno.EPERM, "process_vm_readv: Operation not permitted")


def test_a_refused_process_vm_readv_is_dropped_by_the_probe(monkeypatch: pytest.MonkeyPatch,
                                                            fresh_probe: None) -> None:
    monkeypatch.setattr(batch, "process_vm_readv", _refuse)
    usable = batch.available_mechanisms()
    assert "vm-readv" not in usable and "memcpy" in usable
    measured = costs.calibrate()
    assert measured.mechanism in ("ucontext", "cffi", "memcpy", "memmove")
    assert measured.to_dict()["mechanisms"] == list(usable)


def test_a_short_process_vm_readv_is_dropped_too(monkeypatch: pytest.MonkeyPatch,
                                                 fresh_probe: None) -> None:
    monkeypatch.setattr(batch, "process_vm_readv", lambda *a: 1)  # copies "1 byte"
    assert "vm-readv" not in batch.available_mechanisms()


def test_without_a_loadable_libc_only_ctypes_memmove_is_left(monkeypatch: pytest.MonkeyPatch,
                                                            fresh_probe: None) -> None:
    monkeypatch.setattr(batch, "_libc", lambda: None)
    monkeypatch.setattr(batch, "_cffi_memcpy", lambda: None)
    monkeypatch.setattr(chain, "usable", lambda: "no libc here")
    assert batch.available_mechanisms() == ("memmove",)


def test_context_chains_are_the_first_choice_where_they_work(fresh_probe: None) -> None:
    assert chain.usable() is None, chain.usable()
    assert batch.available_mechanisms()[:2] == ("ucontext", "cffi")
    timed = costs._worth_measuring(batch.available_mechanisms())
    assert "ucontext" in timed and not {"cffi", "memcpy", "memmove"} & set(timed)


def test_a_context_chain_runs_again_and_past_its_slot_count() -> None:
    """Running a chain clobbers libc's link words; they are restored before every run. More
    pieces than one chain holds are copied in several runs."""
    src, dst = _buffers()
    pieces = [(64 * i, (7919 * i) % 900_000, 1 + i % 61) for i in range(chain.MAX_SLOTS * 2 + 17)]
    p = _pieces(src, dst, pieces)
    for _ in range(3):
        dst.zero_()
        chain.copy_lists(p.dst.tolist(), p.src.tolist(), p.length.tolist())
        assert torch.equal(dst, _expected(src, torch.zeros_like(dst), pieces))


def test_a_context_chain_belongs_to_the_thread_that_built_it() -> None:
    import threading

    built = chain.Chain()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            built.copy([1], [2], [3])
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and "thread that built it" in str(errors[0])


def test_a_probe_that_crashes_in_the_child_leaves_context_chains_out(
        monkeypatch: pytest.MonkeyPatch, fresh_probe: None) -> None:
    """What a libc with another context layout would do: the child dies, we go on."""
    chain.usable.cache_clear()
    monkeypatch.setattr(chain, "PROBE", "import os; os.abort()")
    try:
        why = chain.usable()
        assert why is not None and "child process failed" in why
        assert "ucontext" not in batch.available_mechanisms()
        assert batch.available_mechanisms()[0] == "cffi"
    finally:
        chain.usable.cache_clear()


def test_without_cffi_ctypes_memcpy_does_the_job() -> None:
    """A real interpreter where `import cffi` fails: the probe drops it, ctypes copies."""
    code = ("import sys; sys.modules['cffi'] = None\n"
            "from vllm_offload_cli.core.transfer import batch, costs\n"
            "usable = batch.available_mechanisms()\n"
            "print(','.join(usable)); print(costs.calibrate().mechanism)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert not {"cffi", "ucontext"} & set(out[0].split(",")) and "memcpy" in out[0].split(",")
    assert out[1] in ("memcpy", "vm-readv")


def _worker_round_trip(shm_dir: Path) -> list[str]:
    """Store and load scattered blocks through a real worker; the methods it used."""
    block = 4096
    region = SharedOffloadRegion("batch", 64, 0, default_row_stride(1, block), block,
                                 shm_dir=shm_dir, world_size=1)
    g = torch.Generator().manual_seed(5)
    device = torch.randint(-128, 128, (48, block), dtype=torch.int8, generator=g)
    src = torch.randperm(48, generator=g)[:40]
    dst = torch.randperm(64, generator=g)[:40]
    try:
        with CopyWorker(region, [device]) as worker:
            worker.submit_store(1, src, dst)
            worker.wait([1])
            (stored,) = worker.get_finished()
            assert stored.success, stored.error
            assert torch.equal(worker.region_views[0][dst], device[src])
            back = torch.zeros_like(device)
            with CopyWorker(region, [back], region_views=worker.region_views) as loader:
                loader.submit_load(2, dst, src)
                loader.wait([2])
                (loaded,) = loader.get_finished()
            assert loaded.success and torch.equal(back[src], device[src])
            return [stored.method, loaded.method]
    finally:
        region.cleanup()


def test_with_every_mechanism_refused_the_worker_copies_with_torch(
        monkeypatch: pytest.MonkeyPatch, fresh_probe: None, shm_dir: Path) -> None:
    monkeypatch.setattr(batch, "_libc", lambda: None)
    monkeypatch.setattr(batch, "_cffi_memcpy", lambda: None)
    monkeypatch.setattr(chain, "usable", lambda: "refused")
    monkeypatch.setattr(batch.ctypes, "memmove", _refuse)
    assert batch.available_mechanisms() == ()
    measured = costs.calibrate()
    assert measured.batched is None and measured.mechanism is None
    methods = _worker_round_trip(shm_dir)
    assert all(m and not m.startswith("batched") for m in methods)


def test_the_worker_uses_the_mechanism_that_was_measured(monkeypatch: pytest.MonkeyPatch,
                                                         fresh_probe: None,
                                                         shm_dir: Path) -> None:
    """Make batched copies clearly cheapest; the worker's result names the mechanism."""
    measured = costs.calibrate()
    if measured.batched is None:
        pytest.skip("no batched copy mechanism works here")
    cheap = costs.Cost(0.0, 0.0, 1e-13)
    monkeypatch.setattr(costs, "calibrate", lambda: costs.CopyCosts(
        measured.copy, measured.gather, measured.scatter, cheap, measured.mechanism,
        measured.mechanisms, measured.seconds))
    monkeypatch.setattr("vllm_offload_cli.core.transfer.cpu.calibrate", costs.calibrate)
    monkeypatch.setattr("vllm_offload_cli.core.transfer.cpu.measured", costs.calibrate)
    methods = _worker_round_trip(shm_dir)
    assert methods == [f"batched:{measured.mechanism}"] * 2
