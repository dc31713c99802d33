#!/usr/bin/env bash
# The one GPU proof for the copy workers (issue 5), for a session lent an H200:
# environment, the cuda-marked tests, `vllm-offload benchmark --device cuda`
# (copy-engine, pinned and pageable), then the opt-in kernel strategy. Under
# 5 minutes. Results go to $OUT (the device tool brings them back) or /tmp.
#
#   device run: bash benchmarks/gpu_check.sh          (timeout_s 420)
#
# The GPU image has torch but maybe an older typer; if the first check fails,
# carry wheels for typer>=0.29 (and its needs) in .whl/ as the device README says.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt" || exit 3
import torch, typer._click, rich, psutil, prometheus_client  # noqa: F401
assert torch.cuda.is_available(), "torch sees no GPU"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
PY
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv \
  2>&1 | tee -a "$OUT/env.txt"
echo "ulimit -l: $(ulimit -l)" | tee -a "$OUT/env.txt"
SHM=$(mktemp -d -p /dev/shm vllm-offload-gpu.XXXXXX)
trap 'rm -rf "$SHM"' EXIT

echo "== cuda tests"
timeout 180 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_transfer_cuda.py \
  2>&1 | tee "$OUT/cuda_tests.txt"

echo "== benchmark: copy engines, pinned and pageable"
timeout 150 python3 -m vllm_offload_cli benchmark --device cuda --shm-dir "$SHM" \
  --size 1GiB --repeat 5 --pattern contiguous --pattern scattered 2>&1 | tee "$OUT/benchmark.txt"

echo "== kernel strategy (zero-copy gather/scatter), pinned only"
timeout 90 python3 - "$SHM" <<'PY' 2>&1 | tee "$OUT/kernel.txt"
import sys
from vllm_offload_cli.core.transfer.bench import BenchConfig, run_benchmark
report = run_benchmark(BenchConfig(shm_dir=sys.argv[1], device="cuda", size_bytes=1 << 30,
                                   repeat=5, patterns=("contiguous", "scattered"),
                                   cuda_strategy="kernel"))
for r in report.rows:
    if r.mode == "pinned":
        print(f"{r.block_bytes >> 10:>5} KiB {r.pattern:<11} store {r.store.gbps:6.2f} "
              f"({r.store.ratio:.2f}x of {r.store.memcpy_gbps:.2f})  load {r.load.gbps:6.2f} "
              f"({r.load.ratio:.2f}x of {r.load.memcpy_gbps:.2f})  {r.store.method}")
PY
ls -A "$SHM"  # must print nothing: every scratch region removed
