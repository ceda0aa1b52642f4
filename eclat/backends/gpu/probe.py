"""A GPU's device model, measured once per device by the same three kernels in every dialect: an
FMA-throughput loop, a streaming triad larger than any L2, and an empty launch."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ...autotune.device import FMA_ACCUMULATORS, FMA_SECONDS, REPEATS, Device, DeviceError, calibrated

_GPU_KERNELS = """
KERNEL void fma_peak(GLOBAL VT *out, int iters, float a, float b) {
  VT x = (VT)((float)(GID % 7)), va = (VT)(a), vb = (VT)(b);
""" + "".join(f"  VT acc{j} = x + (VT)({j}.0f);\n" for j in range(FMA_ACCUMULATORS)) + """
  for (int i = 0; i < iters; i++) {
""" + "".join(f"    acc{j} = FMA(acc{j}, va, vb);\n" for j in range(FMA_ACCUMULATORS)) + """
  }
  out[GID] = """ + " + ".join(f"acc{j}" for j in range(FMA_ACCUMULATORS)) + """;
}
KERNEL void triad(GLOBAL float *a, GLOBAL const float *b, GLOBAL const float *c, float s, int n) {
  int i = GID;
  if (i < n) a[i] = b[i] + s * c[i];
}
KERNEL void noop(GLOBAL float *out) {}
"""
GPU_FMA_ITEMS_PER_UNIT = 2048  # work-items per compute unit for the FMA kernel: enough to fill a GPU's SM
GPU_STREAM_BYTES = 64 << 20  # per array: larger than any GPU's L2 today (H100/H200: 50 MB)


def gpu_source(macros: dict[str, str], lanes: int = 1) -> str:
    """The benchmark kernels in a dialect: macros give KERNEL, GLOBAL, GID (the global index) and FMA;
    VT, the FMA kernel's element type, is the device's preferred float vector (CPUs under OpenCL
    want one)."""
    src = _GPU_KERNELS
    for macro, text in {**macros, "VT": f"float{lanes}" if lanes > 1 else "float"}.items():
        src = src.replace(macro, text)
    return src


def measure_gpu(kind: str, name: str, ident: dict[str, Any], units: int, lanes: int,
                 launch: Callable[[str, int, tuple], None], alloc: Callable[[np.ndarray], Any],
                 sync: Callable[[], None], read: Callable[[Any, np.ndarray], None]) -> Device:
    """The GPU benchmarks, written once over four small callables that a runtime supplies.

    launch(kernel, global_size, args) enqueues; sync() waits for the queue; alloc(host) makes a
    device copy of host; read(buffer, host) copies back.
    """
    items = units * GPU_FMA_ITEMS_PER_UNIT
    out = alloc(np.zeros(items * lanes, np.float32))

    def run_fma(iters: int) -> float:
        sync()
        t0 = time.perf_counter()
        launch("fma_peak", items, (out, np.int32(iters), np.float32(0.5), np.float32(1.0)))
        sync()
        return time.perf_counter() - t0

    run_fma(1)  # first launch compiles / uploads
    iters = min(calibrated(run_fma, 64, FMA_SECONDS), 1 << 30)
    flops = 2.0 * FMA_ACCUMULATORS * lanes * items * iters
    gflops = flops / min(run_fma(iters) for _ in range(REPEATS)) / 1e9

    n = GPU_STREAM_BYTES // 4
    bufs = [alloc(np.full(n, v, np.float32)) for v in (0.0, 1.0, 2.0)]

    def run_triad() -> float:
        sync()
        t0 = time.perf_counter()
        launch("triad", n, (*bufs, np.float32(3.0), np.int32(n)))
        sync()
        return time.perf_counter() - t0

    run_triad()
    gbps = 3 * n * 4 / min(run_triad() for _ in range(REPEATS + 2)) / 1e9
    check = np.zeros(n, np.float32)
    read(bufs[0], check)
    if not np.all(check[:: max(1, n // 97)] == 7.0):
        raise DeviceError(f"{kind} triad benchmark on {name} computed wrong values")

    launches = 200

    def run_noop() -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(launches):
            launch("noop", 1, (out,))
        sync()
        return time.perf_counter() - t0

    run_noop()
    overhead = min(run_noop() for _ in range(REPEATS)) / launches * 1e6
    return Device(name=name, kind=kind, fingerprint=ident["fingerprint"],
                  peak_gflops={"float32": round(gflops, 2)}, peak_gbps=round(gbps, 2),
                  launch_overhead_us=round(overhead, 3), threads=units, info=ident.get("info", {}))


