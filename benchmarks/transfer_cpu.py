"""CPU copy-worker figures against a plain memcpy, optionally over several rounds.

A thin wrapper over the benchmark core (`vllm-offload benchmark --device cpu`)
for a noisy host: each round runs the whole sweep (each figure the median of
--repeat bracketed memcpy/worker rounds, as the CLI does), and the summary gives
the median ratio per (block size, pattern) across rounds. Prints plain text;
--json for the rows.

    python benchmarks/transfer_cpu.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from collections import defaultdict

from vllm_offload_cli.core.base.units import format_bytes, parse_size
from vllm_offload_cli.core.transfer.bench import (
    DEFAULT_BLOCK_SIZES,
    DEFAULT_REPEAT,
    PATTERNS,
    BenchConfig,
    run_benchmark,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="256MiB", help="scratch region per block size")
    parser.add_argument("--block-sizes", default=",".join(str(b) for b in DEFAULT_BLOCK_SIZES))
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--repeat", type=int, default=DEFAULT_REPEAT)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    blocks = tuple(parse_size(b) for b in args.block_sizes.split(","))
    shm_dir = tempfile.mkdtemp(prefix="vllm-offload-bench-", dir="/dev/shm")
    ratios: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    figures: dict[tuple[int, str], list[tuple[float, float, float, float]]] = defaultdict(list)
    methods: dict[tuple[int, str], set[str]] = defaultdict(set)
    rounds = []
    try:
        for r in range(args.rounds):
            report = run_benchmark(BenchConfig(
                shm_dir=shm_dir, device="cpu", size_bytes=parse_size(args.size),
                block_sizes=blocks, repeat=args.repeat,
                patterns=tuple(args.patterns.split(",")), populate_threads=2, seed=r))
            rounds.append(report.to_dict())
            for row in report.rows:
                key = (row.block_bytes, row.pattern)
                ratios[key].append((row.store.ratio, row.load.ratio))
                methods[key].add(f"{row.store.method}/{row.load.method}")
                figures[key].append((row.store.gbps, row.store.memcpy_gbps, row.load.gbps,
                                     row.load.memcpy_gbps))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    if args.json:
        print(json.dumps(rounds, indent=2))
        return 0
    print(f"{'block':>9} {'pattern':<17} {'store':>6} {'memcpy':>6} {'ratio':>6}  "
          f"{'load':>6} {'memcpy':>6} {'ratio':>6}  method (GB/s; medians over {args.rounds} "
          "rounds)")
    for (block, pattern), values in ratios.items():
        fig = [statistics.median(v) for v in zip(*figures[(block, pattern)], strict=True)]
        store = statistics.median(v[0] for v in values)
        load = statistics.median(v[1] for v in values)
        print(f"{format_bytes(block):>9} {pattern:<17} {fig[0]:6.2f} {fig[1]:6.2f} "
              f"{store:5.2f}x  {fig[2]:6.2f} {fig[3]:6.2f} {load:5.2f}x  "
              f"{', '.join(sorted(methods[(block, pattern)]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
