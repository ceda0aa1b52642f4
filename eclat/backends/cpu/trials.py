"""Timing one CPU kernel with one schedule: the kernel alone, in a program of its own whose inputs
are random, so that a schedule is judged on the kernel and nothing else."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ...compiler.kernel import Buffer, Kernel, Program, loads, mentioned_sizes, specialised
from ...ir.symbolic import bind_sizes, evaluate, sint, var_list

# runs of a kernel per timing, the least of them its time: noise (another process, an interrupt) only
# adds time, and on a shared 2-core VM one run was 10% off often enough that a 1x7 convolution's
# tuning kept the default tile where (12, 32) ran 7% faster
RUNS = 5


def isolate(program: Program, kernel: Kernel) -> Program:
    """A program running only kernel: what it reads becomes inputs (weights stay weights), flat. Over
    run-time sizes each input keeps its size (a program input's, or the kernel's that writes it), so
    that the kernel is timed as the code that runs, reading its sizes at run time (`_reads_sizes`
    says where it cannot)."""
    read = sorted({x.buffer for x in loads(kernel.body)} - {kernel.out})
    buffers: dict[str, Buffer] = {}
    for name in read:
        b = program.buffers[name]
        buffers[name] = b if b.role == "weight" else replace(b, role="input", data=None)
    out = program.buffers[kernel.out]
    buffers[kernel.out] = replace(out, role="output", data=None)
    ins = [n for n in read if buffers[n].role == "input"]
    flat = _flat_shapes(program) if program.sizes else {}
    shapes = [(flat.get(n, buffers[n].numel),) for n in ins]
    sizes = tuple(v for v in program.sizes if any(v in var_list(s[0]) for s in shapes))
    return Program(buffers, [kernel], ins, [kernel.out], shapes, [(flat.get(kernel.out, out.numel),)],
                   sizes=sizes)


def _flat_shapes(program: Program) -> dict[str, sint]:
    """Each input's and kernel output's number of elements, an expression of the run-time sizes."""
    flat = {k.out: math.prod(k.shape) for k in program.kernels}
    return flat | {n: math.prod(s) for n, s in zip(program.inputs, program.input_shapes)}


def _reads_sizes(sub: Program, sizes: dict[str, int]) -> bool:
    """Whether sub reads every run-time size its kernel mentions off its inputs' shapes, and reads
    them as sizes has them (not where a size is in no input, or only in a product of two)."""
    if not sub.sizes or mentioned_sizes(sub.kernels[0]) - {v.name for v in sub.sizes}:
        return False
    try:
        got = bind_sizes(sub.input_shapes, [(int(evaluate(s[0], sizes)),) for s in sub.input_shapes])
    except ValueError:
        return False
    return all(got.get(v.name) == sizes[v.name] for v in sub.sizes)


def _random(buf: Buffer, numel: int, rng: np.random.Generator) -> np.ndarray:
    if buf.dtype.is_float:
        return rng.standard_normal(numel).astype(buf.dtype.np)
    return np.zeros(numel, buf.dtype.np)  # indices: row 0 is always in range


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

        sub = isolate(self.program, replace(kernel, schedule=schedule))
        if self.sizes and not _reads_sizes(sub, self.sizes):  # at the caller's sizes, each a constant
            sub = isolate(self.program, replace(specialised(kernel, self.sizes), schedule=schedule))
        if kernel.name not in self._inputs:
            self._inputs[kernel.name] = [_random(sub.buffers[n], int(evaluate(shape[0], self.sizes)),
                                                 self._rng) for n, shape in zip(sub.inputs, sub.input_shapes)]
        inputs = self._inputs[kernel.name]
        exe = CpuExecutable(sub, self.threads)
        return lambda: min(exe.profile(inputs, 1)[0] for _ in range(RUNS))
