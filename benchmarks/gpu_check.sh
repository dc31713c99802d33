#!/usr/bin/env bash
# The one GPU proof for the copy workers, for a session lent a GPU host: environment, the
# cuda-marked tests, then store/load of contiguous, device-scattered and scattered 16 KiB ..
# 2 MiB blocks against the device's own pinned memcpy (target >= 0.9x for contiguous,
# information for the rest), pinned and pageable. Under 5 minutes. Results go to $OUT (the device
# tool brings them back) or /tmp/gpu_check.
#
#   device run: bash benchmarks/gpu_check.sh          (timeout_s 330)
#
# Exit status: 0 all good; 1 something is broken (no CUDA in torch, a cuda test failed or
# was SKIPPED although nvidia-smi sees a GPU, a benchmark error, a scratch region left);
# 2 no GPU visible here (nothing was checked); 4 everything works but a figure misses the
# 0.9x target. It never reports success for a check it did not run.
#
# The GPU image has torch but maybe an older typer; if the first check fails,
# carry wheels for typer>=0.29 (and its needs) in .whl/ as the device README says.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
broken=0
fail() { echo "GPU CHECK FAILED: $*" | tee -a "$OUT/failures.txt" >&2; broken=1; }

if ! nvidia-smi -L >"$OUT/gpus.txt" 2>&1 || ! grep -q '^GPU ' "$OUT/gpus.txt"; then
  echo "no GPU visible to nvidia-smi: nothing was checked (run this on a GPU host)" >&2
  exit 2
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch, typer._click, rich, psutil, prometheus_client  # noqa: F401
assert torch.cuda.is_available(), "nvidia-smi sees a GPU but torch does not"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
PY
[ "${PIPESTATUS[0]}" = 0 ] || { fail "environment: see $OUT/env.txt"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv \
  2>&1 | tee -a "$OUT/env.txt"
echo "ulimit -l: $(ulimit -l)" | tee -a "$OUT/env.txt"
SHM=$(mktemp -d -p /dev/shm vllm-offload-gpu.XXXXXX)
trap 'rm -rf "$SHM"' EXIT

echo "== cuda tests (a skip is a failure here: the GPU is present)"
timeout 100 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/test_transfer_cuda.py tests/test_transfer_cuda_logic.py 2>&1 | tee "$OUT/cuda_tests.txt"
rc=${PIPESTATUS[0]}
summary=$(tail -n 1 "$OUT/cuda_tests.txt")
[ "$rc" = 0 ] || fail "cuda tests exited $rc: $summary"
grep -qE '[0-9]+ passed' <<<"$summary" || fail "no cuda test passed: $summary"
grep -qE '[0-9]+ skipped' <<<"$summary" && fail "cuda tests were skipped on a GPU host: $summary"

echo "== store/load vs pinned memcpy, pinned and pageable"
timeout 170 python3 - "$SHM" "$OUT" <<'PY' 2>&1 | tee "$OUT/benchmark.txt"
import json, sys
from vllm_offload_cli.core.transfer.bench import BenchConfig, run_benchmark
shm, out = sys.argv[1], sys.argv[2]
KiB = 1024
sizes = (16 * KiB, 64 * KiB, 256 * KiB, 1024 * KiB, 2048 * KiB)
report = run_benchmark(BenchConfig(
    shm_dir=shm, device="cuda", size_bytes=1 << 30, block_sizes=sizes, repeat=5))
json.dump(report.to_dict(), open(f"{out}/benchmark.json", "w"), indent=1)
assert report.removed, "a scratch region was left behind"
assert report.pinned, f"pinning failed: {report.pin_warning}"
print(f"-- {report.device_name} (pinned: {report.pinned})")
missed = 0
for r in report.rows:
    worst = min(r.store.ratio, r.load.ratio)
    judged = r.mode == "pinned" and r.pattern == "contiguous"
    verdict = ("ok" if worst >= 0.9 else "MISSED 0.9x") if judged else "(info)"
    missed += judged and worst < 0.9
    print(f"{r.block_bytes // KiB:>5} KiB {r.pattern:<16} {r.mode:<8} "
          f"store {r.store.gbps:6.2f} GB/s {r.store.ratio:4.2f}x  "
          f"load {r.load.gbps:6.2f} GB/s {r.load.ratio:4.2f}x  "
          f"(memcpy {r.store.memcpy_gbps:.2f}/{r.load.memcpy_gbps:.2f})  "
          f"{r.store.method}/{r.load.method}  {verdict}")
print(f"targets missed: {missed}")
sys.exit(4 if missed else 0)
PY
rc=${PIPESTATUS[0]}
targets=0
case "$rc" in
  0) ;;
  4) targets=1; echo "GPU CHECK: a contiguous figure misses 0.9x pinned memcpy" >&2 ;;
  *) fail "benchmark exited $rc (124: over time): see $OUT/benchmark.txt" ;;
esac
left=$(ls -A "$SHM")
[ -z "$left" ] || fail "scratch regions left in $SHM: $left"
if [ "$broken" = 1 ]; then
  echo "GPU CHECK: BROKEN (see above and $OUT/failures.txt)" >&2
  exit 1
fi
[ "$targets" = 1 ] && exit 4
echo "GPU CHECK: all good"
