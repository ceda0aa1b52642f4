#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the gpu-marked tests, then the CUDA benchmark.
# Installs nothing. Results go to $OUT (or ./gpu_results). Finishes in under 8 minutes.
#   bash benchmarks/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
export ECLAT_CACHE_DIR="${ECLAT_CACHE_DIR:-$OUT/cache}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export ECLAT_REQUIRE_GPU=1  # the gpu tests fail (not skip) without pycuda or a device
status=0

{ nvidia-smi || echo "nvidia-smi: not available"; nvcc --version || echo "nvcc: not on PATH"; } \
    > "$OUT/environment.txt" 2>&1
python - >> "$OUT/environment.txt" 2>&1 <<'PY'
import importlib
for mod in ("torch", "pycuda", "triton"):
    try:
        m = importlib.import_module(mod)
        print(mod, getattr(m, "__version__", getattr(m, "VERSION", "?")))
    except Exception as e:
        print(mod, "MISSING:", type(e).__name__, e)
import torch
print("torch.cuda.is_available:", torch.cuda.is_available())
PY
cat "$OUT/environment.txt"

echo "== pytest -m gpu"
timeout 270 python -m pytest -m gpu -q -p no:cacheprovider tests/test_cuda_runtime.py \
    --junitxml="$OUT/pytest_gpu.xml" 2>&1 | tee "$OUT/pytest_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== benchmarks/gpu_bench.py"
timeout 190 python benchmarks/gpu_bench.py --out "$OUT" --budget 120 2>&1 | tee "$OUT/gpu_bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "gpu_check: results in $OUT (exit $status)"
exit $status
