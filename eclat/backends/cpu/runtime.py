"""The CPU executable: one JIT-compiled entry point called through ctypes."""

from __future__ import annotations

import ctypes
import time

import numpy as np

from ...compiler.kernel import Program
from ...compiler.memplan import MemoryPlan, plan_memory
from .codegen import build_module
from .jit import Jitted
from .sides import fold_row_reductions


def _data(a: np.ndarray) -> int:
    """a's data pointer. ndarray.ctypes and __array_interface__ build objects (3 us each
    here); a ctypes view of the buffer is 1 us. Read-only or empty arrays take the slow way."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError):
        return a.ctypes.data


class NativeRun:
    """Calls a compiled `eclat_run(slots)`: slots ordered as slot_names, the arena last. Weights
    are bound once; `run(inputs)` binds contiguous inputs of the right shapes and dtypes (the
    caller validates) and fresh outputs, and returns the outputs."""

    def __init__(self, program: Program, plan: MemoryPlan, slot_names: list[str], address: int,
                 owner: object = None):
        self.program, self.plan = program, plan
        self._owner = owner  # what holds the machine code at address (an execution engine), kept alive
        self._fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(address)
        self._arena = np.zeros(max(plan.arena_bytes, 1) + 64, dtype=np.uint8)
        base = self._arena.ctypes.data
        arena_ptr = base + (-base % 64)
        self._slots = (ctypes.c_void_p * len(slot_names))()
        self._keep: list[np.ndarray] = []
        self._index = {name: j for j, name in enumerate(slot_names)}
        for name, j in self._index.items():
            buf = program.buffers.get(name)
            if name == "<arena>" or (buf is not None and buf.role == "weight" and
                                     (buf.numel == 0 or buf.data is None)):
                self._slots[j] = arena_ptr  # nothing to point at: a valid address nothing reads
            elif buf is not None and buf.role == "weight":
                data = np.ascontiguousarray(buf.data, dtype=buf.dtype.np)
                self._keep.append(data)
                self._slots[j] = data.ctypes.data

        # per call work precomputed: a model step is a few microseconds of Python, not tens
        self._address = ctypes.addressof(self._slots)
        self._in_slots = [self._index[name] for name in program.inputs]
        self._out_specs = [(self._index[name], tuple(shape), program.buffers[name].dtype.np)
                           for name, shape in zip(program.outputs, program.output_shapes)]

    def _bind(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        slots = self._slots
        for j, a in zip(self._in_slots, inputs):
            slots[j] = _data(a)
        outs = []
        for j, shape, dtype in self._out_specs:
            o = np.empty(shape, dtype)
            slots[j] = _data(o)
            outs.append(o)
        return outs

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        outs = self._bind(inputs)
        self._fn(self._address)
        return outs


class CpuExecutable(NativeRun):
    """Program -> native code: the module built and JIT-compiled here, run by NativeRun."""

    def __init__(self, program: Program, threads: int = 1):
        code = fold_row_reductions(program)  # what runs; program stays what tuning and artifacts see
        plan = plan_memory(code)
        start = time.perf_counter()
        self.module = build_module(code, plan, threads)
        self.jit = Jitted(self.module.ir)
        self.compile_seconds = time.perf_counter() - start
        super().__init__(program, plan, self.module.slot_names, self.jit.address("eclat_run"))

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
