"""Device model: measured peak FLOP/s, memory bandwidth and launch overhead of a target.

Peaks are measured once by micro-benchmarks (an FMA-throughput kernel, a streaming triad
over buffers larger than the last-level cache, an empty call) and cached as JSON under
<cache_dir>/devices/ keyed by a fingerprint of the hardware, so a later compile reads them.

    dev = get_device("cpu", threads=2)        # or "opencl", "opencl:1", "cuda", "cuda:0"
    dev.peak_gflops["float32"], dev.peak_gbps, dev.launch_overhead_us

The CPU kernels are LLVM IR JIT-compiled with llvmlite for the host's features; threads run
them concurrently from Python threads (ctypes releases the GIL during the call). OpenCL uses
pyopencl on the device found (PoCL on a machine without a GPU); CUDA uses pycuda, imported
only when a CUDA device is asked for.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EclatError
from .cache import cache_dir as _cache_dir

KINDS = ("cpu", "opencl", "cuda", "metal")
CACHE_SCHEMA = 1
FMA_ACCUMULATORS = 12  # independent FMA chains: enough to cover latency x issue width on x86 and GPUs
FMA_SECONDS = 0.05  # target duration of one FMA run after calibration
STREAM_MIN_BYTES = 32 << 20  # per array; at least 4x the last-level cache is used when that is larger
REPEATS = 3  # best of REPEATS for each benchmark: other processes only ever make a run slower


class DeviceError(EclatError):
    """A target device is missing, unknown, or could not be measured."""


@dataclass(frozen=True)
class Device:
    """One target device with its measured roofline parameters."""

    name: str
    kind: str  # one of KINDS
    fingerprint: str  # stable hash of what decides performance (model, features, threads, driver)
    peak_gflops: dict[str, float]  # by dtype name ("float32"); measured, not the data-sheet figure
    peak_gbps: float  # streaming triad bandwidth, GB/s (1e9 bytes)
    launch_overhead_us: float  # cost of one call/launch that does nothing
    threads: int  # CPU threads used; GPU compute units / SMs
    info: dict[str, Any] = field(default_factory=dict)  # kind-specific details (features, vector width...)

    def gflops(self, dtype: str = "float32") -> float:
        """Peak GFLOP/s for dtype; dtypes not measured fall back to float32 (an estimate, not a bound)."""
        return self.peak_gflops.get(dtype, self.peak_gflops["float32"])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# targets and cache


def parse_target(target: str) -> tuple[str, int]:
    """'opencl:1' -> ('opencl', 1); 'cpu' -> ('cpu', 0). Raises DeviceError for an unknown kind."""
    kind, _, index = target.partition(":")
    if kind not in KINDS:
        raise DeviceError(f"unknown target {target!r}: expected one of {', '.join(KINDS)} (optionally ':N')")
    if index and not index.isdigit():
        raise DeviceError(f"bad device index in target {target!r}: expected e.g. '{kind}:0'")
    return kind, int(index or 0)


def get_device(target: str = "cpu", threads: int | None = None, cache_dir: str | os.PathLike | None = None,
               remeasure: bool = False) -> Device:
    """The device for target, measured once and then read from the cache.

    threads only applies to the CPU (default: the CPUs this process may run on).
    """
    kind, index = parse_target(target)
    probe = _PROBES[kind]
    ident = probe.identify(index, threads)
    path = _cache_dir(cache_dir) / "devices" / f"{kind}-{ident['fingerprint']}.json"
    if not remeasure:
        cached = _read_cached(path)
        if cached is not None and not _measured_busy(cached):
            return cached
    device = probe.measure(index, ident)
    _write_cached(path, device)
    return device


def describe_devices(cache_dir: str | os.PathLike | None = None,
                     measure: bool = True) -> list[dict[str, Any]]:
    """One dict per device this machine offers (for `eclat devices`); measured peaks when measure=True.

    A device that fails to measure is listed with an "error" entry instead of stopping the listing.
    """
    rows: list[dict[str, Any]] = []
    for kind, probe in _PROBES.items():
        for index, name in enumerate(probe.names()):
            target = f"{kind}:{index}" if kind != "cpu" else "cpu"
            row: dict[str, Any] = {"target": target, "kind": kind, "name": name}
            if measure:
                try:
                    row.update(get_device(target, cache_dir=cache_dir).to_dict())
                except Exception as e:  # noqa: BLE001 - one broken device must not hide the others
                    row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
    return rows


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def _measured_busy(dev: Device) -> bool:
    """A CPU measured while other work held half its cores or more (beyond this process),
    and the machine is quieter now: its cached peaks are too low, so measure again."""
    then = dev.info.get("load_during_measurement")
    if dev.kind != "cpu" or not isinstance(then, (int, float)):
        return False
    others = then - 1.0  # this process's own load
    return others >= 0.5 * _cpu_count() and _load() < others


def _read_cached(path: Path) -> Device | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("schema") != CACHE_SCHEMA:
            return None
        dev = Device(**data["device"])
        if not (dev.peak_gflops.get("float32", 0) > 0 and dev.peak_gbps > 0 and dev.launch_overhead_us >= 0):
            raise ValueError("non-positive peaks")
        return dev
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        warnings.warn(f"ignoring unreadable device cache {path} ({e}); measuring again", stacklevel=3)
        return None


def _write_cached(path: Path, device: Device) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"schema": CACHE_SCHEMA, "device": device.to_dict()}, indent=1))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError as e:
        warnings.warn(f"could not cache device measurements at {path}: {e}", stacklevel=3)


def _hash(*parts: Any) -> str:
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:16]


def _calibrated(run: Callable[[int], float], n: int, seconds: float) -> int:
    """Grow n until run(n) takes a measurable time, then scale it to last about `seconds`."""
    while True:
        t = run(n)
        if t > seconds / 8 or n > 1 << 40:
            return max(1, int(n * seconds / max(t, 1e-9)))
        n *= 4


# ---------------------------------------------------------------------------------------------
# CPU: llvmlite JIT


_CPU_FEATURES = ("avx512f", "avx2", "fma", "avx", "sse4.2", "neon", "sve")  # those that set the peaks
_KEEP_ALIVE: list[Any] = []  # JIT engines whose functions are still callable


def _host_features() -> list[str]:
    import llvmlite.binding as llvm

    return sorted(f[1:] for f in llvm.get_host_cpu_features().flatten().split(",") if f.startswith("+"))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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


def _vector_lanes(features: list[str]) -> int:
    return 16 if "avx512f" in features else 8 if "avx" in features else 4


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

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    tm = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3)
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


class _CpuProbe:
    def names(self) -> list[str]:
        return [_cpu_model()]

    def identify(self, index: int, threads: int | None) -> dict[str, Any]:
        if index != 0:
            raise DeviceError(f"there is one CPU target ('cpu'), not cpu:{index}")
        threads = _cpu_count() if threads is None else threads
        if not isinstance(threads, int) or threads < 1:
            raise DeviceError(f"threads must be a positive integer, got {threads!r}")
        features = _host_features()
        key = [f for f in _CPU_FEATURES if f in features]
        return {"fingerprint": _hash("cpu", _cpu_model(), platform.machine(), *key, threads),
                "threads": threads, "features": features}

    def measure(self, index: int, ident: dict[str, Any]) -> Device:
        threads, features = ident["threads"], ident["features"]
        lanes = _vector_lanes(features)
        engine = _jit_cpu(_fma_ir(lanes, FMA_ACCUMULATORS))
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        address = engine.get_function_address
        fma = ctypes.CFUNCTYPE(None, i64, ptr)(address("fma_peak"))
        triad = ctypes.CFUNCTYPE(None, ptr, ptr, ptr, f32, i64, i64)(address("triad"))
        noop = ctypes.CFUNCTYPE(None)(address("noop"))

        # FMA throughput: acc = acc * 0.5 + 1 stays near 2.0, so no overflow and no denormals; sum -> io[2]
        ios = [np.repeat(np.float32([0.5, 1.0, 0.0]), lanes) for _ in range(threads)]
        run_fma = lambda n: _in_threads([lambda io=io: fma(n, io.ctypes.data) for io in ios])
        iters = _calibrated(run_fma, 1 << 12, FMA_SECONDS)
        flops = 2.0 * lanes * FMA_ACCUMULATORS * iters * threads
        gflops = flops / min(run_fma(iters) for _ in range(REPEATS + 2)) / 1e9
        if not np.allclose(ios[0][2 * lanes:], 2.0 * FMA_ACCUMULATORS):  # each chain converges to 2.0
            raise DeviceError("CPU FMA benchmark computed wrong values; the JIT is broken")

        # streaming triad a = b + s*c, each thread on its own slice; counted as 3 streams (STREAM's rule)
        n = max(STREAM_MIN_BYTES, 4 * _llc_bytes()) // 4
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
                      info={"features": [f for f in _CPU_FEATURES if f in features],
                            "vector_lanes_f32": lanes, "llc_bytes": _llc_bytes(),
                            "llvm_cpu": _llvm_cpu_name(),
                            # other processes lower the peaks: a high load here means remeasure later
                            "load_during_measurement": round(_load(), 2)})


def _timed_loop(fn: Callable[[], Any], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - t0


def _llvm_cpu_name() -> str:
    import llvmlite.binding as llvm

    return llvm.get_host_cpu_name()


# ---------------------------------------------------------------------------------------------
# GPUs: one set of kernels, two dialects (OpenCL C through pyopencl, CUDA C through pycuda)

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
# VT: the FMA kernel's element type, the device's preferred float vector (CPUs under OpenCL want one)
_DIALECTS = {
    "opencl": {"KERNEL": "__kernel", "GLOBAL": "__global", "GID": "get_global_id(0)", "FMA": "mad"},
    "cuda": {"KERNEL": 'extern "C" __global__', "GLOBAL": "",
             "GID": "(blockIdx.x * blockDim.x + threadIdx.x)", "FMA": "fmaf"},
}
GPU_FMA_ITEMS_PER_UNIT = 2048  # work-items per compute unit for the FMA kernel: enough to fill a GPU's SM
GPU_STREAM_BYTES = 64 << 20  # per array: larger than any GPU's L2 today (H100/H200: 50 MB)


def _gpu_source(dialect: str, lanes: int = 1) -> str:
    src = _GPU_KERNELS
    for macro, text in {**_DIALECTS[dialect], "VT": f"float{lanes}" if lanes > 1 else "float"}.items():
        src = src.replace(macro, text)
    return src


def _measure_gpu(kind: str, name: str, ident: dict[str, Any], units: int, lanes: int,
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
    iters = min(_calibrated(run_fma, 64, FMA_SECONDS), 1 << 30)
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


class _OpenCLProbe:
    @staticmethod
    def _devices() -> list[Any]:
        try:
            import pyopencl as cl
        except ImportError:
            return []
        try:
            return [d for p in cl.get_platforms() for d in p.get_devices()]
        except cl.Error:  # no ICD / no platform installed
            return []

    def names(self) -> list[str]:
        return [d.name.strip() for d in self._devices()]

    def identify(self, index: int, threads: int | None) -> dict[str, Any]:
        devices = self._devices()
        if index >= len(devices):
            have = ", ".join(f"opencl:{i} ({d.name.strip()})" for i, d in enumerate(devices)) or "none"
            raise DeviceError(f"no OpenCL device {index}: found {have} "
                              "(are pyopencl and an OpenCL driver such as PoCL installed?)")
        d = devices[index]
        info = {"platform": d.platform.name.strip(), "platform_version": d.platform.version.strip(),
                "driver": d.driver_version.strip(), "compute_units": d.max_compute_units,
                "clock_mhz": d.max_clock_frequency, "global_mem_bytes": d.global_mem_size, "index": index}
        return {"fingerprint": _hash("opencl", d.name.strip(), *info.values()), "device": d, "info": info}

    def measure(self, index: int, ident: dict[str, Any]) -> Device:
        import pyopencl as cl

        d = ident["device"]
        ctx = cl.Context([d])
        queue = cl.CommandQueue(ctx)
        lanes = max(1, d.preferred_vector_width_float)
        prog = cl.Program(ctx, _gpu_source("opencl", lanes)).build()
        kernels = {k: getattr(prog, k) for k in ("fma_peak", "triad", "noop")}
        mf = cl.mem_flags
        alloc = lambda host: cl.Buffer(ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=host)
        launch = lambda k, size, args: kernels[k](queue, (size,), None, *args)
        read = lambda buf, host: cl.enqueue_copy(queue, host, buf).wait()
        return _measure_gpu("opencl", d.name.strip(), ident, d.max_compute_units, lanes, launch, alloc,
                            queue.finish, read)


class _CudaProbe:
    @staticmethod
    def _driver() -> Any:
        try:
            import pycuda.driver as cuda
        except ImportError:
            return None
        try:
            cuda.init()
        except cuda.Error:
            return None
        return cuda

    def names(self) -> list[str]:
        cuda = self._driver()
        return [cuda.Device(i).name() for i in range(cuda.Device.count())] if cuda else []

    def identify(self, index: int, threads: int | None) -> dict[str, Any]:
        cuda = self._driver()
        if cuda is None:
            raise DeviceError("CUDA target needs pycuda and an NVIDIA driver: `pip install pycuda`")
        if index >= cuda.Device.count():
            raise DeviceError(f"no CUDA device {index}: this machine has {cuda.Device.count()}")
        d = cuda.Device(index)
        attrs = d.get_attributes()
        info = {"compute_capability": ".".join(map(str, d.compute_capability())),
                "driver": cuda.get_driver_version(), "sms": attrs[cuda.device_attribute.MULTIPROCESSOR_COUNT],
                "memory_bytes": d.total_memory(), "index": index}
        return {"fingerprint": _hash("cuda", d.name(), *info.values()), "info": info}

    def measure(self, index: int, ident: dict[str, Any]) -> Device:
        cuda = self._driver()
        from pycuda.compiler import SourceModule

        d = cuda.Device(index)
        ctx = d.make_context()
        try:
            mod = SourceModule(_gpu_source("cuda"), no_extern_c=True)
            kernels = {k: mod.get_function(k) for k in ("fma_peak", "triad", "noop")}
            block = 256
            grid = lambda size: ((size + block - 1) // block, 1)
            launch = lambda k, size, args: kernels[k](*args, block=(block, 1, 1), grid=grid(size))
            alloc = lambda host: cuda.to_device(host)
            read = lambda buf, host: cuda.memcpy_dtoh(host, buf)
            return _measure_gpu("cuda", d.name(), ident, ident["info"]["sms"], 1, launch, alloc,
                                ctx.synchronize, read)
        finally:
            ctx.pop()


class _MetalProbe:
    def names(self) -> list[str]:
        return []  # measured by the Metal backend on macOS; nothing to list elsewhere

    def identify(self, index: int, threads: int | None) -> dict[str, Any]:
        where = "this is not macOS" if sys.platform != "darwin" else "Metal peaks are not measured yet"
        raise DeviceError(f"cannot model a Metal device: {where}")

    def measure(self, index: int, ident: dict[str, Any]) -> Device:  # pragma: no cover - identify raises
        raise DeviceError("Metal peaks are not measured yet")


_PROBES: dict[str, Any] = {"cpu": _CpuProbe(), "opencl": _OpenCLProbe(), "cuda": _CudaProbe(),
                           "metal": _MetalProbe()}
