"""CUDA runtime through pycuda (imported lazily: an optional extra).

The executable renders and plans memory when made; the device is touched on the first run,
which raises "no CUDA device found" on a machine without one. Temporaries live in one arena
placed by the memory planner; weights are uploaded once. The kernels are captured once into a
CUDA graph and replayed, so a call is one launch whatever the number of kernels.

A call takes host arrays (copied through pinned staging buffers, one copy each way) or device
tensors: torch CUDA tensors (run on torch's current stream, outputs are new torch tensors) or
anything with `__cuda_array_interface__` (outputs are pycuda GPUArrays); no host copy either way.
"""

from __future__ import annotations

import atexit
import ctypes
import sys
from typing import Any

import numpy as np

from ...compiler.kernel import Program
from ...compiler.memplan import MemoryPlan, plan_memory
from ...errors import EclatError
from ..gpu import CUDA, Dialect, GpuSchedule, RenderedProgram, render_program
from ..gpu.packing import device_dtype, from_device, resident, to_device
from .nvcc import compile_cubin

_STATE: dict[str, Any] = {}

# the driver entry points pycuda does not wrap (graphs, copies on any stream): (name, argument types)
_ENTRY_POINTS = {
    "cuStreamBeginCapture_v2": (ctypes.c_void_p, ctypes.c_int),
    "cuStreamEndCapture": (ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)),
    "cuGraphInstantiateWithFlags": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_ulonglong),
    "cuGraphLaunch": (ctypes.c_void_p, ctypes.c_void_p),
    "cuMemcpyHtoDAsync_v2": (ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p),
    "cuMemcpyDtoHAsync_v2": (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p),
    "cuMemcpyDtoDAsync_v2": (ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p),
    "cuStreamSynchronize": (ctypes.c_void_p,),
}
CAPTURE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED: pycuda's own calls may run during the capture


class _Driver:
    """The CUDA driver's entry points of _ENTRY_POINTS, each raising EclatError on a failure."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")  # already loaded by pycuda
        for name, argtypes in _ENTRY_POINTS.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            setattr(self, name.removeprefix("cu").split("_")[0], self._checked(name, fn))

    @staticmethod
    def _checked(name: str, fn: Any) -> Any:
        def call(*args: Any) -> None:
            rc = fn(*args)
            if rc:
                raise EclatError(f"CUDA {name} failed with error {rc}")
        return call


def driver() -> tuple[Any, Any]:
    """(pycuda.driver, the device) with the primary context current; raises without a GPU."""
    if "cuda" not in _STATE:
        try:
            import pycuda.driver as cuda
        except ImportError as e:
            raise EclatError("no CUDA device found: pycuda is not installed (`pip install pycuda`)") from e
        try:
            cuda.init()
            count = cuda.Device.count()
        except cuda.Error as e:
            raise EclatError(f"no CUDA device found ({e})") from e
        if count == 0:
            raise EclatError("no CUDA device found")
        dev = cuda.Device(0)
        ctx = dev.retain_primary_context()  # the context torch uses too: its tensors' pointers are ours
        ctx.push()
        atexit.register(ctx.pop)  # pycuda aborts at exit if a pushed context is left on the stack
        _STATE.update(cuda=cuda, device=dev, context=ctx, raw=_Driver())
    return _STATE["cuda"], _STATE["device"]


def available() -> bool:
    """Whether this machine can run CUDA kernels (pycuda and a device)."""
    try:
        driver()
    except EclatError:
        return False
    return True


def device_arch() -> str:
    """The arch of this machine's device ("sm_90"); raises without one."""
    major, minor = driver()[1].compute_capability()
    return f"sm_{major}{minor}"


class CudaExecutable:
    def __init__(self, program: Program, schedules: dict[str, GpuSchedule] | None = None,
                 dialect: Dialect = CUDA):
        self.program = program
        self.plan: MemoryPlan = plan_memory(program)
        self.rendered: RenderedProgram = render_program(program, dialect, schedules)
        self._ready = False

    @property
    def source(self) -> str:
        return self.rendered.source

    def _setup(self) -> None:
        cuda, _ = driver()
        module = cuda.module_from_buffer(compile_cubin(self.source, device_arch()))
        p = self.program
        self._arena = cuda.mem_alloc(max(self.plan.arena_bytes, 1))
        self._own: dict[str, Any] = {}
        ptr: dict[str, int] = {}
        for name, b in resident(p).items():
            if b.role == "temp":
                ptr[name] = int(self._arena) + self.plan.offsets.get(name, 0)
                continue
            self._own[name] = cuda.mem_alloc(max(b.nbytes, 4))
            ptr[name] = int(self._own[name])
            if b.role == "weight" and b.nbytes:
                cuda.memcpy_htod(self._own[name], to_device(b.dtype, b.data))
        self._ptr = ptr
        self._launches: dict[str, tuple] = {}
        for rk in self.rendered.kernels:
            if rk.groups == 0:
                continue
            fn = module.get_function(rk.name)
            fn.prepare("P" * len(rk.args))
            self._launches[rk.name] = (fn, (rk.groups, 1), (rk.threads, 1, 1), [ptr[a] for a in rk.args])
        # pinned staging for host calls: (buffer, its device pointer, its host array, bytes)
        self._host_in = [self._staging(cuda, n) for n in p.inputs]
        self._host_out = [self._staging(cuda, n) for n in p.outputs]
        self._stream = cuda.Stream()
        self._last_stream: int | None = None
        self._cuda, self._raw = cuda, _STATE["raw"]
        self._graph = self._capture()
        self._ready = True

    def _staging(self, cuda: Any, name: str) -> tuple[str, int, np.ndarray, int]:
        b = self.program.buffers[name]
        host = cuda.pagelocked_empty(max(b.numel, 1), device_dtype(b.dtype))[:b.numel]
        return name, self._ptr[name], host, host.nbytes

    def _capture(self) -> ctypes.c_void_p | None:
        """Every kernel's launch, captured once on a stream of our own into an executable graph
        (None for a program with no kernels to launch)."""
        raw, stream = _STATE["raw"], self._stream
        if not self._launches:
            return None
        raw.StreamBeginCapture(stream.handle, CAPTURE_RELAXED)
        try:
            for fn, grid, block, args in self._launches.values():
                fn.prepared_async_call(grid, block, stream, *args)
        finally:
            graph = ctypes.c_void_p()
            raw.StreamEndCapture(stream.handle, ctypes.byref(graph))
        executable = ctypes.c_void_p()
        raw.GraphInstantiateWithFlags(ctypes.byref(executable), graph, 0)
        return executable

    def launch(self, stream: int | None = None) -> None:
        """Enqueue every kernel (one graph launch) on stream (default: our own), inputs already on
        the device. A call on another stream than the last waits for the last to finish first: both
        use the same buffers."""
        if not self._ready:
            self._setup()
        stream = self._stream.handle if stream is None else stream
        if self._last_stream is not None and self._last_stream != stream:
            self._raw.StreamSynchronize(self._last_stream)
        self._last_stream = stream
        if self._graph is not None:
            self._raw.GraphLaunch(self._graph, stream)

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        if not self._ready:
            self._setup()
        raw, p, stream = self._raw, self.program, self._stream.handle
        for (name, ptr, host, nbytes), a in zip(self._host_in, inputs):
            if nbytes:
                host[...] = to_device(p.buffers[name].dtype, a)
                raw.MemcpyHtoDAsync(ptr, host.ctypes.data, nbytes, stream)
        self.launch(stream)
        for _, ptr, host, nbytes in self._host_out:
            if nbytes:
                raw.MemcpyDtoHAsync(host.ctypes.data, ptr, nbytes, stream)
        raw.StreamSynchronize(stream)
        return [from_device(p.buffers[name].dtype, host.copy()).reshape(shape)
                for (name, _, host, _), shape in zip(self._host_out, p.output_shapes)]

    def run_device(self, inputs: list[Any]) -> list[Any]:
        """The outputs for inputs in GPU memory (compiler.specs.in_gpu_memory), in GPU memory: torch
        tensors on torch's current stream for torch inputs (asynchronous, as torch is), else GPUArrays
        once the work is done. Shapes and dtypes are the caller's to check (CompiledModel does)."""
        if not self._ready:
            self._setup()
        raw, p = self._raw, self.program
        torch = sys.modules.get("torch")
        use_torch = torch is not None and all(isinstance(x, torch.Tensor) for x in inputs)
        stream = torch.cuda.current_stream().cuda_stream if use_torch else 0  # 0: the legacy default
        for (_, ptr, _, nbytes), x in zip(self._host_in, inputs):
            if nbytes:
                raw.MemcpyDtoDAsync(ptr, _device_pointer(x), nbytes, stream)
        self.launch(stream)
        outs = [self._empty_like_output(name, shape, torch if use_torch else None)
                for name, shape in zip(p.outputs, p.output_shapes)]
        for (_, ptr, _, nbytes), out in zip(self._host_out, outs):
            if nbytes:
                raw.MemcpyDtoDAsync(_device_pointer(out), ptr, nbytes, stream)
        if not use_torch:
            raw.StreamSynchronize(stream)
        return outs

    def _empty_like_output(self, name: str, shape: tuple[int, ...], torch: Any) -> Any:
        dt = self.program.buffers[name].dtype
        if torch is not None:
            return torch.empty(shape, dtype=getattr(torch, dt.name), device="cuda")
        from pycuda import gpuarray

        return gpuarray.empty(shape, device_dtype(dt))

    def time_kernels(self, repeats: int = 50) -> float:
        """Median seconds of one launch of every kernel (the graph), by CUDA events (no host copies)."""
        return self._timed(self.launch, repeats)

    def time_kernel(self, name: str, repeats: int = 20) -> float:
        """Median seconds of one launch of kernel `name`, by CUDA events."""
        if not self._ready:
            self._setup()
        if name not in self._launches:
            return 0.0
        fn, grid, block, args = self._launches[name]
        return self._timed(lambda: fn.prepared_async_call(grid, block, self._stream, *args), repeats)

    def _timed(self, work: Any, repeats: int) -> float:
        if not self._ready:
            self._setup()
        cuda = self._cuda
        work()  # warm: the first launch of a graph uploads it
        times = []
        for _ in range(repeats):
            start, end = cuda.Event(), cuda.Event()
            start.record(self._stream)
            work()
            end.record(self._stream)
            end.synchronize()
            times.append(start.time_till(end) / 1e3)
        return float(np.median(times))


def _device_pointer(x: Any) -> int:
    """The address of x's first element in GPU memory (a contiguous tensor in GPU memory)."""
    if hasattr(x, "data_ptr"):
        return x.data_ptr()
    return int(x.__cuda_array_interface__["data"][0])
