#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the gpu-marked tests, then the CUDA benchmark.
# Installs nothing (PYTHONPATH may point at carried wheels). Results go to $OUT (or ./gpu_results):
# six files. Finishes in under 8 minutes (TEST_SECONDS + BENCH_SECONDS + the environment).
#   PYTHON=python3 bash benchmarks/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export ECLAT_CACHE_DIR="${ECLAT_CACHE_DIR:-/tmp/eclat_gpu_cache}"  # not under $OUT: few files come back
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export ECLAT_REQUIRE_GPU=1  # the gpu tests fail (not skip) without pycuda or a device
status=0

{ nvidia-smi || echo "nvidia-smi: not available"; nvcc --version || echo "nvcc: not on PATH"; } \
    > "$OUT/environment.txt" 2>&1
"$PY" - >> "$OUT/environment.txt" 2>&1 <<'PY'
import importlib
for mod in ("torch", "pycuda", "triton", "egglog", "llvmlite", "numpy", "transformers"):
    try:
        m = importlib.import_module(mod)
        print(mod, getattr(m, "__version__", getattr(m, "VERSION", "?")))
    except Exception as e:
        print(mod, "MISSING:", type(e).__name__, e)
import torch
print("torch.cuda.is_available:", torch.cuda.is_available())
import pycuda.driver as drv
drv.init()
print("pycuda device:", drv.Device(0).name(), drv.Device(0).compute_capability(), "driver", drv.get_driver_version())
PY
cat "$OUT/environment.txt"

echo "== pytest -m gpu"
timeout "${TEST_SECONDS:-200}" "$PY" -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=10 \
    tests/test_cuda_runtime.py tests/test_gpu_mma.py 2>&1 | tee "$OUT/pytest_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== benchmarks/gpu_bench.py"
timeout "${BENCH_SECONDS:-230}" "$PY" benchmarks/gpu_bench.py --out "$OUT" --autotune fast \
    --budget "$(( ${BENCH_SECONDS:-230} - 60 ))" 2>&1 | tee "$OUT/gpu_bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "gpu_check: results in $OUT (exit $status)"
exit $status
