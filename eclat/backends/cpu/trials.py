"""Timing one CPU kernel with one schedule: the kernel alone, in a program of its own whose inputs
are random, so that a schedule is judged on the kernel and nothing else."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...compiler.kernel import Buffer, Kernel, Program, loads, specialised
from ...ir.symbolic import bind_sizes


def isolate(program: Program, kernel: Kernel) -> Program:
    """A program running only kernel: what it reads becomes inputs (weights stay weights)."""
    read = sorted({x.buffer for x in loads(kernel.body)} - {kernel.out})
    buffers: dict[str, Buffer] = {}
    for name in read:
        b = program.buffers[name]
        buffers[name] = b if b.role == "weight" else replace(b, role="input", data=None)
    out = program.buffers[kernel.out]
    buffers[kernel.out] = replace(out, role="output", data=None)
    ins = [n for n in read if buffers[n].role == "input"]
    return Program(buffers, [kernel], ins, [kernel.out], [(buffers[n].numel,) for n in ins],
                   [(out.numel,)])


def _random(buf: Buffer, rng: np.random.Generator) -> np.ndarray:
    if buf.dtype.is_float:
        return rng.standard_normal(buf.numel).astype(buf.dtype.np)
    return np.zeros(buf.numel, buf.dtype.np)  # indices: row 0 is always in range


class Trials:
    """(kernel, schedule) -> a timer of the kernel built with that schedule (microseconds of a run)."""

    def __init__(self, program: Program, threads: int, inputs: list[np.ndarray]):
        """inputs: the program's; a kernel with run-time sizes is timed at theirs."""
        self.program, self.threads = program, threads
        self.sizes = bind_sizes(program.input_shapes, [a.shape for a in inputs]) if program.sizes else {}
        self._inputs: dict[str, list[np.ndarray]] = {}
        self._rng = np.random.default_rng(0)

    def __call__(self, kernel: Kernel, schedule: object):
        from .runtime import CpuExecutable

        sub = isolate(self.program, replace(specialised(kernel, self.sizes), schedule=schedule))
        if kernel.name not in self._inputs:
            self._inputs[kernel.name] = [_random(sub.buffers[n], self._rng) for n in sub.inputs]
        inputs = self._inputs[kernel.name]
        exe = CpuExecutable(sub, self.threads)
        return lambda: min(exe.profile(inputs, 1))
