"""The CPU's device model: its peak FMA throughput, streaming bandwidth and call overhead, measured
by JIT-compiled micro-benchmarks run from Python threads (ctypes releases the GIL during a call)."""

from __future__ import annotations

import ctypes
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ...autotune.device import (
    FMA_ACCUMULATORS,
    FMA_SECONDS,
    REPEATS,
    STREAM_BYTES,
    Device,
    DeviceError,
    calibrated,
    cpu_count,
    fingerprint_of,
    load_average,
)
from . import host
from .jit import target_machine

_KEEP_ALIVE: list[Any] = []  # JIT engines whose functions are still callable


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _llc_bytes() -> int:
    sizes = []
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (idx / "size").read_text().strip()  # e.g. "8192K"
            unit = {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
            sizes.append(int(text.rstrip("KM")) * unit)
        except (OSError, ValueError):
            pass
    return max(sizes, default=32 << 20)


def _fma_ir(lanes: int, k: int) -> str:
    vt = f"<{lanes} x float>"
    fn = f"@llvm.fmuladd.v{lanes}f32"
    phis = "\n".join(f"  %acc{j} = phi {vt} [%a, %entry], [%n{j}, %loop]" for j in range(k))
    fmas = "\n".join(f"  %n{j} = call {vt} {fn}({vt} %acc{j}, {vt} %a, {vt} %b)" for j in range(k))
    sums = "\n".join(f"  %s{j} = fadd {vt} %s{j - 1}, %n{j}" for j in range(1, k))
    return f"""
define void @fma_peak(i64 %iters, ptr noalias %io) {{
entry:
  %a = load {vt}, ptr %io, align 4
  %pb = getelementptr {vt}, ptr %io, i64 1
  %b = load {vt}, ptr %pb, align 4
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%inext, %loop]
{phis}
{fmas}
  %inext = add i64 %i, 1
  %done = icmp uge i64 %inext, %iters
  br i1 %done, label %exit, label %loop
exit:
  %s0 = fadd {vt} %n0, zeroinitializer
{sums}
  %pout = getelementptr {vt}, ptr %io, i64 2
  store {vt} %s{k - 1}, ptr %pout, align 4
  ret void
}}
declare {vt} {fn}({vt}, {vt}, {vt})

define void @triad(ptr noalias %a, ptr noalias %b, ptr noalias %c, float %s, i64 %start, i64 %end) {{
entry:
  %empty = icmp sge i64 %start, %end
  br i1 %empty, label %exit, label %loop
loop:
  %i = phi i64 [%start, %entry], [%inext, %loop]
  %pb = getelementptr float, ptr %b, i64 %i
  %pc = getelementptr float, ptr %c, i64 %i
  %pa = getelementptr float, ptr %a, i64 %i
  %vb = load float, ptr %pb, align 4
  %vc = load float, ptr %pc, align 4
  %m = fmul float %s, %vc
  %v = fadd float %vb, %m
  store float %v, ptr %pa, align 4
  %inext = add i64 %i, 1
  %done = icmp eq i64 %inext, %end
  br i1 %done, label %exit, label %loop
exit:
  ret void
}}

define void @noop() {{
  ret void
}}
"""


def _jit_cpu(ir: str) -> Any:
    import llvmlite.binding as llvm

    tm = target_machine()
    mod = llvm.parse_assembly(ir)
    mod.verify()
    pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=3))
    pb.getModulePassManager().run(mod, pb)
    engine = llvm.create_mcjit_compiler(mod, tm)
    engine.finalize_object()
    _KEEP_ALIVE.append(engine)
    return engine


def _in_threads(calls: list[Callable[[], Any]]) -> float:
    """Run each call in its own thread at once; wall seconds from the first start to the last end."""
    if len(calls) == 1:
        t0 = time.perf_counter()
        calls[0]()
        return time.perf_counter() - t0
    spans: list[tuple[float, float]] = []
    barrier = threading.Barrier(len(calls))

    def worker(call: Callable[[], Any]) -> None:
        barrier.wait()
        t0 = time.perf_counter()
        call()
        spans.append((t0, time.perf_counter()))

    workers = [threading.Thread(target=worker, args=(c,)) for c in calls]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return max(e for _, e in spans) - min(s for s, _ in spans)


class CpuProbe:
    def names(self) -> list[str]:
        return [_cpu_model()]

    def identify(self, index: int, threads: int | None) -> dict[str, Any]:
        if index != 0:
            raise DeviceError(f"there is one CPU target ('cpu'), not cpu:{index}")
        threads = cpu_count() if threads is None else threads
        if not isinstance(threads, int) or threads < 1:
            raise DeviceError(f"threads must be a positive integer, got {threads!r}")
        unit = host.vector_unit()
        return {"fingerprint": fingerprint_of("cpu", _cpu_model(), platform.machine(), unit, threads),
                "threads": threads, "unit": unit}

    def measure(self, index: int, ident: dict[str, Any]) -> Device:
        threads = ident["threads"]
        lanes = host.vector_lanes()
        engine = _jit_cpu(_fma_ir(lanes, FMA_ACCUMULATORS))
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        address = engine.get_function_address
        fma = ctypes.CFUNCTYPE(None, i64, ptr)(address("fma_peak"))
        triad = ctypes.CFUNCTYPE(None, ptr, ptr, ptr, f32, i64, i64)(address("triad"))
        noop = ctypes.CFUNCTYPE(None)(address("noop"))

        # FMA throughput: acc = acc * 0.5 + 1 stays near 2.0, so no overflow and no denormals; sum -> io[2]
        ios = [np.repeat(np.float32([0.5, 1.0, 0.0]), lanes) for _ in range(threads)]
        run_fma = lambda n: _in_threads([lambda io=io: fma(n, io.ctypes.data) for io in ios])
        iters = calibrated(run_fma, 1 << 12, FMA_SECONDS)
        flops = 2.0 * lanes * FMA_ACCUMULATORS * iters * threads
        gflops = flops / min(run_fma(iters) for _ in range(REPEATS + 2)) / 1e9
        if not np.allclose(ios[0][2 * lanes:], 2.0 * FMA_ACCUMULATORS):  # each chain converges to 2.0
            raise DeviceError("CPU FMA benchmark computed wrong values; the JIT is broken")

        # streaming triad a = b + s*c, each thread on its own slice; counted as 3 streams (STREAM's rule)
        n = STREAM_BYTES // 4
        # filled here so that page faults happen before the timing
        a, b, c = np.zeros(n, np.float32), np.ones(n, np.float32), np.full(n, 2.0, np.float32)
        bounds = np.linspace(0, n, threads + 1).astype(np.int64)
        ptrs = (a.ctypes.data, b.ctypes.data, c.ctypes.data)
        calls = [lambda lo=lo, hi=hi: triad(*ptrs, 3.0, int(lo), int(hi))
                 for lo, hi in zip(bounds, bounds[1:])]
        _in_threads(calls)  # warm-up
        gbps = 3 * n * 4 / min(_in_threads(calls) for _ in range(REPEATS + 2)) / 1e9
        if not np.all(a[:: max(1, n // 97)] == 7.0):
            raise DeviceError("CPU triad benchmark computed wrong values; the JIT is broken")

        calls_n = 20000
        best = min(_timed_loop(noop, calls_n) for _ in range(REPEATS))
        return Device(name=_cpu_model(), kind="cpu", fingerprint=ident["fingerprint"],
                      peak_gflops={"float32": round(gflops, 2)}, peak_gbps=round(gbps, 2),
                      launch_overhead_us=round(best / calls_n * 1e6, 4), threads=threads,
                      info={"vector_unit": ident["unit"], "vector_lanes_f32": lanes,
                            "llc_bytes": _llc_bytes(), "llvm_cpu": host.cpu_name(),
                            # other processes lower the peaks: a high load here means remeasure later
                            "load_during_measurement": round(load_average(), 2)})


def _timed_loop(fn: Callable[[], Any], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - t0
