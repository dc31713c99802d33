"""`vllm-offload benchmark`: pre-fault, store and load throughput against a plain memcpy.

torch and the copy path load inside the command only, so `--help` stays fast."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING

import click

from vllm_offload_cli.cli import common
from vllm_offload_cli.cli.common import Invocation, Out, Outcome, Size, shm_dir_checked, subcommand
from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.base.extras import COPY, require
from vllm_offload_cli.core.base.units import format_bytes, parse_size

if TYPE_CHECKING:
    from vllm_offload_cli.core.transfer.bench import BenchReport, Throughput

# bench.DEFAULT_BLOCK_SIZES and bench.PATTERNS, not imported: --help must not load the copy path
DEFAULT_SIZES = "16KiB,64KiB,256KiB,1MiB,2MiB"
PATTERNS = ("contiguous", "device-scattered", "scattered")


def _block_sizes(values: tuple[str, ...]) -> tuple[int, ...]:
    parts = [p for p in ",".join(values or [DEFAULT_SIZES]).split(",") if p.strip()]
    sizes = tuple(dict.fromkeys(parse_size(p, what="--cpu-page-size") for p in parts))
    if not sizes:
        raise InvalidInputError("--cpu-page-size needs at least one size", code="invalid_size")
    if min(sizes) <= 0:
        raise InvalidInputError("--cpu-page-size must be greater than 0", code="invalid_size")
    return sizes


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the scratch region is removed either way."""
    with contextlib.ExitStack() as restore:
        with contextlib.suppress(ValueError):  # not the main thread: nothing to install
            previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
            restore.callback(signal.signal, signal.SIGTERM, previous)
        yield


@subcommand("benchmark", help="Measure pre-fault, store and load throughput of the copy "
            "workers against a plain memcpy.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              help="Where the KV blocks live: auto picks cuda when a GPU is visible.")
@click.option("--size", type=Size(), default="256MiB",
              help="Scratch region size per block size (e.g. 256MiB, 4GiB).")
@click.option("--cpu-page-size", multiple=True, metavar="SIZE", show_default=DEFAULT_SIZES,
              help="Block size(s) to measure: one worker's bytes per block. Repeatable or "
              "comma-separated.")
@click.option("--world-size", type=click.IntRange(min=1), default=1, metavar="N",
              help="Worker slots per row (the benchmark fills slot 0).")
@click.option("--blocks-per-transfer", type=click.IntRange(min=1), metavar="N",
              show_default="128 MiB per job, at most half the region",
              help="Blocks per store/load job (the batch size).")
# 11 is bench.DEFAULT_REPEAT
@click.option("--repeat", type=click.IntRange(min=1), default=11, metavar="N",
              help="Timed rounds per figure (each: a memcpy, 2 jobs in flight, a memcpy); the "
              "best round is shown, the median is also in --json.")
@click.option("--pattern", type=click.Choice(PATTERNS), multiple=True, show_default="all",
              help="Block-id patterns to measure (repeatable).")
@click.option("--threads", type=click.IntRange(min=1), metavar="N",
              show_default="CPUs, at most 8", help="Pre-fault threads.")
@click.option("--huge-pages", is_flag=True, help="Also measure pre-fault and contiguous copies "
              "with normal and with transparent huge pages (largest block size) and report "
              "the ratio.")
def benchmark_cmd(inv: Invocation, device: str, size: int, cpu_page_size: tuple[str, ...],
                  world_size: int, blocks_per_transfer: int | None, repeat: int,
                  pattern: tuple[str, ...], threads: int | None, huge_pages: bool) -> Outcome:
    """Create a scratch region, measure pre-fault and the copy workers' store and load
    throughput for each block size and block-id pattern, and a plain memcpy of the same
    bytes as the baseline; on CUDA both pinned and pageable. The region is removed at the
    end, also on Ctrl-C or SIGTERM.
    """
    require(COPY, what="vllm-offload benchmark")
    from vllm_offload_cli.core.transfer import bench

    bench.passive_openmp()  # before torch loads
    blocks = _block_sizes(cpu_page_size)
    resolved = bench.resolve_device(device)
    config = bench.BenchConfig(
        shm_dir=shm_dir_checked(inv), device=resolved, size_bytes=size, block_sizes=blocks,
        world_size=world_size, blocks_per_transfer=blocks_per_transfer, repeat=repeat,
        patterns=pattern or PATTERNS,
        populate_threads=common.prefault_threads(threads), huge_pages=huge_pages)
    inv.info(f"benchmarking on {resolved}, block sizes "
             f"{', '.join(format_bytes(b) for b in blocks)}")
    with _sigterm_interrupts(), inv.progress("benchmark", 1) as update:
        report = bench.run_benchmark(config, progress=update)
    return Outcome(data=report.to_dict(), render=lambda out: _render(out, report))


def _figures(t: Throughput) -> list[str]:
    return [f"{t.gbps:.2f}", f"{t.memcpy_gbps:.2f}", f"{t.ratio:.2f}x"]


def _render(out: Out, report: BenchReport) -> None:
    """Plain lines and a table of one line per row, never cut (as inspect and gc print)."""
    lines = [f"Device    {report.device}: {report.device_name}; torch {report.torch_version}, "
             f"{report.torch_threads} intra-op thread(s)",
             f"Region    {report.engine_id} in {report.shm_dir}: "
             f"{format_bytes(report.size_bytes)} per block size, world size "
             f"{report.world_size}; {'removed' if report.removed else 'NOT removed'}"]
    if report.pinned is not None:
        lines.append("Pinned    " + ("yes" if report.pinned else
                                     f"no ({report.pin_warning or 'pinning failed'})"))
    if report.prefault:
        figures = ", ".join(f"{format_bytes(p.block_bytes)} {p.gbps:.2f} GB/s"
                            for p in report.prefault)
        p0 = report.prefault[0]
        lines.append(f"Pre-fault {figures} ({p0.method}, {p0.threads} thread(s))")
    lines.append(f"Figures   GB/s, best of {report.repeat} rounds; memcpy = a plain copy of "
                 "the same bytes, measured interleaved"
                 + (" (pinned d2h / h2d)" if report.device == "cuda" else "")
                 + "; ratio = median of the rounds' ratios")
    headers = ["BLOCK", "PATTERN", "MODE", "BLOCKS", "STORE", "MEMCPY", "RATIO", "LOAD",
               "MEMCPY", "RATIO", "STORED BY", "LOADED BY"]
    rows = [[format_bytes(r.block_bytes), r.pattern, r.mode, str(r.blocks_per_transfer),
             *_figures(r.store), *_figures(r.load), r.store.method, r.load.method]
            for r in report.rows]
    lines.append(common.text_table(headers, rows, right=(0, 3, 4, 5, 6, 7, 8, 9)))
    if (huge := report.huge_pages) is not None:
        if not huge.available or huge.huge is None or (q := huge.ratios) is None:
            lines.append(f"Huge pages not measured: {huge.reason}")
        else:
            lines.append(f"Huge pages {format_bytes(huge.block_bytes)} blocks, huge / normal: "
                         f"pre-fault {q['prefault']:.2f}x, store {q['store']:.2f}x, load "
                         f"{q['load']:.2f}x ({format_bytes(huge.huge.huge_page_bytes)} mapped "
                         "huge)")
    if target := report.target:
        verdicts = "; ".join(
            f"{name} >= {v['ratio']:g}x {'met' if v['met'] else 'NOT met'} "
            f"(worst {v['min_ratio']:.2f}x)" for name, v in target["patterns"].items())
        lines.append(f"Target    memcpy ratio for blocks >= "
                     f"{format_bytes(target['min_block_bytes'])}: {verdicts}")
    out.print("\n".join(lines))
