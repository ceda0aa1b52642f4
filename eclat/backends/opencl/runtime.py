"""OpenCL runtime: a Program rendered in the OpenCL dialect, run through pyopencl.

Runs on any OpenCL device; on this machine that is PoCL's CPU device, which executes the
GPU lowering itself (work-groups, local memory, barriers). Buffers are allocated once per
executable; a run copies the inputs in, enqueues every kernel in order and reads the
outputs back. Built programs are cached by source hash (PoCL compiles are slow).
"""

from __future__ import annotations

import hashlib
import statistics
import time
from functools import lru_cache
from typing import Any

import numpy as np

from ...compiler.kernel import Program
from ...compiler.memplan import MemoryPlan, plan_memory
from ...errors import EclatError
from ..gpu import OPENCL, Dialect, GpuSchedule, RenderedProgram, render_program
from ..gpu.packing import device_dtype, from_device, resident, to_device

_BUILT: dict[tuple[int, str], Any] = {}


def _cl() -> Any:
    try:
        import pyopencl as cl
    except ImportError as e:
        raise EclatError("target 'opencl' needs pyopencl: `pip install pyopencl` and an OpenCL driver "
                         "(e.g. `apt-get install pocl-opencl-icd`)") from e
    return cl


@lru_cache(maxsize=1)
def context() -> tuple[Any, Any]:
    """(context, queue) on the first OpenCL GPU, else the first OpenCL device."""
    cl = _cl()
    try:
        devices = [d for p in cl.get_platforms() for d in p.get_devices()]
    except cl.Error:
        devices = []
    if not devices:
        raise EclatError("no OpenCL device found (install a driver, e.g. `apt-get install pocl-opencl-icd "
                         "ocl-icd-libopencl1`)")
    gpus = [d for d in devices if d.type & cl.device_type.GPU]
    ctx = cl.Context([(gpus or devices)[0]])
    return ctx, cl.CommandQueue(ctx)


def build(source: str) -> Any:
    """The built cl.Program for source, cached by its hash."""
    cl = _cl()
    ctx, _ = context()
    key = (id(ctx), hashlib.sha256(source.encode()).hexdigest())
    if key not in _BUILT:
        try:
            _BUILT[key] = cl.Program(ctx, source).build(options=["-cl-std=CL1.2"])
        except cl.RuntimeError as e:
            raise EclatError(f"OpenCL build failed: {e}") from e
    return _BUILT[key]


class OpenCLExecutable:
    """Program -> OpenCL kernels. `run(inputs)` takes arrays of the program's input shapes and
    dtypes and returns fresh output arrays."""

    def __init__(self, program: Program, schedules: dict[str, GpuSchedule] | None = None,
                 dialect: Dialect = OPENCL):
        cl = _cl()
        self.program = program
        self.ctx, self.queue = context()
        self.rendered: RenderedProgram = render_program(program, dialect, schedules)
        prog = build(self.rendered.source)
        mf = cl.mem_flags
        # temporaries are regions of one arena placed by the memory planner, where the device's
        # sub-buffer alignment allows; the others get buffers of their own
        self.plan: MemoryPlan = plan_memory(program)
        self.arena = cl.Buffer(self.ctx, mf.READ_WRITE, max(self.plan.arena_bytes, 4))
        align = max(1, self.ctx.devices[0].mem_base_addr_align // 8)
        self.buffers: dict[str, Any] = {}
        for name, b in resident(program).items():
            offset = self.plan.offsets.get(name)
            if b.role == "weight" and b.nbytes:
                host = to_device(b.dtype, b.data)
                self.buffers[name] = cl.Buffer(self.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=host)
            elif b.role == "temp" and offset is not None and offset % align == 0 and b.nbytes:
                self.buffers[name] = self.arena.get_sub_region(offset, b.nbytes)
            else:
                self.buffers[name] = cl.Buffer(self.ctx, mf.READ_WRITE, max(b.nbytes, 4))
        self.launches: dict[str, tuple[Any, int, int]] = {}
        for rk in self.rendered.kernels:
            if rk.groups == 0:
                continue
            kern = cl.Kernel(prog, rk.name)
            kern.set_args(*(self.buffers[a] for a in rk.args))
            self.launches[rk.name] = (kern, rk.groups * rk.threads, rk.threads)

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        cl = _cl()
        p, q = self.program, self.queue
        keep = []
        for name, a in zip(p.inputs, inputs):
            b = p.buffers[name]
            host = to_device(b.dtype, a)
            if host.size:
                keep.append(host)
                cl.enqueue_copy(q, self.buffers[name], host, is_blocking=False)
        for kern, global_size, local in self.launches.values():
            cl.enqueue_nd_range_kernel(q, kern, (global_size,), (local,))
        outs = []
        for name in p.outputs:
            b = p.buffers[name]
            out = np.empty(b.numel, dtype=device_dtype(b.dtype))
            if out.size:
                cl.enqueue_copy(q, out, self.buffers[name], is_blocking=False)
            outs.append(out)
        q.finish()
        return [from_device(p.buffers[name].dtype, out).reshape(shape)
                for name, out, shape in zip(p.outputs, outs, p.output_shapes)]

    def time_kernel(self, name: str, repeats: int = 10) -> float:
        """Median seconds of one launch of kernel `name` on the buffers as they are."""
        cl = _cl()
        if name not in self.launches:
            return 0.0  # an empty kernel is never launched
        kern, global_size, local = self.launches[name]
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            cl.enqueue_nd_range_kernel(self.queue, kern, (global_size,), (local,))
            self.queue.finish()
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])
