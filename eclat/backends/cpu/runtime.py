"""The CPU executable: one JIT-compiled entry point called through ctypes."""

from __future__ import annotations

import ctypes
import time

import numpy as np

from ...compiler.kernel import Program
from ...compiler.memplan import MemoryPlan, plan_memory
from .codegen import build_module
from .jit import Jitted


class CpuExecutable:
    """Program -> native code. `run(inputs)` takes contiguous arrays of the right
    shapes and dtypes (the caller validates) and returns fresh output arrays."""

    def __init__(self, program: Program, threads: int = 1):
        self.program = program
        self.plan: MemoryPlan = plan_memory(program)
        start = time.perf_counter()
        self.module = build_module(program, self.plan, threads)
        self.jit = Jitted(self.module.ir)
        self.compile_seconds = time.perf_counter() - start
        self._fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self.jit.address("eclat_run"))
        self._arena = np.zeros(max(self.plan.arena_bytes, 1) + 64, dtype=np.uint8)
        base = self._arena.ctypes.data
        arena_ptr = base + (-base % 64)
        self._slots = (ctypes.c_void_p * len(self.module.slot_names))()
        self._keep: list[np.ndarray] = []
        self._index = {name: j for j, name in enumerate(self.module.slot_names)}
        for name, j in self._index.items():
            if name == "<arena>":
                self._slots[j] = arena_ptr
                continue
            buf = program.buffers[name]
            if buf.role == "weight":
                data = np.ascontiguousarray(buf.data, dtype=buf.dtype.np)
                self._keep.append(data)
                self._slots[j] = data.ctypes.data if data.size else arena_ptr

    def _bind(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        p = self.program
        outs = [np.empty(p.buffers[name].numel, dtype=p.buffers[name].dtype.np) for name in p.outputs]
        for name, a in zip(p.inputs, inputs):
            self._slots[self._index[name]] = a.ctypes.data
        for name, a in zip(p.outputs, outs):
            self._slots[self._index[name]] = a.ctypes.data
        return outs

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        outs = self._bind(inputs)
        self._fn(ctypes.addressof(self._slots))
        return [o.reshape(s) for o, s in zip(outs, self.program.output_shapes)]

    def profile(self, inputs: list[np.ndarray], repeats: int = 5) -> list[float]:
        """Median microseconds of each kernel alone, in program order (inputs as for run)."""
        keep = self._bind(inputs)
        self._fn(ctypes.addressof(self._slots))  # every temporary holds real values
        times = []
        for j in range(len(self.program.kernels)):
            fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self.jit.address(f"eclat_kernel_{j}"))
            samples = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn(ctypes.addressof(self._slots))
                samples.append(time.perf_counter() - t)
            times.append(sorted(samples)[len(samples) // 2] * 1e6)
        del keep
        return times
