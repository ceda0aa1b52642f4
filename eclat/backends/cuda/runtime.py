"""CUDA runtime through pycuda (imported lazily: an optional extra).

The executable renders and plans memory when made; the device is touched on the first run,
which raises "no CUDA device found" on a machine without one. Temporaries live in one arena
placed by the memory planner; weights are uploaded once.
"""

from __future__ import annotations

import atexit
from typing import Any

import numpy as np

from ...compiler.kernel import Program
from ...compiler.memplan import MemoryPlan, plan_memory
from ...errors import EclatError
from ..gpu import CUDA, Dialect, GpuSchedule, RenderedProgram, render_program
from ..gpu.packing import device_dtype, from_device, resident, to_device
from .nvcc import compile_ptx

_STATE: dict[str, Any] = {}


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
        ctx = dev.retain_primary_context()
        ctx.push()
        atexit.register(ctx.pop)  # pycuda aborts at exit if a pushed context is left on the stack
        _STATE.update(cuda=cuda, device=dev, context=ctx)
    return _STATE["cuda"], _STATE["device"]


def available() -> bool:
    """Whether this machine can run CUDA kernels (pycuda and a device)."""
    try:
        driver()
    except EclatError:
        return False
    return True


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
        cuda, dev = driver()
        major, minor = dev.compute_capability()
        module = cuda.module_from_buffer(compile_ptx(self.source, f"sm_{major}{minor}").encode())
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
        self._cuda = cuda
        self._ready = True

    def launch(self) -> None:
        """Enqueue every kernel on the default stream (inputs already on the device)."""
        if not self._ready:
            self._setup()
        for fn, grid, block, args in self._launches.values():
            fn.prepared_call(grid, block, *args)

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        if not self._ready:
            self._setup()
        cuda, p = self._cuda, self.program
        for name, a in zip(p.inputs, inputs):
            host = to_device(p.buffers[name].dtype, a)
            if host.size:
                cuda.memcpy_htod(self._ptr[name], host)
        self.launch()
        outs = []
        for name, shape in zip(p.outputs, p.output_shapes):
            dt = p.buffers[name].dtype
            out = np.empty(p.buffers[name].numel, dtype=device_dtype(dt))
            if out.size:
                cuda.memcpy_dtoh(out, self._ptr[name])
            outs.append(from_device(dt, out).reshape(shape))
        return outs

    def time_kernels(self, repeats: int = 50) -> float:
        """Median seconds of one launch of every kernel, by CUDA events (no host copies)."""
        if not self._ready:
            self._setup()
        cuda = self._cuda
        self.launch()
        cuda.Context.synchronize()
        times = []
        for _ in range(repeats):
            start, end = cuda.Event(), cuda.Event()
            start.record()
            self.launch()
            end.record()
            end.synchronize()
            times.append(start.time_till(end) / 1e3)
        return float(np.median(times))

    def time_kernel(self, name: str, repeats: int = 20) -> float:
        """Median seconds of one launch of kernel `name`, by CUDA events."""
        if not self._ready:
            self._setup()
        if name not in self._launches:
            return 0.0
        cuda = self._cuda
        fn, grid, block, args = self._launches[name]
        times = []
        for _ in range(repeats + 1):
            start, end = cuda.Event(), cuda.Event()
            start.record()
            fn.prepared_call(grid, block, *args)
            end.record()
            end.synchronize()
            times.append(start.time_till(end) / 1e3)
        return float(np.median(times[1:]))
